"""The admin UI in a real browser (Debian's chromium through Playwright): over a real mesh of 3 agents, 2 stages
and a spare, drain the agent of stage 0 from the UI and watch its stage land on the spare; and over fixed JSON
for a larger mesh, check the layout, GPU columns and that names from the network stay text.
Screenshots go to .artifacts/admin-ui/."""

from __future__ import annotations

import json
import time
from itertools import permutations
from pathlib import Path
from urllib.parse import urlparse

import httpx
import pytest

from stratamesh.fleet.launcher import LocalMesh

pytestmark = pytest.mark.slow

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"]
REPO = Path(__file__).resolve().parents[2]
ARTIFACTS = REPO / ".artifacts" / "admin-ui"
UI_DIR = REPO / "coordinator" / "ui"
MODEL = "tiny-llama"
EVIL = '<img src=x onerror="window.__pwned=1">'     # an agent name from the network, to be shown, not run


needs_chromium = pytest.mark.skipif(not CHROMIUM.exists(),
                                    reason="needs Debian's chromium at /usr/bin/chromium (apt-get install chromium)")


def launch(playwright, **context):
    browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
    return browser, browser.new_page(viewport={"width": 1440, "height": 1000}, **context)


def collect_errors(page) -> list[str]:
    errors: list[str] = []
    page.on("console", lambda m: errors.append(f"console: {m.text}") if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(f"pageerror: {e}"))
    return errors


def active_segment(page, stage: int):
    return page.locator(f'[data-testid="placement-segment"][data-plan-state="active"][data-stage="{stage}"]')


@needs_chromium
def test_the_ui_shows_the_mesh_and_a_drain_from_it_moves_the_stage(tiny_models: dict[str, Path],
                                                                  tmp_path: Path) -> None:
    """The acceptance test of the admin UI: 3 agents and the placement bars, then a drain from the UI."""
    sync_api = pytest.importorskip("playwright.sync_api", reason="needs the playwright package")
    expect = sync_api.expect
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with LocalMesh(str(tiny_models["llama"]), num_agents=3, num_stages=2, log_dir=str(tmp_path / "logs"),
                   db=str(tmp_path / "registry.db")) as mesh, sync_api.sync_playwright() as playwright:
        for _ in range(3):    # something for the charts and the requests table
            httpx.post(f"{mesh.url}/v1/completions", timeout=30,
                       json={"model": MODEL, "prompt": "The mesh", "max_tokens": 12}).raise_for_status()
        browser, page = launch(playwright)
        errors = collect_errors(page)
        page.goto(f"{mesh.url}/admin/")

        expect(page.get_by_test_id("agent-row")).to_have_count(3, timeout=15_000)
        expect(page.locator('[data-testid="placement-segment"][data-plan-state="active"]')).to_have_count(2)
        expect(page.get_by_test_id("connection")).to_have_attribute("data-state", "live", timeout=10_000)
        expect(page.get_by_test_id("topology-node")).to_have_count(3)
        serving = {active_segment(page, s).get_attribute("data-agent-id") for s in (0, 1)}
        (spare,) = set(mesh.agent_ids) - serving
        drained = active_segment(page, 0).get_attribute("data-agent-id")
        expect(page.locator(f'[data-testid="drain-button"][data-agent-id="{spare}"]')).to_be_disabled()

        page.get_by_test_id("request-row").first.click()      # the trace timeline of a request
        expect(page.locator('[data-testid="trace-timeline"] rect.span-compute').first).to_be_attached()
        before = ARTIFACTS / "before-drain.png"
        page.evaluate("window.scrollTo(0, 0)")      # the sticky header at the top of a full-page shot
        page.screenshot(path=str(before), full_page=True)

        page.locator(f'[data-testid="drain-button"][data-agent-id="{drained}"]').click()
        expect(page.get_by_test_id("confirm-dialog")).to_be_visible()
        page.get_by_test_id("confirm-accept").click()
        expect(page.get_by_test_id("toast").first).to_contain_text("Draining")

        expect(active_segment(page, 0)).to_have_attribute("data-agent-id", spare, timeout=45_000)
        row = page.locator(f'[data-testid="agent-row"][data-agent-id="{drained}"]')
        expect(row.get_by_test_id("agent-state")).to_have_text("drained", timeout=30_000)
        expect(row.get_by_test_id("drain-status")).to_have_attribute("data-drain-state", "drained")
        expect(page.locator(f'[data-testid="placement-segment"][data-agent-id="{drained}"]')).to_have_count(0)
        after = ARTIFACTS / "after-drain.png"
        page.evaluate("window.scrollTo(0, 0)")
        page.screenshot(path=str(after), full_page=True)
        browser.close()
        plans = httpx.get(f"{mesh.url}/admin/api/plans").json()["plans"]
    print(f"\nadmin UI screenshots: {before} {after}")
    assert errors == [], errors
    active = next(p for p in plans if p["state"] == "active")
    assert {s["agent_id"] for s in active["stages"]} == {spare} | (serving - {drained})   # what the UI showed


