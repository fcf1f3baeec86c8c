"""The stage engine on its own, in one process on the CPU, no gRPC: stages of a tiny random-weight checkpoint driven
through open/add -> schedule() -> run() -> postprocess(), and what lands in the Outbox (messages to the next hop,
token events to the origin) checked against transformers on the same checkpoint: a whole-model stage and a pipeline
of two give its greedy tokens, a first stage forwards its hidden states, the decode loop's limits, chunked prefill,
the prefix cache, hold / resume / export / import, close, preemption, and input outside the vocabulary."""

from __future__ import annotations

import json

import functools
import math
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import transformers

from stratamesh.agent.engine.stage_engine import EngineConfig, Outbox, StageEngine
from stratamesh.agent.engine.stage_runner import StageRunner
from stratamesh.fleet.errors import InvalidInput
from stratamesh.fleet.sessions import (Hop, SamplingParams, SessionClose, SessionHold, SessionOpen, StepBatch,
                                       StepChunk, StepChunks, TokenEvent)
from stratamesh.fleet.stages import Assignment, StageSpec
from stratamesh.kernels import codec
from stratamesh.kernels.models.decoder import load_stage

NUM_LAYERS = 2
VOCAB = 1024                # write_tiny_model's default
BS = 4                      # KV block size: a 21-token prompt fills 5 blocks and starts a 6th
HIDDEN_ATOL = 1e-4          # float32 on the CPU, as tests/kernels/test_decoder.py
ORIGIN = "origin.test:1"
# a whole-model stage, or the first of two, serves a0 (and is where the decode loop feeds); the last of two serves a1
FIRST, LAST = Hop("first.test:1", "a0"), Hop("last.test:1", "a1")

StageMessage = SessionOpen | StepChunk | StepChunks | StepBatch | SessionClose | SessionHold


@pytest.fixture(scope="module")
def model_dir(tiny_model) -> Path:
    return tiny_model("llama", num_layers=NUM_LAYERS, hidden_size=64, intermediate_size=128)


# ------------------------------------------------------------ the reference
@functools.cache
def hf_model(model_dir: Path) -> transformers.PreTrainedModel:
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_greedy(model_dir: Path, prompt: list[int], num_tokens: int) -> list[int]:
    """transformers' greedy generation of exactly num_tokens tokens (no EOS stops it)."""
    with torch.inference_mode():
        ids = torch.tensor([prompt])
        out = hf_model(model_dir).generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=num_tokens,
                                           do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def hf_hidden(model_dir: Path, prompt: list[int], num_layers: int) -> torch.Tensor:
    """transformers' hidden states after the first num_layers decoder layers: [len(prompt), hidden]."""
    with torch.inference_mode():
        return hf_model(model_dir)(torch.tensor([prompt]), output_hidden_states=True).hidden_states[num_layers][0]


