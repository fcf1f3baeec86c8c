"""The autoscaler: every autoscaled model's replicas follow its load (control/autoscale.py decides, Plans.scale
acts), each change an event with its reason, and the replicas over time kept for the admin API and UI."""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from stratamesh.coordinator.control.autoscale import ReplicaLoad, Scaling, decide
from stratamesh.coordinator.control.deployer import Deployer
from stratamesh.coordinator.demand import DemandMeter
from stratamesh.coordinator.records import ModelRecord, PlanRecord

log = logging.getLogger(__name__)

TICK_S = 1.0                # how often the autoscaler weighs every autoscaled model
HISTORY_S = 600.0           # the replicas over time kept per model
HISTORY_EVERY_S = 5.0       # a point at least this often, and at every change


@dataclass(frozen=True, slots=True)
class ReplicaPoint:
    """The replicas a model wanted and had ready at one moment."""

    t: float
    desired: int
    ready: int


@dataclass(slots=True)
class _ModelScaling:
    scaling: Scaling
    history: deque[ReplicaPoint]
    cold_since: float | None = None     # when a replica was asked for with none serving (a cold start)
    last_reason: str = ""
    last_cold_start_s: float | None = None


class Autoscaler:
    """Runs the decision for each autoscaled model every TICK_S (tick()), from the API's demand (DemandMeter) and
    the planner's predictions of each replica's plan."""

    def __init__(self, deployer: Deployer, demand: DemandMeter, clock: Callable[[], float]) -> None:
        self._deployer = deployer
        self._demand = demand
        self._clock = clock
        self._models: dict[str, _ModelScaling] = {}

    def tick(self) -> None:
        now = self._clock()
        for model in self._deployer.registry.models():
            if model.autoscale is None:
                self._models.pop(model.model_id, None)
                continue
            self._weigh(model, now)

    def history(self, model_id: str) -> list[ReplicaPoint]:
        scaled = self._models.get(model_id)
        return list(scaled.history) if scaled else []

    def last_reason(self, model_id: str) -> str:
        scaled = self._models.get(model_id)
        return scaled.last_reason if scaled else ""

    def last_cold_start_s(self, model_id: str) -> float | None:
        """How long the model's last start from zero replicas took, to its first ready replica."""
        scaled = self._models.get(model_id)
        return scaled.last_cold_start_s if scaled else None

    def _weigh(self, model: ModelRecord, now: float) -> None:
        scaled = self._models.get(model.model_id)
        if scaled is None:
            scaled = self._models[model.model_id] = _ModelScaling(Scaling(), deque())
        routes, registry = self._deployer.routes, self._deployer.registry
        plans = [p for p in registry.active_plans(model.model_id) if not p.canary]
        replicas = [ReplicaLoad(plan.replica, routes.serves(plan), plan.prediction.get("tokens_per_s"),
                                self._limits_near(plan)) for plan in plans]
        ready = sum(r.ready for r in replicas)
        if scaled.cold_since is not None and ready:
            scaled.last_cold_start_s = now - scaled.cold_since
            registry.log_event("cold_start", f"{model.model_id}: a replica serves {scaled.last_cold_start_s:.1f} s "
                               "after the first was asked for", now)
            scaled.cold_since = None
        decision = decide(model.autoscale, self._demand.demand(model.model_id, now), replicas, model.num_replicas,
                          scaled.scaling, now)
        desired = model.num_replicas
        if decision is not None:
            desired = decision.replicas
            given_back = self._deployer.plans.scale(model.model_id, desired, decision.give_back)
            scaled.cold_since = now if model.num_replicas == 0 and desired > 0 else None
            reason = f"{model.model_id}: {decision.reason}"
            if given_back:
                reason += f" (its {len(given_back)} stage(s) finish their generations, then are released)"
            scaled.last_reason = reason
            registry.log_event("replicas_scaled", reason, now)
            log.info("autoscaler: %s", reason)
        self._record(scaled, ReplicaPoint(now, desired, ready))

    def _limits_near(self, plan: PlanRecord) -> float:
        telemetry = self._deployer.roster.telemetry
        return max((t.limits_near for s in plan.stages if (t := telemetry.get(s.agent_id)) is not None), default=0.0)

    @staticmethod
    def _record(scaled: _ModelScaling, point: ReplicaPoint) -> None:
        history = scaled.history
        last = history[-1] if history else None
        if last is None or (last.desired, last.ready) != (point.desired, point.ready) \
                or point.t - last.t >= HISTORY_EVERY_S:
            history.append(point)
        while history and history[0].t < point.t - HISTORY_S:
            history.popleft()
