"""The cost model: how long a unit (a device or a tensor-parallel group) takes for a layer range, and links.

A stage's step is roofline-bound: max(bytes read / memory bandwidth, FLOPs / FLOP/s), plus the framework's
overhead (fixed per step, and per layer: what the agent measured beyond FLOPs and bytes), the serving path's cost
per token of the step (messages in and out, scheduling: what the agents measured while serving) and, in a
tensor-parallel group, two all-reduces of the step's activations per layer. Rank 0 of a group
computes the whole LM head alone, so a group's head is a roofline of its own at rank 0's speed. Every unit
computes in its own dtype: its weights, KV and activations cost that dtype's bytes. Tables are numpy arrays over
(start, end) layer pairs so the planner's dynamic programmes are array operations.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

import numpy as np

from stratamesh.fleet.boxes import Speed
from stratamesh.fleet.sessions import wire_dtype
from stratamesh.partitioner.fleet_snapshot import Device, FleetSnapshot, Link, shards
from stratamesh.partitioner.plan import PlanRequest
from stratamesh.partitioner.profile import DTYPE_BYTES, TOKEN_ID_BYTES, WEIGHT_BYTES, ModelProfile

TP_EFFICIENCY = 0.9        # of degree x the slowest rank's FLOP/s and bandwidth, after the shards' imbalance
TP_MIN_BANDWIDTH = 20e9    # bytes/s: slower intra-node links are not worth sharding a layer over


@dataclass(frozen=True, slots=True)
class Unit:
    """What serves one stage: one device, or a tensor-parallel group of devices on one node (rank 0 first)."""

    devices: tuple[Device, ...]
    speed: Speed                   # effective for the layers: a group's slowest FLOP/s and slowest bandwidth, scaled
    head_speed: Speed              # rank 0's own: it alone computes the LM head
    memory_bytes: int              # per rank: the smallest device's
    overhead_s: float
    allreduce_s: float             # per layer per step (0 for one device)
    layer_overhead_s: float = 0.0  # per layer per step: the framework's cost beyond FLOPs and bytes
    token_overhead_s: float = 0.0  # per token of a step: the serving path's cost beyond the layers
    weights: str = ""              # what its matrices, LM head and embedding are stored in where not dtype: int8/int4
    # the device's other backends for the same dtype and weights (a CPU with torch and ONNX Runtime): a range is
    # priced at the fastest of the unit and these (StageTables.best)
    options: tuple[Unit, ...] = ()

    @property
    def id(self) -> str:
        return "+".join(d.id for d in self.devices)

    @property
    def lead(self) -> Device:
        return self.devices[0]

    @property
    def degree(self) -> int:
        return len(self.devices)

    @property
    def dtype(self) -> str:
        return self.speed.dtype

    @property
    def weight_dtype(self) -> str:
        return self.weights or self.dtype

    @property
    def total_memory_bytes(self) -> int:
        return self.degree * self.memory_bytes


def single_unit(device: Device, profile: ModelProfile) -> Unit | None:
    """The device alone in its dtype (the profile's when it names none), or None if it measured nothing for it.
    For a profile of quantized weights (ModelProfile.weights), a device that measured its speed with them holds
    and computes them so; one that did not holds the model in its dtype. Of several backends it measured for those,
    the unit is the one of most FLOP/s, the others its options."""
    dtype = device.dtype or profile.dtype
    if device.speed(dtype) is None:
        return None
    weights = profile.weights if profile.weights and device.speed(profile.weights) is not None else ""
    units = [_device_unit(device, replace(s, dtype=dtype), weights) for s in device.speeds_for(weights or dtype)]
    return replace(units[0], options=tuple(units[1:]))


def _device_unit(device: Device, speed: Speed, weights: str) -> Unit:
    """One device computing with speed (and its overheads, where the backend measured its own)."""
    step_s = device.step_overhead_s if speed.step_overhead_s is None else speed.step_overhead_s
    layer_s = device.layer_overhead_s if speed.layer_overhead_s is None else speed.layer_overhead_s
    return Unit((device,), speed, speed, device.memory_bytes, step_s, 0.0, layer_s, device.token_overhead_s, weights)


def group_link(fleet: FleetSnapshot, devices: tuple[Device, ...]) -> Link:
    """The weakest link inside a group: the lowest bandwidth and the longest round trip over its pairs."""
    pairs = [fleet.link(a, b) for i, a in enumerate(devices) for b in devices[i + 1:]]
    return Link("", "", min(p.bandwidth for p in pairs), max(p.rtt_s for p in pairs))


def group_unit(members: tuple[Unit, ...], link: Link, profile: ModelProfile, request: PlanRequest) -> Unit | None:
    """Single units (single_unit) as one tensor-parallel group over its weakest link (group_link), or None: the
    degree must divide the heads and the KV heads, the link be fast enough, and every rank compute on one
    backend in one dtype. The layers run at the lowest FLOP/s and the lowest bandwidth of any rank (each its own
    minimum) times degree x TP_EFFICIENCY; rank 0 computes the LM head alone, at its own speed."""
    degree, lead = len(members), members[0]
    if profile.num_heads % degree or profile.num_kv_heads % degree or link.bandwidth < TP_MIN_BANDWIDTH:
        return None
    if any(m.weights for m in members):     # quantized weights are for single-process stages (StageSpec.quantize)
        members = tuple(_unquantized(m, profile) for m in members)
        if any(m is None for m in members):
            return None
    members = tuple(next((u for u in (m, *m.options) if shards(u.speed.backend)), None) for m in members)
    if any(m is None for m in members):
        return None
    lead = members[0]
    if len({(m.speed.backend, m.dtype) for m in members}) > 1:
        return None
    scale = degree * TP_EFFICIENCY
    speed = Speed(lead.speed.backend, lead.dtype, scale * min(m.speed.flops for m in members),
                  scale * min(m.speed.mem_bandwidth for m in members))
    # ring all-reduce of the step's activations, twice per layer (after attention and after the MLP)
    payload = request.step_tokens * profile.hidden_size * DTYPE_BYTES[lead.dtype]
    one = 2 * (degree - 1) / degree * payload / link.bandwidth + 2 * (degree - 1) * link.rtt_s / 2
    return Unit(tuple(m.lead for m in members), speed, lead.head_speed, min(m.memory_bytes for m in members),
                max(m.overhead_s for m in members), 2 * one, max(m.layer_overhead_s for m in members),
                lead.token_overhead_s)      # (rank 0 alone talks to the neighbouring stages)


def _unquantized(unit: Unit, profile: ModelProfile) -> Unit | None:
    """A single unit holding the model in its dtype rather than quantized (None if it measured no speed for it)."""
    return single_unit(unit.lead, replace(profile, weights=""))


class Rates(NamedTuple):
    """What prices one unit's step, as scalars or as arrays over units."""

    bytes_per_param: Any      # of the weights
    bytes_per_kv: Any         # of a K or V entry (the unit's dtype)
    bandwidth: Any            # the layers' bytes/s and FLOP/s
    flop_rate: Any
    head_bandwidth: Any       # rank 0's, for a group's LM head
    head_flop_rate: Any
    overhead_s: Any
    allreduce_s: Any          # per layer
    grouped: Any              # a tensor-parallel group: its head is priced apart, on rank 0
    layer_overhead_s: Any     # per layer
    token_overhead_s: Any     # per token of the step


def _rates(unit: Unit) -> Rates:
    return Rates(WEIGHT_BYTES[unit.weight_dtype], DTYPE_BYTES[unit.dtype], unit.speed.mem_bandwidth,
                 unit.speed.flops, unit.head_speed.mem_bandwidth, unit.head_speed.flops, unit.overhead_s,
                 unit.allreduce_s, unit.degree > 1, unit.layer_overhead_s, unit.token_overhead_s)


class StageTables:
    """Per unit, over layer ranges [a, b): predicted step time (inf where it does not fit) and memory per rank.

    Weights and KV are counted in values (parameters, K and V entries) and priced in each unit's dtype; the
    memory table of each (dtype, degree) is built when first asked for (a fleet has few)."""

    def __init__(self, profile: ModelProfile, request: PlanRequest) -> None:
        self.profile, self.request = profile, request
        num = profile.num_layers
        a, b = np.meshgrid(np.arange(num + 1), np.arange(num + 1), indexing="ij")   # a: start, b: end
        self.starts, self.ends, self.valid = a, b, b > a
        self.last = b == num
        kv_values = [k // profile.bytes_per_param for k in profile.layer_kv_bytes_per_token]
        self.kv_values = _prefix(kv_values)
        # the context tokens a step's token reads in each layer: a sliding window's at most
        read_ctx = [min(request.mean_context, w) if w else request.mean_context for w in profile.layer_windows]
        flops = _prefix([f + n * c for f, c, n in
                         zip(profile.layer_flops_per_token, profile.layer_attn_flops_per_ctx, read_ctx, strict=True)])
        self.held_params = self._span(_prefix(profile.layer_params))     # weights a stage holds
        self.read_params = self._span(_prefix(profile.layer_read_params(request.step_tokens)))   # ... a step reads
        self.read_kv = request.step_tokens * self._span(_prefix([k * n for k, n in zip(kv_values, read_ctx)]))
        self.flops = self._span(flops)                                                   # per token
        # Memory in values: what a group's ranks share (weights and KV of the layers) and what each holds whole
        self._kv_reserve_values = request.concurrency * request.context_len * self._span(self.kv_values)
        first = a == 0
        head = np.where(first & profile.tied_embeddings, profile.head_params - profile.embed_params,
                        profile.head_params)
        self._embed_values, self._head_values = first * profile.embed_params, self.last * head
        self._memory: dict[tuple[str, int, str], np.ndarray] = {}

    def _span(self, prefix: np.ndarray) -> np.ndarray:
        """prefix summed over every range [a, b): [L+1, L+1]."""
        return prefix[self.ends] - prefix[self.starts]

    def memory_at(self, dtype: str, degree: int = 1, weights: str = "") -> np.ndarray:
        """Bytes [L+1, L+1] one rank of a degree-way group in dtype holds for [a, b): its share of the layers'
        weights and KV reserve, and the whole embedding (first stage) and final norm + LM head (last stage).
        weights: what the layers' matrices, the LM head and the embedding are stored in where not dtype ("int8",
        "int4": their bytes with their scales, fleet.stages.QUANTIZED_BYTES)."""
        key = (dtype, degree, weights)
        if key not in self._memory:
            bpp, wbpp = DTYPE_BYTES[dtype], WEIGHT_BYTES[weights or dtype]
            shared = wbpp * self.held_params + bpp * self._kv_reserve_values
            self._memory[key] = np.ceil(shared / degree + wbpp * (self._embed_values + self._head_values))
        return self._memory[key]

    def memory_of(self, unit: Unit) -> np.ndarray:
        """Bytes [L+1, L+1] each rank of unit holds for [a, b) (memory_at)."""
        return self.memory_at(unit.dtype, unit.degree, unit.weights)

    def kv_reserve(self, unit: Unit, start: int, end: int) -> int:
        """Bytes of KV each rank of unit reserves for [start, end): concurrency x context_len tokens, its share
        of the KV heads."""
        req = self.request
        values = req.concurrency * req.context_len * round(self.kv_values[end] - self.kv_values[start])
        return -(-values * DTYPE_BYTES[unit.dtype] // unit.degree)

    def time_of(self, unit: Unit, start: int, end: int) -> float:
        """Step time of unit serving [start, end), ignoring memory (the scalar form of times)."""
        return min(self._time_of(u, start, end) for u in (unit, *unit.options))

    def best(self, unit: Unit, start: int, end: int) -> Unit:
        """Of unit and its options, the one fastest on [start, end) (the unit itself on a tie)."""
        return min((unit, *unit.options), key=lambda u: self._time_of(u, start, end))

    def _time_of(self, unit: Unit, start: int, end: int) -> float:
        return float(self._roofline(_rates(unit), self.read_params[start, end], self.read_kv[start, end],
                                    self.flops[start, end], end == self.profile.num_layers, end - start))

    def times(self, unit: Unit) -> np.ndarray:
        """Step time [L+1, L+1] of unit (at its fastest option) serving [a, b); inf where a >= b or it does not fit
        (its options have its dtype, weights and memory)."""
        t = np.minimum.reduce([self._roofline(_rates(u), self.read_params, self.read_kv, self.flops, self.last,
                                              self.ends - self.starts) for u in (unit, *unit.options)])
        fits = self.valid & (self.memory_of(unit) <= unit.memory_bytes)
        return np.where(fits, t, np.inf)

    def times_of(self, units: Sequence[Unit], start: int, end: int) -> np.ndarray:
        """Step time of each unit (at its fastest option) serving [start, end), ignoring memory: one array operation
        for many units."""
        every = [(i, u) for i, unit in enumerate(units) for u in (unit, *unit.options)]
        rates = Rates(*np.array([_rates(u) for _, u in every], dtype=np.float64).reshape(-1, len(Rates._fields)).T)
        t = self._roofline(rates, self.read_params[start, end], self.read_kv[start, end], self.flops[start, end],
                           end == self.profile.num_layers, end - start)
        out = np.full(len(units), np.inf)
        np.minimum.at(out, np.array([i for i, _ in every], dtype=np.intp), t)
        return out

    def _roofline(self, rates: Rates, read_params: Any, read_kv: Any, flops: Any, last: Any, layers: Any) -> Any:
        """max(bytes read / bandwidth, FLOPs / FLOP/s) + overheads + all-reduces, over scalars or arrays alike.

        read_params, read_kv: weights and KV entries one step reads over the range(s); flops: per token; last:
        the range ends at the last layer, whose LM head one device prices in one roofline with its layers and a
        group prices apart, at rank 0's speed."""
        p, tokens = self.profile, self.request.step_tokens
        read, work = rates.bytes_per_param * read_params + rates.bytes_per_kv * read_kv, tokens * flops
        head_read, head_work = last * rates.bytes_per_param * p.head_params, last * tokens * p.head_flops_per_token
        together = np.maximum((read + head_read) / rates.bandwidth, (work + head_work) / rates.flop_rate)
        apart = (np.maximum(read / rates.bandwidth, work / rates.flop_rate)
                 + np.maximum(head_read / rates.head_bandwidth, head_work / rates.head_flop_rate))
        return (np.where(rates.grouped, apart, together) + rates.overhead_s + tokens * rates.token_overhead_s
                + layers * (rates.allreduce_s + rates.layer_overhead_s))


def hop_s(link: Link, payload_bytes: float) -> float:
    """One message over a link: half a round trip plus the transfer."""
    return link.rtt_s / 2 + payload_bytes / link.bandwidth


class LinkCosts:
    """Transfer and hop times between units and to/from the origin, for one step's payloads."""

    def __init__(self, fleet: FleetSnapshot, profile: ModelProfile, request: PlanRequest) -> None:
        self.fleet = fleet
        self.activation_values = request.step_tokens * profile.hidden_size
        self.token_bytes = request.step_tokens * TOKEN_ID_BYTES

    def payload_bytes(self, wire: str) -> int:
        """One step's activations, raw in dtype wire."""
        return self.activation_values * DTYPE_BYTES[wire]

    def between(self, a: Unit, b: Unit) -> tuple[float, float]:
        """(transfer s, hop s) of activations from a's rank 0 to b's, in the dtype they travel in (wire_dtype)."""
        link = self.fleet.link(a.lead, b.lead)
        payload = self.payload_bytes(wire_dtype(a.dtype, b.dtype))
        return payload / link.bandwidth, hop_s(link, payload)

    def origin(self, unit: Unit) -> tuple[float, float]:
        """(transfer s, hop s) of token ids between the origin and unit."""
        link = self.fleet.link(None, unit.lead)
        return self.token_bytes / link.bandwidth, hop_s(link, self.token_bytes)


def _prefix(values: Sequence[float]) -> np.ndarray:
    return np.concatenate(([0.0], np.cumsum(np.asarray(values, dtype=np.float64))))
