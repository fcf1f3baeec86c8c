"""A fleet growing by hundreds of boxes while the mesh serves: joins cost a few plans, streams are untouched, and a
box that dies is declared dead within its lease."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from stratamesh.bench.chaos import StreamOutcome, make_jobs, run_streams, wait_for_tokens
from stratamesh.bench.control import LoadProcess
from stratamesh.bench.datasets import regular_token_ids
from stratamesh.bench.margins import decisive
from stratamesh.bench.sim_agents import agent_id
from stratamesh.coordinator.leader import LIVENESS_CHECK_S
from stratamesh.launcher import LocalMesh

from .streams import held, settled_requests

pytestmark = pytest.mark.slow

MODEL = "tiny-llama"
NUM_JOINING = 500
# Boxes the planner must weigh: RAM for the whole model, but a fiftieth of a real agent's measured speed
CAPABLE_BUT_SLOW = ["--ram-mib", "8192", "--gflops", "1"]
# What the joins may cost the planner: a burst is weighed once it settles, and every JOINS_SETTLE_MAX_S while it
# lasts (one plan per replica each time). Without the debounce each of the 500 joins weighed a plan.
MAX_PLANS_FOR_THE_JOINS = 5


def metric(mesh: LocalMesh, name: str) -> float:
    text = httpx.get(f"{mesh.url}/metrics", headers=mesh.headers, timeout=30).text
    return next(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


def events_of(mesh: LocalMesh, agent: str) -> dict[str, float]:
    """kind -> when the coordinator logged it, of the agent's newest events."""
    events = httpx.get(f"{mesh.url}/admin/api/events", params={"limit": 1000}, headers=mesh.headers,
                       timeout=30).json()["events"]
    out: dict[str, float] = {}
    for event in sorted(events, key=lambda e: e["ts"]):
        if event.get("agent_id") == agent:
            out[event["kind"]] = event["ts"]
    return out


def wait_for(predicate, timeout_s: float, what: str):  # noqa: ANN001, ANN201
    deadline = time.monotonic() + timeout_s
    while not (found := predicate()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)
    return found


def test_hundreds_of_boxes_join_while_streams_run_and_a_dead_one_is_found_within_its_lease(
        tiny_models: dict[str, Path], tmp_path: Path) -> None:
    model_dir = tiny_models["llama"]
    jobs = decisive(make_jobs(8, regular_token_ids(model_dir), prompt_len=20, max_tokens=96, seed=25), model_dir)
    mesh = LocalMesh(str(model_dir), num_agents=2, num_stages=2, insecure=True, log_dir=str(tmp_path / "logs"),
                     db=str(tmp_path / "registry.db"))
    loads: list[LoadProcess] = []
    try:
        mesh.start()
        reference = asyncio.run(run_streams(mesh.url, MODEL, jobs, headers=mesh.headers))
        plans_before = metric(mesh, "stratamesh:plans_computed_total")
        deaths_before = metric(mesh, "stratamesh:agents_declared_dead_total")
        joined: dict[str, bool] = {}
        release = asyncio.Event()

        async def join(outcomes: list[StreamOutcome]) -> None:
            try:
                await wait_for_tokens(outcomes, 8)
                loads.append(LoadProcess(mesh, 0, NUM_JOINING, CAPABLE_BUT_SLOW + ["--join-timeout", "120"]))
                while loads[0].latest("joined") is None and loads[0].process.poll() is None:
                    await asyncio.sleep(0.1)
                joined["welcomed"] = (loads[0].latest("joined") or {}).get("welcomed", 0)
                joined["while streaming"] = not any(o.end_s for o in outcomes)
            finally:
                release.set()       # the held streams end at their 96 tokens from here on

        during = asyncio.run(run_streams(mesh.url, MODEL, held(jobs), during=join, headers=mesh.headers,
                                         release=release))
        records = settled_requests(mesh, 8)
        assert joined == {"welcomed": NUM_JOINING, "while streaming": True}
        assert [o.error for o in during if o.error] == []
        assert [o.tokens for o in during] == [o.tokens for o in reference]     # greedy and seeded, token for token
        assert [r["num_failovers"] for r in records] == [0] * 8

        # the joins settle, and are weighed (the plan serving is kept: the newcomers are too slow to help)
        wait_for(lambda: metric(mesh, "stratamesh:plans_computed_total") > plans_before, 60,
                 "the joins to be weighed")
        plans = metric(mesh, "stratamesh:plans_computed_total") - plans_before
        print(f"{NUM_JOINING} joins computed {plans:.0f} plan(s)")
        assert 1 <= plans <= MAX_PLANS_FOR_THE_JOINS

        # one more box, killed: its stream drops at once, and its lease (not heard from since) runs out
        loads.append(LoadProcess(mesh, NUM_JOINING, 1, CAPABLE_BUT_SLOW))
        wait_for(lambda: loads[1].latest("joined"), 60, "the last box to be welcomed")
        victim = agent_id(mesh.mesh, NUM_JOINING)
        lease_s = metric(mesh, "stratamesh:agent_lease_seconds")
        stalled_before = metric(mesh, "stratamesh:coordinator_stalled_seconds_total")
        os.kill(loads[1].process.pid, signal.SIGKILL)
        events = wait_for(lambda: (e := events_of(mesh, victim)).get("agent_dead") and e, 60,
                          f"{victim} to be declared dead")
        stalled = metric(mesh, "stratamesh:coordinator_stalled_seconds_total") - stalled_before
        found_dead_s = events["agent_dead"] - events["agent_disconnected"]
        print(f"declared dead {found_dead_s:.2f} s after its stream dropped; lease {lease_s:.1f} s, the coordinator "
              f"stalled {stalled:.2f} s")
        # within the lease, plus the time the coordinator could not check it (given back to every lease) and one
        # check's period
        assert 0 < found_dead_s <= lease_s + stalled + LIVENESS_CHECK_S + 0.05
        assert metric(mesh, "stratamesh:agents_declared_dead_total") - deaths_before == 1    # the joins cost no death
        assert metric(mesh, "stratamesh:plans_computed_total") - plans_before <= MAX_PLANS_FOR_THE_JOINS
    finally:
        for load in loads:
            if load.process.poll() is None:
                load.stop()
        mesh.stop()
