"""Draft tokens for speculative decoding: guesses at a session's next tokens that its last stage verifies in one
step (fleet.sessions.Speculation says which proposer, and how many tokens).

ngram (prompt lookup, vLLM's "ngram" method): the longest n-gram ending the session's tokens (n from
prompt_lookup_max down to prompt_lookup_min) that occurred before in them (the prompt and the output so far), at
its first occurrence (in the prompt, where a span the output repeats was given; and the one with the most tokens
after it), proposes the tokens that followed it there. It needs no model; it pays where the output repeats spans of
the input (editing a given text, quoting, code).

draft_model: a small model guesses them (agent.engine.draft_model)."""

from __future__ import annotations

from array import array
from collections.abc import Mapping, Sequence
from pathlib import Path

from stratamesh.agent.engine.draft_model import DraftModel
from stratamesh.fleet.errors import InvalidInput
from stratamesh.fleet.sessions import Speculation

_WIDTH = array("q").itemsize        # bytes a token takes in the searched buffer


def ngram_draft(tokens: Sequence[int], min_n: int, max_n: int, num_tokens: int) -> tuple[int, ...]:
    """Up to num_tokens tokens that followed the first occurrence of the longest n-gram (min_n <= n <= max_n) that
    ends tokens and occurred before that end; () when none did. The search is bytes.find over the tokens as 8-byte
    integers (a match must start on a token's first byte)."""
    buffer = array("q", tokens).tobytes()
    end = len(tokens)
    for n in range(min(max_n, end - 1), min_n - 1, -1):
        suffix = buffer[(end - n) * _WIDTH:]
        limit = (end - 1) * _WIDTH          # an occurrence ends before the last token: it has a follower
        begin = 0
        while (found := buffer.find(suffix, begin, limit)) >= 0:
            if found % _WIDTH == 0:
                start = found // _WIDTH + n
                return tuple(tokens[start:start + num_tokens])
            begin = found + 1
    return ()


class Proposers:
    """A last stage's proposers, for the sessions whose decode loops speculate: ngram's lookup, and the draft models
    they name, each loaded once, at the first session that names it, onto the stage's device."""

    def __init__(self, target_dir: str, vocab_size: int, device: str = "cpu", dtype: str = "float32") -> None:
        self.target_dir, self.vocab_size, self.device, self.dtype = target_dir, vocab_size, device, dtype
        self.draft_models: dict[str, DraftModel] = {}      # by folder
        self.sessions: dict[str, DraftModel] = {}           # session id -> the draft model it names

    def open(self, session_id: str, speculation: Speculation) -> None:
        """A session speculates as speculation says; InvalidInput if its draft model cannot serve this target."""
        if speculation.method != "draft_model":
            return
        model = self.draft_models.get(speculation.model)
        if model is None:
            _check_tokenizer(speculation.model, self.target_dir)
            model = DraftModel(speculation.model, self.device, self.dtype)
            if model.vocab_size != self.vocab_size:
                raise InvalidInput(f"draft model {speculation.model!r} has {model.vocab_size} tokens, the target "
                                   f"{self.vocab_size}: a draft shares its target's tokenizer")
            self.draft_models[speculation.model] = model
        self.sessions[session_id] = model

    def propose(self, requests: Mapping[str, tuple[Speculation, Sequence[int], int]]) -> dict[str, tuple[int, ...]]:
        """session id -> (its speculation, its tokens so far, how many to draft): the drafts, by session (the draft
        models' sessions batched, one pass a token, per model)."""
        drafts: dict[str, tuple[int, ...]] = {}
        by_model: dict[int, tuple[DraftModel, dict[str, tuple[Sequence[int], int]]]] = {}
        for session_id, (spec, tokens, most) in requests.items():
            model = self.sessions.get(session_id)
            if model is None:
                drafts[session_id] = ngram_draft(tokens, spec.prompt_lookup_min, spec.prompt_lookup_max, most)
            else:
                by_model.setdefault(id(model), (model, {}))[1][session_id] = (tokens, most)
        for model, batch in by_model.values():
            drafts.update(model.propose(batch))
        return drafts

    def close(self, session_id: str) -> None:
        """The session ended (or moved): its draft model forgets it."""
        model = self.sessions.pop(session_id, None)
        if model is not None:
            model.forget(session_id)


def _check_tokenizer(draft_dir: str, target_dir: str) -> None:
    """InvalidInput unless the draft's tokenizer is the target's (the same tokenizer.json, where both have one)."""
    draft, target = Path(draft_dir, "tokenizer.json"), Path(target_dir, "tokenizer.json")
    if not Path(draft_dir).is_dir():
        raise InvalidInput(f"draft model {draft_dir!r} is not a folder on this agent")
    if draft.is_file() and target.is_file() and draft.read_bytes() != target.read_bytes():
        raise InvalidInput(f"draft model {draft_dir!r} does not share the target's tokenizer")
