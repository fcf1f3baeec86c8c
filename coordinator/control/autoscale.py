"""The autoscaler's decision for one model: how many replicas its load wants within the operator's bounds, and which
to give back. Pure: demand, replicas and the time in; a Decision (or none) out. coordinator/autoscaler.py runs it.

Up, before the targets are missed: the arrivals' tokens/s (Demand) against what the planner predicts a replica
carries, at UTILIZATION of it; and, after they are missed with requests in flight, one more replica (once every
replica is ready and the window has seen the last one serve). A request waiting on a model scaled to zero wants one.
Down, one at a time: once the load has wanted fewer for the policy's scale_down_after_s without a target missed;
the replica whose boxes are nearest their owners' limits goes first.

A replica added for a missed target is a trial: once it serves and the window has seen it, the miss must have
shrunk (by HELPED of what it was, unless the arrivals grew by GREW meanwhile); else it is given back at once and
no replica is added for a missed target for BACKOFF_S (boxes that share their cores, or a bottleneck replicas do
not widen, such as the origin: more replicas would only hold more boxes, or slow every step).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from stratamesh.coordinator.demand import Demand
from stratamesh.coordinator.records import Autoscale

UTILIZATION = 0.75      # a replica is asked to carry at most this share of the tokens/s predicted for it
HELPED = 0.9            # a replica added for a missed target helped if the miss fell below this share of it
GREW = 1.2              # ... or the arrivals grew by this factor meanwhile (the miss then says nothing of it)
BACKOFF_S = 300.0       # after a replica that did not help, none is added for a missed target for this long


@dataclass(frozen=True, slots=True)
class ReplicaLoad:
    """One replica of the model as the decision sees it."""

    replica: int
    ready: bool
    tokens_per_s: float | None = None   # what the planner predicts its plan carries (None: no prediction)
    limits_near: float = 0.0            # how near its nearest box is to its owner's limits (1: at one)


@dataclass(slots=True)
class Scaling:
    """What the autoscaler remembers of a model between decisions."""

    fewer_since: float | None = None    # since when the load has wanted fewer replicas
    added_at: float = -math.inf         # when replicas were last added
    capacity: float | None = None       # a replica's predicted tokens/s, remembered through zero replicas
    trial: Trial | None = None          # the last replica added for a missed target, until it is judged
    backoff_until: float = -math.inf    # no replica is added for a missed target before then


@dataclass(frozen=True, slots=True)
class Trial:
    """A replica added for a missed target: the miss and the arrivals when it was added."""

    replica: int
    miss: float                 # the worst p90 over its target (1.2: 20% over)
    arrivals_per_s: float


@dataclass(frozen=True, slots=True)
class Decision:
    replicas: int
    give_back: tuple[int, ...]          # the replicas that go, first to last
    reason: str


def decide(policy: Autoscale, demand: Demand, replicas: Sequence[ReplicaLoad], current: int, state: Scaling,
           now: float) -> Decision | None:
    """The change the model's replicas need now, or None. current: the replicas it wants now (some may load)."""
    if current != policy.bound(current):        # the operator moved the bounds
        return _change(policy.bound(current), current, replicas, state, now, "outside its bounds "
                       f"{policy.min_replicas}..{policy.max_replicas}")
    predicted = [r.tokens_per_s for r in replicas if r.tokens_per_s]
    if predicted:
        state.capacity = sum(predicted) / len(predicted)
    need, why = _by_rate(demand, state.capacity, current)
    missed = _missed(policy, demand)
    settled = len(replicas) == current and all(r.ready for r in replicas) and now - state.added_at >= demand.window_s
    if settled and state.trial is not None:
        trial = state.trial
        failed = _judge_trial(state, policy, demand, now)
        if failed:
            return _change(current - 1, current, replicas, state, now, failed, first=(trial.replica,))
        state.trial = None
    if missed and demand.in_flight and settled and need <= current and now >= state.backoff_until \
            and current < policy.max_replicas:
        state.trial = Trial(current, _miss(policy, demand), demand.arrivals_per_s)
        need, why = current + 1, f"{missed} with {demand.in_flight} request(s) in flight"
    if demand.in_flight and need < 1:
        need, why = 1, f"{demand.in_flight} request(s) in flight"
    if current == 0 and demand.waiting:
        why = f"cold start: {demand.waiting} request(s) wait for a replica; {why}"
    wanted = policy.bound(need)
    if wanted > current:
        return _change(wanted, current, replicas, state, now, why)
    if wanted == current or missed:
        state.fewer_since = None
        return None
    if state.fewer_since is None:
        state.fewer_since = now
    if now - state.fewer_since < policy.scale_down_after_s:
        return None
    quiet = f"for {policy.scale_down_after_s:g} s {why}" if demand.arrivals_per_s else \
        f"no request for {policy.scale_down_after_s:g} s"
    return _change(current - 1, current, replicas, state, now, quiet)


