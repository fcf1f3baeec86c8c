"""From connected agents and a model's config to the planner's inputs, and from its Plan to stage specs."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from stratamesh.coordinator.records import LinkRecord
from stratamesh.fleet.errors import InvalidInput, PlacementError
from stratamesh.fleet.types import Capabilities, StageSpec
from stratamesh.partitioner.fleet import NODE_LINK, ORIGIN, Device, FleetSnapshot, Link, Speed
from stratamesh.partitioner.plan import Pipeline, Plan, PlannedStage, PlanRequest
from stratamesh.partitioner.planner import evaluate, plan_pipeline
from stratamesh.partitioner.profile import ModelProfile, profile_from_hf_config

# A placement as the registry keeps it: (agent id, start layer, end layer, tp degree) per stage, in pipeline order.
Placement = Sequence[tuple[str, int, int, int]]

STAGE_DTYPE = "float32"          # what the CPU stages run today, whatever the checkpoint stores
# An agent too old to measure its speed is planned as a modest CPU box.
UNMEASURED = Speed("torch-cpu", STAGE_DTYPE, flops=50e9, mem_bandwidth=10e9)
KV_CONTEXT_TOKENS = 4096         # the KV reserve a stage must hold: this context ...
KV_SEQUENCES = 8                 # ... for this many sequences


@dataclass(frozen=True, slots=True)
class SitePins:
    """Data residency: the site the first stage (it sees token ids) and the last (it produces them) run at."""

    first: str = ""             # "" for any site
    last: str = ""


def fleet_of(agents: Mapping[str, Capabilities], links: Sequence[LinkRecord] = ()) -> FleetSnapshot:
    """One device per rank of each agent (rank_ids), the agent its node; measured links between agents apply
    to all their devices, and agents of one host that never measured theirs talk over loopback (NODE_LINK).

    A rank of a GPU agent has its GPU's free memory and the measured speed; a rank of a CPU agent a share of
    the RAM and of the speed (the ranks split the cores). Agents on one host share its best speed: their
    probes overlapped."""
    best: dict[tuple[str, str, str], Speed] = {}
    for caps in agents.values():
        for s in caps.speeds:
            key = (caps.hostname, s.backend, s.dtype)
            if key not in best or s.flops > best[key].flops:
                best[key] = Speed(s.backend, s.dtype, s.flops, s.mem_bandwidth)
    devices = []
    for agent_id, caps in agents.items():
        speeds = tuple(v for (host, _, _), v in sorted(best.items()) if host == caps.hostname) or (UNMEASURED,)
        devices += _rank_devices(agent_id, caps, speeds)
    return FleetSnapshot(tuple(devices), _links(agents, links))


def num_ranks(caps: Capabilities) -> int:
    """The most ranks one stage may have on the agent: what it reports, no more than its GPUs if it has any."""
    return max(1, min(caps.num_ranks, len(caps.gpus)) if caps.gpus else caps.num_ranks)


def rank_ids(agent_id: str, ranks: int) -> list[str]:
    """The planner's device ids of an agent's ranks: the agent id itself when it has one rank."""
    return [agent_id] if ranks == 1 else [f"{agent_id}#{rank}" for rank in range(ranks)]


def _rank_devices(agent_id: str, caps: Capabilities, speeds: tuple[Speed, ...]) -> list[Device]:
    ranks = num_ranks(caps)
    if ranks > 1 and caps.gpus:
        memory = [g.mem_free_bytes for g in caps.gpus[:ranks]]
    else:
        memory = [caps.usable_mem_bytes // ranks] * ranks
        speeds = tuple(Speed(s.backend, s.dtype, s.flops / ranks, s.mem_bandwidth / ranks) for s in speeds)
    return [Device(device_id, mem, speeds, caps.tier or "edge", caps.site, node=agent_id)
            for device_id, mem in zip(rank_ids(agent_id, ranks), memory, strict=True)]


def _links(agents: Mapping[str, Capabilities], links: Sequence[LinkRecord]) -> tuple[Link, ...]:
    """Measured links between agents (or an agent and ORIGIN) as links between their devices, and loopback
    between the devices of two agents on one host that measured no link (each agent is its own node)."""
    ids = {a: rank_ids(a, num_ranks(caps)) for a, caps in agents.items()} | {ORIGIN: [ORIGIN]}
    measured = measured_links(agents.keys(), links)
    out = [Link(x, y, m.bandwidth, m.rtt_s) for m in measured for x in ids[m.a] for y in ids[m.b]]
    seen = {frozenset((m.a, m.b)) for m in measured}
    for a, b in itertools.combinations(agents, 2):
        if agents[a].hostname == agents[b].hostname and frozenset((a, b)) not in seen:
            out += [Link(x, y, NODE_LINK.bandwidth, NODE_LINK.rtt_s) for x in ids[a] for y in ids[b]]
    return tuple(out)


def measured_links(agent_ids: Iterable[str], links: Sequence[LinkRecord]) -> tuple[Link, ...]:
    """The planner's links from measured ones: between two of these agents, or one of them and ORIGIN."""
    ends = {*agent_ids, ORIGIN}
    return tuple(Link(r.agent_id, r.peer_id, r.bandwidth_bytes_per_s, r.rtt_s) for r in links
                 if r.agent_id in ends and r.peer_id in ends and r.agent_id != r.peer_id
                 and r.bandwidth_bytes_per_s > 0 and r.rtt_s > 0)


