"""The admin API at fleet scale, over a real registry and deployer: pages of agents (cursor, total, filters, bad
parameters), the fleet view the live stream sends (per-site sums, only the agents that matter held in full, links
among those) and the deltas between views, the stream itself behind a real uvicorn, and the SDK's walk over pages."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from stratamesh.coordinator.api import admin_schemas as schemas
from stratamesh.coordinator.api.admin import admin_router
from stratamesh.coordinator.api.errors import install_error_handlers
from stratamesh.coordinator.control.deployer import Deployer
from stratamesh.coordinator.control.drainer import Drainer
from stratamesh.coordinator.fleet_view import DETAIL_ALL_UP_TO, RECENT_MAX, RECENT_S, AgentQuery, fleet_delta
from stratamesh.coordinator.live_stats import LiveStats
from stratamesh.coordinator.mesh_admin import MeshAdmin, expert_view
from stratamesh.coordinator.serving.records import RequestLog
from stratamesh.coordinator.serving.sessions import SessionTable
from stratamesh.coordinator.registry import Registry
from stratamesh.fleet.boxes import Capabilities, GpuInfo, StageLoad, Telemetry
from stratamesh.fleet.control_messages import LinkMeasurement
from stratamesh.partitioner.fleet_snapshot import ORIGIN
from stratamesh.sdk import AsyncMesh, calls
from stratamesh.sdk.errors import UnexpectedResponseError
from tests.coordinator.served import served
from tests.coordinator.test_deployer import Agent, model_dir, ready_pair  # noqa: F401 (a fixture)
from tests.patience import patient

T0 = 1_700_000_000.0
GiB = 1 << 30
SITES = ("north", "south", "east")
BASE_KEYS = {"ts", "num_agents", "stats", "agents", "agents_removed", "sites", "sites_removed"}


@dataclass
class Fleet:
    """A 2-stage model on a1 and a2 with a3 spare (site ""), the admin API over them, and a clock to move."""

    registry: Registry
    deployer: Deployer
    agents: list[Agent]
    admin: MeshAdmin
    app: FastAPI
    now: list[float]

    def add(self, count: int, since: float, first: int = 0) -> list[str]:
        """count more agents, b000 on, over SITES (every third in the cloud, with a GPU), registered at since."""
        ids = []
        for i in range(first, first + count):
            gpus = (GpuInfo(0, "L4", 24 * GiB, 20 * GiB),) if i % 3 == 0 else ()
            caps = Capabilities(f"host-{i}", "cpu", 4, 8 * GiB, 6 * GiB, gpus, site=SITES[i % len(SITES)],
                                tier="cloud" if i % 3 == 0 else "edge")
            self.registry.upsert_agent(f"b{i:03d}", f"box-{i}", f"10.0.{i // 250}.{i % 250}:7000", caps, since)
            ids.append(f"b{i:03d}")
        return ids

    def client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app), base_url="http://mesh")


@pytest.fixture
def fleet(model_dir: Path) -> Fleet:  # noqa: F811 (the fixture imported above)
    registry, deployer, agents = ready_pair(model_dir, [100.0])
    now = [T0 + 10]
    admin = MeshAdmin(registry, RequestLog(), {"a1": "127.0.0.1:9101"}, Drainer(deployer, SessionTable(), registry), deployer,
                      LiveStats(), clock=lambda: now[0])
    app = FastAPI()
    app.include_router(admin_router(admin))
    install_error_handlers(app)
    return Fleet(registry, deployer, agents, admin, app, now)


async def pages(client: httpx.AsyncClient, **params: Any) -> list[dict]:
    """Every page of GET /admin/api/agents with these parameters, following next_after."""
    out, after = [], None
    while True:
        query = params | ({"after": after} if after is not None else {})
        page = (await client.get("/admin/api/agents", params=query)).raise_for_status().json()
        out.append(page)
        if (after := page["next_after"]) is None:
            return out


# ------------------------------------------------------------------ pages of agents
async def test_agents_come_a_page_at_a_time_in_id_order_with_a_cursor_and_a_total(fleet: Fleet) -> None:
    fleet.add(120, T0 - 3600)
    every = sorted(a.agent_id for a in fleet.registry.agents())
    fleet.deployer.heartbeat("a1", Telemetry(T0, queue_depth=3, tokens_per_s=42.5))
    async with fleet.client() as client:
        walked = await pages(client, limit=50)
        first = (await client.get("/admin/api/agents")).json()
        gone = (await client.get("/admin/api/agents", params={"after": "b0505", "limit": 2})).json()
    assert [len(p["agents"]) for p in walked] == [50, 50, 23] and {p["total"] for p in walked} == {123}
    assert [a["agent_id"] for p in walked for a in p["agents"]] == every
    assert [p["next_after"] for p in walked] == [every[49], every[99], None]
    assert len(first["agents"]) == schemas.DEFAULT_AGENTS_PAGE and first["next_after"] == every[99]
    assert [a["agent_id"] for a in gone["agents"]] == ["b051", "b052"]    # after an id no agent has: pages on
    schemas.AgentsPage(**walked[0])                                         # the documented shape
    a1 = next(a for a in walked[0]["agents"] if a["agent_id"] == "a1")
    assert a1["metrics_address"] == "127.0.0.1:9101" and a1["state"] == "connected"
    assert (a1["telemetry"]["queue_depth"], a1["telemetry"]["tokens_per_s"], a1["telemetry"]["received"]) == (
        3, 42.5, 100.0)
    b003 = next(a for a in walked[0]["agents"] if a["agent_id"] == "b003")
    assert b003["capabilities"]["gpus"][0]["name"] == "L4" and b003["telemetry"] is None


async def test_agents_are_filtered_by_site_state_tier_serving_and_text(fleet: Fleet) -> None:
    ids = fleet.add(60, T0 - 3600)
    for agent_id in ids[:7]:
        fleet.registry.set_agent_state(agent_id, "dead", T0)
    records = {a.agent_id: a for a in fleet.registry.agents()}

    def expect(keep) -> list[str]:
        return sorted(i for i, a in records.items() if keep(a))

    def text(a) -> str:
        return f"{a.agent_id} {a.name} {a.capabilities.hostname} {a.address}".lower()

    async with fleet.client() as client:
        async def listed(**params: Any) -> list[str]:
            walked = await pages(client, limit=7, **params)
            assert {p["total"] for p in walked} == {sum(len(p["agents"]) for p in walked)}
            return [a["agent_id"] for p in walked for a in p["agents"]]

        assert await listed(site="north") == expect(lambda a: a.capabilities.site == "north")
        assert await listed(site="") == ["a1", "a2", "a3"]              # "": the agents that name no site
        assert await listed(state="dead") == ids[:7]
        assert await listed(tier="cloud") == expect(lambda a: a.capabilities.tier == "cloud")
        assert await listed(serving="true") == ["a1", "a2"]
        assert await listed(serving="false") == expect(lambda a: a.agent_id not in ("a1", "a2"))
        assert await listed(q="BOX-1") == expect(lambda a: "box-1" in text(a))     # any case
        assert await listed(q="10.0.0.5") == expect(lambda a: "10.0.0.5" in text(a))
        assert await listed(site="south", tier="cloud", state="online") == expect(
            lambda a: (a.capabilities.site, a.capabilities.tier, a.state) == ("south", "cloud", "online"))
        assert await listed(site="nowhere") == []


@pytest.mark.parametrize("params, param", [
    ({"limit": 0}, "limit"), ({"limit": schemas.MAX_AGENTS_PAGE + 1}, "limit"), ({"limit": "all"}, "limit"),
    ({"state": "sleeping"}, "state"), ({"tier": "fog"}, "tier"), ({"serving": "maybe"}, "serving"),
    ({"after": "x" * 300}, "after"), ({"q": "y" * 200}, "q"), ({"limt": 5}, "limt"), ({"page": 2}, "page")])
async def test_a_bad_agents_query_is_a_400_naming_the_parameter(fleet: Fleet, params: dict, param: str) -> None:
    async with fleet.client() as client:
        refused = await client.get("/admin/api/agents", params=params)
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == f"query.{param}", error
    assert param in error["message"]


# ------------------------------------------------------------------ the fleet view and its deltas
async def test_a_small_fleet_is_held_in_full_and_a_quiet_delta_carries_nothing(fleet: Fleet) -> None:
    first = await fleet.admin.view()
    snapshot = first.snapshot()
    schemas.Snapshot(**snapshot)
    assert sorted(first.agents) == ["a1", "a2", "a3"] and first.num_agents == 3
    (site,) = snapshot["sites"]
    assert (site["site"], site["num_agents"], site["num_up"], site["num_serving"], site["states"], site["tiers"]) == (
        "", 3, 3, 2, {"connected": 3}, {"edge": 3})
    quiet = fleet_delta(first, await fleet.admin.view())
    assert set(quiet) == BASE_KEYS and not any(quiet[k] for k in ("agents", "agents_removed", "sites", "sites_removed"))
    fleet.registry.set_agent_state("a3", "dead", fleet.now[0])
    changed = fleet_delta(first, await fleet.admin.view())
    schemas.SnapshotDelta(**changed)
    assert [(a["agent_id"], a["state"]) for a in changed["agents"]] == [("a3", "dead")]
    assert [(s["num_up"], s["states"]) for s in changed["sites"]] == [(2, {"connected": 2, "dead": 1})]
    assert "plans" not in changed and "models" not in changed          # unchanged: not sent again


async def test_a_large_fleet_sends_its_sites_and_only_the_agents_that_matter(fleet: Fleet) -> None:
    bulk = fleet.add(150, T0 - 3600)
    first = await fleet.admin.view()
    assert first.num_agents == 153 > DETAIL_ALL_UP_TO
    assert sorted(first.agents) == ["a1", "a2"]         # the plan's; the spare and the bulk only in their sites' sums
    sums = first.sites
    assert sorted(sums) == ["", *sorted(SITES)] and sum(s["num_agents"] for s in sums.values()) == 153
    assert sums["north"]["tiers"] == {"cloud": 50} and sums["north"]["num_gpus"] == 50
    assert sums["north"]["gpu_mem_bytes"] == 50 * 24 * GiB and sums["south"]["ram_total_bytes"] == 50 * 8 * GiB
    assert sums[""]["num_serving"] == 2 and sums["east"]["num_up"] == 50

    # most of a site goes down: its sum changes, and the newest RECENT_MAX of those agents are held in full
    dying = bulk[0:90:3]                            # 30 agents of north, each a second after the one before
    for k, agent_id in enumerate(dying):
        fleet.registry.set_agent_state(agent_id, "dead", T0 - 30 + k)
    second = await fleet.admin.view()
    down = fleet_delta(first, second)
    newest = dying[-RECENT_MAX:]
    assert sorted(a["agent_id"] for a in down["agents"]) == newest and down["agents_removed"] == []
    assert {a["state"] for a in down["agents"]} == {"dead"}
    assert [s["site"] for s in down["sites"]] == ["north"] and down["num_agents"] == 153
    assert second.sites["north"]["states"] == {"dead": 30, "online": 20} and second.sites["north"]["num_up"] == 20

    # a newcomer is held; a minute on, those that changed are no longer, and a resting agent is
    fleet.registry.upsert_agent("c000", "newcomer", "10.9.9.9:7000", Capabilities("h", "cpu", 2, GiB, GiB,
                                                                                 site="west"), fleet.now[0])
    third = await fleet.admin.view()
    joined = fleet_delta(second, third)
    assert [a["agent_id"] for a in joined["agents"]] == ["c000"] and joined["num_agents"] == 154
    assert [s["site"] for s in joined["sites"]] == ["west"] and joined["agents_removed"] == [newest[0]]   # the oldest
    fleet.now[0] += RECENT_S + 1
    fleet.registry.set_agent_state(bulk[1], "resting", fleet.now[0] - RECENT_S - 1)
    aged = fleet_delta(third, await fleet.admin.view())
    assert [a["agent_id"] for a in aged["agents"]] == [bulk[1]]
    assert sorted(aged["agents_removed"]) == sorted([*newest[1:], "c000"])
    # what a new connection gets does not grow with the fleet: its sites, and the agents that matter
    everyone = (await fleet.admin.agents_page(AgentQuery(limit=1000)))["agents"]
    assert len(third.agents) == 2 + RECENT_MAX and len(json.dumps(third.snapshot())) < len(json.dumps(everyone)) / 4


async def test_a_view_holds_the_links_among_the_agents_it_holds_and_sums_the_others_per_site(fleet: Fleet) -> None:
    north, south, east, _, south2 = fleet.add(120, T0 - 3600)[:5]       # by site: b000 north, b001 south ...
    fleet.registry.record_links("a1", [LinkMeasurement("a2", 0.001, 1e9), LinkMeasurement(north, 0.02, 1e7)], T0)
    fleet.registry.record_links(south, [LinkMeasurement(north, 0.03, 2e7), LinkMeasurement(east, 0.05, 4e7),
                                        LinkMeasurement(south2, 0.004, 3e8)], T0)
    fleet.registry.record_links(south, [LinkMeasurement(south2, error="refused")], T0 + 1)   # measured, then failed
    fleet.registry.record_links(south2, [LinkMeasurement(south, 0.002, 5e8)], T0)
    fleet.registry.record_links(ORIGIN, [LinkMeasurement("a1", 0.0005, 2e9), LinkMeasurement(east, 0.01, 1e8)], T0)
    view = await fleet.admin.view()
    assert sorted((k["agent_id"], k["peer_id"]) for k in view.links) == [("a1", "a2"), (ORIGIN, "a1")]
    assert view.site_links == [      # the most links first; the origin's are left out
        {"a": "south", "b": "south", "num_links": 2, "num_failed": 1, "rtt_s": 0.002, "bandwidth_bytes_per_s": 5e8},
        {"a": "", "b": "", "num_links": 1, "num_failed": 0, "rtt_s": 0.001, "bandwidth_bytes_per_s": 1e9},
        {"a": "", "b": "north", "num_links": 1, "num_failed": 0, "rtt_s": 0.02, "bandwidth_bytes_per_s": 1e7},
        {"a": "east", "b": "south", "num_links": 1, "num_failed": 0, "rtt_s": 0.05, "bandwidth_bytes_per_s": 4e7},
        {"a": "north", "b": "south", "num_links": 1, "num_failed": 0, "rtt_s": 0.03, "bandwidth_bytes_per_s": 2e7}]


# ------------------------------------------------------------------ the stream, behind a real server
@pytest.fixture
async def live(fleet: Fleet) -> AsyncIterator[str]:
    """The admin API behind a real uvicorn on a loopback port: its base URL."""
    async with served(fleet.app) as url:
        yield url


async def sse(response: httpx.Response) -> AsyncIterator[tuple[str, dict]]:
    """(event, data) of each server-sent event of a streamed response."""
    kind = ""
    async for line in response.aiter_lines():
        if line.startswith("event: "):
            kind = line[len("event: "):]
        elif line.startswith("data: "):
            yield kind, json.loads(line[len("data: "):])


async def test_the_stream_sends_a_snapshot_then_what_changed_and_a_new_connection_a_snapshot(fleet: Fleet,
                                                                                             live: str) -> None:
    async with httpx.AsyncClient(base_url=live, timeout=30) as client:
        async with client.stream("GET", "/admin/api/stream") as response:
            events = sse(response)
            kind, first = await anext(events)
            assert kind == "snapshot" and sorted(a["agent_id"] for a in first["agents"]) == ["a1", "a2", "a3"]
            fleet.registry.set_agent_state("a3", "dead", fleet.now[0])
            deadline = time.monotonic() + patient(20)
            async for kind, delta in events:
                assert kind == "delta" and set(delta) >= BASE_KEYS, (kind, delta)
                if [(a["agent_id"], a["state"]) for a in delta["agents"]] == [("a3", "dead")]:
                    break
                assert time.monotonic() < deadline, "no delta carried a3's death"
        async with client.stream("GET", "/admin/api/stream") as response:
            kind, again = await anext(sse(response))
    assert kind == "snapshot" and {a["agent_id"]: a["state"] for a in again["agents"]}["a3"] == "dead"
    assert again["sites"][0]["num_up"] == 2


async def test_the_snapshot_endpoint_is_what_the_stream_sends_first(fleet: Fleet) -> None:
    async with fleet.client() as client:
        snapshot = (await client.get("/admin/api/snapshot")).raise_for_status().json()
    schemas.Snapshot(**snapshot)
    assert snapshot == json.loads(json.dumps((await fleet.admin.view()).snapshot()))


# ------------------------------------------------------------------ the SDK
async def test_the_sdk_lists_every_agent_following_the_pages(fleet: Fleet, monkeypatch: pytest.MonkeyPatch) -> None:
    fleet.add(5, T0)
    monkeypatch.setattr(calls, "AGENTS_PAGE", 3)       # 8 agents: three pages
    async with AsyncMesh("http://mesh", api_key="", transport=httpx.ASGITransport(app=fleet.app)) as mesh:
        listed = await mesh.agents()
    assert [a.agent_id for a in listed] == ["a1", "a2", "a3", *(f"b{i:03d}" for i in range(5))]
    assert [a.site for a in listed] == ["", "", "", "north", "south", "east", "north", "south"]


def test_the_sdk_refuses_a_cursor_that_does_not_move() -> None:
    assert calls.next_after({"agents": [], "next_after": None}, "b") is None
    assert calls.next_after({"agents": []}, None) is None          # a coordinator older than paging
    assert calls.next_after({"next_after": "c"}, "b") == "c"
    with pytest.raises(UnexpectedResponseError):
        calls.next_after({"next_after": "b"}, "b")
    with pytest.raises(UnexpectedResponseError):
        calls.next_after({"next_after": 7}, "b")


@pytest.mark.parametrize("tokens, ranks, rank_tokens, straggler", [
    ((20, 30, 25, 25, 90, 60, 80, 70), 2, [100, 300], 1),       # rank 1 holds experts 4-7, the busiest
    ((50, 50, 10, 10, 40, 40), 3, [100, 20, 80], 0),
    ((5, 5, 5, 5), 2, [10, 10], None),                          # even: nobody straggles
    ((9, 1, 3), 2, [13], None),                                 # 3 experts cannot split over 2 ranks: one run
    ((9, 1, 3, 4), 1, [17], None),                              # one rank
])
def test_the_expert_view_names_the_rank_holding_the_busiest_experts(tokens, ranks, rank_tokens, straggler) -> None:
    view = expert_view(StageLoad("p-0", 1, 0, 1, 8, expert_tokens=tokens, expert_imbalance=1.7), ranks)
    assert view == {"tokens": list(tokens), "imbalance": 1.7, "rank_tokens": rank_tokens,
                    "straggler_rank": straggler}
    assert schemas.ExpertsView(**view).model_dump() == view      # what the admin API documents


def test_a_dense_stage_has_no_expert_view() -> None:
    assert expert_view(StageLoad("p-0", 1, 0, 1, 8), 2) is None