def _by_rate(demand: Demand, capacity: float | None, current: int) -> tuple[int, str]:
    """The replicas the arrivals' tokens/s want at UTILIZATION of a replica's predicted tokens/s, and why."""
    asked = demand.tokens_per_s
    if not asked:
        return 0, "no request arrives"
    if not capacity:
        return max(current, 1), "requests arrive and no replica's speed is predicted yet"
    need = math.ceil(asked / (capacity * UTILIZATION))
    return need, (f"{demand.arrivals_per_s:.2f} requests/s x {demand.tokens_per_request:.0f} tokens = "
                  f"{asked:.0f} tokens/s want {need} replica(s) at {UTILIZATION:.0%} of the {capacity:.0f} tokens/s "
                  "predicted for one")


def _judge_trial(state: Scaling, policy: Autoscale, demand: Demand, now: float) -> str:
    """Why the replica on trial did not help ("" if it did, or the arrivals grew too much to say)."""
    trial, miss = state.trial, _miss(policy, demand)
    if miss < HELPED * trial.miss or demand.arrivals_per_s > GREW * trial.arrivals_per_s:
        return ""
    state.trial, state.backoff_until = None, now + BACKOFF_S
    return (f"replica {trial.replica}, added for a missed target, did not help: the worst p90 was {trial.miss:.2f}x "
            f"its target then and is {miss:.2f}x now (the boxes may share their cores, or the bottleneck is one "
            f"replicas do not widen); no replica is added for a missed target for {BACKOFF_S:g} s")


def _p90s(policy: Autoscale, demand: Demand) -> list[tuple[str, float, float]]:
    """(name, the window's p90 in ms, its target in ms) of each target set and measured."""
    return [(name, value * 1e3, target)
            for name, value, target in (("time to first token", demand.ttft_p90_s, policy.slo_ttft_ms),
                                        ("inter-token latency", demand.itl_p90_s, policy.slo_itl_ms))
            if value is not None and target is not None]


def _miss(policy: Autoscale, demand: Demand) -> float:
    """The worst of the window's p90s over its target (0 where none is measured or set)."""
    return max((ms / target for _, ms, target in _p90s(policy, demand)), default=0.0)


def _missed(policy: Autoscale, demand: Demand) -> str:
    """The targets the window's p90s miss, in words ("" for none)."""
    return "; ".join(f"the p90 {name} {ms:.0f} ms is above its target {target:g} ms"
                     for name, ms, target in _p90s(policy, demand) if ms > target)


def _change(wanted: int, current: int, replicas: Sequence[ReplicaLoad], state: Scaling, now: float,
            why: str, first: tuple[int, ...] = ()) -> Decision:
    """The decision from current to wanted replicas; those given back: the replicas in first, then those whose
    boxes are nearest their owners' limits, then the last."""
    if wanted > current:
        state.added_at, state.fewer_since = now, None
        return Decision(wanted, (), f"{current} -> {wanted} replicas: {why}")
    state.fewer_since = now if wanted > 0 else None     # the next step down waits a cool-down of its own
    order = sorted(replicas, key=lambda r: (r.replica not in first, -r.limits_near, -r.replica))
    going = order[:current - wanted]
    near = [r for r in going if r.limits_near > 0 and r.replica not in first]
    owners = f"; replica {near[0].replica} goes first: its boxes are at {near[0].limits_near:.0%} of their " \
        "owners' limits" if near else ""
    return Decision(wanted, tuple(r.replica for r in going), f"{current} -> {wanted} replicas: {why}{owners}")
