"""Plans and failures in plain words."""

from __future__ import annotations

from typing import TYPE_CHECKING

from stratamesh.partitioner.fleet import FleetSnapshot
from stratamesh.partitioner.plan import Plan, PlanRequest
from stratamesh.partitioner.profile import ModelProfile

if TYPE_CHECKING:
    from stratamesh.partitioner.cost import StageTables


def gb(num_bytes: float) -> str:
    return f"{num_bytes / 1e9:.1f} GB"


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
    words.append(f"Tightest memory: {'+'.join(tight.devices)} with {gb(tight.headroom_bytes)} free after "
                 f"weights and a KV reserve of {request.concurrency} x {request.context_len} tokens.")
    if len(plan.pipelines) > 1:
        words.append(f"{len(plan.pipelines)} replicas together: {plan.tokens_per_s:.0f} tokens/s predicted.")
    return " ".join(words)


def infeasible(profile: ModelProfile, fleet: FleetSnapshot, tables: StageTables, request: PlanRequest) -> str:
    """What is missing when no plan fits: memory, a pinned site, or too few stages allowed."""
    usable = [d for d in fleet.devices if d.speed(profile.dtype) is not None]
    if not usable:
        return f"no device measured a speed for {profile.dtype} (of {len(fleet.devices)} not excluded)"
    for pin, site in (("first", request.first_site), ("last", request.last_site)):
        if site is not None and not any(d.site == site for d in usable):
            return f"the {pin} stage is pinned to site {site!r}, which has no usable device"
    need = float(tables.memory[0, profile.num_layers])
    have = sum(d.memory_bytes for d in usable)
    if need > have:
        return (f"{profile.name} needs {gb(need)} (weights + KV for {request.concurrency} x "
                f"{request.context_len} tokens) but the usable devices have {gb(have)}: needs "
                f"{gb(need - have)} more memory")
    largest = max(d.memory_bytes for d in usable)
    one_layer = float(tables.memory[1, 2]) if profile.num_layers > 2 else need
    if one_layer > largest:
        return (f"one layer with its KV needs {gb(one_layer)} but the largest device has {gb(largest)}: needs "
                f"{gb(one_layer - largest)} more memory on one device (or tensor parallelism)")
    return (f"{gb(need)} would fit in {gb(have)} in total, but not as contiguous stages under the constraints "
            f"(max_stages={request.max_stages}, first_site={request.first_site}, "
            f"last_site={request.last_site}): add memory near the pinned sites or allow more stages")