def plan_stages(model_id: str, model_path: str, config: dict[str, Any], agents: Mapping[str, Capabilities],
                num_stages: int, links: Sequence[LinkRecord] = (), previous: Placement = (),
                pins: SitePins = SitePins()) -> tuple[Plan, list[tuple[str, StageSpec]]]:
    """The planner's best num_stages-stage pipeline over the agents and measured links (PlacementError if none);
    a stage may be a tensor-parallel group of one agent's ranks.

    previous: the placement serving now; the plan keeps it (search "kept") unless moving is clearly better."""
    profile, request = _profile(model_id, config), _request(config, num_stages, pins)
    fleet = fleet_of(agents, links)
    previous_plan = _as_plan(profile, fleet, request, previous, _ranks(agents))
    plan = plan_pipeline(profile, fleet, request, previous=previous_plan)
    return plan, stage_specs(plan, fleet, model_id, model_path, profile.num_layers)


def repair_stages(model_id: str, config: dict[str, Any], agents: Mapping[str, Capabilities], placement: Placement,
                  links: Sequence[LinkRecord] = (), pins: SitePins = SitePins()) -> list[str]:
    """The agent of each stage after the stages of agents not among these go to the spares that price best,
    layer ranges and TP degrees unchanged (what lets a drained stage's sessions move with their KV);
    PlacementError if none fit."""
    fleet = fleet_of(agents, links)
    plan = _as_plan(_profile(model_id, config), fleet, _request(config, len(placement), pins), placement,
                    _ranks(agents))
    if plan is None:
        missing = [f"[{start}, {end})" for agent, start, end, _ in placement if agent not in agents]
        raise PlacementError(f"no spare agent can take the stages {', '.join(missing)} of {model_id}")
    return [_agent_of(fleet, stage) for stage in plan.pipelines[0].stages]


def _profile(model_id: str, config: dict[str, Any]) -> ModelProfile:
    return profile_from_hf_config(config, dtype=STAGE_DTYPE, name=model_id)


def _request(config: dict[str, Any], num_stages: int, pins: SitePins) -> PlanRequest:
    context = min(int(config.get("max_position_embeddings", KV_CONTEXT_TOKENS)), KV_CONTEXT_TOKENS)
    return PlanRequest(objective="throughput", num_stages=num_stages, context_len=context,
                       concurrency=KV_SEQUENCES, tensor_parallel=True, first_site=pins.first or None,
                       last_site=pins.last or None)


def _ranks(agents: Mapping[str, Capabilities]) -> dict[str, int]:
    return {agent_id: num_ranks(caps) for agent_id, caps in agents.items()}


