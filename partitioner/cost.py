"""The cost model: how long a unit (a device or a tensor-parallel group) takes for a layer range, and links.

A stage's step is roofline-bound: max(bytes read / memory bandwidth, FLOPs / FLOP/s), plus a fixed per-step
overhead and, in a tensor-parallel group, two all-reduces of the step's activations per layer. Tables are
numpy arrays over (start, end) layer pairs so the planner's dynamic programmes are array operations.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from stratamesh.partitioner.fleet import Device, FleetSnapshot, Link, Speed
from stratamesh.partitioner.plan import PlanRequest
from stratamesh.partitioner.profile import TOKEN_ID_BYTES, ModelProfile

TP_EFFICIENCY = 0.9        # of a group's summed FLOP/s and bandwidth, after the shards' imbalance
TP_MIN_BANDWIDTH = 20e9    # bytes/s: slower intra-node links are not worth sharding a layer over


@dataclass(frozen=True, slots=True)
class Unit:
    """What serves one stage: one device, or a tensor-parallel group of devices on one node."""

    devices: tuple[Device, ...]
    speed: Speed                   # effective: the group's summed FLOP/s and bandwidth
    memory_bytes: int              # the group's: degree x its smallest device
    overhead_s: float
    allreduce_s: float             # per layer per step (0 for one device)

    @property
    def id(self) -> str:
        return "+".join(d.id for d in self.devices)

    @property
    def lead(self) -> Device:
        return self.devices[0]

    @property
    def degree(self) -> int:
        return len(self.devices)


def single_unit(device: Device, profile: ModelProfile) -> Unit | None:
    """The device alone, or None if it measured nothing for the profile's dtype."""
    speed = device.speed(profile.dtype)
    if speed is None:
        return None
    return Unit((device,), speed, device.memory_bytes, device.step_overhead_s, 0.0)


def group_link(fleet: FleetSnapshot, devices: tuple[Device, ...]) -> Link:
    """The weakest link inside a group: the lowest bandwidth and the longest round trip over its pairs."""
    pairs = [fleet.link(a, b) for i, a in enumerate(devices) for b in devices[i + 1:]]
    return Link("", "", min(p.bandwidth for p in pairs), max(p.rtt_s for p in pairs))


def group_unit(members: tuple[Unit, ...], link: Link, profile: ModelProfile, request: PlanRequest) -> Unit | None:
    """Single units (single_unit) as one tensor-parallel group over its weakest link (group_link), or None:
    the degree must divide the heads and the KV heads, and the link be fast enough."""
    degree = len(members)
    if profile.num_heads % degree or profile.num_kv_heads % degree or link.bandwidth < TP_MIN_BANDWIDTH:
        return None
    slowest = min((m.speed for m in members), key=lambda s: (s.flops, s.mem_bandwidth))
    speed = Speed(slowest.backend, profile.dtype, degree * slowest.flops * TP_EFFICIENCY,
                  degree * slowest.mem_bandwidth * TP_EFFICIENCY)
    # ring all-reduce of the step's activations, twice per layer (after attention and after the MLP)
    payload = request.step_tokens * profile.activation_bytes_per_token
    one = 2 * (degree - 1) / degree * payload / link.bandwidth + 2 * (degree - 1) * link.rtt_s / 2
    memory = degree * min(m.memory_bytes for m in members)
    return Unit(tuple(m.lead for m in members), speed, memory, max(m.overhead_s for m in members), 2 * one)


