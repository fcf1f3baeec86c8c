"""The planner: which devices, in what order, with which contiguous layers, for a throughput or latency goal.

1. Units: every usable device alone, and, per tensor-parallel degree d in (2, 4, 8) that divides the heads
   and KV heads, each node's GPUs in groups of d where the node's links are fast. Each degree is one
   configuration; the best plan over configurations wins.
2. Order: with at most EXACT_UNITS units, an exact search over every ordered subset (search.every_order).
   Beyond that, a heuristic: keep the units of the strongest sites (all of a small fleet's; the fastest
   UNITS_PER_SITE of each site in a large one), try every order of those sites (inside a site fastest first,
   or slowest first; the pinned first site first, the pinned last site last), then swap pairs while that
   improves. search.fixed_order is exact for each order tried. The first configuration tries every site
   order; the others only its best few (the order of sites follows the links, not the grouping).
   Gap to the exact optimum: benchmarks/partition_compare.py (section 2) measures it on 10-device fleets.
3. Split: for an order, dynamic programming over integer layer ranges is exact.
4. Throughput ties: among plans with the best bottleneck, the one with the smallest step.
5. Replicas: while max_replicas allows, plan again on the devices left over.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from stratamesh.fleet.errors import PlacementError
from stratamesh.fleet.sessions import wire_dtype
from stratamesh.partitioner import describe
from stratamesh.partitioner.cost import LinkCosts, StageTables, Unit, group_link, group_unit, single_unit
from stratamesh.partitioner.fleet_snapshot import FleetSnapshot
from stratamesh.partitioner.plan import Pipeline, Plan, PlannedStage, PlanRequest
from stratamesh.partitioner.profile import ModelProfile
from stratamesh.partitioner.search import Costs, Split, every_order, fixed_order
from stratamesh.partitioner.wire_codec import choose_codec

EXACT_UNITS = 8           # every ordered subset of this many units: 2^8 x 8 states
MAX_CANDIDATES = 32       # a fleet of at most this many units keeps them all; a larger one keeps ...
UNITS_PER_SITE = 8        # ... the fastest units of a site ...
MAX_SITES = 4             # ... of the strongest sites (plus pinned ones); a small fleet keeps one more
TIE = 1 + 1e-9            # relative slack when restricting to the best bottleneck
TP_DEGREES = (2, 4, 8)
SWAP_TRIALS = 32          # pair swaps the heuristic tries after the site orders ...
REUSE_ORDERS = 3          # the heuristic tries every site order for the first configuration, its best few for the rest
SWAP_WITHIN = 1.25        # ... in each configuration whose best site order is within this of the best


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
        alone = tuple(single_unit(d, profile) for d in devices)
        unit = (None if None in alone else alone[0] if len(alone) == 1
                else group_unit(alone, group_link(fleet, devices), profile, request))
        if unit is None:
            dtypes = "/".join(sorted({d.dtype or profile.dtype for d in devices}))
            raise PlacementError(f"{'+'.join(ids)} cannot serve {dtypes} (no speed measured, or a group that "
                                 f"does not divide the heads or mixes backends or dtypes)")
        units.append(unit)
    ranges = [(a, b) for _, a, b in placement]
    if ranges[0][0] != 0 or ranges[-1][1] != profile.num_layers or any(
            r[1] != s[0] for r, s in zip(ranges, ranges[1:])):
        raise PlacementError(f"ranges {ranges} do not tile [0, {profile.num_layers})")
    for unit, (a, b) in zip(units, ranges, strict=True):
        need = tables.memory_of(unit)[a, b]
        if need > unit.memory_bytes:
            raise PlacementError(f"{unit.id} cannot hold layers [{a}, {b}): needs "
                                 f"{describe.size(need - unit.memory_bytes)} more memory")
    return _pipeline(units, ranges, tables, LinkCosts(fleet, profile, request))


# ------------------------------------------------------------------ one pipeline
def _best_pipeline(profile: ModelProfile, fleet: FleetSnapshot, tables: StageTables, request: PlanRequest,
                   search: str) -> tuple[Pipeline, str] | None:
    """The best pipeline over the tensor-parallel configurations, and how its order was found.

    Few units: an exact search per configuration. Many: the site orders of every configuration first, then
    pair swaps only for those within SWAP_WITHIN of the best (swaps rarely gain more than that)."""
    links, configs = LinkCosts(fleet, profile, request), _configurations(profile, fleet, request)
    exact = search == "exact" or (search == "auto" and max(map(len, configs), default=0) <= EXACT_UNITS)
    found: list[tuple[list[Unit], Costs, Split, str]] = []
    if exact:
        for units in configs:
            costs = _costs(units, [tables.times(u) for u in units], links, request, request.objective)
            split = every_order(costs, request.stage_limit, request.num_stages is not None)
            if split is not None:
                found.append((units, costs, split, "exact"))
    else:
        per_layer, ranked = _per_layer(configs, tables), None
        for units in configs:
            units = _candidates(units, tables, request, per_layer)
            if not units:
                continue
            costs = _costs(units, [tables.times(u) for u in units], links, request, request.objective)
            split, orders = _site_orders(units, costs, request, ranked)
            if split is None and ranked is not None:
                split, orders = _site_orders(units, costs, request)
            if split is not None:
                found.append((units, costs, split, "heuristic"))
                ranked = ranked or _diverse(orders)
        good = min((f[2].value for f in found), default=np.inf) * SWAP_WITHIN
        found = [(u, c, _improve_by_swaps(c, s, request) if s.value <= good else s, how) for u, c, s, how in found]
    best = None
    for units, costs, split, how in found:
        chosen, ranges = _break_tie(units, costs, split, tables, links, request, exact)
        pipeline = _pipeline(chosen, ranges, tables, links)
        key = (pipeline.objective_s(request.objective), pipeline.step_s, len(pipeline.stages))
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
        if d.id in alone:
            by_node.setdefault(d.node_id, []).append(d)
    for degree in TP_DEGREES:
        if profile.num_heads % degree or profile.num_kv_heads % degree:
            continue
        grouped, any_group = [], False
        for node_devices in by_node.values():
            groups = _groups(node_devices, degree, fleet, profile, request, alone) if len(node_devices) >= degree else []
            any_group |= bool(groups)
            grouped += groups or [alone[d.id] for d in node_devices]
        if any_group:
            configs.append(grouped)
    return configs


def _groups(devices: list, degree: int, fleet: FleetSnapshot, profile: ModelProfile, request: PlanRequest,
            alone: dict[str, Unit]) -> list[Unit]:
    """The node's devices in consecutive groups of degree (leftovers alone); [] if any group does not qualify."""
    units = []
    for i in range(0, len(devices) - len(devices) % degree, degree):
        members = tuple(devices[i:i + degree])
        unit = group_unit(tuple(alone[d.id] for d in members), group_link(fleet, members), profile, request)
        if unit is None:
            return []
        units.append(unit)
    return units + [alone[d.id] for d in devices[len(devices) - len(devices) % degree:]]