def random_prompt(seed: int, length: int) -> list[int]:
    return torch.randint(3, VOCAB, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


# ------------------------------------------------------------ the engines under test
def make_engine(model_dir: Path, layers: tuple[int, int] = (0, NUM_LAYERS), num_blocks: int = 64,
                **config) -> StageEngine:
    """The stage of the tiny model's layers [start, end), with num_blocks KV blocks, serving a0 if it is the first."""
    spec = StageSpec("m", str(model_dir), *layers, NUM_LAYERS, kv_block_size=BS)
    hop = FIRST if spec.is_first else LAST
    return StageEngine(Assignment(hop.assignment_id, spec), StageRunner(load_stage(spec), num_blocks),
                       EngineConfig(**config))


def generation(session_id: str, prompt: list[int], max_new_tokens: int = 0, stop_token_ids: tuple[int, ...] = (),
               route: tuple[Hop, ...] = (), feed: Hop | None = FIRST, max_cached_tokens: int | None = None,
               resume_from: str = "") -> SessionOpen:
    """A greedy generation's open as the origin sends it to the first stage (the decode loop feeding FIRST)."""
    return SessionOpen(session_id, FIRST.assignment_id, route, ORIGIN, SamplingParams(),
                       prompt_token_ids=tuple(prompt), resume_from=resume_from, feed=feed,
                       max_cached_tokens=len(prompt) - 1 if max_cached_tokens is None else max_cached_tokens,
                       max_new_tokens=max_new_tokens, stop_token_ids=stop_token_ids)


def free_blocks(engine: StageEngine) -> int:
    return engine.scheduler.block_manager.num_free_blocks


class Mesh:
    """Engines wired as the data plane wires them, in one thread: each stage message goes to the engine its hop
    names (one outside the mesh is only recorded), each event to the origin; steps run round-robin until no engine
    has work."""

    def __init__(self, *engines: StageEngine) -> None:
        self.engines = {engine.assignment.assignment_id: engine for engine in engines}
        self.sent: list[tuple[Hop, StageMessage]] = []     # every stage message, in order
        self.events: list[TokenEvent] = []                  # every event to the origin, in order
        self.num_steps = 0

    def send(self, assignment_id: str, message: StageMessage) -> None:
        """message arrives at the stage serving assignment_id."""
        engine = self.engines.get(assignment_id)
        if engine is None:
            return
        outbox = Outbox()
        match message:
            case SessionOpen():
                engine.open(message, outbox)
            case StepChunk():
                engine.add(message, None)
            case StepChunks():
                for chunk in message.chunks:
                    engine.add(chunk, None)
            case StepBatch():
                hidden, row = codec.decode(message.hidden), 0     # [sum of chunk lengths, hidden]
                for chunk in message.chunks:
                    engine.add(chunk, hidden[row:row + len(chunk.token_ids)])
                    row += len(chunk.token_ids)
            case SessionClose():
                engine.close(message.session_id, outbox)
            case SessionHold():
                engine.hold(message.session_id, outbox)
        self.deliver(outbox)

    def deliver(self, outbox: Outbox) -> None:
        for origin, event in outbox.events:
            assert origin == ORIGIN
            self.events.append(event)
        for hop, message in outbox.stage_messages:
            self.sent.append((hop, message))
            self.send(hop.assignment_id, message)

    def step(self, engine: StageEngine) -> bool:
        """One step of engine, its outbox delivered; False if it had nothing to do."""
        batch = engine.schedule()
        if batch is None:
            return False
        output = engine.run(batch) if batch.chunks else None
        outbox = Outbox()
        engine.postprocess(batch, output, outbox)
        self.num_steps += 1
        self.deliver(outbox)
        return True

    def run(self, max_steps: int = 500) -> None:
        while any([self.step(engine) for engine in self.engines.values()]):    # a list: every engine steps
            assert self.num_steps < max_steps, "the engines never ran out of work"

    def events_of(self, session_id: str) -> list[TokenEvent]:
        return [event for event in self.events if event.session_id == session_id]

    def tokens(self, session_id: str) -> list[int]:
        return [e.token_id for e in self.events_of(session_id) if not (e.opened or e.preempted or e.error)]

    def opened(self, session_id: str) -> TokenEvent:
        (event,) = [e for e in self.events_of(session_id) if e.opened]
        return event

    def fed(self) -> list[tuple[Hop, tuple[str, int, int, tuple[int, ...], bool]]]:
        """Each chunk the decode loop fed, with its hop: (session, step, start_pos, token ids, sample)."""
        return [(hop, (c.session_id, c.step, c.start_pos, c.token_ids, c.sample))
                for hop, message in self.sent if isinstance(message, StepChunks) for c in message.chunks]

    def batches(self) -> list[tuple[Hop, StepBatch]]:
        return [(hop, message) for hop, message in self.sent if isinstance(message, StepBatch)]


def start(mesh: Mesh, open_message: SessionOpen, start_pos: int = 0, step: int = 0) -> None:
    """Opens a generation and sends its prompt from start_pos as one chunk that samples."""
    mesh.send(FIRST.assignment_id, open_message)
    prompt = open_message.prompt_token_ids
    mesh.send(FIRST.assignment_id, StepChunk(open_message.session_id, step, start_pos, prompt[start_pos:], True))


# ------------------------------------------------------------ greedy tokens
@pytest.mark.parametrize("feed", [FIRST, None], ids=["decode-loop", "origin-drives"])
def test_a_whole_model_stage_generates_the_greedy_tokens_of_transformers(model_dir: Path, feed: Hop | None) -> None:
    num_tokens = 8
    prompts = {"s0": random_prompt(0, 5), "s1": random_prompt(1, 22), "s2": random_prompt(2, 11)}
    mesh = Mesh(make_engine(model_dir))
    for session_id, prompt in prompts.items():       # one batch: three prefills, then three decodes a step
        start(mesh, generation(session_id, prompt, max_new_tokens=num_tokens, feed=feed))
    if feed is None:                                 # the origin sends each decode step itself
        for step in range(1, num_tokens):
            mesh.run()
            for session_id, prompt in prompts.items():
                token = mesh.tokens(session_id)[-1]
                mesh.send("a0", StepChunk(session_id, step, len(prompt) + step - 1, (token,), True))
    mesh.run()
    for session_id, prompt in prompts.items():
        assert mesh.opened(session_id).cached_tokens == 0
        assert mesh.tokens(session_id) == hf_greedy(model_dir, prompt, num_tokens), session_id
        assert [e.step for e in mesh.events_of(session_id) if not e.opened] == list(range(num_tokens))
    assert len(mesh.fed()) == (0 if feed is None else len(prompts) * (num_tokens - 1))


def test_a_pipeline_of_two_stages_generates_the_greedy_tokens_of_transformers(model_dir: Path) -> None:
    first, last = make_engine(model_dir, (0, 1)), make_engine(model_dir, (1, 2))
    mesh = Mesh(first, last)
    prompts = {"g1": random_prompt(3, 9), "g2": random_prompt(4, 14)}
    for session_id, prompt in prompts.items():
        start(mesh, generation(session_id, prompt, max_new_tokens=10, route=(LAST,)))
    mesh.run()
    for session_id, prompt in prompts.items():
        assert mesh.opened(session_id).cached_tokens == 0          # answered by the last stage
        assert mesh.tokens(session_id) == hf_greedy(model_dir, prompt, 10), session_id
    assert {hop for hop, _ in mesh.fed()} == {FIRST} and {hop for hop, _ in mesh.batches()} == {LAST}
    assert not first.loops and not last.loops


# ------------------------------------------------------------ a first stage's messages
def test_a_first_stage_forwards_the_open_and_its_hidden_states_with_the_chunks_it_got(model_dir: Path) -> None:
    mesh = Mesh(make_engine(model_dir, (0, 1)))       # the next stage (a1) is not in the mesh: its messages stay
    prompts = {"s0": random_prompt(5, 7), "s1": random_prompt(6, 3)}
    opens = {sid: generation(sid, prompt, route=(LAST,)) for sid, prompt in prompts.items()}
    for open_message in opens.values():
        mesh.send("a0", open_message)
    assert mesh.sent == [(LAST, replace(message, assignment_id="a1", route=(), max_cached_tokens=0))
                         for message in opens.values()]
    trace_id = "ab" * 16
    for step, (session_id, prompt) in enumerate(prompts.items(), start=3):
        mesh.send("a0", StepChunk(session_id, step, 0, tuple(prompt), True, trace_id if step == 3 else ""))
    mesh.run()
    (hop, batch), = mesh.batches()                    # both sessions in one step: one message to their next stage
    assert hop == LAST and not mesh.events
    assert batch.chunks == (StepChunk("s0", 3, 0, tuple(prompts["s0"]), True, trace_id),
                            StepChunk("s1", 4, 0, tuple(prompts["s1"]), True))
    hidden = codec.decode(batch.hidden)
    expected = torch.cat([hf_hidden(model_dir, prompt, 1) for prompt in prompts.values()])
    assert hidden.dtype == torch.float32
    torch.testing.assert_close(hidden, expected, atol=HIDDEN_ATOL, rtol=0)


def test_a_first_stage_passes_holds_and_closes_on_to_the_next_stage(model_dir: Path) -> None:
    engine = make_engine(model_dir, (0, 1))
    mesh = Mesh(engine)
    mesh.send("a0", generation("s", random_prompt(7, 6), route=(LAST,)))
    for message in (SessionHold("s"), SessionClose("s"), SessionHold("s"), SessionClose("s")):
        mesh.send("a0", message)              # the second hold and close find the session gone: nothing to pass on
    assert [message for _, message in mesh.sent[1:]] == [SessionHold("s"), SessionClose("s")]
    assert not engine.sessions


# ------------------------------------------------------------ the decode loop
@pytest.mark.parametrize("max_new_tokens, stop_at", [(1, None), (6, None), (0, 4), (9, 2)],
                         ids=["one-token", "limit", "stop-token", "stop-before-limit"])
def test_the_decode_loop_feeds_each_token_until_the_limit_or_a_stop_token(model_dir: Path, max_new_tokens: int,
                                                                           stop_at: int | None) -> None:
    prompt = random_prompt(8, 6)
    reference = hf_greedy(model_dir, prompt, 10)
    stop = () if stop_at is None else (reference[stop_at],)
    ends = [max_new_tokens] if max_new_tokens else []
    ends += [reference.index(stop[0]) + 1] if stop else []
    expected = reference[:min(ends)]
    engine = make_engine(model_dir)
    mesh = Mesh(engine)
    start(mesh, generation("g", prompt, max_new_tokens=max_new_tokens, stop_token_ids=stop))
    mesh.run()
    assert mesh.tokens("g") == expected
    assert not any(e.held for e in mesh.events)
    # each token but the last went on as the next step, at the position after the last one computed
    assert mesh.fed() == [(FIRST, ("g", k + 1, len(prompt) + k, (token,), True))
                          for k, token in enumerate(expected[:-1])]
    assert "g" in engine.sessions and not engine.loops         # the loop is over; the session stays open


# ------------------------------------------------------------ chunked prefill
def test_a_prompt_longer_than_max_batch_tokens_is_prefilled_over_several_steps(model_dir: Path) -> None:
    prompt, max_batch_tokens, num_tokens = random_prompt(9, 30), 8, 5
    mesh = Mesh(make_engine(model_dir, max_batch_tokens=max_batch_tokens))
    start(mesh, generation("g", prompt, max_new_tokens=num_tokens))
    mesh.run()
    assert mesh.tokens("g") == hf_greedy(model_dir, prompt, num_tokens)
    assert mesh.num_steps == math.ceil(len(prompt) / max_batch_tokens) + num_tokens - 1


def test_logprobs_of_the_prompt_and_of_each_pick_are_transformers_log_softmax(model_dir: Path) -> None:
    """A prompt prefilled over several steps: each of its tokens' log-probability (the second on) and its 2 likeliest
    come with the first token, each pick's with 3 likeliest with it; all within 1e-4 of transformers' log_softmax,
    taken before the bias that changes the picks."""
    prompt, num_tokens = random_prompt(12, 21), 6
    greedy = hf_greedy(model_dir, prompt, num_tokens)
    mesh = Mesh(make_engine(model_dir, max_batch_tokens=8))
    params = SamplingParams(logprobs=3, prompt_logprobs=2, logit_bias=((greedy[0], -100.0),))
    start(mesh, replace(generation("g", prompt, max_new_tokens=num_tokens), sampling=params))
    mesh.run()
    events = [e for e in mesh.events_of("g") if not e.opened]
    tokens = [e.token_id for e in events]
    with torch.inference_mode():
        expected = torch.log_softmax(hf_model(model_dir)(torch.tensor([prompt + tokens])).logits[0].float(), -1)
    assert len(events[0].prompt_logprobs) == len(prompt) - 1 and not any(e.prompt_logprobs for e in events[1:])
    predicted = [(p, lp) for p, lp in enumerate(events[0].prompt_logprobs)] + [
        (len(prompt) - 1 + i, e.logprobs) for i, e in enumerate(events)]
    for row, lp in predicted:       # the row at position `row` predicts the token after it
        assert lp.token_id == (prompt + tokens)[row + 1]
        assert lp.logprob == pytest.approx(float(expected[row, lp.token_id]), abs=1e-4)
        top = expected[row].topk(2 if row < len(prompt) - 1 else 3)
        assert [t for t, _ in lp.top] == top.indices.tolist()
        assert [v for _, v in lp.top] == pytest.approx(top.values.tolist(), abs=1e-4)
    assert tokens[0] != greedy[0]       # the bias changed the pick; the log-probabilities are the model's


def test_a_first_stage_forwards_a_long_prompt_in_pieces_of_max_batch_tokens(model_dir: Path) -> None:
    prompt, size = random_prompt(10, 30), 8
    mesh = Mesh(make_engine(model_dir, (0, 1), max_batch_tokens=size))
    mesh.send("a0", generation("g", prompt, route=(LAST,)))
    mesh.send("a0", StepChunk("g", 0, 0, tuple(prompt), True))
    mesh.run()
    batches = [batch for _, batch in mesh.batches()]
    starts = range(0, len(prompt), size)
    assert [batch.chunks for batch in batches] == [
        (StepChunk("g", 0, begin, tuple(prompt[begin:begin + size]), begin + size >= len(prompt)),)
        for begin in starts]                                      # only the piece that ends the prompt samples
    hidden = torch.cat([codec.decode(batch.hidden) for batch in batches])
    torch.testing.assert_close(hidden, hf_hidden(model_dir, prompt, 1), atol=HIDDEN_ATOL, rtol=0)


# ------------------------------------------------------------ the prefix cache
@pytest.mark.parametrize("max_cached_tokens, prefix_cache, start_pos", [
    (20, True, None), (9, True, None), (0, True, None), (20, False, None), (20, True, 10), (20, True, 0)],
    ids=["whole-blocks", "capped", "none-asked", "cache-off", "origin-settles-lower", "origin-sends-all"])
def test_a_repeated_prompt_reports_its_cached_tokens_and_gives_the_same_tokens(
        model_dir: Path, max_cached_tokens: int, prefix_cache: bool, start_pos: int | None) -> None:
    prompt, num_tokens = random_prompt(11, 21), 4
    engine = make_engine(model_dir, enable_prefix_cache=prefix_cache)
    mesh = Mesh(engine)
    start(mesh, generation("first", prompt, max_new_tokens=num_tokens))
    mesh.run()
    mesh.send("a0", SessionClose("first"))
    expected_cached = min(max_cached_tokens, len(prompt) - 1) // BS * BS if prefix_cache else 0
    mesh.send("a0", generation("again", prompt, max_new_tokens=num_tokens, max_cached_tokens=max_cached_tokens))
    assert mesh.opened("again").cached_tokens == expected_cached
    start_pos = expected_cached if start_pos is None else start_pos
    mesh.send("a0", StepChunk("again", 0, start_pos, tuple(prompt[start_pos:]), True))
    mesh.run()
    assert mesh.tokens("again") == mesh.tokens("first") == hf_greedy(model_dir, prompt, num_tokens)


# ------------------------------------------------------------ hold, resume, export, import, close
def held_session(mesh: Mesh, prompt: list[int], num_before_hold: int) -> list[int]:
    """Starts generation g with no limit, holds it after num_before_hold tokens; the tokens it gave."""
    engine = mesh.engines["a0"]
    start(mesh, generation("g", prompt))
    for _ in range(num_before_hold):          # a prefill, then decodes: a token each
        mesh.step(engine)
    mesh.send("a0", SessionHold("g"))
    mesh.run()
    return mesh.tokens("g")


@pytest.mark.parametrize("moved", [False, True], ids=["resumed-here", "exported-and-imported"])
def test_a_held_session_is_quiet_and_resumes_from_its_kv(model_dir: Path, moved: bool) -> None:
    prompt, before_hold, after = random_prompt(12, 9), 3, 4
    reference = hf_greedy(model_dir, prompt, before_hold + 1 + after)
    engine = make_engine(model_dir)
    mesh = Mesh(engine)
    free = free_blocks(engine)
    tokens = held_session(mesh, prompt, before_hold)
    # the token sampled after the hold is the last: marked held, fed nowhere; the session is quiet with its KV
    assert tokens == reference[:before_hold + 1] and mesh.events[-1].held
    assert len(mesh.fed()) == before_hold and not engine.scheduler.has_work and engine.prefilled("g")
    num_computed = len(prompt) + before_hold
    if moved:
        kv = engine.export_session("g")
        assert (kv.token_ids, kv.prompt_len, kv.num_computed) == (tuple(prompt + tokens[:-1]), len(prompt),
                                                                  num_computed)
        engine.drop("g")
        assert free_blocks(engine) == free and not engine.sessions
        engine = make_engine(model_dir)
        engine.import_session(kv)
        assert free - free_blocks(engine) == math.ceil(num_computed / BS)
        mesh = Mesh(engine)
    # the origin resumes it under a new id with every token so far; the stage computes only the held token
    mesh.send("a0", generation("g2", prompt + tokens, max_new_tokens=after, resume_from="g"))
    assert mesh.opened("g2").cached_tokens == num_computed
    mesh.send("a0", StepChunk("g2", before_hold + 1, num_computed, (tokens[-1],), True))
    mesh.run()
    assert mesh.tokens("g2") == reference[before_hold + 1:]
    assert set(engine.sessions) == {"g2"}


def test_an_imported_session_nobody_resumes_is_freed_by_unpark(model_dir: Path) -> None:
    source, target = make_engine(model_dir), make_engine(model_dir)
    held_session(Mesh(source), random_prompt(13, 10), 2)
    kv = source.export_session("g")
    free = free_blocks(target)
    target.import_session(kv)
    assert free_blocks(target) == free - math.ceil(kv.num_computed / BS)
    with pytest.raises(InvalidInput, match="already here"):
        target.import_session(kv)
    assert target.unpark("g") and free_blocks(target) == free
    assert not target.unpark("g")


def test_a_closed_session_gives_its_kv_blocks_back(model_dir: Path) -> None:
    engine = make_engine(model_dir)
    mesh = Mesh(engine)
    free = free_blocks(engine)
    prompts, num_tokens = {"a": random_prompt(14, 13), "b": random_prompt(15, 6)}, 5
    for session_id, prompt in prompts.items():
        start(mesh, generation(session_id, prompt, max_new_tokens=num_tokens))
    mesh.run()
    # every position computed holds a slot: the prompt and each token but the last (never fed back)
    blocks = {sid: math.ceil((len(prompt) + num_tokens - 1) / BS) for sid, prompt in prompts.items()}
    assert free - free_blocks(engine) == sum(blocks.values())
    mesh.send("a0", SessionClose("a"))
    assert free - free_blocks(engine) == blocks["b"]
    with pytest.raises(InvalidInput, match="chunk.session_id"):
        engine.add(StepChunk("a", 5, len(prompts["a"]) + 4, (1,), True), None)
    mesh.send("a0", SessionClose("b"))
    assert free_blocks(engine) == free and not engine.sessions
    assert engine.close("b", Outbox()) is None


# ------------------------------------------------------------ preemption
def test_out_of_kv_blocks_a_session_is_preempted_its_origin_told_and_the_others_go_on(model_dir: Path) -> None:
    # 3 sessions of 8 + 11 positions need 5 blocks each: 12 blocks hold only two of them
    num_tokens, num_blocks = 12, 12
    engine = make_engine(model_dir, num_blocks=num_blocks)
    mesh = Mesh(engine)
    prompts = {f"s{i}": random_prompt(20 + i, 8) for i in range(3)}
    for session_id, prompt in prompts.items():
        start(mesh, generation(session_id, prompt, max_new_tokens=num_tokens))
    mesh.run()
    preempted = [e.session_id for e in mesh.events if e.preempted]
    assert 1 <= len(preempted) < len(prompts) and len(set(preempted)) == len(preempted)
    for session_id, prompt in prompts.items():
        reference, tokens = hf_greedy(model_dir, prompt, num_tokens), mesh.tokens(session_id)
        if session_id in preempted:       # told last, ended here, its tokens so far right
            assert mesh.events_of(session_id)[-1].preempted and session_id not in engine.sessions
            assert tokens == reference[:len(tokens)] and len(tokens) < num_tokens
        else:
            assert tokens == reference, session_id
    for session_id in prompts.keys() - set(preempted):
        mesh.send("a0", SessionClose(session_id))
    assert free_blocks(engine) == num_blocks
    for session_id in preempted:          # the origin replays it as a new session
        start(mesh, generation(f"{session_id}-replay", prompts[session_id], max_new_tokens=num_tokens))
    mesh.run()
    for session_id in preempted:
        assert mesh.tokens(f"{session_id}-replay") == hf_greedy(model_dir, prompts[session_id], num_tokens)


# ------------------------------------------------------------ bad input
BAD_OPENS = [
    ({"prompt_token_ids": (5, VOCAB, 6)}, "open.prompt_token_ids"),
    ({"prompt_token_ids": (-1, 5)}, "open.prompt_token_ids"),
    ({"route": (LAST,)}, "open.route"),               # the whole model: this is the last stage
    ({"session_id": "good"}, "open.session_id"),
    ({"output_start": 9}, "open.output_start"),
    ({"revision": "a1b2c3d4e5f6"}, "open.revision"),  # another revision of the model: a pipeline never mixes two
]
BAD_CHUNKS = [
    (StepChunk("victim", 0, 0, (5, 6, VOCAB), True), "chunk.token_ids"),
    (StepChunk("victim", 0, 0, (5, -3), True), "chunk.token_ids"),
    (StepChunk("stranger", 0, 0, (5, 6), True), "chunk.session_id"),
]


# ------------------------------------------------------------ penalties count the output, across a replay
PENALIZED = SamplingParams(temperature=0.8, seed=3, frequency_penalty=1.2, presence_penalty=0.4, repetition_penalty=1.3,
                           min_tokens=6, stop_token_ids=(0, 2))


def test_a_replay_picks_the_tokens_of_the_run_it_replays_its_penalties_counting_the_output_so_far(
        model_dir: Path) -> None:
    """A replayed generation's open carries prompt + output so far, and output_start where the output begins: the
    last stage counts that output, as the undisturbed run did, and picks the same tokens after it."""
    prompt, num_tokens = random_prompt(40, 9), 12
    whole = Mesh(make_engine(model_dir))
    start(whole, replace(generation("s", prompt, max_new_tokens=num_tokens), sampling=PENALIZED))
    whole.run()
    tokens = whole.tokens("s")
    assert len(tokens) == num_tokens
    replayed = Mesh(make_engine(model_dir))
    so_far = tokens[:5]
    start(replayed, replace(generation("r", prompt + so_far, max_new_tokens=num_tokens - 5), sampling=PENALIZED,
                            output_start=len(prompt)))
    replayed.run()
    assert so_far + replayed.tokens("r") == tokens
    unaware = Mesh(make_engine(model_dir))      # guards it: without output_start, the output so far is prompt
    start(unaware, replace(generation("u", prompt + so_far, max_new_tokens=num_tokens - 5), sampling=PENALIZED))
    unaware.run()
    assert so_far + unaware.tokens("u") != tokens


# ------------------------------------------------------------ structured output
SCHEMA = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 3, "maximum": 9},
                                           "tags": {"type": "array", "items": {"enum": ["edge", "cloud"]},
                                                    "minItems": 1, "maxItems": 2}},
          "required": ["id", "tags"], "additionalProperties": False}