class StageTables:
    """Per unit, over layer ranges [a, b): predicted step time (inf where it does not fit) and memory."""

    def __init__(self, profile: ModelProfile, request: PlanRequest) -> None:
        self.profile, self.request = profile, request
        bpp, num = profile.bytes_per_param, profile.num_layers
        self.param_bytes = _prefix([p * bpp for p in profile.layer_params])
        self.kv_bytes = _prefix(profile.layer_kv_bytes_per_token)
        flops = [f + request.mean_context * a
                 for f, a in zip(profile.layer_flops_per_token, profile.layer_attn_flops_per_ctx, strict=True)]
        self.flops = _prefix(flops)
        a, b = np.meshgrid(np.arange(num + 1), np.arange(num + 1), indexing="ij")   # a: start, b: end
        self.starts, self.ends, self.valid = a, b, b > a
        self.memory = self._memory()                                                    # [L+1, L+1] bytes

    def _span(self, prefix: np.ndarray) -> np.ndarray:
        """prefix summed over every range [a, b): [L+1, L+1]."""
        return prefix[self.ends] - prefix[self.starts]

    def _memory(self) -> np.ndarray:
        p, req, span = self.profile, self.request, self._span
        kv_reserve = req.concurrency * req.context_len * span(self.kv_bytes)
        first, last = self.starts == 0, self.ends == p.num_layers
        head = np.where(first & p.tied_embeddings, p.head_bytes - p.embed_bytes, p.head_bytes)
        return span(self.param_bytes) + kv_reserve + first * p.embed_bytes + last * head

    def kv_reserve(self, start: int, end: int) -> int:
        req = self.request
        return int(req.concurrency * req.context_len * (self.kv_bytes[end] - self.kv_bytes[start]))

    def time_of(self, unit: Unit, start: int, end: int) -> float:
        """Step time of unit serving [start, end), ignoring memory (the scalar form of times)."""
        between = lambda prefix: prefix[end] - prefix[start]   # noqa: E731
        return float(self._roofline(_rates(unit), between, end == self.profile.num_layers, end - start))

    def times(self, unit: Unit) -> np.ndarray:
        """Step time [L+1, L+1] of unit serving [a, b); inf where a >= b or it does not fit."""
        t = self._roofline(_rates(unit), self._span, self.ends == self.profile.num_layers, self.ends - self.starts)
        fits = self.valid & (self.memory <= unit.memory_bytes)
        return np.where(fits, t, np.inf)

    def times_of(self, units: Sequence[Unit], start: int, end: int) -> np.ndarray:
        """Step time of each unit serving [start, end), ignoring memory: one array operation for many units."""
        rates = np.array([_rates(u) for u in units], dtype=np.float64).reshape(-1, 4).T
        between = lambda prefix: prefix[end] - prefix[start]   # noqa: E731
        return self._roofline(tuple(rates), between, end == self.profile.num_layers, end - start)

    def _roofline(self, rates: tuple[Any, Any, Any, Any], span: Callable[[np.ndarray], Any], last: Any,
                  layers: Any) -> Any:
        """max(bytes read / bandwidth, FLOPs / FLOP/s) + overhead + all-reduces, over scalars or arrays alike.

        rates: (bandwidth, FLOP/s, overhead, all-reduce per layer) of one unit, or arrays over units;
        span(prefix) sums a per-layer prefix over the range(s); last: the range ends at the last layer."""
        bandwidth, flop_rate, overhead, allreduce = rates
        p, tokens = self.profile, self.request.step_tokens
        read = span(self.param_bytes) + tokens * self.request.mean_context * span(self.kv_bytes) + last * p.head_bytes
        flops = tokens * (span(self.flops) + last * p.head_flops_per_token)
        return np.maximum(read / bandwidth, flops / flop_rate) + overhead + layers * allreduce


def _rates(unit: Unit) -> tuple[float, float, float, float]:
    return unit.speed.mem_bandwidth, unit.speed.flops, unit.overhead_s, unit.allreduce_s


def hop_s(link: Link, payload_bytes: float) -> float:
    """One message over a link: half a round trip plus the transfer."""
    return link.rtt_s / 2 + payload_bytes / link.bandwidth


class LinkCosts:
    """Transfer and hop times between units and to/from the origin, for one step's payloads."""

    def __init__(self, fleet: FleetSnapshot, profile: ModelProfile, request: PlanRequest) -> None:
        self.fleet = fleet
        self.activation_bytes = request.step_tokens * profile.activation_bytes_per_token
        self.token_bytes = request.step_tokens * TOKEN_ID_BYTES

    def between(self, a: Unit, b: Unit) -> tuple[float, float]:
        """(transfer s, hop s) of activations from a's rank 0 to b's."""
        link = self.fleet.link(a.lead, b.lead)
        return self.activation_bytes / link.bandwidth, hop_s(link, self.activation_bytes)

    def origin(self, unit: Unit) -> tuple[float, float]:
        """(transfer s, hop s) of token ids between the origin and unit."""
        link = self.fleet.link(None, unit.lead)
        return self.token_bytes / link.bandwidth, hop_s(link, self.token_bytes)


def _prefix(values: list[float] | tuple[float, ...]) -> np.ndarray:
    return np.concatenate(([0.0], np.cumsum(np.asarray(values, dtype=np.float64))))
