"""The decode loop as a ring: the last stage feeds each sampled token straight to the first stage, until the
generation's limits or a hold; the origin only receives tokens (over real gRPC, against the greedy reference)."""

from __future__ import annotations

import asyncio
import shutil
from contextlib import AsyncExitStack
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from stratamesh.fleet.sessions import (Hop, SamplingParams, SessionClose, SessionHold, SessionOpen, Speculation,
                                       StepChunk)
from stratamesh.agent.engine.stage_engine import MAX_RUNS, CycleFit, DecodeLoop, Run, StageEngine
from stratamesh.fleet.stages import Assignment, StageSpec
from tests.agent.test_dataplane import greedy_reference, send, serving
from tests.patience import eventually


def tiny_spec(tiny_model, start: int, end: int) -> StageSpec:
    path = tiny_model("llama", num_layers=2, hidden_size=64, intermediate_size=128)
    return StageSpec("m", str(path), start, end, 2, kv_block_size=4)


def start(stream, session_id: str, first: Hop, origin_address: str, prompt: list[int], route: tuple[Hop, ...] = (),
          max_new_tokens: int = 0, stop_token_ids: tuple[int, ...] = (),
          speculation: Speculation | None = None, sampling: SamplingParams = SamplingParams(),
          follow_runs: bool = False) -> None:
    """Opens a generation whose last stage feeds first, and sends its whole prompt as one chunk."""
    send(stream, SessionOpen(session_id, first.assignment_id, route, origin_address, sampling,
                             prompt_token_ids=tuple(prompt), feed=first, max_new_tokens=max_new_tokens,
                             stop_token_ids=stop_token_ids, speculation=speculation, follow_runs=follow_runs))
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


async def held_after(stream, origin, session_id: str, count: int) -> list[int]:
    """The session's tokens up to the one marked held, after a hold sent once it has count tokens."""
    events = await tokens_of(origin, session_id, count)
    send(stream, SessionHold(session_id))
    while not events[-1].held:
        events += await tokens_of(origin, session_id, 1)
    return [e.token_id for e in events]


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
    tokens = await held_after(stream, origin, "g", 3)
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


def proposer(tiny_model, name: str) -> Speculation:
    """ngram; the draft_model proposer with the target itself as its draft (it guesses every token right); or with
    another random model of the same tokenizer (mostly wrong)."""
    if name == "ngram":
        return Speculation("ngram", 4, 1, 3)
    draft = (tiny_spec(tiny_model, 0, 2).model_path if name == "draft-is-target" else
             str(tiny_model("llama", num_layers=1, hidden_size=32, intermediate_size=64, seed=7)))
    return Speculation("draft_model", 4, model=draft)


@pytest.mark.parametrize("name", ["ngram", "draft-is-target", "draft-differs"])
async def test_a_speculating_ring_gives_the_tokens_of_one_a_step_in_fewer_trips(tiny_model, name: str) -> None:
    """Drafts ride each step the last stage feeds; it keeps those the model agrees with, and the stages forget
    the rest: the tokens are greedy decoding's, one a step, but a trip yields several."""
    whole = tiny_spec(tiny_model, 0, 2)
    speculation = proposer(tiny_model, name)
    async with AsyncExitStack() as stack:
        first = await stack.enter_async_context(serving(tiny_spec(tiny_model, 0, 1), "a0", "first"))
        last = await stack.enter_async_context(serving(tiny_spec(tiny_model, 1, 2), "a1", "last"))
        first_host, _, origin, first_address, stream = first
        last_host, _, _, last_address, _ = last
        # the second prompt repeats itself: drafted from, the model continues it (a tiny random model's greedy
        # output also falls into loops, which the lookup then finds in its own output)
        prompts = {"g1": [5, 17, 42, 99, 7], "g2": [3, 9, 27, 81, 3, 9, 27, 81, 3, 9]}
        for session_id, prompt in prompts.items():
            start(stream, session_id, Hop(first_address, "a0"), first_address, prompt,
                  route=(Hop(last_address, "a1", "float32"),), max_new_tokens=24, speculation=speculation)
        results = await asyncio.gather(*(tokens_of(origin, s, 24) for s in prompts))
        for (session_id, prompt), events in zip(prompts.items(), results, strict=True):
            assert [e.token_id for e in events] == greedy_reference(whole, prompt, 24), session_id
        last_engine = last_host.engine("a1")
        await eventually(lambda: not last_engine.loops)
        counts = last_engine.speculation
        assert counts.num_drafts > 0 and counts.num_accepted_tokens <= counts.num_draft_tokens
        if name == "draft-is-target":       # every draft kept: up to 5 tokens a trip
            assert counts.num_accepted_tokens == counts.num_draft_tokens and counts.num_drafts <= 2 * 6
        elif name == "ngram":
            assert counts.num_accepted_tokens > 0
        # every stage holds exactly the KV of the tokens kept (the 24th is fed nowhere): none of a rejected draft
        for host, assignment_id in ((first_host, "a0"), (last_host, "a1")):
            sessions = host.engine(assignment_id).scheduler.sessions
            for session_id, prompt in prompts.items():
                session = sessions[session_id]
                kept = len(prompt) + 23
                assert session.num_computed >= kept and session.token_ids[:kept] == (
                    prompt + [e.token_id for e in results[list(prompts).index(session_id)]][:23])
        for session_id in prompts:
            send(stream, SessionClose(session_id), to="a0")
        await eventually(lambda: last_host.num_sessions == 0)
        assert not last_engine.proposers.sessions       # a draft model's sessions end with theirs, their KV freed
        for draft in last_engine.proposers.draft_models.values():
            assert not draft.scheduler.sessions
            assert draft.scheduler.block_manager.num_free_blocks == draft.runner.num_blocks


