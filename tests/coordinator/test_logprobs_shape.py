"""OpenAI's logprobs shapes (coordinator/api/logprobs.py, responses.py): names for the tokens, offsets through an
echoed prompt and across streamed chunks, the token's own entry among the completions API's top ones, bytes."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from stratamesh.coordinator.api.generation import Delta
from stratamesh.coordinator.api.logprobs import LogprobsShape
from stratamesh.coordinator.api.responses import ChatFormat, CompletionFormat, Echo
from stratamesh.coordinator.text import Tokenizer
from stratamesh.fleet.sessions import Logprobs


@dataclass
class FinishedRun:
    """What the formats read of a finished TextStream."""

    token_ids: list[int]
    logprobs: list[Logprobs | None]
    prompt_logprobs: tuple[Logprobs, ...] = ()


def lp(token: int, value: float, *top: tuple[int, float]) -> Logprobs:
    return Logprobs(token, value, top)


def test_an_echoed_completion_offsets_every_token_through_the_prompt_streamed_or_whole(chatml_dir: Path) -> None:
    tokenizer = Tokenizer.from_dir(chatml_dir)
    prompt, out = tokenizer.encode("the mesh carries"), tokenizer.encode(" every layer")
    run = FinishedRun(out, [lp(t, -0.5 - i, (t, -0.5 - i), (7, -2.0)) for i, t in enumerate(out)],
                      tuple(lp(t, -1.0 - i, (5, -0.1)) for i, t in enumerate(prompt[1:])))
    shape = LogprobsShape(tokenizer, 2)
    echo = Echo("the mesh carries", tuple(prompt))
    whole = CompletionFormat("c", "m", logprobs=shape, echo=echo).whole([(" every layer", "length", run)], {})
    body = whole["choices"][0]["logprobs"]
    assert whole["choices"][0]["text"] == "the mesh carries every layer"
    assert "".join(body["tokens"]) == "the mesh carries every layer"
    assert body["text_offset"] == [sum(len(t) for t in body["tokens"][:i]) for i in range(len(body["tokens"]))]
    assert body["token_logprobs"][0] is None and body["token_logprobs"][1] == -1.0
    assert body["top_logprobs"][1] == {shape.text(5): -0.1, shape.text(prompt[1]): -1.0}   # its own token too
    streamed = CompletionFormat("c", "m", logprobs=shape, echo=echo)
    chunks = streamed.head(run) + streamed.pieces(Delta(" every", None, tuple(out[:1]), tuple(run.logprobs[:1])))
    chunks += streamed.pieces(Delta(" layer", "length", tuple(out[1:]), tuple(run.logprobs[1:])))
    parts = [c["choices"][0]["logprobs"] for c in chunks]
    assert sum((p["text_offset"] for p in parts), []) == body["text_offset"]
    assert sum((p["token_logprobs"] for p in parts), []) == body["token_logprobs"]
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]


def test_chat_logprobs_name_each_token_with_its_bytes_and_its_likeliest(chatml_dir: Path) -> None:
    tokenizer = Tokenizer.from_dir(chatml_dir)
    out = tokenizer.encode("Héllo")
    run = FinishedRun(out, [lp(t, -0.25, (t, -0.25), (9, -3.0), (11, -4.0)) for t in out])
    body = ChatFormat("c", "m", logprobs=LogprobsShape(tokenizer, 2)).whole([("Héllo", "stop", run)], {})
    content = body["choices"][0]["logprobs"]["content"]
    assert [e["token"] for e in content] == [tokenizer.decode([t], skip_special_tokens=False) for t in out]
    assert all(e["bytes"] == list(e["token"].encode("utf-8")) and len(e["top_logprobs"]) == 2 for e in content)
    assert ChatFormat("c", "m").whole([("Héllo", "stop", run)], {})["choices"][0]["logprobs"] is None
