"""The planner: which devices, in what order, with which contiguous layers, for a throughput or latency goal.

1. Units: every usable device alone, and, per tensor-parallel degree d in (2, 4, 8) that divides the heads
   and KV heads, each node's GPUs in groups of d where the node's links are fast. Each degree is one
   configuration; the best plan over configurations wins.
2. Order: with at most EXACT_UNITS units, an exact search over every ordered subset (search.every_order).
   Beyond that, a heuristic: keep the fastest units of the strongest sites, try every order of those sites
   (units inside a site fastest first), then swap pairs while it improves (search.fixed_order is exact for
   each order tried). Its gap to the exact optimum is measured by benchmarks/partition_compare.py.
3. Split: for an order, dynamic programming over integer layer ranges is exact.
4. Throughput ties: among plans with the best bottleneck, the one with the smallest step.
5. Replicas: while max_replicas allows, plan again on the devices left over.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from stratamesh.fleet.errors import PlacementError
from stratamesh.partitioner import describe
from stratamesh.partitioner.cost import LinkCosts, StageTables, Unit, group_link, group_unit, single_unit
from stratamesh.partitioner.fleet import FleetSnapshot
from stratamesh.partitioner.plan import Pipeline, Plan, PlannedStage, PlanRequest
from stratamesh.partitioner.profile import ModelProfile
from stratamesh.partitioner.search import Costs, Split, every_order, fixed_order

EXACT_UNITS = 8           # every ordered subset of this many units: 2^8 x 8 states
UNITS_PER_SITE = 8        # the heuristic keeps the fastest units of a site ...
MAX_SITES = 4             # ... of the strongest sites (plus pinned ones)
TIE = 1 + 1e-9            # relative slack when restricting to the best bottleneck
TP_DEGREES = (2, 4, 8)
SWAP_TRIALS = 32          # pair swaps the heuristic tries after the site orders


def plan_pipeline(profile: ModelProfile, fleet: FleetSnapshot, request: PlanRequest = PlanRequest(),
                  previous: Plan | None = None, search: str = "auto") -> Plan:
    """The best plan for the request; PlacementError says what is missing when nothing fits.

    search: "auto" (exact when few units), "exact" or "heuristic". previous: a plan to stay close to."""
    fleet = _canonical(fleet, request)
    tables = StageTables(profile, request)
    pipelines, used, how = [], set(), ""
    while len(pipelines) < request.max_replicas:
        found = _best_pipeline(profile, fleet.without(used), tables, request, search)
        if found is None:
            break
        pipeline, how = found
        pipelines.append(pipeline)
        used |= set(pipeline.devices)
    if not pipelines:
        raise PlacementError(describe.infeasible(profile, fleet, tables, request))
    plan = _plan(profile, request, tuple(pipelines), how)
    if previous is not None:
        from stratamesh.partitioner.replan import stay_close
        plan = stay_close(plan, previous, profile, fleet, request)
    return plan


def evaluate(profile: ModelProfile, fleet: FleetSnapshot, request: PlanRequest,
             placement: Sequence[tuple[tuple[str, ...], int, int]]) -> Pipeline:
    """The predicted cost of a given placement [(device ids, start, end), ...] in pipeline order."""
    tables, units = StageTables(profile, request), []
    for ids, _, _ in placement:
        devices = tuple(fleet.device(i) for i in ids)
        unit = (single_unit(devices[0], profile) if len(devices) == 1
                else group_unit(devices, group_link(fleet, devices), profile, request))
        if unit is None:
            raise PlacementError(f"{'+'.join(ids)} cannot serve {profile.dtype} (no speed measured, or a "
                                 f"group that does not divide the heads)")
        units.append(unit)
    ranges = [(a, b) for _, a, b in placement]
    if ranges[0][0] != 0 or ranges[-1][1] != profile.num_layers or any(
            r[1] != s[0] for r, s in zip(ranges, ranges[1:])):
        raise PlacementError(f"ranges {ranges} do not tile [0, {profile.num_layers})")
    for unit, (a, b) in zip(units, ranges, strict=True):
        if tables.memory[a, b] > unit.memory_bytes:
            raise PlacementError(f"{unit.id} cannot hold layers [{a}, {b}): needs "
                                 f"{describe.gb(tables.memory[a, b] - unit.memory_bytes)} more memory")
    return _pipeline(units, ranges, tables, LinkCosts(fleet, profile, request))


# ------------------------------------------------------------------ one pipeline
def _best_pipeline(profile: ModelProfile, fleet: FleetSnapshot, tables: StageTables, request: PlanRequest,
                   search: str) -> tuple[Pipeline, str] | None:
    """The best pipeline over the tensor-parallel configurations, and how its order was found."""
    links, best, per_layer = LinkCosts(fleet, profile, request), None, {}
    for units in _configurations(profile, fleet, request):
        found = _search(units, tables, links, request, search, per_layer)
        if found is None:
            continue
        chosen, ranges, how = found
        pipeline = _pipeline(chosen, ranges, tables, links)
        key = (_objective(pipeline, request), pipeline.step_s, len(pipeline.stages))
        if best is None or key < best[0]:
            best = (key, pipeline, how)
    return None if best is None else (best[1], best[2])


def _configurations(profile: ModelProfile, fleet: FleetSnapshot, request: PlanRequest) -> list[list[Unit]]:
    """Disjoint unit sets: every device alone, then for each TP degree, each node's GPUs grouped."""
    alone = {d.id: u for d in fleet.devices if (u := single_unit(d, profile)) is not None}
    singles = list(alone.values())
    configs = [singles]
    if not request.tensor_parallel:
        return configs
    by_node: dict[str, list] = {}
    for d in fleet.devices:
        by_node.setdefault(d.node_id, []).append(d)
    for degree in TP_DEGREES:
        grouped, any_group = [], False
        for node_devices in by_node.values():
            groups = _groups(node_devices, degree, fleet, profile, request)
            any_group |= bool(groups)
            grouped += groups or [alone[d.id] for d in node_devices if d.id in alone]
        if any_group:
            configs.append(grouped)
    return configs


