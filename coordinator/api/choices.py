"""A request's choices: n (or best_of) generations of one prompt, each a TextStream of its own.

The first starts alone; the others start once it has its first token, when the stages' prefix caches hold the
prompt's full blocks: they prefill only the last partial block (one prefill of the prompt, as vLLM's n shares its
blocks). Each draws with a seed of its own (the request's plus its index, where it names one). Collected whole, the
best_of candidates are ranked by the sum of their tokens' log-probabilities and the best n returned; streamed, the
choices' deltas are interleaved as they come, each with its index."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Sequence

from stratamesh.coordinator.api.generation import Delta, TextStream
from stratamesh.coordinator.serving.request import Request

INT64 = 2 ** 63


def choice_request(request: Request, index: int) -> Request:
    """The request of choice index: the first is the request itself; each other a request id and seed of its own."""
    if index == 0:
        return request
    seed = request.params.seed
    params = dataclasses.replace(request.params, seed=None if seed is None else (seed + index + INT64) % 2 ** 64
                                 - INT64)
    return dataclasses.replace(request, request_id=f"{request.request_id}-{index}", params=params)


class Choices:
    """The runs of one request's candidates, in index order; n of them are returned."""

    def __init__(self, runs: Sequence[TextStream], n: int) -> None:
        assert 1 <= n <= len(runs)
        self.runs = list(runs)
        self.n = n

    async def start(self) -> None:
        """Waits for every run's first token: the first's before the others start (see the module)."""
        await self.runs[0].start()
        if len(self.runs) > 1:
            await asyncio.gather(*(run.start() for run in self.runs[1:]))

    async def collect(self) -> list[tuple[str, str, TextStream]]:
        """The n choices returned, each (text, finish reason, run): the runs in order, or (best_of) the n whose
        tokens are likeliest under the model, likeliest first."""
        results = await asyncio.gather(*(run.collect() for run in self.runs))
        order = list(range(len(self.runs)))
        if self.n < len(self.runs):
            order.sort(key=lambda i: -sum(lp.logprob for lp in self.runs[i].logprobs if lp is not None))
        return [(*results[i], self.runs[i]) for i in order[:self.n]]

    async def deltas(self) -> AsyncIterator[tuple[int, Delta]]:
        """Every run's deltas, each with its run's index, as they come; the first error raises."""
        queue: asyncio.Queue[tuple[int, Delta | None, BaseException | None]] = asyncio.Queue()

        async def pump(index: int, run: TextStream) -> None:
            try:
                async for delta in run.deltas():
                    await queue.put((index, delta, None))
                await queue.put((index, None, None))
            except Exception as e:
                await queue.put((index, None, e))

        tasks = [asyncio.create_task(pump(i, run)) for i, run in enumerate(self.runs)]
        try:
            ended = 0
            while ended < len(self.runs):
                index, delta, error = await queue.get()
                if error is not None:
                    raise error
                if delta is None:
                    ended += 1
                else:
                    yield index, delta
        finally:
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task

    async def aclose(self) -> None:
        for run in self.runs:
            await run.aclose()

    def usage(self) -> dict[str, object]:
        """The prompt once, every candidate's tokens (best_of's unreturned ones too), the first's cached tokens."""
        first = self.runs[0]
        prompt, completion = len(first.request.prompt_ids), sum(run.num_completion_tokens for run in self.runs)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": first.cached_tokens}}