def _as_plan(profile: ModelProfile, fleet: FleetSnapshot, request: PlanRequest, placement: Placement,
             ranks: Mapping[str, int]) -> Plan | None:
    """A placement as the planner's Plan, priced on this fleet; None if there is none or nothing fits.

    A stage whose agent left goes, layer range and all, to the spare that prices best: after a death the
    planner then keeps every surviving stage where it is (loaded, nothing to move) unless moving is clearly
    better."""
    pipelines = []
    for candidate in _repairs(placement, ranks):
        try:
            pipeline = evaluate(profile, fleet, request, _on_ranks(candidate, ranks))
        except (PlacementError, InvalidInput):
            continue
        if _keeps_pins(pipeline, fleet, request):
            pipelines.append(pipeline)
    if not pipelines:
        return None
    best = min(pipelines, key=lambda p: p.objective_s(request.objective))
    return Plan(profile.name, request.objective, (best,), best.tokens_per_s, "")


def _keeps_pins(pipeline: Pipeline, fleet: FleetSnapshot, request: PlanRequest) -> bool:
    """Whether the first and last stages run at the sites the request pins them to."""
    first, last = (fleet.device(s.devices[0]).site for s in (pipeline.stages[0], pipeline.stages[-1]))
    return request.first_site in (None, first) and request.last_site in (None, last)


def _repairs(placement: Placement, ranks: Mapping[str, int], limit: int = 64) -> list[list[tuple[str, int, int, int]]]:
    """The placement with each stage of a missing agent given to a spare (every way, up to limit).

    A spare takes one stage, as a group of the same degree: it needs at least that many ranks (a TP stage is
    never narrowed, so its KV moves to a group of the same shape)."""
    if not placement:
        return []
    spares = sorted(set(ranks) - {stage[0] for stage in placement})
    missing = [i for i, stage in enumerate(placement) if stage[0] not in ranks]
    options = [[a for a in spares if ranks[a] >= placement[i][3]] for i in missing]
    distinct = (chosen for chosen in itertools.product(*options) if len(set(chosen)) == len(chosen))
    out = []
    for chosen in itertools.islice(distinct, limit):
        repaired = list(placement)
        for i, agent in zip(missing, chosen, strict=True):
            repaired[i] = (agent, *repaired[i][1:])
        out.append(repaired)
    return out


def _on_ranks(placement: Placement, ranks: Mapping[str, int]) -> list[tuple[tuple[str, ...], int, int]]:
    """The placement on the planner's devices: each stage takes the next free ranks of its agent in pipeline
    order; InvalidInput if an agent has too few."""
    taken: dict[str, int] = {}
    out = []
    for agent, start, end, degree in placement:
        first = taken.get(agent, 0)
        taken[agent] = first + degree
        if taken[agent] > ranks[agent]:
            raise InvalidInput(f"agent {agent!r} has {ranks[agent]} rank(s), fewer than its stages need")
        out.append((tuple(rank_ids(agent, ranks[agent])[first:first + degree]), start, end))
    return out


def _agent_of(fleet: FleetSnapshot, stage: PlannedStage) -> str:
    """The one agent whose ranks serve the stage (fleet_of makes each agent the node of its devices)."""
    agents = sorted({fleet.device(d).node_id for d in stage.devices})
    if len(agents) != 1:
        raise PlacementError(f"stage [{stage.start_layer}, {stage.end_layer}) spans agents {', '.join(agents)}")
    return agents[0]


def stage_specs(plan: Plan, fleet: FleetSnapshot, model_id: str, model_path: str,
                num_layers: int) -> list[tuple[str, StageSpec]]:
    """(agent id, spec) of each stage of the plan's first pipeline, in order; tp_degree: the stage's ranks."""
    return [(_agent_of(fleet, s), StageSpec(model_id, model_path, s.start_layer, s.end_layer, num_layers, s.dtype,
                                            tp_degree=len(s.devices)))
            for s in plan.pipelines[0].stages]