def says_zero(tiny_model, tmp_path: Path) -> StageSpec:
    """The tiny model with its final norm zero: every logit is 0, so its greedy pick is token 0, always."""
    folder = Path(shutil.copytree(tiny_spec(tiny_model, 0, 2).model_path, tmp_path / "says-zero"))
    weights = load_file(folder / "model.safetensors")
    weights["model.norm.weight"] = torch.zeros_like(weights["model.norm.weight"])
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return StageSpec("m", str(folder), 0, 2, 2, kv_block_size=4)


async def test_drafts_the_model_agrees_with_come_several_a_trip_and_never_past_the_generations_end(
        tiny_model, tmp_path: Path) -> None:
    """A model whose final norm is zero has every logit 0: its greedy pick is token 0, always. Its prompt of zeros
    gives the lookup a draft of four 0s at every step, all kept: after the prompt's token, one trip yields 5 tokens,
    and the next drafts only the 3 that max_new_tokens leaves before its 10th, which ends the loop unfed."""
    spec = says_zero(tiny_model, tmp_path)
    async with serving(spec, "a0", "agent-under-test") as (host, _, origin, address, stream):
        prompt = [0] * 8
        start(stream, "g", Hop(address, "a0"), address, prompt, max_new_tokens=10,
              speculation=Speculation("ngram", 4, 1, 2))
        events = await tokens_of(origin, "g", 10)
        assert [e.token_id for e in events] == greedy_reference(spec, prompt, 10) == [0] * 10
        engine = host.engine("a0")
        await eventually(lambda: not engine.scheduler.has_work and "g" not in engine.loops)
        counts = engine.speculation
        assert (counts.num_drafts, counts.num_draft_tokens, counts.num_accepted_tokens) == (2, 7, 7)
        assert engine.scheduler.sessions["g"].num_computed == len(prompt) + 9     # the 10th token was not fed
        assert origin.queue("g").empty()


async def test_a_speculating_session_held_exports_and_resumes_with_its_verified_tokens_only(
        tiny_model, tmp_path: Path) -> None:
    """A hold ends the loop at the next token, a kept draft here (the model that says 0 keeps every draft of 0s), and
    drops the rest; the stage still holds the KV of every drafted position of the last step (no next step came to
    say which were kept). Its export carries the positions before those drafts, and an open resuming it with the
    origin's tokens keeps what those confirm."""
    spec = says_zero(tiny_model, tmp_path)
    async with serving(spec, "a0", "agent-under-test") as (host, _, origin, address, stream):
        prompt = [0] * 8
        start(stream, "g", Hop(address, "a0"), address, prompt, speculation=Speculation("ngram", 4, 1, 3))
        tokens = await held_after(stream, origin, "g", 2)
        assert tokens == greedy_reference(spec, prompt, len(tokens))
        engine = host.engine("a0")
        await eventually(lambda: not engine.scheduler.has_work)
        session = engine.scheduler.sessions["g"]
        assert session.drafted_from is not None and session.num_computed > len(prompt) + len(tokens) - 1
        exported = engine.export_session("g")
        verified = session.drafted_from
        assert exported.num_computed == verified <= len(prompt) + len(tokens) - 1
        assert list(exported.token_ids) == (prompt + tokens)[:verified]
        # the origin resumes it (as a move does) with its prompt and every token it got
        resumed = engine.scheduler.resume("g", "g2", prompt + tokens, len(prompt + tokens))
        assert resumed == len(prompt) + len(tokens) - 1          # all but the last token's KV, none of a draft
        assert engine.scheduler.sessions["g2"].token_ids[:resumed] == (prompt + tokens)[:resumed]


