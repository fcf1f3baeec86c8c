"""From connected agents and a model's config to the planner's inputs, and from its Plan to stage specs."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from stratamesh.coordinator.records import LinkRecord
from stratamesh.fleet.errors import InvalidInput, PlacementError
from stratamesh.fleet.types import Capabilities, StageSpec
from stratamesh.partitioner.fleet import ORIGIN, Device, FleetSnapshot, Link, Speed
from stratamesh.partitioner.plan import Plan, PlanRequest
from stratamesh.partitioner.planner import evaluate, plan_pipeline
from stratamesh.partitioner.profile import ModelProfile, profile_from_hf_config

# A placement as the registry keeps it: (agent id, start layer, end layer) per stage, in pipeline order.
Placement = Sequence[tuple[str, int, int]]

STAGE_DTYPE = "float32"          # what the CPU stages run today, whatever the checkpoint stores
# An agent too old to measure its speed is planned as a modest CPU box.
UNMEASURED = Speed("torch-cpu", STAGE_DTYPE, flops=50e9, mem_bandwidth=10e9)
KV_CONTEXT_TOKENS = 4096         # the KV reserve a stage must hold: this context ...
KV_SEQUENCES = 8                 # ... for this many sequences


def fleet_of(agents: Mapping[str, Capabilities], links: Sequence[LinkRecord] = ()) -> FleetSnapshot:
    """One device per agent (agents on one host share its best speed: their probes overlapped); measured links."""
    best: dict[tuple[str, str, str], Speed] = {}
    for caps in agents.values():
        for s in caps.speeds:
            key = (caps.hostname, s.backend, s.dtype)
            if key not in best or s.flops > best[key].flops:
                best[key] = Speed(s.backend, s.dtype, s.flops, s.mem_bandwidth)
    devices = []
    for agent_id, caps in agents.items():
        speeds = tuple(v for (host, _, _), v in sorted(best.items()) if host == caps.hostname) or (UNMEASURED,)
        devices.append(Device(agent_id, caps.usable_mem_bytes, speeds, caps.tier or "edge", caps.site,
                              node=caps.hostname))
    return FleetSnapshot(tuple(devices), measured_links(agents.keys(), links))


def measured_links(agent_ids: Iterable[str], links: Sequence[LinkRecord]) -> tuple[Link, ...]:
    """The planner's links from measured ones: between two of these agents, or one of them and ORIGIN."""
    ends = {*agent_ids, ORIGIN}
    return tuple(Link(r.agent_id, r.peer_id, r.bandwidth_bytes_per_s, r.rtt_s) for r in links
                 if r.agent_id in ends and r.peer_id in ends and r.agent_id != r.peer_id
                 and r.bandwidth_bytes_per_s > 0 and r.rtt_s > 0)


def plan_stages(model_id: str, model_path: str, config: dict[str, Any], agents: Mapping[str, Capabilities],
                num_stages: int, links: Sequence[LinkRecord] = (),
                previous: Placement = ()) -> tuple[Plan, list[tuple[str, StageSpec]]]:
    """The planner's best num_stages-stage pipeline over the agents and measured links (PlacementError if none).

    previous: the placement serving now; the plan keeps it (search "kept") unless moving is clearly better."""
    profile, request = _profile(model_id, config), _request(config, num_stages)
    fleet = fleet_of(agents, links)
    plan = plan_pipeline(profile, fleet, request, previous=_as_plan(profile, fleet, request, previous))
    return plan, stage_specs(plan, model_id, model_path, profile.num_layers)


def repair_stages(model_id: str, config: dict[str, Any], agents: Mapping[str, Capabilities], placement: Placement,
                  links: Sequence[LinkRecord] = ()) -> list[str]:
    """The agent of each stage after the stages of agents not among these go to the spares that price best,
    layer ranges unchanged (what lets a drained stage's sessions move with their KV); PlacementError if none fit."""
    plan = _as_plan(_profile(model_id, config), fleet_of(agents, links), _request(config, len(placement)), placement)
    if plan is None:
        missing = [f"[{start}, {end})" for agent, start, end in placement if agent not in agents]
        raise PlacementError(f"no spare agent can take the stages {', '.join(missing)} of {model_id}")
    return [stage.devices[0] for stage in plan.pipelines[0].stages]


def _profile(model_id: str, config: dict[str, Any]) -> ModelProfile:
    return profile_from_hf_config(config, dtype=STAGE_DTYPE, name=model_id)


def _request(config: dict[str, Any], num_stages: int) -> PlanRequest:
    context = min(int(config.get("max_position_embeddings", KV_CONTEXT_TOKENS)), KV_CONTEXT_TOKENS)
    return PlanRequest(objective="throughput", num_stages=num_stages, context_len=context,
                       concurrency=KV_SEQUENCES, tensor_parallel=False)   # TP stages: not served yet


def _as_plan(profile: ModelProfile, fleet: FleetSnapshot, request: PlanRequest, placement: Placement) -> Plan | None:
    """A placement as the planner's Plan, priced on this fleet; None if there is none or nothing fits.

    A stage whose agent left goes, layer range and all, to the spare that prices best: after a death the
    planner then keeps every surviving stage where it is (loaded, nothing to move) unless moving is clearly
    better."""
    pipelines = []
    for candidate in _repairs(placement, [d.id for d in fleet.devices]):
        try:
            pipelines.append(evaluate(profile, fleet, request, [((a,), start, end) for a, start, end in candidate]))
        except (PlacementError, InvalidInput):
            continue
    if not pipelines:
        return None
    best = min(pipelines, key=lambda p: p.objective_s(request.objective))
    return Plan(profile.name, request.objective, (best,), best.tokens_per_s, "")


def _repairs(placement: Placement, agents: Sequence[str], limit: int = 64) -> list[list[tuple[str, int, int]]]:
    """The placement with each stage of a missing agent given to a spare (every way, up to limit)."""
    if not placement:
        return []
    spares = sorted(set(agents) - {a for a, _, _ in placement})
    missing = [i for i, (a, _, _) in enumerate(placement) if a not in agents]
    out = []
    for chosen in itertools.islice(itertools.permutations(spares, len(missing)), limit):
        repaired = list(placement)
        for i, agent in zip(missing, chosen, strict=True):
            repaired[i] = (agent, repaired[i][1], repaired[i][2])
        out.append(repaired)
    return out


def stage_specs(plan: Plan, model_id: str, model_path: str, num_layers: int) -> list[tuple[str, StageSpec]]:
    """(agent id, spec) of each stage of the plan's first pipeline, in order."""
    return [(s.devices[0], StageSpec(model_id, model_path, s.start_layer, s.end_layer, num_layers, s.dtype))
            for s in plan.pipelines[0].stages]
