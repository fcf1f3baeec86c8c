"""The admin UI over a fleet of 10,000 boxes, in a real browser (Debian's chromium through Playwright): a real
coordinator with one real agent serving the tiny model, and 10,000 simulated agents over 50 sites
(stratamesh.bench.sim_agents: real Control streams, 4 processes of 2,500). The stream's first snapshot stays under
FIRST_SNAPSHOT_MAX_BYTES; the topology shows the sites, each one node with its counts, and the serving agent on its
own; the agents table and an opened site page through the agents API; and when one process of simulated agents
stops (2,500 agents leave), the page shows it without a reload. Screenshots go to .artifacts/admin-ui/."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from stratamesh.bench.control import LoadProcess
from stratamesh.coordinator.fleet_view import RECENT_MAX
from stratamesh.launcher import LocalMesh
from tests.e2e.test_admin_ui import ARTIFACTS, collect_errors, launch, needs_chromium
from tests.patience import patient

pytestmark = pytest.mark.slow

NUM_SIMULATED = 10_000
PER_PROCESS = 2_500
JOIN_TIMEOUT_S = patient(300)     # every limit here is stretched by the machine's patience (tests/patience.py)
# The stream's first event at 10,000 agents: 50 site summaries (~330 bytes each), the serving agent, the RECENT_MAX
# agents that changed state last (~600 bytes each), the plan, the links among those, the newest events and stats.
# Every agent in full would be ~6 MB.
FIRST_SNAPSHOT_MAX_BYTES = 64 * 1024
DELTA_MAX_BYTES = 16 * 1024     # a quiet second's delta: what changed of the agents held in full, the stats point


@pytest.fixture(scope="module")
def fleet(tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[tuple[LocalMesh, list[LoadProcess]]]:
    """The mesh and its simulated agents' processes, every simulated agent welcomed."""
    tmp = tmp_path_factory.mktemp("admin-ui-fleet")
    mesh = LocalMesh(str(tiny_models["llama"]), num_agents=1, insecure=True, log_dir=str(tmp / "logs"),
                     db=str(tmp / "registry.db"))
    loads: list[LoadProcess] = []
    try:
        mesh.start()
        args = ["--join-timeout", f"{JOIN_TIMEOUT_S:.0f}", "--report-every", "5"]
        loads = [LoadProcess(mesh, first, PER_PROCESS, args) for first in range(0, NUM_SIMULATED, PER_PROCESS)]
        deadline = time.monotonic() + JOIN_TIMEOUT_S + patient(60)
        while any(p.latest("joined") is None for p in loads) and time.monotonic() < deadline:
            time.sleep(0.2)
        joined = [p.latest("joined") for p in loads]
        assert all(j is not None and j["welcomed"] == PER_PROCESS for j in joined), joined
        yield mesh, loads
    finally:
        for load in loads:
            load.stop()
        mesh.stop()