def test_a_session_drafts_as_many_tokens_as_its_acceptance_makes_worth_it_and_tries_again_later() -> None:
    loop = DecodeLoop(Hop("a:1", "a0"), None, frozenset(), speculation=Speculation("ngram", 8, 1, 1))
    assert loop.num_to_draft(64) == 4                      # a prior acceptance of 3 in 4: 0.75^4 >= 1/4 > 0.75^5
    for _ in range(6):
        loop.verified(4, 0)                                # rejected at once, step after step: fewer ...
    assert loop.num_to_draft(64) == 1
    for _ in range(14):
        loop.verified(1, 0)
    assert loop.num_to_draft(64) == 0                      # ... and none
    for _ in range(30):
        loop.verified(0, 0)                                # steps without drafts: what they said fades
    assert loop.num_to_draft(64) >= 3
    for _ in range(30):
        loop.verified(8, 8)                                # every draft kept: as many as allowed
    assert loop.num_to_draft(64) == 8 and loop.num_to_draft(5) == 5
    limited = DecodeLoop(Hop("a:1", "a0"), 3, frozenset(), speculation=Speculation("ngram", 8, 1, 1))
    assert limited.num_to_draft(64) == 2                   # the 3rd token it may sample ends the loop: not drafted
    assert DecodeLoop(Hop("a:1", "a0"), None, frozenset()).num_to_draft(64) == 0      # it does not speculate


def test_a_session_drafts_fewer_tokens_where_its_cycles_say_a_drafted_token_costs_more_than_it_saves() -> None:
    """Cycles that take base + per_token x drafted tokens: over a long trip (a slow link) drafting pays, and the
    loop drafts more than its acceptance alone would risk; where a drafted token costs a good part of the trip (a
    busy or slow stage next to a fast link), fewer, and none once each costs more than it is likely to save."""
    def loop_after(base_s: float, per_token_s: float) -> DecodeLoop:
        loop = DecodeLoop(Hop("a:1", "a0"), None, frozenset(), speculation=Speculation("ngram", 8, 1, 1))
        for _ in range(40):
            loop.verified(4, 2)                            # half of the drafted tokens kept: acceptance about 2/3
        arrived_ns = 1
        for step in range(24):                             # cycles carrying 0 to 3 drafted tokens
            num_draft = step % 4
            sent = Run(step, 10 + step, (1,) * (num_draft + 1), after_ns=arrived_ns)   # the answer to a chunk
            arrived_ns += int(1e9 * (base_s + per_token_s * num_draft))
            loop.arrived(sent, arrived_ns, num_draft)
        return loop

    unfit = DecodeLoop(Hop("a:1", "a0"), None, frozenset(), speculation=Speculation("ngram", 8, 1, 1))
    fitted = loop_after(0.080, 0.0)
    unfit.kept, unfit.missed = fitted.kept, fitted.missed
    acceptance_only = unfit.num_to_draft(64)
    assert acceptance_only == 3                            # (2/3)^3 >= 1/4 > (2/3)^4: all it allows untold
    assert fitted.num_to_draft(64) == 8                    # free: all num_speculative_tokens allows
    assert loop_after(0.080, 0.002).num_to_draft(64) > acceptance_only    # cheap next to an 80 ms trip
    assert 0 < loop_after(0.010, 0.004).num_to_draft(64) < acceptance_only
    assert loop_after(0.010, 0.050).num_to_draft(64) == 0
    fit = loop_after(0.010, 0.004).cycles.line()
    assert fit is not None and fit == pytest.approx((0.010, 0.004), rel=1e-3)
    steady = DecodeLoop(Hop("a:1", "a0"), None, frozenset(), speculation=Speculation("ngram", 8, 1, 1))
    for step in range(1, 20):                              # always 2: no spread to tell a token's cost by
        steady.arrived(Run(step, 10 + step, (1, 2, 3), after_ns=step * 10**7), (step + 1) * 10**7, 2)
    assert steady.cycles.line() is None
    followed = loop_after(0.010, 0.004)
    before = followed.cycles.line()
    followed.arrived(Run(99, 200, (1, 2, 3)), 10**12, 2)  # a run that followed another in: no cycle of its own
    assert followed.cycles.line() == before


