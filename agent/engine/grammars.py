"""Structured output at the last stage: each constrained session's grammar matcher (llguidance), and the tokens it
allows next.

A matcher's state is a function of the session's output so far, and only of it: the stage feeds it the output's
tokens it has not seen before each pick, and builds it again from the whole output when the output is not the one it
saw (a replay after a failover or a preemption, a session moved here with its KV). So a structured stream survives a
lost box: its new last stage rebuilds the grammar's state from the tokens the origin replays."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import llguidance
import torch

from stratamesh.fleet.errors import InvalidInput
from stratamesh.fleet.weight_files import TOKENIZER_FILE


@dataclass(slots=True)
class _Matched:
    matcher: llguidance.LLMatcher
    output: list[int] = field(default_factory=list)     # what it consumed


class Grammars:
    """The matchers of one stage's constrained sessions, over the model's tokenizer (read from its folder when the
    first grammar comes)."""

    def __init__(self, model_dir: str | Path, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self._model_dir = Path(model_dir)
        self._vocab_size = vocab_size
        self._eos = list(eos_token_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._sessions: dict[str, _Matched] = {}

    def allowed(self, session_id: str, grammar: str, output: Sequence[int]) -> torch.Tensor:
        """The tokens the session's grammar allows after output: bool [vocab]; InvalidInput where the output left
        its grammar (a token it did not allow) or the grammar does not compile."""
        state = self._state(session_id, grammar, output)
        words = torch.frombuffer(bytearray(state.matcher.compute_bitmask()), dtype=torch.int32)
        bits = (words[:, None] >> torch.arange(32, dtype=torch.int32)) & 1      # [words, 32], token 32w + b
        return bits.flatten()[:self._vocab_size].bool()

    def close(self, session_id: str) -> None:
        self._sessions.pop(session_id, None)

    def _state(self, session_id: str, grammar: str, output: Sequence[int]) -> _Matched:
        state = self._sessions.get(session_id)
        if state is None or list(output[:len(state.output)]) != state.output:     # new, or not this output
            state = self._sessions[session_id] = _Matched(self._matcher(grammar))
        new = list(output[len(state.output):])
        if new and not state.matcher.consume_tokens(new):
            del self._sessions[session_id]
            raise InvalidInput(f"session {session_id}'s output left its grammar: {state.matcher.get_error()}")
        state.output += new
        return state

    def _matcher(self, grammar: str) -> llguidance.LLMatcher:
        if self._tokenizer is None:
            path = self._model_dir / TOKENIZER_FILE
            if not path.is_file():
                raise InvalidInput(f"structured output needs the model's {TOKENIZER_FILE}, which {self._model_dir} "
                                   "lacks")
            self._tokenizer = llguidance.LLTokenizer(path.read_text(), n_vocab=self._vocab_size,
                                                     eos_token=self._eos or None)
        matcher = llguidance.LLMatcher(self._tokenizer, grammar)
        if matcher.is_error():
            raise InvalidInput(f"sampling.grammar does not compile: {matcher.get_error()}")
        return matcher
