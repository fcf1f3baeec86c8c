"""Predicted step costs of exo's ring split, Petals' greedy spans and plan_pipeline on seeded fleets, and plan time.

    python benchmarks/partition_compare.py [--fleets 1000] [--model llama-3.1-8b]
                                           [--objective throughput|latency] [--gap-fleets 100]
                                           [--gap-devices 10] [--quick]

Section 1: over --fleets seeded heterogeneous fleets (stratamesh/testbed/sim.py random_fleet: 1-3 edge sites of 1-4 boxes,
0-2 cloud nodes of 4 or 8 GPUs), each strategy places the model and partitioner.planner.evaluate scores the
placement with the cost model plan_pipeline minimises, so all three are judged by one model: the bottleneck
(throughput) or the step time (latency) of one decode step. A strategy whose placement does not fit (or that
cannot place at all) is infeasible on that fleet. Ratios are taken per fleet where all three are feasible.

Section 2: the heuristic's optimality gap. On --gap-fleets fleets of --gap-devices devices (beyond
planner.EXACT_UNITS units, where plan_pipeline uses the heuristic), the heuristic's objective over the exact
optimum of every ordered subset.

Section 3: plan_pipeline's wall time on large_fleet(seed, 10,000) for llama-3.1-70b (80 layers).

--quick: 30 fleets, 10 gap fleets and 1,000 devices, a smoke test.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from stratamesh.testbed import sim
from stratamesh.fleet.errors import PlacementError
from stratamesh.partitioner.fleet_snapshot import Device, FleetSnapshot, fleet_from_dict
from stratamesh.partitioner.plan import PlanRequest
from stratamesh.partitioner.planner import evaluate, plan_pipeline
from stratamesh.partitioner.profile import TOKEN_ID_BYTES, ModelProfile, profile_from_hf_config
from stratamesh.partitioner.proportional import split_layers

Placement = list[tuple[tuple[str, ...], int, int]]
TARGET_RATIO = 0.7          # ours / better of exo and Petals, median over fleets
TARGET_PLAN_S = 1.0         # plan_pipeline on 10,000 devices


# ------------------------------------------------------------------ exo
def exo_placement(profile: ModelProfile, fleet: FleetSnapshot, request: PlanRequest) -> Placement:
    """exo's RingMemoryWeightedPartitioningStrategy (github.com/exo-explore/exo, exo/topology/): every device in
    a ring ordered by memory, most first (ties by id, descending), each given layers in proportion to its memory.

    exo cuts [0, 1) into float shares and rounds them to layers; here the shares are rounded by largest remainder
    with at least one layer each (integer ranges), so a fleet with more devices than layers cannot be placed.
    No tensor parallelism; a device short of memory for its share makes the placement infeasible."""
    ring = sorted(fleet.devices, key=lambda d: (d.memory_bytes, d.id), reverse=True)
    ranges = split_layers(profile.num_layers, [max(d.memory_bytes, 1) for d in ring])
    return [((d.id,), start, end) for d, (start, end) in zip(ring, ranges, strict=True)]


# ------------------------------------------------------------------ Petals
@dataclass(frozen=True, slots=True, eq=False)
class Server:
    """A Petals server: the blocks [start, end) it holds and what it measured."""

    device: Device
    start: int
    end: int
    block_s: float              # one block of one step, as its own benchmark would measure
    overhead_s: float


def petals_placement(profile: ModelProfile, fleet: FleetSnapshot, request: PlanRequest) -> Placement:
    """Petals (Borzunov et al. 2023, "Distributed Inference and Fine-tuning of Large Language Models Over the
    Internet", NeurIPS; petals/server/block_selection.py and the client's min-latency routing).

    Servers join one at a time, fastest first. Each holds as many consecutive blocks as fit in its memory with a
    KV reserve, and puts them where the swarm is weakest: the span whose per-block throughputs (sums over the
    servers already there), sorted ascending, are lexicographically smallest. A server reports
    throughput = min(forward_rps / ((blocks + 1) / 2), network_rps). The client then routes the fastest chain
    through servers covering every block (shortest path: per-block compute plus a hop per server change).
    Adapted: Petals' client runs the embeddings and the LM head, here the first and last stage do, so every
    server keeps room for them. No rebalancing after joining."""
    servers = _join_swarm(profile, fleet, request)
    covered = {layer for s in servers for layer in range(s.start, s.end)}
    if len(covered) < profile.num_layers:
        raise PlacementError(f"Petals: the swarm's spans leave {profile.num_layers - len(covered)} blocks unserved")
    return _fastest_chain(servers, profile, fleet, request)


def _join_swarm(profile: ModelProfile, fleet: FleetSnapshot, request: PlanRequest) -> list[Server]:
    """Servers in join order (measured throughput, fastest first), each on its chosen span."""
    num_layers, candidates = profile.num_layers, []
    for device in fleet.devices:
        blocks = min(num_layers, _blocks_that_fit(profile, device, request))
        block_s = _block_s(profile, device, request)
        if blocks >= 1 and block_s is not None:
            forward_rps = request.step_tokens / block_s
            network_rps = fleet.link(None, device).bandwidth / profile.activation_bytes_per_token
            candidates.append((min(forward_rps / ((blocks + 1) / 2), network_rps), device, blocks, block_s))
    swarm_throughput, servers = [0.0] * num_layers, []
    for rps, device, blocks, block_s in sorted(candidates, key=lambda c: (-c[0], c[1].id)):
        start = min(range(num_layers - blocks + 1), key=lambda i: (sorted(swarm_throughput[i:i + blocks]), i))
        for layer in range(start, start + blocks):
            swarm_throughput[layer] += rps
        servers.append(Server(device, start, start + blocks, block_s, device.step_overhead_s))
    return servers


def _blocks_that_fit(profile: ModelProfile, device: Device, request: PlanRequest) -> int:
    """Whole blocks (weights + KV reserve) that fit beside the embedding and the head."""
    ends = profile.embed_bytes + profile.head_bytes - (profile.embed_bytes if profile.tied_embeddings else 0)
    kv = request.concurrency * request.context_len * max(profile.layer_kv_bytes_per_token)
    block = max(profile.layer_param_bytes(i) for i in range(profile.num_layers)) + kv
    return max(0, (device.memory_bytes - ends) // block)


def _block_s(profile: ModelProfile, device: Device, request: PlanRequest) -> float | None:
    """A roofline estimate of one block for one step (weights and KV read, matmul FLOPs); None if no speed."""
    speed = device.speed(profile.dtype)
    if speed is None:
        return None
    tokens, context = request.step_tokens, request.mean_context
    read = profile.layer_param_bytes(0) + tokens * context * profile.layer_kv_bytes_per_token[0]
    flops = tokens * (profile.layer_flops_per_token[0] + context * profile.layer_attn_flops_per_ctx[0])
    return max(read / speed.mem_bandwidth, flops / speed.flops)


def _fastest_chain(servers: list[Server], profile: ModelProfile, fleet: FleetSnapshot,
                   request: PlanRequest) -> Placement:
    """Shortest path over (layer boundary, server ending a stage there), origin to origin, covering [0, L)."""
    num_layers, hop = profile.num_layers, _hop_costs(profile, fleet, request)
    # best[b]: {server whose stage ends at layer b: (cost so far, its start a, the server before)}; None: origin
    best: list[dict[Server | None, tuple[float, int, Server | None]]] = [{None: (0.0, 0, None)}]
    arrivals: dict[tuple[int, int], tuple[float, Server | None] | None] = {}

    def arrive(a: int, s: Server) -> tuple[float, Server | None] | None:
        """The cheapest way to hand layer a to s (from another server, or the origin at a = 0)."""
        if (a, id(s)) not in arrivals:
            options = [(cost + hop(t, s), t) for t, (cost, _, _) in best[a].items() if t is not s]
            arrivals[(a, id(s))] = min(options, key=lambda o: o[0], default=None)
        return arrivals[(a, id(s))]

    for b in range(1, num_layers + 1):
        best.append({})
        for s in (s for s in servers if s.start < b <= s.end):
            for a in range(s.start, b):
                if (arrived := arrive(a, s)) is None:
                    continue
                cost = arrived[0] + s.overhead_s + (b - a) * s.block_s
                if s not in best[b] or cost < best[b][s][0]:
                    best[b][s] = (cost, a, arrived[1])
    if not best[num_layers]:
        raise PlacementError("Petals: no chain of servers covers every block")
    last = min(best[num_layers], key=lambda s: best[num_layers][s][0] + hop(s, None))
    chain, b, s = [], num_layers, last
    while s is not None:
        _, a, before = best[b][s]
        chain.append(((s.device.id,), a, b))
        b, s = a, before
    return chain[::-1]


def _hop_costs(profile: ModelProfile, fleet: FleetSnapshot, request: PlanRequest
               ) -> Callable[[Server | None, Server | None], float]:
    """hop(a, b): half a round trip plus the step's payload (activations, or token ids to/from the origin)."""
    activations = request.step_tokens * profile.activation_bytes_per_token
    tokens = request.step_tokens * TOKEN_ID_BYTES

    def hop(a: Server | None, b: Server | None) -> float:
        link = fleet.link(a.device if a else None, b.device if b else None)
        return link.rtt_s / 2 + (activations if a and b else tokens) / link.bandwidth
    return hop


# ------------------------------------------------------------------ scoring
STRATEGIES: dict[str, Callable[[ModelProfile, FleetSnapshot, PlanRequest], Placement]] = {
    "exo": exo_placement, "petals": petals_placement}
LABELS = {"exo": "exo: memory-proportional ring", "petals": "Petals: throughput-greedy spans",
          "ours": "stratamesh: plan_pipeline"}


@dataclass
class Results:
    """Per strategy, the objective on each fleet in seed order (None: infeasible), and oddities seen."""

    values: dict[str, list[float | None]]
    odd: dict[str, list[int]]           # what -> seeds


def score(profile: ModelProfile, fleet: FleetSnapshot, request: PlanRequest, strategy: str) -> float | None:
    """A baseline's placement scored by evaluate; None if it cannot place or a stage does not fit."""
    try:
        placement = STRATEGIES[strategy](profile, fleet, request)
        return evaluate(profile, fleet, request, placement).objective_s(request.objective)
    except PlacementError:
        return None


def score_ours(profile: ModelProfile, fleet: FleetSnapshot, request: PlanRequest) -> tuple[float | None, bool]:
    """plan_pipeline's placement scored by evaluate like the others (None: PlacementError), and whether that
    agrees with the plan's own prediction."""
    try:
        pipeline = plan_pipeline(profile, fleet, request).pipelines[0]
    except PlacementError:
        return None, True
    placement = [(s.devices, s.start_layer, s.end_layer) for s in pipeline.stages]
    value = evaluate(profile, fleet, request, placement).objective_s(request.objective)
    return value, math.isclose(value, pipeline.objective_s(request.objective), rel_tol=1e-9)


def compare(profile: ModelProfile, request: PlanRequest, seeds: Sequence[int]) -> Results:
    """Every strategy on random_fleet(seed) for each seed."""
    results = Results({name: [] for name in (*STRATEGIES, "ours")},
                      {"ours infeasible, a baseline feasible": [], "ours worse than the better baseline": [],
                       "evaluate(ours) differs from the plan": []})
    for seed in seeds:
        fleet = fleet_from_dict(sim.random_fleet(seed))
        base = {name: score(profile, fleet, request, name) for name in STRATEGIES}
        ours, consistent = score_ours(profile, fleet, request)
        for name, value in (*base.items(), ("ours", ours)):
            results.values[name].append(value)
        feasible = [v for v in base.values() if v is not None]
        odd = {"ours infeasible, a baseline feasible": ours is None and bool(feasible),
               "ours worse than the better baseline": ours is not None and bool(feasible)
               and ours > min(feasible) * (1 + 1e-9),
               "evaluate(ours) differs from the plan": not consistent}
        for what, happened in odd.items():
            if happened:
                results.odd[what].append(seed)
    return results


# ------------------------------------------------------------------ reporting
def spread(values: Sequence[float]) -> tuple[float, float, float]:
    """Median, 10th and 90th percentile (interpolated); NaNs for no values."""
    if not values:
        return math.nan, math.nan, math.nan
    if len(values) == 1:
        return values[0], values[0], values[0]
    deciles = statistics.quantiles(values, n=10, method="inclusive")
    return statistics.median(values), deciles[0], deciles[8]


def print_placements(results: Results, profile: ModelProfile, request: PlanRequest) -> None:
    """The strategies' table, the per-fleet ratios, the target line and the oddities."""
    num_fleets, what = len(results.values["ours"]), "bottleneck" if request.objective == "throughput" else "step"
    print(f"## Placement on {num_fleets} seeded fleets: {profile.name} ({profile.dtype}), objective "
          f"{request.objective}, predicted {what} per decode step of {request.step_tokens} tokens\n")
    print(f"| strategy | feasible fleets | median {what} (ms) | p10 (ms) | p90 (ms) |\n|---|---:|---:|---:|---:|")
    for name, values in results.values.items():
        feasible = [v * 1e3 for v in values if v is not None]
        median, p10, p90 = spread(feasible)
        print(f"| {LABELS[name]} | {len(feasible)} / {num_fleets} | {median:.2f} | {p10:.2f} | {p90:.2f} |")
    rows = [(e, p, o) for e, p, o in zip(*results.values.values(), strict=True) if None not in (e, p, o)]
    ratios = {"ours / exo": [o / e for e, _, o in rows], "ours / petals": [o / p for _, p, o in rows],
              "ours / min(exo, petals)": [o / min(e, p) for e, p, o in rows]}
    print(f"\n| ratio, per fleet where all three are feasible ({len(rows)} fleets) | median | p10 | p90 |"
          "\n|---|---:|---:|---:|")
    for name, values in ratios.items():
        print("| {} | {:.3f} | {:.3f} | {:.3f} |".format(name, *spread(values)))
    median = spread(ratios["ours / min(exo, petals)"])[0]
    verdict = "PASS" if median <= TARGET_RATIO else "FAIL"
    print(f"\nmedian ours / better-of-two <= {TARGET_RATIO}x: {verdict} ({median:.3f}x)\n")
    for what_odd, seeds in results.odd.items():
        print(f"- {what_odd}: {len(seeds)} fleets" + (f" (seeds {seeds[:10]})" if seeds else ""))


def heuristic_gaps(profile: ModelProfile, request: PlanRequest, seeds: Sequence[int],
                   num_devices: int) -> tuple[list[float], list[int]]:
    """heuristic / exact objective on random_fleet(seed, num_devices) for each seed where the exact search finds
    a plan, and the seeds where it does but the heuristic does not."""
    gaps, missed = [], []
    for seed in seeds:
        fleet = fleet_from_dict(sim.random_fleet(seed, num_devices=num_devices))
        try:
            exact = plan_pipeline(profile, fleet, request, search="exact").objective_s
        except PlacementError:
            continue
        try:
            gaps.append(plan_pipeline(profile, fleet, request, search="heuristic").objective_s / exact)
        except PlacementError:
            missed.append(seed)
    return gaps, missed


def print_heuristic_gaps(profile: ModelProfile, request: PlanRequest, num_fleets: int, num_devices: int) -> None:
    print(f"## The heuristic's gap: search='heuristic' against search='exact' (every ordered subset) on "
          f"random_fleet(seed, {num_devices}) for {profile.name}, objective {request.objective}\n")
    gaps, missed = heuristic_gaps(profile, request, range(num_fleets), num_devices)
    if not gaps:
        print("no fleet had an exact plan")
        return
    median, _, p90 = spread(gaps)
    print(f"| fleets with an exact plan | heuristic optimal | median | p90 | worst | heuristic found none |\n"
          f"|---:|---:|---:|---:|---:|---:|\n"
          f"| {len(gaps) + len(missed)} | {sum(g <= 1 + 1e-9 for g in gaps)} | {median:.4f} | {p90:.4f} | "
          f"{max(gaps):.4f} | {len(missed)} |")
    if missed:
        print(f"\n- the heuristic found no plan where the exact search did: seeds {missed[:10]}")


def plan_times(profile: ModelProfile, request: PlanRequest, num_devices: int, runs: int) -> list[float]:
    """Seconds plan_pipeline takes on large_fleet(seed, num_devices) for seeds 0..runs-1 (building it untimed)."""
    times = []
    for seed in range(runs):
        fleet = fleet_from_dict(sim.large_fleet(seed, num_devices))
        start = time.perf_counter()
        try:
            plan = plan_pipeline(profile, fleet, request)
            found = f"{len(plan.pipelines[0].stages)} stages, {plan.search}"
        except PlacementError as e:
            found = f"infeasible: {e}"
        times.append(time.perf_counter() - start)
        print(f"- seed {seed}: {times[-1]:.3f} s ({found})")
    return times


def print_plan_times(profile: ModelProfile, request: PlanRequest, num_devices: int, runs: int) -> None:
    print(f"## Planning time: plan_pipeline on large_fleet(seed, {num_devices:,}) for {profile.name} "
          f"({profile.num_layers} layers), objective {request.objective}\n")
    times = plan_times(profile, request, num_devices, runs)
    median = statistics.median(times)
    print(f"\n| devices | runs | median (s) | min (s) | max (s) |\n|---:|---:|---:|---:|---:|\n"
          f"| {num_devices:,} | {runs} | {median:.3f} | {min(times):.3f} | {max(times):.3f} |")
    print(f"\ntarget < {TARGET_PLAN_S:g} s: {'PASS' if median < TARGET_PLAN_S else 'FAIL'} ({median:.3f} s)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fleets", type=int, default=1000, help="seeded fleets to place the model on")
    parser.add_argument("--model", default="llama-3.1-8b", choices=sim.MODEL_NAMES)
    parser.add_argument("--objective", default="throughput", choices=("throughput", "latency"))
    parser.add_argument("--devices", type=int, default=10_000, help="devices of the planning-time fleet")
    parser.add_argument("--runs", type=int, default=3, help="planning-time runs (one fleet each)")
    parser.add_argument("--gap-fleets", type=int, default=100, help="fleets for the heuristic-vs-exact gap")
    parser.add_argument("--gap-devices", type=int, default=10, help="devices of each gap fleet")
    parser.add_argument("--quick", action="store_true", help="30 fleets, 10 gap fleets, 1,000 devices: a smoke test")
    args = parser.parse_args()
    fleets, devices = (30, 1000) if args.quick else (args.fleets, args.devices)
    gap_fleets = 10 if args.quick else args.gap_fleets
    request = PlanRequest(objective=args.objective)
    started = time.perf_counter()
    profile = profile_from_hf_config(sim.model_config(args.model), name=args.model)
    print_placements(compare(profile, request, range(fleets)), profile, request)
    print()
    print_heuristic_gaps(profile, request, gap_fleets, args.gap_devices)
    print()
    big = profile_from_hf_config(sim.model_config("llama-3.1-70b"), name="llama-3.1-70b")
    print_plan_times(big, request, devices, args.runs)
    print(f"\n(wall time {time.perf_counter() - started:.1f} s)")


if __name__ == "__main__":
    main()