def _groups(devices: list, degree: int, fleet: FleetSnapshot, profile: ModelProfile,
            request: PlanRequest) -> list[Unit]:
    """The node's devices in consecutive groups of degree (leftovers alone); [] if none qualifies."""
    if len(devices) < degree:
        return []
    units, grouped = [], False
    for i in range(0, len(devices) - len(devices) % degree, degree):
        members = tuple(devices[i:i + degree])
        unit = group_unit(members, group_link(fleet, members), profile, request)
        if unit is None:
            return []
        units.append(unit)
        grouped = True
    units += [u for d in devices[len(devices) - len(devices) % degree:] if (u := single_unit(d, profile))]
    return units if grouped else []


def _search(units: list[Unit], tables: StageTables, links: LinkCosts, request: PlanRequest,
            search: str, per_layer: dict[int, float]) -> tuple[list[Unit], list[tuple[int, int]], str] | None:
    """The best units in order and their layer ranges: exact when few units (or asked), else the heuristic."""
    exact = search == "exact" or (search == "auto" and len(units) <= EXACT_UNITS)
    if not exact:
        units = _candidates(units, tables, request, per_layer)
    times = [tables.times(u) for u in units]
    costs = _costs(units, times, links, request, request.objective)
    limit, exact_stages = request.stage_limit, request.num_stages is not None
    if exact:
        split = every_order(costs, limit, exact_stages)
    else:
        split = _heuristic(units, costs, request)
    if split is None:
        return None
    if request.objective == "throughput":   # among the best bottlenecks, the smallest step
        capped = _costs(units, times, links, request, "latency", cap=split.value * TIE)
        tie = (every_order(capped, limit, exact_stages) if exact
               else fixed_order(capped, split.units, limit, exact_stages))
        split = split if tie is None else tie
    return [units[i] for i in split.units], list(split.ranges), "exact" if exact else "heuristic"


def _costs(units: list[Unit], times: list[np.ndarray], links: LinkCosts, request: PlanRequest, objective: str,
           cap: float = np.inf) -> Costs:
    """Costs of one objective over units with stage times (tables.times of each); with cap, every stage or
    transfer slower than cap is forbidden."""
    throughput, n = objective == "throughput", len(units)
    stage = [np.where(t <= cap, t, np.inf) for t in times]
    link = np.full((n, n), np.inf)
    for i, j in itertools.permutations(range(n), 2):
        transfer, hop = links.between(units[i], units[j])
        link[i, j] = (transfer if throughput else hop) if transfer <= cap else np.inf
    enter, leave = np.full(n, np.inf), np.full(n, np.inf)
    for j, unit in enumerate(units):
        transfer, hop = links.origin(unit)
        value = (transfer if throughput else hop) if transfer <= cap else np.inf
        if request.first_site is None or unit.lead.site == request.first_site:
            enter[j] = value
        if request.last_site is None or unit.lead.site == request.last_site:
            leave[j] = value
    return Costs(np.maximum if throughput else np.add, stage, enter, leave, link)


