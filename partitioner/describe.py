"""Plans and failures in plain words."""

from __future__ import annotations

from typing import TYPE_CHECKING

from stratamesh.partitioner.fleet_snapshot import FleetSnapshot
from stratamesh.partitioner.plan import Plan, PlanRequest
from stratamesh.partitioner.profile import DTYPE_BYTES, ModelProfile

if TYPE_CHECKING:
    from stratamesh.partitioner.cost import StageTables


def size(num_bytes: float) -> str:
    """Bytes in the largest decimal unit that keeps the number at least 1: "3.1 GB", "40.2 MB", "512 B"."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(num_bytes) >= scale:
            return f"{num_bytes / scale:.1f} {unit}"
    return f"{num_bytes:.0f} B"


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms"


def reason(plan: Plan, request: PlanRequest) -> str:
    """Why this plan, in a few sentences."""
    first = plan.pipelines[0]
    stages = ", ".join(f"{'+'.join(s.devices)} [{s.start_layer}, {s.end_layer})" for s in first.stages)
    goal = ("the slowest stage or link of a step is as fast as it can be" if request.objective == "throughput"
            else "a token's trip through every stage and hop is as short as it can be")
    words = [f"{len(first.stages)} stage(s): {stages}; chosen so that {goal}.",
             f"Bottleneck: {first.bottleneck} at {ms(first.bottleneck_s)}; step {ms(first.step_s)}."]
    tight = min(first.stages, key=lambda s: s.headroom_bytes)
    words.append(f"Tightest memory: {'+'.join(tight.devices)} with {size(tight.headroom_bytes)} free after "
                 f"weights and a KV reserve of {request.concurrency} x {request.context_len} tokens.")
    words.append(f"{first.tokens_per_s:.0f} tokens/s predicted with {first.micro_batches} micro-batch(es) of "
                 f"{request.concurrency} sequences in flight (as many as the memory left holds KV for, up to "
                 f"what keeps every stage busy).")
    if len(plan.pipelines) > 1:
        words.append(f"{len(plan.pipelines)} replicas together: {plan.tokens_per_s:.0f} tokens/s predicted.")
    return " ".join(words)


def infeasible(profile: ModelProfile, fleet: FleetSnapshot, tables: StageTables, request: PlanRequest) -> str:
    """What is missing when no plan fits: memory, a pinned site, or too few stages allowed. Memory is counted in
    the narrowest dtype any usable device computes in (what is missing at least)."""
    usable = [d for d in fleet.devices if d.speed(d.dtype or profile.dtype) is not None]
    if not usable:
        dtypes = ", ".join(sorted({d.dtype or profile.dtype for d in fleet.devices} or {profile.dtype}))
        return f"no device measured a speed for {dtypes} (of {len(fleet.devices)} not excluded)"
    for pin, site in (("first", request.first_site), ("last", request.last_site)):
        if site is not None and not any(d.site == site for d in usable):
            return f"the {pin} stage is pinned to site {site!r}, which has no usable device"
    if request.num_stages is not None and request.num_stages > min(len(usable), profile.num_layers):
        return (f"exactly {request.num_stages} stages were asked for, but there are only {len(usable)} usable "
                f"device(s) and {profile.num_layers} layer(s)")
    dtype = min({d.dtype or profile.dtype for d in usable}, key=lambda t: (DTYPE_BYTES[t], t))
    memory = tables.memory_at(dtype)
    need = float(memory[0, profile.num_layers])
    have = sum(d.memory_bytes for d in usable)
    if need > have:
        return (f"{profile.name} needs {size(need)} (weights + KV for {request.concurrency} x "
                f"{request.context_len} tokens in {dtype}) but the usable devices have {size(have)}: needs "
                f"{size(need - have)} more memory")
    largest = max(d.memory_bytes for d in usable)
    one_layer = float(memory[1, 2]) if profile.num_layers > 2 else need
    if one_layer > largest:
        return (f"one layer with its KV needs {size(one_layer)} but the largest device has {size(largest)}: needs "
                f"{size(one_layer - largest)} more memory on one device (or tensor parallelism)")
    return (f"{size(need)} would fit in {size(have)} in total, but not as contiguous stages under the constraints "
            f"(max_stages={request.max_stages}, first_site={request.first_site}, "
            f"last_site={request.last_site}): add memory near the pinned sites or allow more stages")