def test_a_constrained_session_keeps_to_its_schema_and_a_replay_rebuilds_the_grammar_from_its_output(
        model_dir: Path) -> None:
    """Sampled (so that only the mask can make it valid), the output is a JSON document of the schema; a replay
    of its first tokens as prompt + output so far picks the rest the same: the new matcher is the old one's state."""
    llguidance = pytest.importorskip("llguidance")
    jsonschema = pytest.importorskip("jsonschema")
    from stratamesh.kernels.tiny_model import ENDOFTEXT, train_tokenizer

    params = SamplingParams(temperature=1.0, seed=2, grammar=llguidance.LLMatcher.grammar_from_json_schema(
        SCHEMA, defaults={"whitespace_flexible": False}))
    prompt = random_prompt(50, 7)
    whole = Mesh(make_engine(model_dir))
    start(whole, replace(generation("s", prompt, max_new_tokens=40, stop_token_ids=(0,)), sampling=params))
    whole.run()
    tokens = whole.tokens("s")
    tokenizer = train_tokenizer(VOCAB)
    assert tokens[-1] == tokenizer.token_to_id(ENDOFTEXT)       # it ended as its grammar was complete
    jsonschema.validate(json.loads(tokenizer.decode(tokens[:-1])), SCHEMA)
    replayed = Mesh(make_engine(model_dir))
    so_far = tokens[:4]
    start(replayed, replace(generation("r", prompt + so_far, max_new_tokens=40 - 4, stop_token_ids=(0,)),
                            sampling=params, output_start=len(prompt)))
    replayed.run()
    assert so_far + replayed.tokens("r") == tokens
    free = Mesh(make_engine(model_dir))        # guards it: unconstrained, the same draws are no JSON
    start(free, replace(generation("f", prompt, max_new_tokens=len(tokens)), sampling=replace(params, grammar="")))
    free.run()
    with pytest.raises(ValueError):
        json.loads(tokenizer.decode(free.tokens("f")))