async def test_a_sampled_speculating_session_draws_the_tokens_of_one_a_step_for_its_seed(one_stage) -> None:
    """Each verified row picks as a step of one token would pick there (its draw keyed by the seed and the
    position), and a draft is kept only where it is that pick: with speculation or without, the same tokens."""
    spec, host, origin, address, stream = one_stage
    prompt = [3, 9, 27, 81, 3, 9, 27, 81, 3, 9]
    runs = {}
    for session_id, speculation in (("plain", None), ("drafted", Speculation("ngram", 4, 1, 3))):
        for seed in (1, 2, 3):
            start(stream, f"{session_id}{seed}", Hop(address, "a0"), address, prompt, max_new_tokens=24,
                  speculation=speculation, sampling=SamplingParams(temperature=0.6, seed=seed))
            runs[session_id, seed] = [e.token_id for e in await tokens_of(origin, f"{session_id}{seed}", 24)]
    for seed in (1, 2, 3):
        assert runs["drafted", seed] == runs["plain", seed], seed
    assert len({tuple(tokens) for tokens in runs.values()}) > 1       # guards it: the seeds draw differently
    counts = host.engine("a0").speculation
    assert counts.num_accepted_tokens > 0 and counts.num_accepted_tokens < counts.num_draft_tokens


def close_draft(target: StageSpec, tmp_path: Path, noise: float = 0.1) -> str:
    """The target with its final norm's weights shaken by a factor of 1 + noise x N(0, 1): a draft that agrees with
    most of its picks and not all (the test asserts both: followers verified, and rewinds)."""
    folder = Path(shutil.copytree(target.model_path, tmp_path / "close-draft"))
    weights = load_file(folder / "model.safetensors")
    norm = weights["model.norm.weight"]
    shake = torch.randn(norm.shape, generator=torch.Generator().manual_seed(3))
    weights["model.norm.weight"] = norm * (1 + noise * shake)
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return str(folder)


async def ring(stack: AsyncExitStack, specs: list[StageSpec]) -> list:
    """Each stage served by an agent of its own over real gRPC: their (host, service, origin, address, stream)."""
    return [await stack.enter_async_context(serving(spec, f"a{i}", f"agent-{i}")) for i, spec in enumerate(specs)]


def route_of(agents: list) -> tuple[Hop, ...]:
    return tuple(Hop(address, f"a{i}", "float32") for i, (_, _, _, address, _) in enumerate(agents))[1:]


@pytest.mark.parametrize("name", ["close-draft", "draft-is-target"])
async def test_runs_follow_each_other_into_a_3_stage_ring_and_the_rejected_are_dropped_where_they_are(
        tiny_model, tmp_path: Path, monkeypatch, name: str) -> None:
    """With follow_runs set (every stage takes them), the last stage sends runs behind the one on its way, drafted
    on as if it were kept whole; a run whose guess was wrong is dropped by a rewind wherever it has got to, and the
    tokens are greedy decoding's, one a step, through all of it."""
    path = tiny_model("llama", num_layers=3, hidden_size=64, intermediate_size=128)
    whole = StageSpec("m", str(path), 0, 3, 3, kv_block_size=4)
    draft = str(path) if name == "draft-is-target" else close_draft(whole, tmp_path)
    rewinds: list[tuple[str, int]] = []
    rewind = StageEngine.rewind

    def spied(engine, message, outbox) -> None:
        rewinds.append((engine.assignment.assignment_id, message.position))
        rewind(engine, message, outbox)

    monkeypatch.setattr(StageEngine, "rewind", spied)
    monkeypatch.setattr(CycleFit, "line", lambda self: None)   # drafts by acceptance alone: no timing in the counts
    async with AsyncExitStack() as stack:
        agents = await ring(stack, [replace(whole, start_layer=i, end_layer=i + 1) for i in range(3)])
        _, _, origin, first_address, stream = agents[0]
        prompts = {"g1": [5, 17, 42, 99, 7], "g2": [3, 9, 27, 81, 3, 9, 27, 81, 3, 9], "g3": [11, 12, 13]}
        results = {}
        for session_id, prompt in prompts.items():      # one at a time: runs follow only on a quiet last stage
            send(stream, SessionOpen(session_id, "a0", route_of(agents), first_address, SamplingParams(),
                                     prompt_token_ids=tuple(prompt), feed=Hop(first_address, "a0"),
                                     max_new_tokens=32, speculation=Speculation("draft_model", 4, model=draft),
                                     follow_runs=True))
            send(stream, StepChunk(session_id, 0, 0, tuple(prompt), sample=True), to="a0")
            results[session_id] = [e.token_id for e in await tokens_of(origin, session_id, 32)]
            assert results[session_id] == greedy_reference(whole, prompt, 32), session_id
            last = agents[2][0].engine("a2")
            await eventually(lambda: not any(a[0].engine(f"a{i}").scheduler.has_work for i, a in enumerate(agents)))
            for i, (host, *_) in enumerate(agents):     # each stage holds the KV of the tokens kept, whatever it
                session = host.engine(f"a{i}").scheduler.sessions[session_id]       # dropped
                kept = len(prompt) + 31
                assert session.num_computed >= kept
                assert session.token_ids[:kept] == prompt + results[session_id][:31]
            send(stream, SessionClose(session_id), to="a0")
            await eventually(lambda: agents[2][0].num_sessions == 0)
            assert not last.loops           # (one over, kept to drop the runs still on their way, went with it)
        counts = last.speculation
        assert 0 < counts.num_followers_verified <= counts.num_followers
        if name == "draft-is-target":        # every guess right: only those on their way at a generation's end drop
            assert not rewinds and counts.num_followers - counts.num_followers_verified <= 3 * (MAX_RUNS - 1)
        else:                                # guesses go wrong: the rewinds go around the ring, ahead of the next run
            assert {stage for stage, _ in rewinds} == {"a0", "a1"}


