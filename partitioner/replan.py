"""Re-planning on a fleet change: keep layers where they are unless moving them is clearly better."""

from __future__ import annotations

from dataclasses import replace

from stratamesh.fleet.errors import PlacementError
from stratamesh.partitioner import describe
from stratamesh.partitioner.fleet_snapshot import FleetSnapshot
from stratamesh.partitioner.plan import Pipeline, Plan, PlanRequest
from stratamesh.partitioner.profile import ModelProfile

KEEP_WITHIN = 0.05        # keep the old placement if its predicted cost is at most 5% worse


def stay_close(best: Plan, previous: Plan, profile: ModelProfile, fleet: FleetSnapshot,
               request: PlanRequest) -> Plan:
    """best, unless the previous placement still fits and is predicted within KEEP_WITHIN of it."""
    kept = _still_valid(previous, profile, fleet, request)
    if kept is not None:
        value = kept[0].objective_s(request.objective)
        if value <= best.objective_s * (1 + KEEP_WITHIN):
            plan = replace(best, pipelines=kept, tokens_per_s=sum(p.tokens_per_s for p in kept), layers_moved=0,
                           search="kept")
            return replace(plan, reason=describe.reason(plan, request)
                           + f" Kept the previous placement: within {KEEP_WITHIN:.0%} of the best "
                             f"({describe.ms(best.objective_s)}).")
    moved = layers_moved(previous, best)
    return replace(best, layers_moved=moved, reason=best.reason + f" Re-planned: {moved} layer(s) move.")


def _still_valid(previous: Plan, profile: ModelProfile, fleet: FleetSnapshot,
                 request: PlanRequest) -> tuple[Pipeline, ...] | None:
    """The previous pipelines re-evaluated on the new fleet, or None if a device left, a stage no longer fits
    or the placement breaks the request (pinned sites, stage counts, replicas, tensor parallelism)."""
    from stratamesh.partitioner.planner import evaluate

    ids = {d.id for d in fleet.devices} - set(request.exclude)
    if len(previous.pipelines) > request.max_replicas:
        return None
    pipelines = []
    for pipeline in previous.pipelines:
        if not set(pipeline.devices) <= ids or not _honours(pipeline, fleet, request):
            return None
        placement = [(s.devices, s.start_layer, s.end_layer) for s in pipeline.stages]
        try:
            pipelines.append(evaluate(profile, fleet, request, placement))
        except PlacementError:
            return None
    return tuple(pipelines)


def _honours(pipeline: Pipeline, fleet: FleetSnapshot, request: PlanRequest) -> bool:
    """Whether a placement obeys the request's constraints (memory and devices are evaluate's to check)."""
    stages, limit = pipeline.stages, request.stage_limit
    first, last = fleet.device(stages[0].devices[0]), fleet.device(stages[-1].devices[0])
    return ((request.first_site is None or first.site == request.first_site)
            and (request.last_site is None or last.site == request.last_site)
            and (limit is None or len(stages) <= limit)
            and (request.num_stages is None or len(stages) == request.num_stages)
            and (request.tensor_parallel or all(s.tp_degree == 1 for s in stages)))


def layers_moved(before: Plan, after: Plan) -> int:
    """Layers (counted per replica) whose devices differ between two plans."""
    moved = 0
    for r in range(max(len(before.pipelines), len(after.pipelines))):
        old = _owners(before.pipelines[r]) if r < len(before.pipelines) else {}
        new = _owners(after.pipelines[r]) if r < len(after.pipelines) else {}
        moved += sum(1 for layer in old.keys() | new.keys() if old.get(layer) != new.get(layer))
    return moved


def _owners(pipeline: Pipeline) -> dict[int, tuple[str, ...]]:
    return {layer: s.devices for s in pipeline.stages for layer in range(s.start_layer, s.end_layer)}