@pytest.mark.parametrize("fields, field_name", BAD_OPENS, ids=[f"{name}-{i}" for i, (_, name) in enumerate(BAD_OPENS)])
def test_a_bad_open_raises_naming_its_field_and_hurts_no_other_session(model_dir: Path, fields: dict,
                                                                        field_name: str) -> None:
    engine = make_engine(model_dir)
    mesh = Mesh(engine)
    prompt = random_prompt(30, 7)
    start(mesh, generation("good", prompt, max_new_tokens=6))
    mesh.step(engine)                                     # good is decoding
    free = free_blocks(engine)
    with pytest.raises(InvalidInput, match=re.escape(field_name)):
        engine.open(replace(generation("bad", random_prompt(31, 5)), **fields), Outbox())
    assert set(engine.sessions) == {"good"} and free_blocks(engine) == free
    mesh.run()
    assert mesh.tokens("good") == hf_greedy(model_dir, prompt, 6)


@pytest.mark.parametrize("chunk, field_name", BAD_CHUNKS, ids=[f"{name}-{i}" for i, (_, name) in enumerate(BAD_CHUNKS)])
def test_a_bad_chunk_raises_naming_its_field_and_hurts_no_other_session(model_dir: Path, chunk: StepChunk,
                                                                         field_name: str) -> None:
    engine = make_engine(model_dir)
    mesh = Mesh(engine)
    prompts = {"good": random_prompt(32, 7), "victim": random_prompt(33, 5)}
    for session_id, prompt in prompts.items():
        mesh.send("a0", generation(session_id, prompt, max_new_tokens=6))
    mesh.send("a0", StepChunk("good", 0, 0, tuple(prompts["good"]), True))
    with pytest.raises(InvalidInput, match=re.escape(field_name)):
        engine.add(chunk, None)
    # nothing of the bad chunk was queued: the victim's own prompt still starts at position 0
    mesh.send("a0", StepChunk("victim", 0, 0, tuple(prompts["victim"]), True))
    mesh.run()
    for session_id, prompt in prompts.items():
        assert mesh.tokens(session_id) == hf_greedy(model_dir, prompt, 6), session_id


