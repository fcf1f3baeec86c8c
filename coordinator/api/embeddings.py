"""/v1/embeddings past validation: the context check, every input embedded concurrently, OpenAI's response body."""

from __future__ import annotations

import asyncio
import base64
import struct
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from stratamesh.coordinator.api.errors import ApiError

# Inputs of one request embedded at once: enough to fill a stage's batch, few enough not to flood its KV cache.
MAX_CONCURRENT_INPUTS = 64

EmbedOne = Callable[[list[int], int], Awaitable[Sequence[float]]]   # (prompt ids, input index) -> vector


def check_context(prompts: Sequence[Sequence[int]], max_context: int) -> None:
    """A 400 context_length_exceeded naming the first input longer than the model's context."""
    for i, ids in enumerate(prompts):
        if len(ids) > max_context:
            raise ApiError(400, f"This model's maximum context length is {max_context} tokens. However, input[{i}] "
                                f"has {len(ids)} tokens. Please reduce the length of the input.",
                           param="input", code="context_length_exceeded")


async def embed_all(embed: EmbedOne, prompts: Sequence[list[int]],
                    max_concurrent: int = MAX_CONCURRENT_INPUTS) -> list[Sequence[float]]:
    """embed(ids, index) of every prompt, in input order, max_concurrent at a time (they batch in the stages);
    the first failure, or the caller's cancellation, cancels the others."""
    slots = asyncio.Semaphore(max_concurrent)

    async def one(index: int, ids: list[int]) -> Sequence[float]:
        async with slots:
            return await embed(ids, index)

    tasks = [asyncio.ensure_future(one(i, ids)) for i, ids in enumerate(prompts)]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()     # a no-op on the finished ones
        await asyncio.gather(*tasks, return_exceptions=True)


def embedding_body(model: str, vectors: Sequence[Sequence[float]], num_prompt_tokens: int,
                   encoding_format: str = "float") -> dict[str, Any]:
    """OpenAI's embeddings response: a list of {"object": "embedding", "index", "embedding"} and the usage."""
    data = [{"object": "embedding", "index": i, "embedding": _encoded(v, encoding_format)}
            for i, v in enumerate(vectors)]
    return {"object": "list", "data": data, "model": model,
            "usage": {"prompt_tokens": num_prompt_tokens, "total_tokens": num_prompt_tokens}}


def _encoded(vector: Sequence[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":   # OpenAI's: the float32 values' little-endian bytes, in base64
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
    return list(vector)
