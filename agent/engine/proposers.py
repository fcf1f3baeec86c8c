"""Draft tokens for speculative decoding: guesses at a session's next tokens that its last stage verifies in one
step (fleet.sessions.Speculation says which proposer, and how many tokens).

ngram (prompt lookup, vLLM's "ngram" method): the longest n-gram ending the session's tokens (n from
prompt_lookup_max down to prompt_lookup_min) that occurred before in them (the prompt and the output so far), at
its first occurrence (in the prompt, where a span the output repeats was given; and the one with the most tokens
after it), proposes the tokens that followed it there. It needs no model; it pays where the output repeats spans of
the input (editing a given text, quoting, code)."""

from __future__ import annotations

from array import array
from collections.abc import Sequence

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
