"""The admin API's models, re-plans, stats, events and snapshots over a real registry and deployer, its OpenAPI
document, and the admin UI's static files (pages of agents and the stream's deltas: test_admin_fleet.py)."""

from __future__ import annotations

import shutil
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI

from stratamesh.coordinator.mesh_admin import MeshAdmin
from stratamesh.coordinator.api import admin_schemas as schemas
from stratamesh.coordinator.api.admin import admin_router
from stratamesh.coordinator.api.errors import install_error_handlers
from stratamesh.coordinator.api.ui import UI_DIR, mount_ui
from stratamesh.coordinator.control.drainer import Drainer
from stratamesh.coordinator.live_stats import LiveStats
from stratamesh.coordinator.serving.records import RequestLog
from stratamesh.coordinator.rollouts import Rollouts
from stratamesh.coordinator.serving.sessions import SessionTable
from stratamesh.fleet.control_messages import LinkMeasurement
from stratamesh.coordinator.control.models import find_model
from stratamesh.fleet.model_folder import revision_of
from stratamesh.fleet.sessions import Speculation
from stratamesh.fleet.stages import StageStatus
from tests.coordinator.test_deployer import model_dir, ready_pair, report_ready  # noqa: F401 (a fixture)

T0 = 1_700_000_000.0


@pytest.fixture
def mesh(model_dir: Path):
    registry, deployer, agents = ready_pair(model_dir, [100.0])
    live = LiveStats()
    requests = RequestLog()
    admin = MeshAdmin(registry, requests, {}, Drainer(deployer, SessionTable(), registry), deployer, live,
                      clock=lambda: T0 + 10, rollouts=Rollouts(deployer, requests, clock=lambda: T0 + 10))
    app = FastAPI()
    app.include_router(admin_router(admin))
    mount_ui(app)
    install_error_handlers(app)
    return registry, deployer, agents, live, admin, app


async def test_a_rollout_starts_through_the_api_is_shown_and_an_operator_rolls_it_back(mesh, model_dir: Path,
                                                                                        tmp_path_factory) -> None:
    registry, deployer, agents, _, _, app = mesh
    following = tmp_path_factory.mktemp("next")
    shutil.copy(model_dir / "config.json", following / "config.json")
    async with await client_of(app) as client:
        for body, status, code in (({"path": str(following), "steps": [50, 10]}, 400, "bad_rollout"),
                                   ({"path": str(following / "nope")}, 400, "bad_model"),
                                   ({"path": str(model_dir)}, 409, "rollout_refused")):     # the serving revision
            refused = await client.post("/admin/api/models/m/rollout", json=body)
            assert (refused.status_code, refused.json()["error"]["code"]) == (status, code), body
        missing = await client.post("/admin/api/models/nope/rollout", json={"path": str(following)})
        assert missing.status_code == 404
        started = await client.post("/admin/api/models/m/rollout", json={"path": str(following), "step_s": 5})
        assert started.status_code == 202, started.text
        rollout = started.json()["model"]["rollout"]
        assert (rollout["revision"], rollout["state"], rollout["share"], rollout["steps"], rollout["step_s"]) == (
            registry.model("m").rollout.revision, "canary", 5, [5, 25, 100], 5.0)
        assert rollout["path"] == str(following.resolve()) and rollout["canary_ready"] is False
        again = await client.post("/admin/api/models/m/rollout", json={"path": str(following)})
        assert again.status_code == 409 and "is running" in again.json()["error"]["message"]
        events = (await client.get("/admin/api/events", params={"limit": 5})).json()["events"]
        assert any(e["kind"] == "rollout_started" for e in events)
        back = await client.delete("/admin/api/models/m/rollout")
        assert back.status_code == 200 and back.json()["model"]["rollout"]["state"] == "rolled_back"
        assert back.json()["model"]["rollout"]["reason"] == "rolled back by an operator"
        none = await client.delete("/admin/api/models/m/rollout")
        assert none.status_code == 409 and none.json()["error"]["code"] == "no_rollout"


