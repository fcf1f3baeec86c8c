"""What the agent reports with every heartbeat: how busy its stages are and what its GPUs read now."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from stratamesh.agent.engine.scheduler import Scheduler
from stratamesh.agent.probe import RawGpu, parse_gpu, read_nvml
from stratamesh.agent.stages import StageHost
from stratamesh.fleet.types import StageLoad, Telemetry

log = logging.getLogger(__name__)


def stage_load(assignment_id: str, scheduler: Scheduler) -> StageLoad:
    """One stage's load as its scheduler and block manager see it."""
    blocks = scheduler.block_manager
    return StageLoad(assignment_id, scheduler.num_running, scheduler.num_waiting,
                     blocks.num_blocks - blocks.num_free_blocks, blocks.num_blocks,
                     blocks.num_prefix_queries_tokens, blocks.num_prefix_hit_tokens)


def tokens_per_s(tokens_now: int, tokens_then: int, elapsed_s: float) -> float:
    """The rate between two readings of a token counter (0 over no time)."""
    return max(tokens_now - tokens_then, 0) / elapsed_s if elapsed_s > 0 else 0.0


class TelemetrySampler:
    """Takes a Telemetry of the agent's stages and GPUs; each sample's rate covers the time since the last."""

    def __init__(self, host: StageHost, inbox_depth: Callable[[], int], has_gpus: bool,
                 read_gpus: Callable[[], list[RawGpu]] = read_nvml, clock: Callable[[], float] = time.time):
        self._host = host
        self._inbox_depth = inbox_depth
        self._has_gpus = has_gpus
        self._read_gpus = read_gpus
        self._clock = clock
        self._last = (clock(), host.num_computed_tokens)

    async def sample(self) -> Telemetry:
        """Reads NVML off the event loop (it can take milliseconds); the rest is counters."""
        gpus = await asyncio.to_thread(self._read_gpus) if self._has_gpus else []
        now, tokens = self._clock(), self._host.num_computed_tokens
        rate = tokens_per_s(tokens, self._last[1], now - self._last[0])
        self._last = (now, tokens)
        engines = list(self._host.engines.items())
        queued = sum(len(s.queue) for _, e in engines for s in e.scheduler.sessions.values())
        return Telemetry(now, self._inbox_depth() + queued, rate,
                         tuple(stage_load(a, e.scheduler) for a, e in engines), tuple(parse_gpu(g) for g in gpus))
