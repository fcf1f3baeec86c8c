"""OpenAI's logprobs shapes of a response's tokens: the completions API's (tokens, token_logprobs, top_logprobs,
text_offset) and the chat API's (content: token, logprob, bytes, top_logprobs). The numbers are the model's
log-probabilities as the last stage computed them (fleet.sessions.Logprobs); this module only names the tokens."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from stratamesh.coordinator.text import Tokenizer
from stratamesh.fleet.sessions import Logprobs


class LogprobsShape:
    """Renders Logprobs with the model's tokenizer; num_top: the likeliest tokens listed for each."""

    def __init__(self, tokenizer: Tokenizer, num_top: int) -> None:
        self._tokenizer = tokenizer
        self.num_top = num_top

    def text(self, token_id: int) -> str:
        """A token's own text (special tokens named as they are)."""
        return self._tokenizer.decode([token_id], skip_special_tokens=False)

    def completion(self, tokens: Sequence[int], logprobs: Sequence[Logprobs | None],
                   offset: int = 0) -> dict[str, Any]:
        """The completions API's logprobs of tokens, each's text at its offset into the choice's text from offset on:
        a token without log-probabilities (an echoed prompt's first) has null ones; top_logprobs maps the likeliest
        tokens' texts to theirs, the token's own included (vLLM's)."""
        texts = [self.text(t) for t in tokens]
        offsets = [offset + sum(len(t) for t in texts[:i]) for i in range(len(texts))]
        return {"tokens": texts, "token_logprobs": [None if lp is None else lp.logprob for lp in logprobs],
                "top_logprobs": [None if lp is None else self._top_map(lp) for lp in logprobs],
                "text_offset": offsets}

    def chat(self, logprobs: Sequence[Logprobs | None]) -> dict[str, Any]:
        """The chat API's logprobs: each token's text, log-probability and UTF-8 bytes, and its top_logprobs."""
        return {"content": [{**self._entry(lp.token_id, lp.logprob),
                             "top_logprobs": [self._entry(t, v) for t, v in lp.top[:self.num_top]]}
                            for lp in logprobs if lp is not None]}

    def _top_map(self, lp: Logprobs) -> dict[str, float]:
        top = {self.text(t): v for t, v in lp.top[:self.num_top]}
        top.setdefault(self.text(lp.token_id), lp.logprob)
        return top

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self.text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}
