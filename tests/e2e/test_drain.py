"""Graceful drain: `stratamesh drain` moves a stage's live sessions to a spare with their KV, nothing recomputed."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from stratamesh.bench.chaos import drain_stage_mid_stream, make_jobs
from stratamesh.bench.datasets import regular_token_ids
from stratamesh.bench.margins import decisive
from stratamesh.bench.metrics import percentile
from stratamesh.launcher import LocalMesh
from tests.patience import patient

from .reference import encode
from .streams import HOLD_TOKENS, held, settled_requests, which_diverged
from .test_mesh import PROMPT, complete_ids

pytestmark = pytest.mark.slow

MODEL = "tiny-llama"


def samples(url: str, text: str | None = None) -> dict[str, float]:
    """Every sample of a /metrics page (fetched from url, or as text), by name and labels ("name{a=b}"), summed over
    unnamed duplicates."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text if text is None else text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k in ("direction",))
            key = f"{s.name}{{{labels}}}" if labels else s.name
            out[key] = out.get(key, 0.0) + s.value
    return out


def gained(now: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    """Each sample's gain since before (a sample not there before counts from 0)."""
    return {name: value - before.get(name, 0.0) for name, value in now.items()}


def test_draining_the_middle_agent_moves_its_sessions_with_their_kv(tiny_models: dict[str, Path],
                                                                     tmp_path: Path) -> None:
    """3 stages and a spare; 8 streams of 128 tokens (greedy and seeded); drain the middle stage's agent."""
    model_dir = tiny_models["llama"]
    # held open: every stream still runs when `stratamesh drain` returns, however busy the box
    jobs = held(decisive(make_jobs(8, regular_token_ids(model_dir), prompt_len=20, max_tokens=128, seed=11), model_dir))
    with LocalMesh(str(model_dir), num_agents=4, num_stages=3, log_dir=str(tmp_path / "logs"),
                   db=str(tmp_path / "registry.db")) as mesh:
        run = asyncio.run(drain_stage_mid_stream(mesh, MODEL, jobs, stage=1))
        records = settled_requests(mesh, 8)
        drained = mesh.agent_index(run.killed_address)
        assert mesh.agents[drained].wait(timeout=30) == 0, "the drained agent exits by itself, cleanly"
        spare_address = run.routes_after[0][1]
        spare = mesh.agent_index(spare_address)
        drained_id = mesh.agent_ids[drained]
        # what the drain moved: what the counters gained since its order (a plan switched to when the 4th agent
        # joined late may have moved sessions before it)
        on_spare = gained(samples(f"http://{mesh.agent_metrics[spare]}"),
                          samples("", run.metrics_before[mesh.agent_metrics[spare]]))
        coordinator = gained(samples(mesh.url), samples("", run.metrics_before["coordinator"]))
        agents = httpx.get(f"{mesh.url}/admin/api/agents", headers=mesh.headers).json()["agents"]
        states = {a["agent_id"]: a["state"] for a in agents}
    assert run.drain_exit == 0 and "drained" in run.drain_output, run.drain_output
    assert [o.error for o in run.reference + run.outcomes if o.error] == []
    assert [o.tokens for o in run.outcomes] == [r.tokens for r in run.reference], which_diverged(   # identical,
        model_dir, jobs, reference=run.reference, drained=run.outcomes)                             # none lost
    assert len(run.routes_after) == 8 and all(r[1] == spare_address for r in run.routes_after)
    assert states[drained_id] == "drained"
    # Every session moved once, with its KV: nothing was computed again, here or on the spare.
    assert [(r["num_moves"], r["num_failovers"], r["num_replayed_tokens"]) for r in records] == [(1, 0, 0)] * 8
    assert coordinator["stratamesh:session_moves_total"] == 8
    assert coordinator["stratamesh:replayed_tokens_total"] == 0
    assert on_spare["stratamesh:kv_migrated_sessions_total{direction=import}"] == 8
    imported = on_spare["stratamesh:kv_migrated_bytes_total{direction=import}"]
    assert coordinator["stratamesh:kv_moved_bytes_total"] == imported > 0
    # decodes only, no re-prefill (from the drain order on: before it, a plan switched to once the 4th agent joined
    # may have had the spare serve the reference run)
    assert on_spare["stratamesh:stage_prefill_tokens_total"] == 0
    # decodes after the move (the held streams asked for up to HOLD_TOKENS each), none computed again
    assert 0 < on_spare["stratamesh:stage_tokens_total"] <= 8 * HOLD_TOKENS
    gaps = run.largest_gaps
    print(f"\ndrain of the middle stage: longest token gap after the drain order p50 "
          f"{percentile(gaps, 50) * 1e3:.0f} ms, max {max(gaps) * 1e3:.0f} ms over {len(gaps)} streams; "
          f"{coordinator['stratamesh:kv_moved_bytes_total'] / 1e6:.2f} MB of KV moved")


def test_a_coordinator_restarted_mid_drain_finishes_it(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    """3 stages and a spare; the spare is stopped (SIGSTOP) so that the drain cannot get past loading the
    replacement; kill -9 of the coordinator, the spare let go, the coordinator started again: the drain,
    kept in the registry, goes on to its end."""
    model_dir = tiny_models["llama"]
    with LocalMesh(str(model_dir), num_agents=4, num_stages=3, log_dir=str(tmp_path / "logs"),
                   db=str(tmp_path / "registry.db")) as mesh:
        before = complete_ids(mesh, model_dir, encode(model_dir, PROMPT), 16)
        plan = active_stages(mesh)
        middle = mesh.agent_ids.index(plan[1])
        spare = next(i for i, a in enumerate(mesh.agent_ids) if a not in plan)
        os.kill(mesh.agents[spare].pid, signal.SIGSTOP)
        try:
            started = httpx.post(f"{mesh.url}/admin/api/agents/{mesh.agent_ids[middle]}/drain", headers=mesh.headers)
            assert started.status_code == 202 and started.json()["drain"]["state"] == "moving_stages", started.text
            assert started.json()["drain"]["stages"][0]["to"] == mesh.agent_ids[spare]
            mesh.kill_coordinator()
        finally:
            os.kill(mesh.agents[spare].pid, signal.SIGCONT)
        mesh.restart_coordinator()
        assert mesh.agents[middle].wait(timeout=180) == 0, "the drained agent exits by itself, cleanly"
        drain = httpx.get(f"{mesh.url}/admin/api/agents/{mesh.agent_ids[middle]}/drain", headers=mesh.headers).json()
        deadline = time.monotonic() + patient(60)
        while mesh.agent_ids[middle] in active_stages(mesh) or len(active_stages(mesh)) != 3:
            assert time.monotonic() < deadline, active_stages(mesh)
            time.sleep(0.2)
        after = complete_ids(mesh, model_dir, encode(model_dir, PROMPT), 16)
    assert (drain["drain"]["state"], drain["drain"]["resumed"]) == ("drained", 1), drain
    assert after == before


def active_stages(mesh: LocalMesh) -> list[str]:
    """The agent of each stage of the active plan, in pipeline order."""
    plans = httpx.get(f"{mesh.url}/admin/api/plans", headers=mesh.headers).json()["plans"]
    return [s["agent_id"] for p in plans if p["state"] == "active" for s in p["stages"]]
