"""What the planner is asked (PlanRequest) and what it answers (Plan): values with a stable JSON form."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from stratamesh.fleet.errors import InvalidInput

OBJECTIVES = ("throughput", "latency")


@dataclass(frozen=True, slots=True)
class PlanRequest:
    """The objective, the workload a plan must hold, and the constraints on where stages may go.

    throughput: the smallest bottleneck (slowest stage compute or link transfer of one step), ties broken
    by latency; latency: the smallest step (every stage plus the K+1 hops from and back to the origin).
    A step is a micro-batch of concurrency tokens (one per sequence) at an average context of context_len / 2;
    every stage reserves KV for one micro-batch (concurrency x context_len tokens). A pipeline keeps every
    stage busy only with several micro-batches in flight: the plan says how many the memory left holds."""

    objective: str = "throughput"
    context_len: int = 2048
    concurrency: int = 8
    first_site: str | None = None          # data residency: the first stage (it sees token ids) stays here
    last_site: str | None = None           # ... and the last (it produces them)
    exclude: frozenset[str] = frozenset()  # device ids never to use
    max_stages: int | None = None
    num_stages: int | None = None          # exactly this many stages (an operator's --stages)
    max_replicas: int = 1                  # pipelines; more only while a further one fits in what is left
    tensor_parallel: bool = True           # group GPUs of one node with fast links

    def __post_init__(self) -> None:
        if self.objective not in OBJECTIVES:
            raise InvalidInput(f"objective {self.objective!r} is not one of {OBJECTIVES}")
        if self.context_len < 1 or self.concurrency < 1 or self.max_replicas < 1:
            raise InvalidInput("context_len, concurrency and max_replicas must be at least 1")
        if self.max_stages is not None and self.max_stages < 1:
            raise InvalidInput("max_stages must be at least 1")
        if self.num_stages is not None and not 1 <= self.num_stages <= (self.max_stages or self.num_stages):
            raise InvalidInput("num_stages must be at least 1 and at most max_stages")

    @property
    def stage_limit(self) -> int | None:
        """The most stages a pipeline may have."""
        return self.num_stages or self.max_stages

    @property
    def step_tokens(self) -> int:
        return self.concurrency

    @property
    def mean_context(self) -> float:
        return self.context_len / 2


@dataclass(frozen=True, slots=True)
class PlannedStage:
    """Layers [start_layer, end_layer) on one device or one tensor-parallel group (rank 0 first)."""

    devices: tuple[str, ...]
    start_layer: int
    end_layer: int
    backend: str
    dtype: str
    compute_s: float                # predicted time of one step
    send_s: float                   # predicted transfer of its output to the next stage (or the origin)
    memory_bytes: int               # per rank: its share of the weights and KV reserve, the embedding and head whole
    headroom_bytes: int             # usable memory left on the tightest device of the group
    kv_budget_bytes: int            # the KV reserve inside memory_bytes (per rank)
    weights: str = ""               # what its matrices are stored in where not dtype: "int8" (StageSpec.quantize)
    codec: str = ""                 # how its output crosses to the next stage: "" raw (wire_dtype), "float16", "int8"
    send_bytes: int = 0             # its output of one step, raw in the dtype it travels in (0 on the last stage)

    @property
    def num_layers(self) -> int:
        return self.end_layer - self.start_layer

    @property
    def tp_degree(self) -> int:
        return len(self.devices)


@dataclass(frozen=True, slots=True)
class Pipeline:
    """One replica: stages in order, its bottleneck and its step time."""

    stages: tuple[PlannedStage, ...]
    bottleneck_s: float             # slowest stage compute or link transfer: one step per this, pipelined
    step_s: float                   # one token of one sequence through every stage and hop
    bottleneck: str                 # what it is, in words
    micro_batches: int = 1          # of concurrency sequences in flight: as many as every stage's KV room holds
    tokens_per_s: float = 0.0       # predicted: concurrency x min(micro_batches / step_s, 1 / bottleneck_s)

    @property
    def devices(self) -> tuple[str, ...]:
        return tuple(d for s in self.stages for d in s.devices)

    def objective_s(self, objective: str) -> float:
        """What an objective minimises: the bottleneck (throughput) or the step time (latency)."""
        return self.bottleneck_s if objective == "throughput" else self.step_s


@dataclass(frozen=True, slots=True)
class Plan:
    """Replicas of pipelines for one model, what they are predicted to do, and why this one."""

    model: str
    objective: str
    pipelines: tuple[Pipeline, ...]
    tokens_per_s: float             # predicted, all replicas together
    reason: str
    layers_moved: int = 0           # on a re-plan: layers whose device changed
    search: str = ""                # how the order was found: "exact", "heuristic" or "kept"

    @property
    def objective_s(self) -> float:
        """The value minimised: bottleneck (throughput) or step time (latency) of the first replica."""
        return self.pipelines[0].objective_s(self.objective)

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model, "objective": self.objective, "tokens_per_s": _round(self.tokens_per_s),
            "reason": self.reason, "layers_moved": self.layers_moved, "search": self.search,
            "pipelines": [{
                "bottleneck_s": _round(p.bottleneck_s), "step_s": _round(p.step_s), "bottleneck": p.bottleneck,
                "micro_batches": p.micro_batches, "tokens_per_s": _round(p.tokens_per_s),
                "stages": [{
                    "devices": list(s.devices), "start_layer": s.start_layer, "end_layer": s.end_layer,
                    "backend": s.backend, "dtype": s.dtype, "compute_s": _round(s.compute_s),
                    "send_s": _round(s.send_s), "memory_bytes": s.memory_bytes,
                    "headroom_bytes": s.headroom_bytes, "kv_budget_bytes": s.kv_budget_bytes, "codec": s.codec,
                } for s in p.stages],
            } for p in self.pipelines],
        }

    def to_json(self) -> str:
        """Stable: sorted keys, floats rounded to 6 significant digits."""
        return json.dumps(self.to_dict(), sort_keys=True, indent=2)


def _round(x: float) -> float:
    return float(f"{x:.6g}")