# ------------------------------------------------------------ between schedule() and postprocess()
def test_a_session_closed_while_its_step_runs_gets_nothing_and_the_others_their_tokens(model_dir: Path) -> None:
    engine = make_engine(model_dir)
    mesh = Mesh(engine)
    prompts = {"kept": random_prompt(40, 6), "closed": random_prompt(41, 6)}
    for session_id, prompt in prompts.items():
        start(mesh, generation(session_id, prompt, max_new_tokens=3))
    batch = engine.schedule()
    output = engine.run(batch)
    outbox = Outbox()
    engine.close("closed", outbox)
    engine.postprocess(batch, output, outbox)
    assert [(e.session_id, e.token_id) for _, e in outbox.events] == [
        ("kept", hf_greedy(model_dir, prompts["kept"], 1)[0])]


def test_a_session_whose_logits_are_not_finite_fails_saying_so_instead_of_picking_from_them(model_dir: Path) -> None:
    """A broken checkpoint (NaN weights, an overflow) fails its sessions with why, rather than answering with the
    tokens argmax makes of NaN: what rolls a bad canary revision back."""
    engine = make_engine(model_dir)
    head = engine.runner.model._lm_head
    with torch.no_grad():
        head[7].fill_(float("nan"))          # one vocabulary row: every row of logits holds a NaN
    mesh = Mesh(engine)
    start(mesh, generation("broken", random_prompt(34, 6), max_new_tokens=4))
    mesh.run()
    (error,) = [e.error for e in mesh.events_of("broken") if e.error]
    assert "logits are not finite" in error and mesh.tokens("broken") == [] and "broken" not in engine.sessions