# ------------------------------------------------------------------ the heuristic for many units
def _candidates(units: list[Unit], tables: StageTables, request: PlanRequest,
                cache: dict[int, float]) -> list[Unit]:
    """The UNITS_PER_SITE fastest units of each of the MAX_SITES strongest sites, and of pinned sites.

    cache: one layer's time per unit object, shared by the configurations (they share their single units)."""
    middle = max(1, tables.profile.num_layers // 2)
    one_layer = float(tables.memory[middle - 1, middle])
    for u in units:
        if id(u) not in cache:
            cache[id(u)] = tables.time_of(u, middle - 1, middle)
    per_layer = [cache[id(u)] for u in units]
    by_site: dict[str, list[int]] = {}
    for i in sorted(range(len(units)), key=lambda i: (per_layer[i], -units[i].memory_bytes, units[i].lead.id)):
        if units[i].memory_bytes >= one_layer:
            by_site.setdefault(units[i].lead.site, []).append(i)
    kept = {site: members[:UNITS_PER_SITE] for site, members in by_site.items()}

    def strength(site: str) -> float:   # layers per second the site's kept units could serve
        return sum(1 / per_layer[i] for i in kept[site])

    sites = sorted(kept, key=lambda s: (-strength(s), s))[:MAX_SITES]
    sites += [s for s in (request.first_site, request.last_site) if s in kept and s not in sites]
    return [units[i] for site in sites for i in kept[site]]


def _heuristic(units: list[Unit], costs: Costs, request: PlanRequest) -> Split | None:
    """Every order of the sites (units inside a site fastest first), then pair swaps while they improve."""
    sites = list(dict.fromkeys(u.lead.site for u in units))
    members = {s: [i for i, u in enumerate(units) if u.lead.site == s] for s in sites}
    best: Split | None = None
    best_order: list[int] = []
    for site_order in itertools.permutations(sites):
        order = [i for s in site_order for i in members[s]]
        split = fixed_order(costs, order, request.stage_limit, request.num_stages is not None)
        if split is not None and (best is None or split.value < best.value):
            best, best_order = split, order
    if best is None:
        return None
    return _improve_by_swaps(costs, best, best_order, request)


def _improve_by_swaps(costs: Costs, best: Split, order: list[int], request: PlanRequest) -> Split:
    """Swap pairs of positions (nearest pairs first, at most SWAP_TRIALS) and keep every swap that helps."""
    pairs = sorted(itertools.combinations(range(len(order)), 2), key=lambda p: (p[1] - p[0], p))
    for i, j in pairs[:SWAP_TRIALS]:
        trial = list(order)
        trial[i], trial[j] = trial[j], trial[i]
        split = fixed_order(costs, trial, request.stage_limit, request.num_stages is not None)
        if split is not None and split.value < best.value * (1 - 1e-12):
            best, order = split, trial
    return best


# ------------------------------------------------------------------ building the answer
def _pipeline(units: list[Unit], ranges: list[tuple[int, int]], tables: StageTables,
              links: LinkCosts) -> Pipeline:
    """Stages with their predicted times and memory, the bottleneck and the step time."""
    enter_transfer, step = links.origin(units[0])
    stages, slowest = [], (enter_transfer, "origin -> first stage")
    for k, (unit, (a, b)) in enumerate(zip(units, ranges, strict=True)):
        compute = tables.time_of(unit, a, b)
        transfer, hop = links.between(unit, units[k + 1]) if k + 1 < len(units) else links.origin(unit)
        memory = int(tables.memory[a, b])
        stages.append(PlannedStage(
            devices=tuple(d.id for d in unit.devices), start_layer=a, end_layer=b, backend=unit.speed.backend,
            dtype=unit.speed.dtype, compute_s=compute, send_s=transfer,
            memory_bytes=memory // unit.degree, headroom_bytes=min(d.memory_bytes for d in unit.devices)
            - memory // unit.degree, kv_budget_bytes=tables.kv_reserve(a, b) // unit.degree))
        step += compute + hop
        where = f"stage {k} ({unit.id}, layers {a}-{b})"
        slowest = max(slowest, (compute, f"compute of {where}"),
                      (transfer, f"transfer out of {where}"), key=lambda x: x[0])
    return Pipeline(tuple(stages), bottleneck_s=slowest[0], step_s=step, bottleneck=slowest[1])


def _objective(pipeline: Pipeline, request: PlanRequest) -> float:
    return pipeline.bottleneck_s if request.objective == "throughput" else pipeline.step_s


def _plan(profile: ModelProfile, request: PlanRequest, pipelines: tuple[Pipeline, ...], how: str) -> Plan:
    tokens_per_s = sum(request.step_tokens / p.bottleneck_s for p in pipelines)
    plan = Plan(profile.name, request.objective, pipelines, tokens_per_s, "", search=how)
    return replace(plan, reason=describe.reason(plan, request))


def _canonical(fleet: FleetSnapshot, request: PlanRequest) -> FleetSnapshot:
    """Devices sorted by id (the same plan for any input order), excluded ones dropped."""
    devices = tuple(sorted((d for d in fleet.devices if d.id not in request.exclude), key=lambda d: d.id))
    return FleetSnapshot(devices, fleet.links, fleet.origin_site)
