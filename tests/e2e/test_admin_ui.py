"""The admin UI in a real browser (Debian's chromium through Playwright): over a real mesh of 3 agents, 2 stages
and a spare, log in as an operator through the login form, drain the agent of stage 0 from the UI and watch its
stage land on the spare; log in as a viewer, who sees the mesh but no operator controls and whose POSTs get 403;
and over fixed JSON for a larger mesh (insecure mode), check the layout, GPU columns and that names from the
network stay text. Screenshots go to .artifacts/admin-ui/."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from itertools import permutations
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import httpx
import pytest

from stratamesh.launcher import LocalMesh

pytestmark = pytest.mark.slow

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"]
REPO = Path(__file__).resolve().parents[2]
ARTIFACTS = REPO / ".artifacts" / "admin-ui"
UI_DIR = REPO / "coordinator" / "ui"
MODEL = "tiny-llama"
EVIL = '<img src=x onerror="window.__pwned=1">'     # an agent name from the network, to be shown, not run
OPERATOR = ("ops", "operator-password-1")
VIEWER = ("val", "viewer-password-1")
INSECURE_USER = {"name": "insecure development mode", "role": "operator", "kind": "insecure"}


needs_chromium = pytest.mark.skipif(not CHROMIUM.exists(),
                                    reason="needs Debian's chromium at /usr/bin/chromium (apt-get install chromium)")


def launch(playwright, **context):
    browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
    return browser, browser.new_page(viewport={"width": 1440, "height": 1000}, **context)


def collect_errors(page, expected_statuses: tuple[int, ...] = ()) -> list[str]:
    """Console errors and uncaught exceptions; chromium's "Failed to load resource" line for an HTTP status the
    test expects (401 before login, 403 for a viewer's POST) is left out."""
    expected = re.compile(rf"status of ({'|'.join(map(str, expected_statuses))}) ") if expected_statuses else None
    errors: list[str] = []

    def on_console(message) -> None:
        if message.type == "error" and not (expected and expected.search(message.text)):
            errors.append(f"console: {message.text}")

    page.on("console", on_console)
    page.on("pageerror", lambda e: errors.append(f"pageerror: {e}"))
    return errors


def log_in(page, username: str, password: str) -> None:
    """Fills the login form and submits it."""
    page.get_by_test_id("login-username").fill(username)
    page.get_by_test_id("login-password").fill(password)
    page.get_by_test_id("login-submit").click()


def shoot(page, name: str) -> Path:
    """A full-page screenshot from the top (the sticky header at the top of the shot)."""
    path = ARTIFACTS / name
    page.evaluate("window.scrollTo(0, 0)")
    page.screenshot(path=str(path), full_page=True)
    return path


def set_theme(page, theme: str) -> None:
    """Light or dark through the header's toggle (the choice is kept in localStorage)."""
    if page.evaluate("document.documentElement.dataset.theme") != theme:
        page.locator("#theme-toggle").click()
    assert page.evaluate("document.documentElement.dataset.theme") == theme


def active_segment(page, stage: int):
    return page.locator(f'[data-testid="placement-segment"][data-plan-state="active"][data-stage="{stage}"]')


@pytest.fixture(scope="module")
def mesh(tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalMesh]:
    """3 agents, 2 stages and a spare, secure (as by default), with an operator and a viewer user for the UI.
    The drain test moves a stage; the viewer test changes nothing, so either may run first."""
    tmp = tmp_path_factory.mktemp("admin-ui")
    with LocalMesh(str(tiny_models["llama"]), num_agents=3, num_stages=2, log_dir=str(tmp / "logs"),
                   db=str(tmp / "registry.db")) as mesh:
        mesh.add_user(*OPERATOR, "operator")
        mesh.add_user(*VIEWER, "viewer")
        for _ in range(3):    # something for the charts and the requests table
            httpx.post(f"{mesh.url}/v1/completions", timeout=30, headers=mesh.headers,
                       json={"model": MODEL, "prompt": "The mesh", "max_tokens": 12}).raise_for_status()
        yield mesh


@needs_chromium
def test_the_ui_shows_the_mesh_and_a_drain_from_it_moves_the_stage(mesh: LocalMesh) -> None:
    """The acceptance test of the admin UI: the login form, 3 agents and the placement bars, then a drain."""
    sync_api = pytest.importorskip("playwright.sync_api", reason="needs the playwright package")
    expect = sync_api.expect
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with sync_api.sync_playwright() as playwright:
        browser, page = launch(playwright, color_scheme="light")
        errors = collect_errors(page, expected_statuses=(401,))    # /whoami before login
        page.goto(f"{mesh.url}/admin/")

        expect(page.get_by_test_id("login-form")).to_be_visible()
        expect(page.get_by_test_id("dashboard")).to_be_hidden()
        expect(page.get_by_test_id("logout-button")).to_be_hidden()
        login = shoot(page, "login.png")
        log_in(page, *OPERATOR)

        expect(page.get_by_test_id("agent-row")).to_have_count(3, timeout=15_000)
        expect(page.get_by_test_id("login-form")).to_be_hidden()
        expect(page.get_by_test_id("user-name")).to_have_text(OPERATOR[0])
        expect(page.get_by_test_id("user-role")).to_have_text("operator")
        expect(page.get_by_test_id("logout-button")).to_be_visible()
        expect(page.get_by_test_id("insecure-banner")).to_be_hidden()
        expect(page.get_by_test_id("deploy-form")).to_be_visible()
        expect(page.get_by_test_id("replan-button")).to_have_count(1)
        expect(page.locator('[data-testid="placement-segment"][data-plan-state="active"]')).to_have_count(2)
        expect(page.get_by_test_id("connection")).to_have_attribute("data-state", "live", timeout=10_000)
        expect(page.get_by_test_id("topology-node")).to_have_count(3)
        expect(page.get_by_test_id("coordinator-lease")).to_have_text("one coordinator (SQLite registry): no lease")
        serving = {active_segment(page, s).get_attribute("data-agent-id") for s in (0, 1)}
        (spare,) = set(mesh.agent_ids) - serving
        drained = active_segment(page, 0).get_attribute("data-agent-id")
        expect(page.locator(f'[data-testid="drain-button"][data-agent-id="{spare}"]')).to_be_disabled()

        page.get_by_test_id("request-row").first.click()      # the trace timeline of a request
        expect(page.locator('[data-testid="trace-timeline"] rect.span-compute').first).to_be_attached()
        before = shoot(page, "before-drain.png")

        page.locator(f'[data-testid="drain-button"][data-agent-id="{drained}"]').click()
        expect(page.get_by_test_id("confirm-dialog")).to_be_visible()
        page.get_by_test_id("confirm-accept").click()
        expect(page.get_by_test_id("toast").first).to_contain_text("Draining")

        expect(active_segment(page, 0)).to_have_attribute("data-agent-id", spare, timeout=45_000)
        row = page.locator(f'[data-testid="agent-row"][data-agent-id="{drained}"]')
        expect(row.get_by_test_id("agent-state")).to_have_text("drained", timeout=30_000)
        expect(row.get_by_test_id("drain-status")).to_have_attribute("data-drain-state", "drained")
        expect(page.locator(f'[data-testid="placement-segment"][data-agent-id="{drained}"]')).to_have_count(0)
        after = shoot(page, "after-drain.png")
        browser.close()
    plans = httpx.get(f"{mesh.url}/admin/api/plans", headers=mesh.headers).raise_for_status().json()["plans"]
    print(f"\nadmin UI screenshots: {login} {before} {after}")
    assert errors == [], errors
    active = next(p for p in plans if p["state"] == "active")
    assert {s["agent_id"] for s in active["stages"]} == {spare} | (serving - {drained})   # what the UI showed


POST_FROM_PAGE = """async (path) => {
    const response = await fetch(path, { method: "POST" });
    return { status: response.status, body: await response.json() };
}"""


@needs_chromium
def test_a_viewer_sees_the_mesh_but_no_operator_controls(mesh: LocalMesh) -> None:
    """A wrong password shows an error and no dashboard (and starts no stream); the viewer then sees the agents
    but no Drain, Re-plan or deploy form, and a drain POSTed with their session gets 403. A session that ends
    (the password was reset) brings the login form back; Log out does too."""
    sync_api = pytest.importorskip("playwright.sync_api", reason="needs the playwright package")
    expect = sync_api.expect
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with sync_api.sync_playwright() as playwright:
        browser, page = launch(playwright, color_scheme="dark")
        errors = collect_errors(page, expected_statuses=(401, 403))
        calls: list[str] = []
        page.on("request", lambda r: calls.append(urlparse(r.url).path) if "/admin/api/" in r.url else None)
        page.goto(f"{mesh.url}/admin/")

        log_in(page, VIEWER[0], "not-the-password")
        expect(page.get_by_test_id("login-error")).to_have_text("Wrong username or password.")
        expect(page.get_by_test_id("login-form")).to_be_visible()
        expect(page.get_by_test_id("dashboard")).to_be_hidden()
        expect(page.get_by_test_id("connection")).to_be_hidden()
        expect(page.get_by_test_id("user-name")).to_be_hidden()
        expect(page.get_by_test_id("agent-row")).to_have_count(0)
        page.wait_for_timeout(1500)                 # long enough for a stream or a poll to have started
        assert set(calls) == {"/admin/api/whoami", "/admin/api/login"}, calls
        set_theme(page, "dark")
        login_error = shoot(page, "login-error-dark.png")

        log_in(page, *VIEWER)
        expect(page.get_by_test_id("agent-row")).to_have_count(3, timeout=15_000)
        expect(page.get_by_test_id("login-form")).to_be_hidden()
        expect(page.get_by_test_id("user-name")).to_have_text(VIEWER[0])
        expect(page.get_by_test_id("user-role")).to_have_text("viewer")
        expect(page.get_by_test_id("logout-button")).to_be_visible()
        expect(page.get_by_test_id("connection")).to_have_attribute("data-state", "live", timeout=10_000)
        expect(page.locator('[data-testid="placement-segment"][data-plan-state="active"]')).to_have_count(2)
        expect(page.get_by_test_id("model-row")).to_have_count(1)
        expect(page.get_by_test_id("drain-button")).to_have_count(0)       # hidden, not merely disabled
        expect(page.get_by_test_id("replan-button")).to_have_count(0)
        expect(page.get_by_test_id("deploy-form")).to_be_hidden()

        refused = page.evaluate(POST_FROM_PAGE, f"/admin/api/agents/{mesh.agent_ids[0]}/drain")
        assert refused["status"] == 403, refused
        assert refused["body"]["error"]["code"] == "insufficient_role", refused
        viewer_dark = shoot(page, "viewer-dark.png")
        set_theme(page, "light")
        viewer_light = shoot(page, "viewer-light.png")

        mesh.add_user(*VIEWER, "viewer")         # a new password ends the user's sessions: the next call gets 401
        expect(page.get_by_test_id("login-form")).to_be_visible(timeout=10_000)
        expect(page.get_by_test_id("login-note")).to_contain_text("session has ended")
        expect(page.get_by_test_id("dashboard")).to_be_hidden()
        expect(page.get_by_test_id("user-name")).to_be_hidden()

        log_in(page, *VIEWER)                   # back in; then out through the header's button
        expect(page.get_by_test_id("agent-row")).to_have_count(3, timeout=15_000)
        page.get_by_test_id("logout-button").click()
        expect(page.get_by_test_id("login-form")).to_be_visible()
        expect(page.get_by_test_id("login-note")).to_contain_text("logged out")
        expect(page.get_by_test_id("dashboard")).to_be_hidden()
        whoami = page.evaluate("fetch('/admin/api/whoami').then((r) => r.status)")
        browser.close()
    print(f"\nadmin UI screenshots: {login_error} {viewer_dark} {viewer_light}")
    assert whoami == 401
    assert errors == [], errors


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
    """12 agents on 2 edge sites and a cloud one; a 4-stage plan with a standby beside it and a model served by
    two replicas, one of them a TP=2 stage."""
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

    def plan(plan_id, model_id, state, layers, stages, replica=0):
        return {"plan_id": plan_id, "model_id": model_id, "state": state, "created": now - 300, "reason": "fixture",
                "num_layers": layers, "replica": replica, "stages": [{"assignment_id": f"{plan_id}-{i}", "agent_id": a, "start_layer": s,
                                                  "end_layer": e, "tp_degree": tp, "state": st,
                                                  "cached_blocks": 40 * i, "kv_cache_bytes": (i + 1) << 30}
                                                 for i, (a, s, e, tp, st) in enumerate(stages)]}
    plans = [plan("p1", "llama-8b", "active", 32, [("e1", 0, 2, 1, "ready"), ("c1", 2, 20, 1, "ready"),
                                                   ("c2", 20, 30, 1, "ready"), ("s1", 30, 32, 1, "ready")]),
             plan("p2", "llama-8b", "standby", 32, [("e2", 0, 2, 1, "ready"), ("c3", 2, 30, 2, "loading"),
                                                    ("s2", 30, 32, 1, "pending")]),
             plan("p3", "qwen-0.5b", "active", 24, [("c4", 0, 24, 2, "ready")]),
             plan("p4", "qwen-0.5b", "active", 24, [("s3", 0, 24, 1, "ready")], replica=1)]
    plans[2]["role"], plans[3]["role"] = "prefill", "decode"    # qwen's replicas split prefill from decode
    # qwen's TP=2 stage splits 8 experts over its 2 ranks: rank 1's four got 300 of the 400 tokens
    plans[2]["stages"][0]["experts"] = {"tokens": [20, 30, 25, 25, 90, 60, 80, 70], "imbalance": 1.84,
                                        "rank_tokens": [100, 300], "straggler_rank": 1}
    # the standby's middle stage is still fetching its tensors; the edge stage beside it fetched them
    weights = {"source": "10.0.0.7:7001", "tensor_bytes": 11_000_000_000, "total_bytes": 11_000_020_000}
    plans[1]["stages"][1]["weights"] = {**weights, "fetched_bytes": 4_000_000_000, "reused_bytes": 400_100_000,
                                        "done": False, "num_corrupt": 1}
    plans[1]["stages"][1]["link_codec"] = "int8"      # a slow link into it (partitioner/wire_codec.py)
    plans[1]["stages"][0]["weights"] = {**weights, "fetched_bytes": 11_000_020_000, "reused_bytes": 0,
                                        "done": True, "num_corrupt": 0}
    models = [{"model_id": m, "path": f"/models/{m}", "num_layers": n, "max_context": 8192, "state": "ready",
               "num_stages": k, "first_site": "lab" if m == "llama-8b" else None, "last_site": None,
               "created": now - 900} for m, n, k in (("llama-8b", 32, 4), ("qwen-0.5b", 24, 1))]
    models[0]["speculation"] = {"draft_tokens": 800, "accepted_tokens": 480, "acceptance_rate": 0.6}
    models[0] |= {"num_replicas": 1, "ready_replicas": 1, "revision": "0a1b2c3d4e5f", "rollout": {
        "path": "/models/llama-8b-v2", "revision": "9f8e7d6c5b4a", "steps": [5, 25, 100], "step_s": 60.0, "step": 1,
        "share": 25, "state": "canary", "started_s": now - 200, "step_since_s": now - 30, "canary_ready": True,
        "reason": "at 5% for 61 s: canary 9 requests, 0 failed, p90 31.0 ms a token; serving 171 requests, 0 failed, "
                  "p90 29.5 ms a token"}}
    # qwen is autoscaled: 1 replica for a minute, 3 wanted under a burst (2 of them ready), back to 2
    history = [(-600, 1, 1), (-300, 3, 1), (-280, 3, 2), (-250, 3, 3), (-60, 2, 3), (-55, 2, 2), (0, 2, 2)]
    models[1] |= {"num_replicas": 2, "ready_replicas": 2, "autoscale": {
        "min_replicas": 0, "max_replicas": 3, "slo_ttft_ms": 500.0, "slo_itl_ms": None, "scale_down_after_s": 60.0,
        "history": [{"t": now + t, "desired": d, "ready": r} for t, d, r in history], "last_cold_start_s": 4.2,
        "last_decision": "qwen-0.5b: 3 -> 2 replicas: for 60 s 0.40 requests/s x 50 tokens = 20 tokens/s want 1 "
                         "replica(s) at 75% of the 300 tokens/s predicted for one; replica 2 goes first: its boxes "
                         "are at 90% of their owners' limits"}}
    models[1]["load_errors"] = [{"model_id": "qwen-0.5b", "assignment_id": "q-s0", "agent_id": "s2", "at": now - 3,
                                 "error": f"CheckpointError: checkpoint has no tensor {EVIL}"}]   # a stage's failure
    events = [{"id": 2, "ts": now - 5, "kind": "agent_dead", "agent_id": "e3", "detail": EVIL},
              {"id": 1, "ts": now - 60, "kind": "plan", "agent_id": None, "detail": "4 stage(s) ..."}]
    drains = [{"agent_id": "e4", "started_unix_s": now - 100, "state": "drained", "sessions_asked": 3,
               "stages": [{"model": "llama-8b", "layers": [0, 2], "from": "e4", "to": "e1"}],
               "finished_unix_s": now - 95, "error": ""}]
    stats = {"t": now, "tokens_per_s": 2400.0, "requests_per_s": 3.5, "ttft_p50_s": 0.12, "ttft_p99_s": 0.4,
             "itl_p50_s": 0.02, "itl_p99_s": 0.05, "running": 12, "waiting": 3}
    serving = {s["agent_id"] for p in plans for s in p["stages"]}
    return {"ts": now, "num_agents": len(agents), "sites": site_sums(agents, serving), "agents": agents,
            "plans": plans, "links": links, "site_links": [], "models": models, "drains": drains, "stats": stats,
            "events": events}


def site_sums(agents: list[dict], serving: set[str]) -> list[dict]:
    """The per-site sums a snapshot carries (as coordinator/fleet_view.py's site_summaries adds them up)."""
    sites: dict[str, dict] = {}
    for a in agents:
        caps, up = a["capabilities"], a["state"] in ("online", "connected")
        site = sites.setdefault(caps["site"], {"site": caps["site"], "num_agents": 0, "num_up": 0, "num_serving": 0,
                                               "states": {}, "tiers": {}, "num_gpus": 0, "gpu_mem_bytes": 0,
                                               "ram_total_bytes": 0, "num_cpus": 0, "tokens_per_s": 0.0,
                                               "queue_depth": 0})
        for key, value in (("num_agents", 1), ("num_up", up), ("num_serving", a["agent_id"] in serving),
                           ("num_gpus", len(caps["gpus"])), ("num_cpus", caps["num_cpus"]),
                           ("gpu_mem_bytes", sum(g["mem_total_bytes"] for g in caps["gpus"])),
                           ("ram_total_bytes", caps["ram_total_bytes"])):
            site[key] += value
        site["states"][a["state"]] = site["states"].get(a["state"], 0) + 1
        site["tiers"][caps["tier"]] = site["tiers"].get(caps["tier"], 0) + 1
        if up and a["telemetry"]:
            site["tokens_per_s"] += a["telemetry"]["tokens_per_s"]
            site["queue_depth"] += a["telemetry"]["queue_depth"]
    return [sites[name] for name in sorted(sites)]


def agents_page(agents: list[dict], query: dict[str, list[str]]) -> dict:
    """GET /admin/api/agents over fixed agents: a page in id order after the cursor, behind the filters."""
    site, state, text = (query[key][0] if key in query else None for key in ("site", "state", "q"))

    def keep(a: dict) -> bool:
        found = f"{a['agent_id']} {a['name']} {a['capabilities']['hostname']} {a['address']}".lower()
        return ((site is None or a["capabilities"]["site"] == site) and (state is None or a["state"] == state)
                and (text is None or text.lower() in found))

    matching = sorted((a for a in agents if keep(a)), key=lambda a: a["agent_id"])
    after, limit = query.get("after", [""])[0], int(query.get("limit", ["100"])[0])
    rest = [a for a in matching if a["agent_id"] > after]
    return {"agents": rest[:limit], "next_after": rest[limit - 1]["agent_id"] if len(rest) > limit else None,
            "total": len(matching)}


# two coordinators on one PostgreSQL registry: the leader, and a standby with a name from the network
COORDINATORS = {"coordinators": [
    {"name": "coord-a:8000", "http_url": "http://10.0.0.1:8000", "grpc_address": "10.0.0.1:7000", "leads": True,
     "seen_s_ago": 0.4},
    {"name": EVIL, "http_url": "http://10.0.0.2:8000", "grpc_address": "10.0.0.2:7000", "leads": False,
     "seen_s_ago": 1.5}], "lease": {"holder": "coord-a:8000", "epoch": 3, "expires_in_s": 8.5}}


def fixture_api(route, snapshot: dict, user: dict = INSECURE_USER, refuse: str = "") -> None:
    """Serves the UI's files and the admin API's answers from fixed data, as the coordinator would: /whoami
    names user (the insecure development mode's by default); refuse: every POST gets 403 with this message."""
    path = urlparse(route.request.url).path
    if path == "/admin/api/whoami":
        return route.fulfill(status=200, content_type="application/json", body=json.dumps({"user": user}))
    if refuse and route.request.method == "POST":
        return route.fulfill(status=403, content_type="application/json", body=json.dumps(
            {"error": {"message": refuse, "type": "permission_error", "param": None, "code": "insufficient_role"}}))
    if path == "/admin/" or path.startswith("/admin/static/"):
        static = "index.html" if path == "/admin/" else path.removeprefix("/admin/static/")
        kind = {"html": "text/html", "js": "text/javascript", "css": "text/css"}[static.rsplit(".", 1)[1]]
        return route.fulfill(status=200, content_type=kind, body=(UI_DIR / static).read_bytes())
    if path == "/admin/api/stream":
        return route.fulfill(status=200, content_type="text/event-stream",
                             body=f"retry: 500\nevent: snapshot\ndata: {json.dumps(snapshot)}\n\n")
    now = snapshot["ts"]
    points = [{**snapshot["stats"], "t": now - 120 + i, "tokens_per_s": 2000 + 400 * (i % 7)} for i in range(120)]
    answers = {"/admin/api/stats": {"interval_s": 1.0, "points": points}, "/admin/api/requests": {"requests": []},
               "/admin/api/coordinators": COORDINATORS,
               "/admin/api/snapshot": snapshot,
               "/admin/api/agents": agents_page(snapshot["agents"],
                                                parse_qs(urlparse(route.request.url).query, keep_blank_values=True))}
    if path in answers:
        return route.fulfill(status=200, content_type="application/json", body=json.dumps(answers[path]))
    return route.fulfill(status=404, content_type="application/json",
                         body=json.dumps({"error": {"message": f"no {path}", "type": "invalid_request_error"}}))


@needs_chromium
def test_a_larger_mesh_renders_and_names_from_the_network_stay_text() -> None:
    """12 agents on 3 sites, a standby plan, 8-GPU boxes, a hostile agent name; any 404 shows as a console error.
    The mesh runs --insecure: a red banner says so, everyone is an operator, there is no Log out."""
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
        expect(page.get_by_test_id("insecure-banner")).to_be_visible()
        expect(page.get_by_test_id("insecure-banner")).to_contain_text("INSECURE DEVELOPMENT MODE: no authentication")
        expect(page.get_by_test_id("user-role")).to_have_text("operator")
        expect(page.get_by_test_id("logout-button")).to_be_hidden()
        expect(page.get_by_test_id("login-form")).to_be_hidden()
        expect(page.get_by_test_id("topology-node")).to_have_count(12)
        expect(page.get_by_test_id("topology-site")).to_have_count(3)
        expect(page.get_by_test_id("placement-segment")).to_have_count(9)
        expect(page.get_by_test_id("plan-replica").filter(has_text="replica 1")).to_have_count(1)
        expect(page.get_by_test_id("stage-cached").filter(has_text="120 blocks cached")).to_have_count(1)
        # the KV cache each stage's plan reserved: stage 1 of the two llama-8b plans, 2 GiB
        expect(page.get_by_test_id("stage-kv").filter(has_text="KV 2.1 GB planned")).to_have_count(2)
        fetching = page.get_by_test_id("stage-weights").filter(has_text="weights 40%")
        expect(fetching).to_contain_text("4.4 GB of 11.0 GB")
        expect(fetching).to_contain_text("1 corrupt chunk(s) fetched again")
        expect(fetching.locator("progress")).to_have_attribute("value", "4400100000")
        expect(page.get_by_test_id("stage-weights").filter(has_text="weights fetched: 11.0 GB")).to_have_count(1)
        expect(page.get_by_test_id("stage-weights")).to_have_count(2)
        expect(page.get_by_test_id("plan-role")).to_have_text(["prefill", "decode"])
        failed = page.locator('[data-testid="model-row"][data-model-id="qwen-0.5b"] [data-testid="load-error"]')
        expect(failed).to_have_text(f"s2 could not load its stage: CheckpointError: checkpoint has no tensor {EVIL}")
        expect(page.locator('[data-testid="model-row"][data-model-id="llama-8b"] [data-testid="load-error"]')
               ).to_have_count(0)
        # speculative decoding: what the model's last stages kept of the tokens drafted for them
        expect(page.locator('[data-testid="model-row"][data-model-id="llama-8b"] [data-testid="model-speculation"]')
               ).to_have_text("60% of 800 drafted")
        expect(page.locator('[data-testid="model-row"][data-model-id="qwen-0.5b"] [data-testid="model-speculation"]')
               ).to_have_text("–")
        # replicas: the count of each; the autoscaled one's bounds, its replicas over time, the last decision
        qwen = page.locator('[data-testid="model-row"][data-model-id="qwen-0.5b"]')
        expect(qwen.get_by_test_id("replicas-count")).to_have_text("2 of 2 ready · autoscaled 0–3")
        expect(qwen.get_by_test_id("replicas-chart")).to_have_attribute("data-peak-ready", "3")
        expect(qwen.get_by_test_id("autoscale-decision")).to_contain_text("3 -> 2 replicas")
        expect(qwen.get_by_test_id("autoscale-decision")).to_have_attribute("title", re.compile("90% of their owners"))
        expect(qwen.get_by_test_id("cold-start")).to_have_text("last cold start: 4.20 s")
        llama = page.locator('[data-testid="model-row"][data-model-id="llama-8b"]')
        expect(llama.get_by_test_id("replicas-count")).to_have_text("1 of 1 ready")
        # its rollout: the canary's share of the requests, and its last comparison with the serving revision
        rollout = llama.get_by_test_id("rollout-progress")
        expect(rollout).to_have_attribute("data-state", "canary")
        expect(rollout).to_contain_text("rollout 9f8e7d6c5b4a: canary serving · 25% of requests")
        expect(rollout.locator("progress")).to_have_attribute("value", "25")
        expect(llama.get_by_test_id("rollout-reason")).to_contain_text("canary 9 requests, 0 failed")
        expect(llama.get_by_test_id("replicas-chart")).to_have_count(0)
        expect(page.get_by_test_id("stage-link-codec").filter(has_text="← int8")).to_have_count(1)
        experts = page.get_by_test_id("stage-experts")       # the mixture of experts' stage alone
        expect(experts).to_have_count(1)
        expect(experts.get_by_test_id("stage-experts-summary")).to_have_text(
            "8 experts · imbalance 1.84× · rank 1 straggles: 75% of tokens on 2 ranks")
        expect(experts).to_have_attribute("data-straggler-rank", "1")
        expect(experts.locator("rect")).to_have_count(8)
        expect(experts.locator("rect").nth(4).locator("title")).to_have_text("expert 4: 90 tokens")
        expect(page.locator('[data-testid="placement-segment"][data-plan-state="standby"]')).to_have_count(3)
        row = page.locator('[data-testid="agent-row"][data-agent-id="e1"]')
        expect(row.get_by_test_id("agent-name")).to_have_text(EVIL)
        gpus = page.locator('[data-testid="agent-row"][data-agent-id="c1"] [data-testid="gpu"]')
        expect(gpus).to_contain_text("8× H100")
        for disabled in ("e3", "e4", "c5"):     # dead, drained, serving nothing
            expect(page.locator(f'[data-testid="drain-button"][data-agent-id="{disabled}"]')).to_be_disabled()
        expect(page.locator('[data-testid="drain-button"][data-agent-id="c1"]')).to_be_enabled()
        expect(page.get_by_test_id("event").first).to_contain_text(EVIL)
        # the coordinators: the leader first, a standby, and their lease
        expect(page.get_by_test_id("coordinator-role")).to_have_text(["leader", "standby"])
        expect(page.get_by_test_id("coordinator-row").nth(1)).to_have_attribute("data-name", EVIL)
        expect(page.get_by_test_id("coordinator-lease")).to_have_text(
            "lease held by coord-a:8000 · epoch 3 · runs out in 8.50 s unless renewed")
        page.get_by_test_id("topology-node").first.hover()
        shot = ARTIFACTS / "fixture-mesh-dark.png"
        page.screenshot(path=str(shot), full_page=True)
        pwned = page.evaluate("window.__pwned")
        injected = page.locator("img[src=x]").count()
        browser.close()
    print(f"\nadmin UI screenshot: {shot}")
    assert pwned is None and injected == 0
    assert errors == [], errors


@needs_chromium
def test_an_action_refused_with_403_says_why_in_a_toast() -> None:
    """An operator's session whose POSTs get 403 (say, the user was made a viewer since): the toast shows the
    coordinator's message, and the dashboard stays."""
    sync_api = pytest.importorskip("playwright.sync_api", reason="needs the playwright package")
    expect = sync_api.expect
    snapshot = fixture_snapshot(time.time())
    message = "ops has the viewer role; this needs operator"
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with sync_api.sync_playwright() as playwright:
        browser, page = launch(playwright, color_scheme="light")
        errors = collect_errors(page, expected_statuses=(403,))
        user = {"name": "ops", "role": "operator", "kind": "user"}
        page.route("http://mesh.test/**", lambda route: fixture_api(route, snapshot, user=user, refuse=message))
        page.goto("http://mesh.test/admin/")
        expect(page.get_by_test_id("insecure-banner")).to_be_hidden()
        expect(page.get_by_test_id("logout-button")).to_be_visible()
        page.locator('[data-testid="replan-button"][data-model-id="llama-8b"]').click()
        toast = page.locator('[data-testid="toast"][data-kind="error"]')
        expect(toast).to_contain_text(f"Re-plan of llama-8b failed: {message}")
        page.locator('[data-testid="drain-button"][data-agent-id="c1"]').click()
        page.get_by_test_id("confirm-accept").click()
        expect(toast.nth(1)).to_contain_text(f"refused: {message}")
        expect(page.get_by_test_id("agent-row")).to_have_count(12)
        expect(page.get_by_test_id("login-form")).to_be_hidden()
        shot = ARTIFACTS / "refused-403.png"
        page.screenshot(path=str(shot))
        browser.close()
    assert errors == [], errors
