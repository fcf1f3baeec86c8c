"""Structured output at the last stage: each constrained session's grammar matcher (llguidance), and the tokens it
allows next.

A matcher's state is a function of the session's output so far, and only of it: the stage feeds it the output's
tokens it has not seen before each pick, and builds it again from the whole output when the output is not the one it
saw (a replay after a failover or a preemption, a session moved here with its KV). So a structured stream survives a
lost box: its new last stage rebuilds the grammar's state from the tokens the origin replays.

A step's masks are computed on a thread of Grammars' own while the step's forward pass runs (llguidance releases the
GIL), and the pick waits for them: the grammar costs a step nothing while its forward takes longer than its masks.
That thread is the only one that touches the matchers: every request (masks, close) is a job on it, run in order.

A grammar ends a generation: once its matcher has stopped (only EOS may follow), an output that goes on past that
end is refused, as is an output that left the grammar, or a grammar that allows no token at all. A refused session
gets no token (StepMasks.refused); the rest of its step is picked as usual."""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import llguidance
import llguidance.numpy
import numpy as np
import torch

from stratamesh.fleet.gguf_files import GgufModel, is_gguf
from stratamesh.fleet.errors import InvalidInput
from stratamesh.fleet.weight_files import TOKENIZER_FILE

NUM_TEMPLATES = 32      # the grammars a stage keeps compiled (each session's matcher is a copy of its grammar's)


@dataclass(frozen=True, slots=True)
class StepMasks:
    """What a step's constrained sessions may pick: bit b of bitmask[r, w] allows token 32w + b to the session of
    row r; a refused session's row allows every token, and its pick is dropped (refused says why)."""

    bitmask: torch.Tensor                       # int32 [rows, ceil(vocab / 32)], on the CPU
    refused: Mapping[str, str] = field(default_factory=dict)     # session id -> why it gets no token


@dataclass(slots=True)
class GrammarTimes:
    """Where a stage's grammars spent time: computing masks (on their thread, beside the forward passes), and how
    long the picks waited for them (on the step's critical path)."""

    num_steps: int = 0
    compute_s: float = 0.0
    wait_s: float = 0.0


@dataclass(frozen=True, slots=True)
class PendingMasks:
    """A step's masks while they are computed: which session has which row, at once; the masks, at wait()."""

    rows: Mapping[str, int]
    _future: Future[StepMasks]
    _times: GrammarTimes

    def wait(self) -> StepMasks:
        """The step's masks, once computed (what the computation raised, if it failed as a whole)."""
        started = time.perf_counter()
        try:
            return self._future.result()
        finally:
            self._times.wait_s += time.perf_counter() - started


def masked_logits(logits: torch.Tensor, bitmask: torch.Tensor, may_ban: bool = False) -> torch.Tensor:
    """logits [rows, vocab] at -inf where bitmask [rows, ceil(vocab / 32)] (StepMasks') disallows, on the logits'
    device. may_ban: some row's processing may have set -inf where its grammar allows (min_tokens bans EOS, the only
    token a grammar's end allows): such a row, left with no finite logit, takes its mask alone (the grammar's end
    ends the generation)."""
    bits = torch.arange(32, dtype=torch.int32, device=logits.device)
    disallowed = ((bitmask[:, :, None] >> bits) & 1).flatten(1)[:, :logits.shape[-1]] == 0     # [rows, vocab]
    masked = logits.masked_fill(disallowed, float("-inf"))
    if not may_ban:
        return masked
    stuck = (masked == float("-inf")).all(dim=-1, keepdim=True)
    return torch.where(stuck, torch.zeros_like(masked).masked_fill(disallowed, float("-inf")), masked)


@dataclass(slots=True)
class _Matched:
    matcher: llguidance.LLMatcher
    output: list[int] = field(default_factory=list)     # what it consumed


