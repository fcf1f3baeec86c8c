"""What the agent reports with every heartbeat: how busy its stages are and what its GPUs read now."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping

from stratamesh.agent.engine.scheduler import Scheduler
from stratamesh.agent.engine.stage_engine import SpeculationCounts
from stratamesh.agent.observer import DecodeSpeed
from stratamesh.agent.probe import RawGpu, parse_gpu, read_nvml
from stratamesh.agent.stages import StageHost
from stratamesh.fleet.boxes import StageLoad, Telemetry
from stratamesh.kernels.ops.moe import ExpertLoad

log = logging.getLogger(__name__)

# The serving path's CPU per token is measured over windows of at least this many step tokens, so that what the
# process spends regardless of load (heartbeats, the control stream, zeroconf) is small beside it.
SERVING_WINDOW_TOKENS = 512


def stage_load(assignment_id: str, scheduler: Scheduler, decode: DecodeSpeed | None = None,
               speculation: SpeculationCounts | None = None, experts: ExpertLoad | None = None) -> StageLoad:
    """One stage's load as its scheduler and block manager see it, its recent decode steps' speed, (a last
    stage) what its verifications of drafted tokens kept, and (a mixture of experts') where its routers sent
    tokens."""
    blocks, decode, spec = scheduler.block_manager, decode or DecodeSpeed(), speculation or SpeculationCounts()
    return StageLoad(assignment_id, scheduler.num_running, scheduler.num_waiting,
                     blocks.num_blocks - blocks.num_free_blocks, blocks.num_blocks,
                     blocks.num_prefix_queries_tokens, blocks.num_prefix_hit_tokens, decode.step_s, decode.roofline,
                     spec.num_draft_tokens, spec.num_accepted_tokens,
                     tuple(experts.tokens) if experts else (), experts.last_imbalance if experts else 0.0)


def tokens_per_s(tokens_now: int, tokens_then: int, elapsed_s: float) -> float:
    """The rate between two readings of a token counter (0 over no time)."""
    return max(tokens_now - tokens_then, 0) / elapsed_s if elapsed_s > 0 else 0.0


class ServingCpu:
    """The CPU seconds per token of a step the agent spends outside its stages' layers (receiving, scheduling,
    sending: the serving path): the process's CPU time less the layers' (StageHost.layers_cpu_s), over a window of
    SERVING_WINDOW_TOKENS tokens or more. A reading that finds no token stepped since the last starts the window
    again, so an idle spell's CPU is not charged to the tokens after it. 0 until a first window fills."""

    def __init__(self, host: StageHost, process_cpu: Callable[[], float] = time.process_time):
        self._host = host
        self._process_cpu = process_cpu
        self._window = self._last = self._reading()
        self.per_token_s = 0.0

    def _reading(self) -> tuple[float, float, int]:
        return self._process_cpu(), self._host.layers_cpu_s, self._host.num_step_tokens

    def update(self) -> float:
        """Takes a reading; returns the newest window's figure."""
        now = self._reading()
        if now[2] == self._last[2]:
            self._window = now
        self._last = now
        cpu, layers, tokens = (b - a for a, b in zip(self._window, now, strict=True))
        if tokens >= SERVING_WINDOW_TOKENS:
            self.per_token_s = max(cpu - layers, 0.0) / tokens
            self._window = now
        return self.per_token_s


class TelemetrySampler:
    """Takes a Telemetry of the agent's stages and GPUs; each sample's rate covers the time since the last."""

    def __init__(self, host: StageHost, inbox_depth: Callable[[], int], has_gpus: bool,
                 read_gpus: Callable[[], list[RawGpu]] = read_nvml, clock: Callable[[], float] = time.time,
                 decode: Mapping[str, DecodeSpeed] | None = None):
        """decode: each stage's decode speed by assignment id (StageObserver.decode)."""
        self._host = host
        self._decode = decode if decode is not None else {}
        self._inbox_depth = inbox_depth
        self._has_gpus = has_gpus
        self._read_gpus = read_gpus
        self._clock = clock
        self._last = (clock(), host.num_computed_tokens)
        self._serving = ServingCpu(host)

    async def sample(self) -> Telemetry:
        """Reads NVML off the event loop (it can take milliseconds); the rest is counters."""
        gpus = await asyncio.to_thread(self._read_gpus) if self._has_gpus else []
        now, tokens = self._clock(), self._host.num_computed_tokens
        rate = tokens_per_s(tokens, self._last[1], now - self._last[0])
        self._last = (now, tokens)
        engines = list(self._host.engines.items())
        queued = sum(len(s.queue) for _, e in engines for s in e.scheduler.sessions.values())
        return Telemetry(now, self._inbox_depth() + queued, rate,
                         tuple(stage_load(a, e.scheduler, self._decode.get(a), e.speculation, e.expert_load)
                               for a, e in engines),
                         tuple(parse_gpu(g) for g in gpus),
                         self._serving.update())