async def test_a_stage_an_agent_could_not_load_is_shown_with_its_model_until_it_loads(mesh, model_dir: Path) -> None:
    registry, deployer, agents, _, _, app = mesh
    deployer.plans.add_model("m2", str(model_dir), num_stages=1)
    (stage,) = registry.active_plan("m2").stages
    failed = StageStatus(stage.assignment_id, "failed", "CheckpointError: checkpoint has no tensor 'lm_head.weight'")
    deployer.stage_status(stage.agent_id, failed)
    async with await client_of(app) as client:
        models = {m["model_id"]: m for m in (await client.get("/admin/api/models")).json()["models"]}
        assert models["m"]["load_errors"] == []
        assert models["m2"]["load_errors"] == [{"model_id": "m2", "assignment_id": stage.assignment_id,
                                                "agent_id": stage.agent_id, "error": failed.error, "at": 100.0}]
        deployer.stage_status(stage.agent_id, StageStatus(stage.assignment_id, "ready"))
        models = {m["model_id"]: m for m in (await client.get("/admin/api/models")).json()["models"]}
        assert models["m2"]["load_errors"] == [] and models["m2"]["state"] == "ready"


async def client_of(app: FastAPI) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://mesh")


async def test_models_are_listed_deployed_and_bad_folders_refused_by_name(mesh, model_dir: Path) -> None:
    registry, deployer, agents, _, _, app = mesh
    async with await client_of(app) as client:
        (m,) = (await client.get("/admin/api/models")).json()["models"]
        assert (m["model_id"], m["state"], m["num_stages"], m["num_layers"], m["first_site"]) == ("m", "ready", 2, 6, "")
        missing = await client.post("/admin/api/models", json={"path": str(model_dir / "nope"), "num_stages": 1})
        assert missing.status_code == 400 and missing.json()["error"]["code"] == "bad_model"
        assert "config.json" in missing.json()["error"]["message"]
        for bad in ({"path": str(model_dir), "num_stages": 0}, {"path": str(model_dir), "stages": 2}, {},
                    {"path": "\u0000"},         # the NUL: once a 500, found by the fuzzer
                    {"path": str(model_dir), "quantize": "int3"}, {"path": str(model_dir), "num_replicas": 0}):
            refused = await client.post("/admin/api/models", json=bad)
            assert refused.status_code == 400 and refused.json()["error"]["type"] == "invalid_request_error", bad
        deployed = await client.post("/admin/api/models", json={"path": str(model_dir), "model_id": "m2",
                                                                "num_stages": 1})
        assert deployed.status_code == 202
        assert deployed.json()["model"] | {"created": 0} == {
            "model_id": "m2", "path": str(model_dir.resolve()), "num_layers": 6, "max_context": 128,
            "state": "loading", "num_stages": 1, "first_site": "", "last_site": "", "quantize": "", "num_replicas": 1,
            "ready_replicas": 0, "created": 0, "load_errors": [],
            "speculation": {"draft_tokens": 0, "accepted_tokens": 0, "acceptance_rate": None},
            "speculative_config": None, "autoscale": None, "revision": revision_of(model_dir), "rollout": None}
        scaled = await client.post("/admin/api/models", json={"path": str(model_dir), "model_id": "m5", "num_stages": 1,
                                                              "min_replicas": 0, "max_replicas": 2, "slo_itl_ms": 50})
        assert scaled.status_code == 202 and scaled.json()["model"]["num_replicas"] == 1     # it starts with one
        assert scaled.json()["model"]["autoscale"] == {
            "min_replicas": 0, "max_replicas": 2, "slo_ttft_ms": None, "slo_itl_ms": 50.0, "scale_down_after_s": 60.0,
            "history": [], "last_decision": "", "last_cold_start_s": None}
        assert registry.model("m5").autoscale.slo_itl_ms == 50
        for bad in ({"min_replicas": 3, "max_replicas": 2}, {"min_replicas": 0, "max_replicas": 0},
                    {"slo_ttft_ms": -1}):
            refused = await client.post("/admin/api/models", json={"path": str(model_dir), "model_id": "m6", **bad})
            assert refused.status_code == 400 and refused.json()["error"]["type"] == "invalid_request_error", bad
        assert registry.model("m6") is None
        pinned = await client.post("/admin/api/models", json={"path": str(model_dir), "model_id": "m3",
                                                              "num_stages": 1, "first_site": "lab"})
        assert pinned.status_code == 202 and pinned.json()["model"]["state"] == "waiting"
        assert registry.model("m3").first_site == "lab"
        quantized = await client.post("/admin/api/models", json={"path": str(model_dir), "model_id": "m4",
                                                                 "num_stages": 1, "quantize": "int8",
                                                                 "first_site": "lab"})
        assert quantized.status_code == 202 and quantized.json()["model"]["quantize"] == "int8"
        assert registry.model("m4").quantize == "int8"
        event = (await client.get("/admin/api/events", params={"limit": 1})).json()["events"][0]
        assert event["kind"] == "placement_failed" and "'lab'" in event["detail"]
        report_ready(deployer, agents)
        states = {m["model_id"]: m["state"] for m in (await client.get("/admin/api/models")).json()["models"]}
        assert states == {"m": "ready", "m2": "ready", "m3": "waiting", "m4": "waiting", "m5": "ready"}
        deployer.plans.scale("m5", 0)
        states = {m["model_id"]: m["state"] for m in (await client.get("/admin/api/models")).json()["models"]}
        assert states["m5"] == "scaled_to_zero"
        plans = (await client.get("/admin/api/plans")).json()["plans"]
        assert sorted((p["model_id"], p["num_layers"], p["state"]) for p in plans) == [
            ("m", 6, "active"), ("m2", 6, "active")]
        # where each stage runs and in what precision, as its spec says (these agents are CPU boxes)
        assert {(s["device"], s["dtype"]) for p in plans for s in p["stages"]} == {("cpu", "float32")}
        # how activations reach each stage, as routes use it now: token ids into the first; a 2 Mbit/s link, int8
        sender, receiver = (s.agent_id for s in registry.active_plan("m").stages)
        deployer.roster.links_reported(sender, [LinkMeasurement(receiver, 0.08, 2.5e5)])
        plans = (await client.get("/admin/api/plans")).json()["plans"]
        assert [s["link_codec"] for p in plans if p["model_id"] == "m" for s in p["stages"]] == ["", "int8"]
        # what the planner predicted: tokens/s at a concurrency, the step, and each stage's part of it
        for plan in plans:
            predicted, steps = plan["predicted"], [s["predicted_step_s"] for s in plan["stages"]]
            assert predicted["concurrency"] % 8 == 0 and predicted["tokens_per_s"] > 0
            assert all(0 < step <= predicted["bottleneck_s"] for step in steps)
            assert predicted["step_s"] >= sum(steps)
            assert predicted["tokens_per_s"] == pytest.approx(8 * min(predicted["concurrency"] / 8 / predicted["step_s"],
                                                                      1 / predicted["bottleneck_s"]), rel=1e-3)