class Grammars:
    """The matchers of one stage's constrained sessions, over the model's tokenizer (read from its folder when the
    first grammar comes); a step's masks are computed by mask_threads threads (default: llguidance's, 80% of the
    CPUs), or by Grammars' own thread alone where that is one: a pool of one would only add a hand-off."""

    def __init__(self, model_dir: str | Path, vocab_size: int, eos_token_ids: Sequence[int],
                 mask_threads: int | None = None) -> None:
        self._model_dir = Path(model_dir)
        self._vocab_size = vocab_size
        self._eos = list(eos_token_ids)
        self._mask_threads = min(32, (os.cpu_count() or 1) * 4 // 5) if mask_threads is None else mask_threads
        self.times = GrammarTimes()
        self._asked: set[str] = set()       # the sessions masks were asked for (and not closed since)
        self._thread: ThreadPoolExecutor | None = None      # made with the first grammar
        self._executor: llguidance.LLExecutor | None = None
        # touched on the thread only
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._sessions: dict[str, _Matched] = {}
        self._templates: dict[str, llguidance.LLMatcher] = {}      # grammar -> its compiled matcher, oldest first

    def start(self, wanted: Mapping[str, tuple[str, Sequence[int]]]) -> PendingMasks:
        """Starts computing the masks of the sessions wanted (session id -> its grammar and output so far, which the
        caller no longer changes), row by row in wanted's order, and returns at once."""
        if self._thread is None:
            self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammars")
            self._executor = llguidance.LLExecutor(self._mask_threads) if self._mask_threads > 1 else None
        self.times.num_steps += 1
        self._asked.update(wanted)
        jobs = [(session_id, grammar, list(output)) for session_id, (grammar, output) in wanted.items()]
        return PendingMasks({session_id: row for row, (session_id, _, _) in enumerate(jobs)},
                            self._thread.submit(self._masks, jobs), self.times)

    def close(self, session_id: str) -> None:
        """Forgets the session's matcher (after any masks of it already asked for)."""
        if session_id in self._asked:
            self._asked.discard(session_id)
            assert self._thread is not None     # (made by the start() that asked)
            self._thread.submit(self._sessions.pop, session_id, None)

    # ------------------------------------------------------------ on the thread
    def _masks(self, jobs: list[tuple[str, str, list[int]]]) -> StepMasks:
        """The masks of jobs (session id, grammar, output so far), a row each, in order."""
        started = time.perf_counter()
        # numpy, not torch, on this thread: a torch op here could start an OpenMP pool beside the forward's (and
        # llguidance.numpy, not llguidance.torch, whose torch.compile'd helpers import dynamo and inductor at every
        # agent's start: `python -X importtime -c "import stratamesh.agent.daemon"` shows what that costs)
        bitmask = np.full(llguidance.numpy.get_bitmask_shape(len(jobs), self._vocab_size), -1, dtype=np.int32)
        matchers, refused = [], {}
        for row, (session_id, grammar, output) in enumerate(jobs):
            try:
                matchers.append((self._state(session_id, grammar, output).matcher, row))
            except InvalidInput as exc:
                refused[session_id] = str(exc)
        if self._executor is not None and len(matchers) > 1:
            llguidance.numpy.fill_next_token_bitmask_par(self._executor, matchers, bitmask)
        else:
            for matcher, row in matchers:
                llguidance.numpy.fill_next_token_bitmask(matcher, bitmask, row)
        for row in np.flatnonzero(~bitmask.any(axis=1)).tolist():
            session_id = jobs[row][0]
            refused[session_id] = f"session {session_id}'s grammar allows no next token"
            bitmask[row] = -1
            self._sessions.pop(session_id, None)
        self.times.compute_s += time.perf_counter() - started
        return StepMasks(torch.from_numpy(bitmask), refused)     # (sharing bitmask's memory)

    def _state(self, session_id: str, grammar: str, output: list[int]) -> _Matched:
        """The session's matcher after output; InvalidInput where output left its grammar, went on past its end, or
        the grammar does not compile."""
        state = self._sessions.get(session_id)
        if state is None or output[:len(state.output)] != state.output:     # new, or not this output
            state = self._sessions[session_id] = _Matched(self._matcher(grammar))
        new = output[len(state.output):]
        if new:
            matcher = state.matcher
            stopped = matcher.is_stopped()      # only EOS could follow, or EOS came: the grammar is over
            consumed = not stopped and matcher.consume_tokens(new)
            if not consumed or matcher.stop_reason() == "EndOfSentence":
                del self._sessions[session_id]
                raise InvalidInput(
                    f"session {session_id}'s output goes on past the end of its grammar: a constrained generation "
                    "ends with its grammar (EOS must stop it; ignore_eos cannot hold it open)" if stopped or consumed
                    else f"session {session_id}'s output left its grammar: {matcher.get_error()}")
            state.output += new
        return state

    def _matcher(self, grammar: str) -> llguidance.LLMatcher:
        """A new matcher of grammar: a copy of the one compiled for its first session, which shares its lexer's
        states with every copy (the masks of the sessions after the first need not build them again)."""
        template = self._templates.pop(grammar, None)
        if template is None:
            template = llguidance.LLMatcher(self._llg_tokenizer(), grammar)
            if template.is_error():
                raise InvalidInput(f"sampling.grammar does not compile: {template.get_error()}")
        self._templates[grammar] = template         # the newest last
        if len(self._templates) > NUM_TEMPLATES:
            del self._templates[next(iter(self._templates))]
        return template.deep_copy()

    def _llg_tokenizer(self) -> llguidance.LLTokenizer:
        """The model's tokenizer as llguidance reads it (from its folder, once)."""
        if self._tokenizer is None:
            path = self._model_dir / TOKENIZER_FILE
            if is_gguf(self._model_dir):        # (a GGUF file holds its tokenizer)
                tokenizer_json = GgufModel(self._model_dir).tokenizer_json()
            elif path.is_file():
                tokenizer_json = path.read_text()
            else:
                raise InvalidInput(f"structured output needs the model's {TOKENIZER_FILE}, which {self._model_dir} "
                                   "lacks")
            self._tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=self._vocab_size,
                                                     eos_token=self._eos or None)
        return self._tokenizer