# ---- a larger mesh from fixed JSON: layout at 12 agents on 3 sites, GPUs, hostile names, the dark theme ----

def gpu(name: str, index: int, mem_gib: int, used_frac: float) -> dict:
    total = mem_gib << 30
    return {"index": index, "name": name, "mem_total_bytes": total, "mem_free_bytes": int(total * (1 - used_frac)),
            "utilization_pct": 40 + 7 * index, "temperature_c": 55 + index, "power_w": 300.0}


def agent(agent_id: str, name: str, site: str, tier: str, gpus: list[dict], state: str, now: float) -> dict:
    caps = {"hostname": name, "cpu_model": "AMD EPYC", "num_cpus": 16, "ram_total_bytes": 64 << 30,
            "ram_available_bytes": 40 << 30, "gpus": gpus, "backends": ["torch-cpu"], "speeds": [], "site": site,
            "tier": tier, "num_ranks": max(1, len(gpus))}
    telemetry = {"unix_s": now, "queue_depth": 2, "tokens_per_s": 812.5, "gpus": gpus, "received": now,
                 "stages": [{"assignment_id": f"{agent_id}-s", "num_running": 3, "num_waiting": 1,
                             "kv_blocks_used": 300, "kv_blocks_total": 1000, "prefix_query_tokens": 0,
                             "prefix_hit_tokens": 0}]}
    return {"agent_id": agent_id, "name": name, "address": f"10.0.0.{len(agent_id)}:7000", "state": state,
            "first_seen": now - 600, "last_seen": now, "state_since": now - 90, "metrics_address": "",
            "capabilities": caps, "telemetry": None if state in ("dead", "drained") else telemetry}


def fixture_snapshot(now: float) -> dict:
    """12 agents on 2 edge sites and a cloud one; a 4-stage plan with a standby beside it and a TP=2 model."""
    h100 = [gpu("NVIDIA H100 80GB HBM3", i, 80, 0.7) for i in range(8)]
    specs = [("e1", EVIL, "lab", "edge", [], "connected"), ("e2", "lab-nuc", "lab", "edge", [], "connected"),
             ("e3", "lab-pi", "lab", "edge", [], "dead"), ("e4", "lab-old", "lab", "edge", [], "drained"),
             ("s1", "shop-orin", "shop", "edge", [gpu("Orin", 0, 32, 0.4)], "connected"),
             ("s2", "shop-till", "shop", "edge", [], "connected"), ("s3", "shop-cam", "shop", "edge", [], "connected")]
    specs += [(f"c{i}", f"gpu-node-{i}", "cloud-east", "cloud", h100 if i == 1 else h100[:2], "connected")
              for i in range(1, 6)]
    agents = [agent(*spec, now) for spec in specs]
    live = [a["agent_id"] for a in agents if a["state"] == "connected"]
    links = [{"agent_id": a, "peer_id": b, "rtt_s": 0.0004 + 0.03 * (a[0] != b[0]), "error": "",
              "bandwidth_bytes_per_s": 1.2e9 if a[0] == b[0] else 6e6, "ts": now} for a, b in permutations(live, 2)]
    links += [{"agent_id": "origin", "peer_id": a, "rtt_s": 0.002, "bandwidth_bytes_per_s": 1e8, "error": "",
               "ts": now} for a in live]

    def plan(plan_id, model_id, state, layers, stages):
        return {"plan_id": plan_id, "model_id": model_id, "state": state, "created": now - 300, "reason": "fixture",
                "num_layers": layers, "stages": [{"assignment_id": f"{plan_id}-{i}", "agent_id": a, "start_layer": s,
                                                  "end_layer": e, "tp_degree": tp, "state": st}
                                                 for i, (a, s, e, tp, st) in enumerate(stages)]}
    plans = [plan("p1", "llama-8b", "active", 32, [("e1", 0, 2, 1, "ready"), ("c1", 2, 20, 1, "ready"),
                                                   ("c2", 20, 30, 1, "ready"), ("s1", 30, 32, 1, "ready")]),
             plan("p2", "llama-8b", "standby", 32, [("e2", 0, 2, 1, "ready"), ("c3", 2, 30, 2, "loading"),
                                                    ("s2", 30, 32, 1, "pending")]),
             plan("p3", "qwen-0.5b", "active", 24, [("c4", 0, 24, 2, "ready")])]
    models = [{"model_id": m, "path": f"/models/{m}", "num_layers": n, "max_context": 8192, "state": "ready",
               "num_stages": k, "first_site": "lab" if m == "llama-8b" else None, "last_site": None,
               "created": now - 900} for m, n, k in (("llama-8b", 32, 4), ("qwen-0.5b", 24, 1))]
    events = [{"id": 2, "ts": now - 5, "kind": "agent_dead", "agent_id": "e3", "detail": EVIL},
              {"id": 1, "ts": now - 60, "kind": "plan", "agent_id": None, "detail": "4 stage(s) ..."}]
    drains = [{"agent_id": "e4", "started_unix_s": now - 100, "state": "drained", "sessions_asked": 3,
               "stages": [{"model": "llama-8b", "layers": [0, 2], "from": "e4", "to": "e1"}],
               "finished_unix_s": now - 95, "error": ""}]
    stats = {"t": now, "tokens_per_s": 2400.0, "requests_per_s": 3.5, "ttft_p50_s": 0.12, "ttft_p99_s": 0.4,
             "itl_p50_s": 0.02, "itl_p99_s": 0.05, "running": 12, "waiting": 3}
    return {"ts": now, "agents": agents, "plans": plans, "links": links, "models": models, "drains": drains,
            "stats": stats, "events": events}