async def test_a_replan_through_the_api_is_kept_moved_or_refused(mesh) -> None:
    registry, _, _, _, _, app = mesh
    async with await client_of(app) as client:
        kept = await client.post("/admin/api/models/m/replan")
        assert kept.status_code == 202 and kept.json()["replan"]["outcome"] == "unchanged"
        moved = await client.post("/admin/api/models/m/replan", json={"num_stages": 3})
        assert moved.status_code == 202 and moved.json()["replan"]["outcome"] == "standby"
        assert moved.json()["replan"]["reason"] == registry.standby_plan("m").reason
        states = [p["state"] for p in (await client.get("/admin/api/plans")).json()["plans"]]
        assert states == ["active", "standby"]
        too_many = await client.post("/admin/api/models/m/replan", json={"num_stages": 9})
        assert too_many.status_code == 409 and "3 of 9 agents" in too_many.json()["error"]["message"]
        unknown = await client.post("/admin/api/models/nope/replan")
        assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
        bad = await client.post("/admin/api/models/m/replan", json={"num_stages": "many"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "num_stages"


async def test_stats_events_and_the_snapshot_the_ui_draws(mesh) -> None:
    _, _, _, live, admin, app = mesh
    live.request_started(T0 + 8.1)
    live.first_token(T0 + 8.2, ttft_s=0.1)
    live.token(T0 + 9.3, gap_s=0.05)
    async with await client_of(app) as client:
        stats = (await client.get("/admin/api/stats", params={"seconds": 3})).json()
        assert stats["interval_s"] == 1.0
        assert [(p["t"] - T0, p["tokens_per_s"], p["running"]) for p in stats["points"]] == [
            (7, 0, 0), (8, 1, 1), (9, 1, 1)]
        assert stats["points"][1]["ttft_p50_s"] == 0.1 and stats["points"][2]["itl_p99_s"] == 0.05
        assert (await client.get("/admin/api/stats", params={"seconds": 0})).status_code == 400
        events = (await client.get("/admin/api/events", params={"limit": 5})).json()["events"]
        assert events[0]["kind"] == "agent_connected" and events[0]["agent_id"] == "a3"   # the spare, last
        assert [e["kind"] for e in events].count("plan") == 1
    snapshot = (await admin.view()).snapshot()
    assert len(snapshot["agents"]) == 3 and [p["model_id"] for p in snapshot["plans"]] == ["m"]
    assert snapshot["stats"]["t"] == T0 + 9 and snapshot["drains"] == [] and snapshot["events"]
    assert snapshot["num_agents"] == 3 and [s["num_agents"] for s in snapshot["sites"]] == [3]
    schemas.Snapshot(**snapshot)                    # what the stream sends obeys the documented shapes


async def test_the_openapi_document_describes_the_admin_api(mesh) -> None:
    app = mesh[-1]
    async with await client_of(app) as client:
        doc = (await client.get("/openapi.json")).json()
    paths = doc["paths"]
    for path in ("/admin/api/agents", "/admin/api/plans", "/admin/api/models", "/admin/api/models/{model_id}/replan",
                 "/admin/api/stats", "/admin/api/events", "/admin/api/stream", "/admin/api/snapshot",
                 "/admin/api/links", "/admin/api/agents/{agent_id}/drain"):
        assert path in paths, path
    assert "DeployModel" in str(paths["/admin/api/models"]["post"]["requestBody"])
    assert {"AgentView", "AgentsPage", "PlanView", "StatsPoint", "Capabilities", "Snapshot", "SiteView",
            "SiteLinkView"} <= doc["components"]["schemas"].keys()
    assert {p["name"] for p in paths["/admin/api/agents"]["get"]["parameters"]} == {
        "limit", "after", "site", "state", "tier", "serving", "q"}
    assert "text/event-stream" in paths["/admin/api/stream"]["get"]["responses"]["200"]["content"]


async def test_the_ui_is_served_as_static_files(mesh) -> None:
    app = mesh[-1]
    async with await client_of(app) as client:
        redirect = await client.get("/admin")
        assert redirect.status_code == 307 and redirect.headers["location"] == "/admin/"
        index = await client.get("/admin/")
        assert index.status_code == 200 and index.headers["content-type"].startswith("text/html")
        assert "/admin/static/" in index.text
        scripts = sorted(p.name for p in UI_DIR.glob("*.js"))
        assert scripts
        for name in scripts:
            asset = await client.get(f"/admin/static/{name}")
            assert asset.status_code == 200 and "javascript" in asset.headers["content-type"], name
            assert asset.headers["cache-control"] == "no-cache"
        assert (await client.get("/admin/static/../admin.py")).status_code == 404


async def test_a_model_deployed_with_its_own_speculative_config_keeps_it_and_a_bad_one_is_refused(
        mesh, model_dir: Path) -> None:
    registry, *_, app = mesh
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}
    async with await client_of(app) as client:
        deployed = await client.post("/admin/api/models", json={"path": str(model_dir), "model_id": "s",
                                                                "speculative_config": ngram})
        assert deployed.status_code == 202
        assert deployed.json()["model"]["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 3,
                                                                 "prompt_lookup_min": 2, "prompt_lookup_max": 2}
        assert registry.model("s").speculation == Speculation("ngram", 3, 2, 2)
        assert find_model(registry, "s").speculation == Speculation("ngram", 3, 2, 2)    # what the origin reads
        refused = await client.post("/admin/api/models", json={"path": str(model_dir), "model_id": "t",
                                                               "speculative_config": {"method": "eagle"}})
        assert refused.status_code == 400 and refused.json()["error"]["code"] == "bad_speculative_config"
        assert "num_speculative_tokens" in refused.json()["error"]["message"] and registry.model("t") is None
        plain = {m["model_id"]: m for m in (await client.get("/admin/api/models")).json()["models"]}["m"]
        assert plain["speculative_config"] is None
