"""A request as the mesh serves it: the prompt, how to sample, and when to stop."""

from __future__ import annotations

from dataclasses import dataclass

from stratamesh.fleet.states import FinishReason
from stratamesh.fleet.sessions import SamplingParams


@dataclass(frozen=True, slots=True)
class Stops:
    """When a generation ends: with its max_tokens-th token, at a token of token_ids, or at a stop string.

    The one place these are decided. The origin ends its attempts by reason(), the last stage stops feeding its
    decode loop by the same two limits (SessionOpen.max_new_tokens and .stop_token_ids, from left() and token_ids),
    and the HTTP API's detokenizer looks for the strings in the text."""

    max_tokens: int | None = None           # None: no limit, the caller closes the generation
    token_ids: frozenset[int] = frozenset()  # EOS (unless ignore_eos) and the request's own
    strings: tuple[str, ...] = ()

    def reason(self, token_id: int, num_tokens: int) -> FinishReason | None:
        """Why a generation whose num_tokens-th token is token_id ends with it (STOP at a stop token, LENGTH at
        max_tokens), or None while it goes on as far as token ids tell (a stop string is found in the text)."""
        if token_id in self.token_ids:
            return FinishReason.STOP
        if self.max_tokens is not None and num_tokens >= self.max_tokens:
            return FinishReason.LENGTH
        return None

    def left(self, num_tokens: int) -> int | None:
        """The tokens still allowed after num_tokens (None: no limit)."""
        return None if self.max_tokens is None else self.max_tokens - num_tokens


@dataclass(frozen=True, slots=True)
class Request:
    """A validated request for a model: what to generate from, how to sample, and when to stop."""

    model_id: str
    request_id: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    stops: Stops = Stops()
