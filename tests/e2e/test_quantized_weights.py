"""A mesh serving a model whose operator chose quantized weights (`coordinator --quantize int8|int4`), as processes
on loopback: every stage holds its weights in that format, the mesh's greedy tokens are those of the same model run
in one process with the same weights (kernels.models.decoder.greedy_tokens), and the admin API shows what the
agents measured of their box (its streaming read, each format's batch-1 products) and each stage's decode steps
against their bandwidth roofline; agents started as `stratamesh up` starts them each compute on cores of their own."""

from __future__ import annotations

import os
import asyncio
from dataclasses import replace
from pathlib import Path

import httpx
import pytest

from stratamesh.bench.chaos import drain_stage_mid_stream, kill_stage_mid_stream, make_jobs
from stratamesh.bench.margins import decisive
from stratamesh.bench.datasets import regular_token_ids
from stratamesh.launcher import LocalMesh
from stratamesh.fleet.stages import StageSpec
from stratamesh.kernels.models.decoder import greedy_tokens, load_stage

from ..patience import wait_until
from .streams import held, settled_requests
from .test_mesh import complete_ids

pytestmark = pytest.mark.slow

MODEL = "tiny-llama"
QUANTIZED_MARGIN = 0.05     # (stratamesh.bench.margins: what a quantized mesh's greedy steps must lead by)


def thread_cpus(pid: int) -> set[frozenset[int]]:
    """The CPU sets a process's threads may run on."""
    out = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            out.add(frozenset(os.sched_getaffinity(int(tid))))
        except ProcessLookupError:      # a thread that ended meanwhile
            continue
    return out


@pytest.mark.parametrize("quantize", ["int8", "int4"])
def test_a_mesh_of_quantized_stages_gives_the_tokens_of_the_quantized_model_in_one_process(
        tiny_models: dict[str, Path], tmp_path: Path, quantize: str) -> None:
    """int8: two agents started as `stratamesh up` starts them (pinned to cores of their own, where there are two);
    int4: three stages and two spares: a drain of the middle stage's agent moves its sessions with their KV
    (nothing recomputed), then a kill -9 of the first stage's loses no token, each run's greedy streams (prompts
    decisive on the quantized model) those of an undisturbed run."""
    model_dir = tiny_models["llama"]
    pinned = quantize == "int8" and len(os.sched_getaffinity(0)) >= 2
    stages = 2 if quantize == "int8" else 3
    with LocalMesh(str(model_dir), num_agents=2 if quantize == "int8" else 5, num_stages=stages,
                   coordinator_args=["--quantize", quantize], log_dir=str(tmp_path / "logs"),
                   db=str(tmp_path / "registry.db"), pin_cpus=pinned) as mesh:
        if pinned:      # each agent on cores of its own, every thread of it
            (first,), (second,) = (thread_cpus(agent.pid) for agent in mesh.agents)
            assert first and second and not first & second
        (model,) = httpx.get(f"{mesh.url}/admin/api/models", headers=mesh.headers).json()["models"]
        assert model["quantize"] == quantize
        (plan,) = [p for p in httpx.get(f"{mesh.url}/admin/api/plans", headers=mesh.headers).json()["plans"]
                   if p["state"] == "active"]     # (a spare joining late may have a standby plan made beside it)
        assert [s["quantize"] for s in plan["stages"]] == [quantize] * stages
        num_layers = plan["stages"][-1]["end_layer"]
        one_process = load_stage(StageSpec("m", str(model_dir), 0, num_layers, num_layers, quantize=quantize))
        for seed, length in ((1, 12), (2, 40)):
            prompt = make_jobs(1, regular_token_ids(model_dir), prompt_len=length, max_tokens=1, seed=seed)[0]
            ids = list(prompt.prompt_ids)
            assert complete_ids(mesh, model_dir, ids, 24) == greedy_tokens(one_process, ids, 24)
        check_the_limit_is_shown(mesh, stages)
        if quantize == "int4":
            jobs = [replace(job, temperature=0.0) for job in make_jobs(4, regular_token_ids(model_dir), prompt_len=16,
                                                                       max_tokens=32, seed=5)]
            jobs = held(decisive(jobs, model_dir, min_margin=QUANTIZED_MARGIN, quantize=quantize))
            drained = asyncio.run(drain_stage_mid_stream(mesh, MODEL, jobs, stage=1))
            assert drained.drain_exit == 0, drained.drain_output
            moves = [(r["num_moves"], r["num_replayed_tokens"]) for r in settled_requests(mesh, len(jobs))]
            assert moves == [(1, 0)] * len(jobs)        # each moved once with its KV, nothing computed again
            killed = asyncio.run(kill_stage_mid_stream(mesh, MODEL, jobs, stage=0))
            for run in (drained, killed):
                assert [o.error for o in run.reference + run.outcomes if o.error] == []
                assert [o.tokens for o in run.outcomes] == [r.tokens for r in run.reference]
                assert all(run.killed_address not in r for r in run.routes_after)


def check_the_limit_is_shown(mesh: LocalMesh, stages: int) -> None:
    """What each agent measured (the box's streaming read, each format's batch-1 products) and the decode steps of
    each of the plan's stages against their roofline, in /admin/api/agents (a spare may hold a standby plan's stage,
    which decodes nothing: 0)."""
    def agents() -> list[dict]:
        return httpx.get(f"{mesh.url}/admin/api/agents", headers=mesh.headers).json()["agents"]

    for agent in agents():
        speeds = {s["dtype"]: s for s in agent["capabilities"]["speeds"] if s["backend"] == "torch-cpu"}
        assert {"float32", "int8", "int4"} <= set(speeds)
        assert all(s["mem_bandwidth"] > 0 and s["decode_bandwidth"] > 0 for s in speeds.values())

    def decode_rooflines() -> list[float]:
        return [s["decode_roofline"] for a in agents() if a["telemetry"] for s in a["telemetry"]["stages"]]

    # each stage's decode steps against the roofline of the bytes they read, once a heartbeat carries them
    wait_until(lambda: sum(r > 0 for r in decode_rooflines()) >= stages, 30)
    assert all(r < 5 for r in decode_rooflines())