def fixture_api(route, snapshot: dict) -> None:
    """Serves the UI's files and the admin API's answers from fixed data, as the coordinator would."""
    path = urlparse(route.request.url).path
    if path == "/admin/" or path.startswith("/admin/static/"):
        static = "index.html" if path == "/admin/" else path.removeprefix("/admin/static/")
        kind = {"html": "text/html", "js": "text/javascript", "css": "text/css"}[static.rsplit(".", 1)[1]]
        return route.fulfill(status=200, content_type=kind, body=(UI_DIR / static).read_bytes())
    if path == "/admin/api/stream":
        return route.fulfill(status=200, content_type="text/event-stream",
                             body=f"retry: 500\nevent: snapshot\ndata: {json.dumps(snapshot)}\n\n")
    now = snapshot["ts"]
    points = [{**snapshot["stats"], "t": now - 120 + i, "tokens_per_s": 2000 + 400 * (i % 7)} for i in range(120)]
    answers = {"/admin/api/stats": {"interval_s": 1.0, "points": points}, "/admin/api/requests": {"requests": []}}
    if path in answers:
        return route.fulfill(status=200, content_type="application/json", body=json.dumps(answers[path]))
    return route.fulfill(status=404, content_type="application/json",
                         body=json.dumps({"error": {"message": f"no {path}", "type": "invalid_request_error"}}))


@needs_chromium
def test_a_larger_mesh_renders_and_names_from_the_network_stay_text() -> None:
    """12 agents on 3 sites, a standby plan, 8-GPU boxes, a hostile agent name; any 404 shows as a console error."""
    sync_api = pytest.importorskip("playwright.sync_api", reason="needs the playwright package")
    expect = sync_api.expect
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    snapshot = fixture_snapshot(time.time())
    with sync_api.sync_playwright() as playwright:
        browser, page = launch(playwright, color_scheme="dark")
        errors = collect_errors(page)
        page.route("http://mesh.test/**", lambda route: fixture_api(route, snapshot))
        page.goto("http://mesh.test/admin/")
        expect(page.get_by_test_id("agent-row")).to_have_count(12, timeout=10_000)
        expect(page.get_by_test_id("topology-node")).to_have_count(12)
        expect(page.get_by_test_id("topology-site")).to_have_count(3)
        expect(page.get_by_test_id("placement-segment")).to_have_count(8)
        expect(page.locator('[data-testid="placement-segment"][data-plan-state="standby"]')).to_have_count(3)
        row = page.locator('[data-testid="agent-row"][data-agent-id="e1"]')
        expect(row.get_by_test_id("agent-name")).to_have_text(EVIL)
        gpus = page.locator('[data-testid="agent-row"][data-agent-id="c1"] [data-testid="gpu"]')
        expect(gpus).to_contain_text("8× H100")
        for disabled in ("e3", "e4", "c5"):     # dead, drained, serving nothing
            expect(page.locator(f'[data-testid="drain-button"][data-agent-id="{disabled}"]')).to_be_disabled()
        expect(page.locator('[data-testid="drain-button"][data-agent-id="c1"]')).to_be_enabled()
        expect(page.get_by_test_id("event").first).to_contain_text(EVIL)
        page.get_by_test_id("topology-node").first.hover()
        shot = ARTIFACTS / "fixture-mesh-dark.png"
        page.screenshot(path=str(shot), full_page=True)
        pwned = page.evaluate("window.__pwned")
        injected = page.locator("img[src=x]").count()
        browser.close()
    print(f"\nadmin UI screenshot: {shot}")
    assert pwned is None and injected == 0
    assert errors == [], errors