def _break_tie(units: list[Unit], costs: Costs, split: Split, tables: StageTables, links: LinkCosts,
               request: PlanRequest, exact: bool) -> tuple[list[Unit], list[tuple[int, int]]]:
    """Throughput: among the splits with the best bottleneck, the one with the smallest step."""
    if request.objective == "throughput":
        capped = _costs(units, list(costs.stage), links, request, "latency", cap=split.value * TIE)
        limit, exact_stages = request.stage_limit, request.num_stages is not None
        tie = (every_order(capped, limit, exact_stages) if exact
               else fixed_order(capped, split.units, limit, exact_stages))
        split = split if tie is None else tie
    return [units[i] for i in split.units], list(split.ranges)


def _costs(units: list[Unit], times: list[np.ndarray], links: LinkCosts, request: PlanRequest, objective: str,
           cap: float = np.inf) -> Costs:
    """Costs of one objective over units with stage times (tables.times of each); with cap, every stage or
    transfer slower than cap is forbidden."""
    throughput, n = objective == "throughput", len(units)
    stage = [np.where(t <= cap, t, np.inf) for t in times] if cap < np.inf else times
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
def _per_layer(configs: list[list[Unit]], tables: StageTables) -> dict[int, float]:
    """One middle layer's step time per unit (by object: configurations share their single units)."""
    units = list({id(u): u for config in configs for u in config}.values())
    middle = max(1, tables.profile.num_layers // 2)
    times = tables.times_of(units, middle - 1, middle)
    return {id(u): float(t) for u, t in zip(units, times, strict=True)}


def _candidates(units: list[Unit], tables: StageTables, request: PlanRequest,
                per_layer: dict[int, float]) -> list[Unit]:
    """The units of the MAX_SITES strongest sites (one more in a small fleet) and of pinned sites, fastest first
    within a site: all of them in a fleet of at most MAX_CANDIDATES units, else the UNITS_PER_SITE fastest of
    each. Units that cannot hold one layer are left out."""
    middle = max(1, tables.profile.num_layers // 2)
    by_site: dict[str, list[Unit]] = {}
    for u in units:
        if tables.memory_of(u)[middle - 1, middle] <= u.memory_bytes:
            by_site.setdefault(u.lead.site, []).append(u)
    cap = UNITS_PER_SITE if len(units) > MAX_CANDIDATES else len(units)   # a small fleet keeps every unit
    kept = {site: heapq.nsmallest(cap, members, key=lambda u: (per_layer[id(u)], -u.total_memory_bytes, u.lead.id))
            for site, members in by_site.items()}

    def strength(site: str) -> float:   # layers per second the site's kept units could serve
        return sum(1 / per_layer[id(u)] for u in kept[site])

    sites = sorted(kept, key=lambda s: (-strength(s), s))[:MAX_SITES + (len(units) <= MAX_CANDIDATES)]
    sites += [s for s in (request.first_site, request.last_site) if s in kept and s not in sites]
    return [u for site in sites for u in kept[site]]


SiteOrder = tuple[int, tuple[str, ...]]    # (1: fastest first inside a site, -1: slowest first; the sites)


def _site_orders(units: list[Unit], costs: Costs, request: PlanRequest, follow: list[SiteOrder] | None = None
                 ) -> tuple[Split | None, list[SiteOrder]]:
    """The best split over orders that keep each site's units together (fastest first, or slowest first), the
    pinned first site first and the pinned last site last, and the site orders tried, best first. When both
    pins name one site, its units also alternate between the front and the back (edge -> cloud -> edge).

    follow: site orders to try instead of all (another configuration's best: the order of the sites depends
    on the links, hardly on how a node's GPUs are grouped)."""
    sites = list(dict.fromkeys(u.lead.site for u in units))
    first, last = request.first_site, request.last_site
    middle = [s for s in sites if s not in (first, last)]
    if follow is None:
        orders = [(step, perm) for step in (1, -1) for perm in itertools.permutations(middle)]
    else:   # the followed orders, with the sites this configuration adds at the end
        orders = [(step, tuple(s for s in p if s in middle) + tuple(s for s in middle if s not in p))
                  for step, p in follow]
    tried: list[tuple[float, int, SiteOrder, Split]] = []
    for step, perm in dict.fromkeys(orders):
        members = {s: [i for i, u in enumerate(units) if u.lead.site == s][::step] for s in sites}
        head = members.get(first, [])
        tail = members[last] if last in members and last != first else []
        layouts = [(head, tail)]
        if first is not None and first == last:
            layouts.append((head[0::2], head[1::2]))
        for front, back in layouts:
            order = front + [i for s in perm for i in members[s]] + back
            split = fixed_order(costs, order, request.stage_limit, request.num_stages is not None)
            if split is not None:
                tried.append((split.value, len(tried), (step, perm), split))
    tried.sort(key=lambda t: t[:2])
    return (tried[0][3] if tried else None), list(dict.fromkeys(t[2] for t in tried))


def _diverse(orders: list[SiteOrder]) -> list[SiteOrder]:
    """The REUSE_ORDERS best site orders, and the best one that starts with each site."""
    leads: dict[tuple[str, ...], SiteOrder] = {}
    for order in orders:
        leads.setdefault(order[1][:1], order)
    return list(dict.fromkeys([*orders[:REUSE_ORDERS], *leads.values()]))


def _improve_by_swaps(costs: Costs, best: Split, request: PlanRequest) -> Split:
    """From the best split's order (its chosen units, then the unused ones), swap pairs of positions (nearest
    pairs first, at most SWAP_TRIALS) and keep every swap that helps."""
    order = list(best.units) + [i for i in range(len(costs.stage)) if i not in best.units]
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
    units = [tables.best(unit, a, b) for unit, (a, b) in zip(units, ranges, strict=True)]
    for k, (unit, (a, b)) in enumerate(zip(units, ranges, strict=True)):
        compute = tables.time_of(unit, a, b)
        codec, send_bytes = "", 0
        if k + 1 < len(units):
            transfer, hop = links.between(unit, units[k + 1])
            # priced raw, as the search priced it; a narrower codec only makes the link faster than predicted
            wire = wire_dtype(unit.dtype, units[k + 1].dtype)
            codec, send_bytes = choose_codec(wire, transfer, compute), links.payload_bytes(wire)
        else:
            transfer, hop = links.origin(unit)
        memory = int(tables.memory_of(unit)[a, b])       # per rank
        stages.append(PlannedStage(
            devices=tuple(d.id for d in unit.devices), start_layer=a, end_layer=b, backend=unit.speed.backend,
            dtype=unit.dtype, compute_s=compute, send_s=transfer, memory_bytes=memory,
            headroom_bytes=unit.memory_bytes - memory, kv_budget_bytes=tables.kv_reserve(unit, a, b),
            weights=unit.weights, codec=codec, send_bytes=send_bytes))
        step += compute + hop
        where = f"stage {k} ({unit.id}, layers {a}-{b})"
        slowest = max(slowest, (compute, f"compute of {where}"),
                      (transfer, f"transfer out of {where}"), key=lambda x: x[0])
    micro_batches = _micro_batches(stages, step, slowest[0])
    tokens_per_s = tables.request.step_tokens * min(micro_batches / step, 1 / slowest[0])
    return Pipeline(tuple(stages), slowest[0], step, slowest[1], micro_batches, tokens_per_s)


def _micro_batches(stages: list[PlannedStage], step_s: float, bottleneck_s: float) -> int:
    """Micro-batches in flight: one, plus as many more as every stage's headroom holds KV for, and no more than
    keep the slowest stage busy (ceil(step / bottleneck)). With m of them a pipeline finishes m micro-batches
    per step, or one per bottleneck, whichever is fewer."""
    useful = max(1, math.ceil(step_s / bottleneck_s - 1e-9))
    room = min((s.headroom_bytes // s.kv_budget_bytes for s in stages if s.kv_budget_bytes > 0), default=useful)
    return int(min(useful, 1 + max(0, room)))


def _plan(profile: ModelProfile, request: PlanRequest, pipelines: tuple[Pipeline, ...], how: str) -> Plan:
    plan = Plan(profile.name, request.objective, pipelines, sum(p.tokens_per_s for p in pipelines), "", search=how)
    return replace(plan, reason=describe.reason(plan, request))


def _canonical(fleet: FleetSnapshot, request: PlanRequest) -> FleetSnapshot:
    """Devices sorted by id (the same plan for any input order), excluded ones dropped."""
    devices = tuple(sorted((d for d in fleet.devices if d.id not in request.exclude), key=lambda d: d.id))
    return FleetSnapshot(devices, fleet.links, fleet.origin_site)