async def test_a_hold_while_runs_follow_leaves_every_stage_quiet_with_verified_kv_to_export(
        tiny_model, tmp_path: Path) -> None:
    """The model that says 0 keeps every draft: runs follow each other in; a hold ends the loop, the runs still on
    their way are dropped (queued ones before an export, the others as they arrive), and each stage exports only
    tokens the origin has."""
    spec = says_zero(tiny_model, tmp_path)
    async with AsyncExitStack() as stack:
        agents = await ring(stack, [replace(spec, end_layer=1), replace(spec, start_layer=1)])
        _, _, origin, first_address, stream = agents[0]
        prompt = [0] * 8
        start(stream, "g", Hop(first_address, "a0"), first_address, prompt, route=route_of(agents),
              speculation=Speculation("ngram", 4, 1, 3), follow_runs=True)
        tokens = await held_after(stream, origin, "g", 12)
        assert tokens == [0] * len(tokens)
        last = agents[1][0].engine("a1")
        assert last.speculation.num_followers_verified > 0
        await eventually(lambda: not any(host.engine(f"a{i}").scheduler.has_work
                                         for i, (host, *_) in enumerate(agents)))
        for i, (host, *_) in enumerate(agents):
            exported = host.engine(f"a{i}").export_session("g")
            assert 0 < exported.num_computed <= len(prompt) + len(tokens) - 1
            assert list(exported.token_ids) == (prompt + tokens)[:exported.num_computed]


def test_a_run_follows_while_its_guess_is_likely_right_within_the_runs_the_stop_tokens_and_max_tokens() -> None:
    def loop_with(kept: float, tokens_left: int | None = None, stop: frozenset[int] = frozenset(),
                  follow: bool = True) -> DecodeLoop:
        loop = DecodeLoop(Hop("a:1", "a0"), tokens_left, stop, speculation=Speculation("ngram", 4, 1, 1),
                          follow=follow, kept=kept)
        loop.fed(Run(1, 10, (7, 8, 9, 10, 11), after_ns=1))     # a token and 4 drafts on their way
        return loop

    assert loop_with(0.0).num_to_follow(64) == 0                   # 3 in 4 (the prior): 0.75^5 < 1/4
    sure = loop_with(1000.0)                                        # every draft kept so far
    assert sure.num_to_follow(64) == 5                              # a guess and 4 drafts
    sure.fed(Run(2, 15, (12, 13, 14, 15, 16), follows=True))
    sure.fed(Run(3, 20, (17, 18, 19, 20, 21), follows=True))
    assert sure.num_to_follow(64) == 5 and sure.unverified_from == 11
    sure.fed(Run(4, 25, (22, 23, 24, 25, 26), follows=True))
    assert sure.num_to_follow(64) == 0                              # MAX_RUNS in the pipeline
    assert loop_with(1000.0, follow=False).num_to_follow(64) == 0   # a stage on the route cannot take them
    assert loop_with(1000.0, stop=frozenset({9})).num_to_follow(64) == 0      # a draft ahead would end it
    # 8 tokens left: the run on its way gives 5 (4 drafts, and the pick after them: the guess), a follower with 2
    # drafts 3 more
    assert loop_with(1000.0, tokens_left=8).num_to_follow(64) == 3
    assert loop_with(1000.0, tokens_left=6).num_to_follow(64) == 0
    # runs abandoned (a rejection before them) are dropped as they arrive, and only they
    assert not sure.drops(4) and sure.verifying(1).step == 1
    assert sure.abandon() and sure.drops(4) and not sure.drops(5) and not sure.runs
    sure.over = True
    assert sure.drops(9)                                            # over: whatever still comes
