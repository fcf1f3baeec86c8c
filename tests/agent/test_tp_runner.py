"""A tensor-parallel stage as an agent serves it: rank 0 in the agent, the other ranks in processes it launched."""

from __future__ import annotations

import asyncio
import os
import signal
from dataclasses import replace

import pytest
from stratamesh.agent.engine.stage_engine import EngineConfig
from stratamesh.agent.engine.tp_group import GroupFailed
from stratamesh.agent.stages import StageHost
from stratamesh.fleet.errors import InvalidInput
from stratamesh.fleet.sessions import StepChunk
from stratamesh.fleet.stages import Assignment, StageSpec

from tests.agent.test_dataplane import greedy_reference, send
from tests.agent.test_kv_transfer import PROMPT, agent, import_kv
from tests.patience import eventually

PROMPTS = [[5, 17, 42, 99, 7], list(range(30, 52)), [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]]


@pytest.fixture
def spec(tiny_model) -> StageSpec:
    path = tiny_model("llama", num_layers=2, hidden_size=64, intermediate_size=128, num_heads=8, num_kv_heads=4)
    return StageSpec("m", str(path), 0, 2, 2, kv_block_size=4)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture
def moe_spec(tiny_model) -> StageSpec:
    path = tiny_model("qwen2_moe", num_layers=2, hidden_size=64, intermediate_size=128, num_heads=8, num_kv_heads=4,
                      num_experts=4)
    return StageSpec("m", str(path), 0, 2, 2, kv_block_size=4)


@pytest.mark.parametrize("world_size, model", [(2, "dense"), (4, "dense"), (2, "experts")])
async def test_a_group_batches_sessions_and_each_matches_the_unsharded_model(spec, moe_spec, world_size,
                                                                             model) -> None:
    """(experts: Qwen2-MoE, its experts split between the group's two processes and its shared expert split as an
    MLP)"""
    spec = moe_spec if model == "experts" else spec
    async with agent(replace(spec, tp_degree=world_size), "tp") as a:
        ranks = a.host.engines["tp"].runner.ranks
        assert len(ranks.pids) == world_size - 1 and all(map(alive, ranks.pids))
        for i, prompt in enumerate(PROMPTS):
            a.open(f"s{i}", prompt)
            assert await a.opened(f"s{i}") == 0
        results = await asyncio.gather(*(a.generate(f"s{i}", p, 0, 10) for i, p in enumerate(PROMPTS)))
        for prompt, tokens in zip(PROMPTS, results, strict=True):
            assert tokens == greedy_reference(spec, prompt, 10)
        assert ranks.collectives.num_all_reduces > 0
    await eventually(lambda: not any(map(alive, ranks.pids)), 60)   # the agent let the stage go: its ranks stop


async def test_kv_moves_from_a_group_to_one_process_and_back_with_every_head(spec) -> None:
    tp = replace(spec, tp_degree=2)
    async with agent(tp, "a0") as a, agent(spec, "b0") as b, agent(tp, "c0") as c:
        a.open("s", PROMPT)
        await a.opened("s")
        first = await a.generate("s", PROMPT, 0, 4)
        history = PROMPT + first
        summary = await import_kv(b, "s", a)        # TP=2 -> one process: rank 1 sends its heads
        assert summary.num_tokens == len(history) - 1
        b.open("s.1", history, resume_from="s")
        assert await b.opened("s.1") == len(history) - 1
        second = await b.generate("s.1", history, len(history) - 1, 4)
        history += second
        await import_kv(c, "s.1", b)                # one process -> TP=2: each rank takes its heads
        c.open("s.2", history, resume_from="s.1")
        assert await c.opened("s.2") == len(history) - 1
        third = await c.generate("s.2", history, len(history) - 1, 4)
        assert first + second + third == greedy_reference(spec, PROMPT, 12)


async def test_a_dead_rank_takes_its_group_down_and_fails_its_sessions(spec) -> None:
    failures: list[str] = []
    async with agent(replace(spec, tp_degree=4), "tp") as a:
        a.host.on_group_failure = failures.append
        ranks = a.host.engines["tp"].runner.ranks
        a.open("s", PROMPT)
        await a.opened("s")
        await a.generate("s", PROMPT, 0, 2)

        os.kill(ranks.pids[1], signal.SIGKILL)       # rank 2, while the group is idle
        await eventually(lambda: failures, 60)
        assert len(failures) == 1 and "rank 2 exited" in failures[0]
        await eventually(lambda: not any(map(alive, ranks.pids)), 60)   # the others killed with it: down as a unit

        a.open("t", PROMPT)                          # a session the broken stage cannot serve
        await a.opened("t")
        send(a.stream, StepChunk("t", 0, 0, tuple(PROMPT), sample=True))
        event = await a.origin.next("t")
        assert event.error and "GroupFailed" in event.error and "rank 2 exited" in event.error
        with pytest.raises(GroupFailed):
            a.host.engines["tp"].runner.read_kv([0], 1)
    assert len(failures) == 1                        # reported once


async def test_a_group_that_cannot_split_the_heads_is_refused_before_any_rank_starts(spec) -> None:
    host = StageHost(EngineConfig(kv_cache_bytes=1 << 20))
    children = set(_children())
    with pytest.raises(InvalidInput, match="cannot split 8 attention heads evenly"):
        await host.load(Assignment("tp", replace(spec, tp_degree=3)))
    assert set(_children()) == children and host.engines == {}


def _children() -> list[int]:
    path = f"/proc/{os.getpid()}/task/{os.getpid()}/children"
    return [int(p) for p in open(path).read().split()]