def stream_events(url: str) -> Iterator[tuple[str, bytes]]:
    """The events of GET /admin/api/stream as they come: (event, its data as sent)."""
    kind = ""
    with httpx.stream("GET", f"{url}/admin/api/stream", timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("event: "):
                kind = line[len("event: "):]
            elif line.startswith("data: "):
                yield kind, line[len("data: "):].encode()
    raise AssertionError("the stream ended")


def quiet_delta(events: Iterator[tuple[str, bytes]], deadline_s: float = patient(120)) -> tuple[str, bytes]:
    """The first delta under DELTA_MAX_BYTES (or the last one, at the deadline). The joins' last state changes and
    events trail their welcome by seconds on a busy box: until they are sent, a delta carries them."""
    deadline = time.monotonic() + deadline_s
    for kind, data in events:
        if len(data) < DELTA_MAX_BYTES or time.monotonic() > deadline:
            return kind, data
    raise AssertionError("the stream ended")


def timed_get(url: str) -> tuple[float, dict]:
    started = time.perf_counter()
    body = httpx.get(url, timeout=60).raise_for_status().json()
    return (time.perf_counter() - started) * 1e3, body


@needs_chromium
def test_ten_thousand_agents_show_by_site_page_by_page_and_live(fleet: tuple[LocalMesh, list[LoadProcess]]) -> None:
    sync_api = pytest.importorskip("playwright.sync_api", reason="needs the playwright package")
    expect = sync_api.expect
    # Each check waits for the page to show its state, up to 30 s rather than Playwright's 5: a page of a site's
    # agents took over 5 s to come on a busy CI box (the API lists 10,000 agents in 0.4-1.5 s when it is quiet)
    expect.set_options(timeout=patient(30_000))
    mesh, loads = fleet
    total = NUM_SIMULATED + 1
    events = stream_events(mesh.url)
    first_kind, first = next(events)
    delta_kind, delta = quiet_delta(events)
    events.close()
    snapshot = json.loads(first)
    page_ms, page_body = timed_get(f"{mesh.url}/admin/api/agents?limit=100")
    all_ms, all_body = timed_get(f"{mesh.url}/admin/api/agents?limit=10000")
    print(f"\nfirst snapshot {len(first):,} bytes ({len(snapshot['agents'])} agents in full, "
          f"{len(snapshot['sites'])} sites); a delta {len(delta):,} bytes; GET /admin/api/agents?limit=100 "
          f"{page_ms:.0f} ms, ?limit=10000 {all_ms:.0f} ms")
    assert (first_kind, delta_kind) == ("snapshot", "delta")
    assert snapshot["num_agents"] == total and sum(s["num_agents"] for s in snapshot["sites"]) == total
    assert len(snapshot["agents"]) <= 1 + RECENT_MAX            # the serving agent, and those that changed last
    assert len(first) < FIRST_SNAPSHOT_MAX_BYTES and len(delta) < DELTA_MAX_BYTES
    assert page_body["total"] == total and len(page_body["agents"]) == 100
    assert len(all_body["agents"]) == 10_000 and all_body["next_after"] is not None
    (serving,) = mesh.agent_ids
    real_site = next(a for a in snapshot["agents"] if a["agent_id"] == serving)["capabilities"]["site"]
    sim_sites = sorted((s for s in snapshot["sites"] if s["site"] != real_site), key=lambda s: s["site"])
    opened, chosen = sim_sites[3], sim_sites[7]

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with sync_api.sync_playwright() as playwright:
        browser, page = launch(playwright, color_scheme="light")
        errors = collect_errors(page)
        page.goto(f"{mesh.url}/admin/")
        expect(page.get_by_test_id("summary-agents")).to_contain_text(f"{total}/{total}", timeout=patient(30_000))
        expect(page.get_by_test_id("connection")).to_have_attribute("data-state", "live", timeout=patient(10_000))
        expect(page.get_by_test_id("topology-site")).to_have_count(len(snapshot["sites"]))
        summaries = page.get_by_test_id("topology-site-summary")
        expect(summaries).to_have_count(len(sim_sites))
        assert sum(int(n) for n in summaries.evaluate_all("(ns) => ns.map((n) => n.dataset.numAgents)")) == 10_000
        expect(page.get_by_test_id("topology-node")).to_have_count(1)        # the agent serving the model
        expect(page.locator(f'[data-testid="topology-node"][data-agent-id="{serving}"]')).to_be_visible()
        expect(page.get_by_test_id("agent-row")).to_have_count(50)
        expect(page.get_by_test_id("agents-range")).to_have_text(f"1–50 of {total:,}")
        page.get_by_test_id("agents-next").click()
        expect(page.get_by_test_id("agents-range")).to_have_text(f"51–100 of {total:,}")
        expect(page.get_by_test_id("agent-row").first).to_have_attribute("data-agent-id",
                                                                         sorted_ids(mesh, 100)[50])
        page.get_by_test_id("agents-site").select_option(chosen["site"])
        expect(page.get_by_test_id("agents-range")).to_have_text(f"1–50 of {chosen['num_agents']:,}")
        page.locator(f'[data-testid="topology-site-summary"][data-site="{opened["site"]}"]').click()
        listed = page.locator(f'[data-testid="site-agents"][data-site="{opened["site"]}"]')
        expect(listed.get_by_test_id("site-agent")).to_have_count(25)
        expect(listed.get_by_test_id("site-agents-range")).to_have_text(f"1–25 of {opened['num_agents']:,}")
        listed.get_by_test_id("site-agents-next").click()
        expect(listed.get_by_test_id("site-agents-range")).to_have_text(f"26–50 of {opened['num_agents']:,}")
        shot = ARTIFACTS / "fleet-10000.png"
        page.screenshot(path=str(shot), full_page=True)

        loads[0].stop()                                  # 2,500 simulated agents leave
        left = total - PER_PROCESS
        expect(page.get_by_test_id("summary-agents")).to_contain_text(f"{left}/{total}", timeout=patient(120_000))
        up = summaries.evaluate_all("(ns) => ns.map((n) => Number(n.dataset.numUp))")
        assert sum(up) == left - 1, up                     # the sites' nodes say so too (the real agent: on its own)
        expect(page.get_by_test_id("connection")).to_have_attribute("data-state", "live")
        after = ARTIFACTS / "fleet-10000-after.png"
        page.screenshot(path=str(after), full_page=True)
        browser.close()
    print(f"admin UI screenshots: {shot} {after}")
    assert errors == [], errors


def sorted_ids(mesh: LocalMesh, count: int) -> list[str]:
    """The first count agent ids in the API's order."""
    body = httpx.get(f"{mesh.url}/admin/api/agents", params={"limit": count}, timeout=60).raise_for_status().json()
    return [a["agent_id"] for a in body["agents"]]
