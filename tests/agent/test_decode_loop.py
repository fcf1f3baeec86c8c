"""The decode loop as a ring: the last stage feeds each sampled token straight to the first stage, until the
generation's limits or a hold; the origin only receives tokens (over real gRPC, against the greedy reference)."""

from __future__ import annotations

import asyncio
from contextlib import AsyncExitStack

import pytest

from stratamesh.fleet.sessions import Hop, SamplingParams, SessionClose, SessionHold, SessionOpen, StepChunk
from stratamesh.fleet.stages import Assignment, StageSpec
from tests.agent.test_dataplane import greedy_reference, send, serving
from tests.patience import eventually


def tiny_spec(tiny_model, start: int, end: int) -> StageSpec:
    path = tiny_model("llama", num_layers=2, hidden_size=64, intermediate_size=128)
    return StageSpec("m", str(path), start, end, 2, kv_block_size=4)


def start(stream, session_id: str, first: Hop, origin_address: str, prompt: list[int], route: tuple[Hop, ...] = (),
          max_new_tokens: int = 0, stop_token_ids: tuple[int, ...] = ()) -> None:
    """Opens a generation whose last stage feeds first, and sends its whole prompt as one chunk."""
    send(stream, SessionOpen(session_id, first.assignment_id, route, origin_address, SamplingParams(),
                             prompt_token_ids=tuple(prompt), feed=first, max_new_tokens=max_new_tokens,
                             stop_token_ids=stop_token_ids))
    send(stream, StepChunk(session_id, 0, 0, tuple(prompt), sample=True), to=first.assignment_id)


async def tokens_of(origin, session_id: str, count: int) -> list:
    """The next count token events of a session (open answers skipped; an error fails the test)."""
    events = []
    while len(events) < count:
        event = await origin.next(session_id)
        assert not event.error, event.error
        if not event.opened:
            events.append(event)
    return events


@pytest.fixture
async def one_stage(tiny_model):
    spec = tiny_spec(tiny_model, 0, 2)
    async with serving(spec, "a0", "agent-under-test") as (host, service, origin, address, stream):
        yield spec, host, origin, address, stream


async def test_a_single_stage_feeds_itself_and_stops_after_max_new_tokens(one_stage) -> None:
    spec, host, origin, address, stream = one_stage
    prompt = [5, 17, 42, 99, 7]
    start(stream, "g", Hop(address, "a0"), address, prompt, max_new_tokens=9)
    events = await tokens_of(origin, "g", 9)       # the test sends no decode step: the stage ran them itself
    assert [e.token_id for e in events] == greedy_reference(spec, prompt, 9)
    assert [e.step for e in events] == list(range(9)) and not any(e.held for e in events)
    engine = host.engine("a0")
    await eventually(lambda: not engine.scheduler.has_work)
    assert "g" not in engine.loops                              # over: its last token was fed nowhere
    session = engine.scheduler.sessions["g"]
    assert session.num_computed == len(prompt) + 8 and not session.queue   # the 9th token was not computed
    assert origin.queue("g").empty()
    send(stream, SessionClose("g"))
    await eventually(lambda: host.num_sessions == 0)


async def test_a_stop_token_ends_the_loop(one_stage) -> None:
    spec, host, origin, address, stream = one_stage
    prompt = [3, 1, 4, 1, 5, 9]
    reference = greedy_reference(spec, prompt, 6)
    stop = reference[3]
    expected = reference[:reference.index(stop) + 1]
    start(stream, "g", Hop(address, "a0"), address, prompt, max_new_tokens=50, stop_token_ids=(stop,))
    assert [e.token_id for e in await tokens_of(origin, "g", len(expected))] == expected
    engine = host.engine("a0")
    await eventually(lambda: not engine.scheduler.has_work and "g" not in engine.loops)
    assert origin.queue("g").empty()


async def test_a_hold_stops_the_loop_at_the_next_token_which_comes_marked_held(one_stage) -> None:
    spec, host, origin, address, stream = one_stage
    prompt = [8, 6, 7, 5, 3, 0, 9]
    start(stream, "g", Hop(address, "a0"), address, prompt)   # no limit: only the hold stops it
    before = await tokens_of(origin, "g", 3)
    send(stream, SessionHold("g"))
    events = [*before]
    while not events[-1].held:
        events += await tokens_of(origin, "g", 1)
    tokens = [e.token_id for e in events]
    assert tokens == greedy_reference(spec, prompt, len(tokens))
    engine = host.engine("a0")
    await eventually(lambda: not engine.scheduler.has_work)
    session = engine.scheduler.sessions["g"]      # quiet, still open: it can move with its KV
    assert not session.queue and session.num_computed == len(prompt) + len(tokens) - 1
    assert "g" not in engine.loops and origin.queue("g").empty()


async def test_a_hold_for_a_session_that_ended_is_ignored(one_stage) -> None:
    _, host, origin, address, stream = one_stage
    start(stream, "g", Hop(address, "a0"), address, [1, 2, 3], max_new_tokens=2)
    await tokens_of(origin, "g", 2)
    send(stream, SessionClose("g"))
    send(stream, SessionHold("g"))
    send(stream, SessionHold("never-opened"))
    await eventually(lambda: host.num_sessions == 0)


async def test_two_stages_form_a_ring_the_last_feeding_the_first(tiny_model) -> None:
    whole = tiny_spec(tiny_model, 0, 2)
    async with AsyncExitStack() as stack:
        first = await stack.enter_async_context(serving(tiny_spec(tiny_model, 0, 1), "a0", "first"))
        last = await stack.enter_async_context(serving(tiny_spec(tiny_model, 1, 2), "a1", "last"))
        _, _, origin, first_address, stream = first
        last_host, _, _, last_address, _ = last
        prompts = {"g1": [5, 17, 42, 99, 7], "g2": list(range(30, 44))}
        for session_id, prompt in prompts.items():
            start(stream, session_id, Hop(first_address, "a0"), first_address, prompt,
                  route=(Hop(last_address, "a1", "float32"),), max_new_tokens=12)
        results = await asyncio.gather(*(tokens_of(origin, s, 12) for s in prompts))
        for (session_id, prompt), events in zip(prompts.items(), results, strict=True):
            assert [e.token_id for e in events] == greedy_reference(whole, prompt, 12), session_id
        await eventually(lambda: not last_host.engine("a1").loops)


@pytest.mark.parametrize("load_order", [("a0", "a1"), ("a1", "a0")], ids=["first-loaded-first", "last-loaded-first"])
async def test_two_stages_of_one_pipeline_on_one_agent_each_get_their_own_steps(tiny_model, load_order) -> None:
    """An agent may serve two stages of one pipeline (on two of its GPUs): both hold each session, so every step
    names the assignment it is for, whichever stage the agent loaded first."""
    whole = tiny_spec(tiny_model, 0, 2)
    specs = {"a0": tiny_spec(tiny_model, 0, 1), "a1": tiny_spec(tiny_model, 1, 2)}
    first_id, second_id = load_order
    async with serving(specs[first_id], first_id, "two-gpus") as (host, _, origin, address, stream):
        await host.load(Assignment(second_id, specs[second_id]))
        assert list(host.engines) == list(load_order)
        prompts = {"g1": [5, 17, 42, 99, 7], "g2": list(range(30, 44))}
        for session_id, prompt in prompts.items():
            start(stream, session_id, Hop(address, "a0"), address, prompt, route=(Hop(address, "a1", "float32"),),
                  max_new_tokens=10)
        results = await asyncio.gather(*(tokens_of(origin, s, 10) for s in prompts))
        for (session_id, prompt), events in zip(prompts.items(), results, strict=True):
            assert [e.token_id for e in events] == greedy_reference(whole, prompt, 10), session_id
        # each stage computed its own layers of every token: the prompt and 9 fed tokens (the 10th ends the loop)
        for assignment_id in ("a0", "a1"):
            sessions = host.engine(assignment_id).scheduler.sessions
            assert {s: sessions[s].num_computed for s in prompts} == {s: len(p) + 9 for s, p in prompts.items()}
        for session_id in prompts:
            send(stream, SessionClose(session_id), to="a0")
        await eventually(lambda: host.num_sessions == 0)
