"""Plans: which agent serves which layers of each model, re-planned as agents come, go and get better."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path

from stratamesh.coordinator.control.drains import Drains, Move
from stratamesh.coordinator.control.events import Sessions
from stratamesh.coordinator.control.models import check_model, check_quantize, find_model
from stratamesh.coordinator.control.roster import Roster
from stratamesh.coordinator.control.routes import Routes
from stratamesh.coordinator.placement import (Hosts, Placement, SitePins, plan_stages, prediction, repair_stages,
                                              serving_cpu_of)
from stratamesh.coordinator.registry import ModelRecord, PlanRecord, Registry, StagePlacement, StageRecord
from stratamesh.fleet.errors import InvalidInput, PlacementError
from stratamesh.fleet.types import Assignment, Capabilities, StageSpec
from stratamesh.partitioner.plan import Plan

log = logging.getLogger(__name__)

# A plan replaced by a better one keeps its stages while generations still run on them, up to this long.
RETIRE_AFTER_S = 600.0


class Plans:
    """Every deployed model's plans: the active one serving, a standby loading beside it to take over, and the
    models waiting for enough agents to get a first one. It re-plans over the plannable agents when one dies
    or a clearly better plan appears, assigns planned stages to agents that lack them, and keeps stages no plan
    wants (retiring ones, while generations still run on them) until they can be released."""

    def __init__(self, registry: Registry, clock: Callable[[], float], roster: Roster, routes: Routes,
                 drains: Drains, sessions: Sessions, origin_host: str):
        self._registry = registry
        self._clock = clock
        self._roster = roster
        self._routes = routes
        self._drains = drains
        self._sessions = sessions
        self._origin_host = origin_host          # the host the origin computes on (planned as a CPU user there)
        self._pending: dict[str, int] = {}     # model id -> stages wanted for its first plan
        self._unplaceable: dict[str, frozenset[str]] = {}   # model id -> agents a re-plan failed with
        self._considered: dict[str, frozenset[str]] = {}    # model id -> agents its plan was last weighed against
        self._retiring: dict[str, float] = {}  # assignment id of a replaced plan -> when it goes regardless

    # ------------------------------------------------------------ models
    def add_model(self, model_id: str, path: str, num_stages: int, pins: SitePins = SitePins(),
                  quantize: str = "") -> None:
        """Registers a model (or updates its path, site pins and quantization: a served one takes them at its next
        re-plan) and asks for a plan of num_stages stages. quantize: "int8" for int8 weights (check_quantize)."""
        config = check_model(path, num_stages)
        check_quantize(quantize)
        self._registry.add_model(model_id, str(Path(path).resolve()), config["num_hidden_layers"],
                                 config, self._clock(), first_site=pins.first, last_site=pins.last, quantize=quantize)
        if self._registry.active_plan(model_id) is None:
            self._pending[model_id] = num_stages
        self.reconcile()

    def num_stages(self, model_id: str) -> int:
        """Stages of the model's serving plan, or of the plan it waits for (0 if neither)."""
        plan = self._registry.active_plan(model_id)
        return len(plan.stages) if plan else self._pending.get(model_id, 0)

    def replan(self, model_id: str, num_stages: int | None = None) -> tuple[str, str]:
        """An operator's re-plan: the best plan over the agents there are now loads beside the serving one and
        takes over once ready ("standby"). ("unchanged", why) if the serving plan is that plan; ("waiting", why)
        if the model has no plan yet and too few agents. ModelNotFound, or PlacementError if no plan fits."""
        find_model(self._registry, model_id)
        plan = self._registry.active_plan(model_id)
        num_stages = num_stages or self.num_stages(model_id) or 1
        if num_stages < 1:
            raise InvalidInput(f"num_stages must be >= 1, got {num_stages}")
        if plan is None:
            self._pending[model_id] = num_stages
            self.reconcile()
            plan = self._registry.active_plan(model_id)
            return ("planned", plan.reason) if plan else (
                "waiting", f"waiting for {num_stages} agent(s); {len(self.plannable())} can take a stage")
        planned, placed = self._best_plan(model_id, num_stages)
        if [(agent, s.start_layer, s.end_layer, s.tp_degree) for agent, s in placed] == _placement(plan):
            return "unchanged", f"the serving plan is still the best one. {planned.reason}"
        if self._registry.standby_plan(model_id) is not None:
            self._registry.abandon_standby(model_id)
        self._save_plan(model_id, planned, placed, standby=True)
        self.reconcile()
        return "standby", planned.reason

    # ------------------------------------------------------------ planned stages
    def plannable(self) -> dict[str, Capabilities]:
        """Connected agents not banned for flapping nor being drained, and what they can do."""
        return self._roster.plannable(excluded=self._drains.excluded)

    def planned_for(self, agent_id: str) -> dict[str, StageRecord]:
        return {s.assignment_id: s for s in self._planned_stages() if s.agent_id == agent_id}

    def _planned_stages(self) -> list[StageRecord]:
        """Every stage of every model's active plan, of the standby plan it moves to next, and of a drain."""
        stages = self._drains.stages()
        for model in self._registry.models():
            for plan in (self._registry.active_plan(model.model_id), self._registry.standby_plan(model.model_id)):
                stages += plan.stages if plan else ()
        return stages

    def set_stage_state(self, assignment_id: str, state: str) -> None:
        if not self._drains.set_stage_state(assignment_id, state):
            self._registry.set_stage_state(assignment_id, state)

    def restart(self) -> list[str]:
        """After a (re)start no stage is known loaded: every active stage is assigned again; returns their agents."""
        agents = []
        for model in self._registry.models():
            plan = self._registry.active_plan(model.model_id)
            for stage in plan.stages if plan else ():
                self._registry.set_stage_state(stage.assignment_id, "assigned")
                agents.append(stage.agent_id)
        return agents

    def unload(self, agent_id: str) -> None:
        """The agent's stream ended: its planned stages are assigned, not loaded."""
        for assignment_id in self.planned_for(agent_id):
            self._registry.set_stage_state(assignment_id, "assigned")

    # ------------------------------------------------------------ planning
    def replan_lost(self) -> None:
        """Re-plans every model whose active plan has a stage on a dead agent, over the agents there are."""
        plannable = frozenset(self.plannable())
        liveness = self._roster.liveness
        for model in self._registry.models():
            plan = self._registry.active_plan(model.model_id)
            if plan is None or self._unplaceable.get(model.model_id) == plannable:
                continue
            standby = self._registry.standby_plan(model.model_id)
            if standby and any(liveness.is_dead(s.agent_id) for s in standby.stages):
                self._registry.abandon_standby(model.model_id)
            dead = sorted({s.agent_id for s in plan.stages if liveness.is_dead(s.agent_id)})
            if dead:
                log.warning("re-planning %s: agents %s are dead", model.model_id, ", ".join(dead))
                if not self._plan(model.model_id, len(plan.stages), previous=plan):
                    self._unplaceable[model.model_id] = plannable
        self.release_unplanned()
        self.reconcile()

    def improve(self) -> None:
        """Weighs each ready model's plan against the agents there are now (one joined, or a ban ended): a
        clearly better plan becomes a standby, loaded beside the serving one and switched to once ready."""
        plannable = frozenset(self.plannable())
        for model in self._registry.models():
            plan = self._registry.active_plan(model.model_id)
            if plan is None or self._considered.get(model.model_id) == plannable \
                    or not self._routes.is_ready(model.model_id) \
                    or self._registry.standby_plan(model.model_id) is not None:
                continue
            self._considered[model.model_id] = plannable
            if self._plan(model.model_id, len(plan.stages), previous=plan, standby=True):
                self.reconcile()

    def promote_standbys(self) -> None:
        """Switches each model whose standby plan is loaded to it; the replaced stages retire."""
        now = self._clock()
        for model in self._registry.models():
            standby = self._registry.standby_plan(model.model_id)
            if standby is None or not all(self._roster.serving(s) for s in standby.stages):
                continue
            replaced = self._registry.active_plan(model.model_id)
            self._registry.activate_plan(model.model_id, standby.plan_id)
            self._registry.log_event("plan_activated", standby.reason, now)
            log.info("%s switched to plan %s; the stages it replaces retire once idle", model.model_id,
                     standby.plan_id)
            self.retire([stage.assignment_id for stage in replaced.stages] if replaced else [], now)
        self.release_unplanned()

    def retire(self, assignment_ids: list[str], now: float) -> None:
        """Stages replaced: they stay loaded while generations run on them, up to RETIRE_AFTER_S."""
        for assignment_id in assignment_ids:
            self._retiring[assignment_id] = now + RETIRE_AFTER_S

    def stop_retiring(self, assignment_ids: list[str]) -> None:
        for assignment_id in assignment_ids:
            self._retiring.pop(assignment_id, None)

    def release_unplanned(self) -> None:
        """Releases loaded stages that no plan wants, once no generation runs on them (or they retired long ago)."""
        now, in_use = self._clock(), set(self._sessions.assignments_in_use())
        for assignment_id, until in list(self._retiring.items()):
            if assignment_id not in in_use or now >= until:
                del self._retiring[assignment_id]
        self._roster.release_all_but({s.assignment_id for s in self._planned_stages()} | set(self._retiring))

    def reconcile(self) -> None:
        """Plans models that wait for agents, and assigns planned stages whose agent lacks them."""
        for model_id, num_stages in list(self._pending.items()):
            if len(self.plannable()) >= num_stages and self._plan(model_id, num_stages):
                del self._pending[model_id]
        for stage in self._planned_stages():
            if self._roster.lacks(stage) and stage.state not in ("loading", "failed"):
                self.set_stage_state(stage.assignment_id, "loading")
                self._roster.send(stage.agent_id, Assignment(stage.assignment_id, stage.spec))
        self._routes.notify()

    def moves_off(self, agent_id: str) -> list[Move]:
        """A spare for every stage of the agent, layer range unchanged (PlacementError if none fits)."""
        agents = {a: caps for a, caps in self.plannable().items() if a != agent_id}
        moves = []
        for model in self._registry.models():
            plan = self._registry.active_plan(model.model_id)
            if plan is None or all(s.agent_id != agent_id for s in plan.stages):
                continue
            chosen = repair_stages(model.model_id, model.path, model.config, agents, _placement(plan),
                                   self._registry.links(), _pins(model), self._hosts(agents), model.quantize)
            # the spare's own device and dtype (a KV move needs the same dtype: else the session is replayed)
            moves += [(s, StageRecord(f"{s.assignment_id}-m{uuid.uuid4().hex[:6]}", plan.plan_id, s.stage_index,
                                      spare, replace(s.spec, device=spec.device, dtype=spec.dtype,
                                                     quantize=spec.quantize), "assigned"))
                      for s, (spare, spec) in zip(plan.stages, chosen, strict=True) if s.agent_id == agent_id]
        return moves

    def _plan(self, model_id: str, num_stages: int, previous: PlanRecord | None = None,
              standby: bool = False) -> bool:
        """Saves a new plan for the model over the plannable agents; False if none fits.

        previous: the plan serving now, kept where it still fits unless moving is clearly better (its lost
        stages go to spares). standby: the new plan loads beside it, and is saved only if it moves layers."""
        try:
            planned, placed = self._best_plan(model_id, num_stages, _placement(previous) if previous else [])
        except PlacementError as exc:
            log.error("cannot place %s: %s", model_id, exc)
            self._registry.log_event("placement_failed", str(exc), self._clock())
            return False
        if standby and planned.search == "kept":
            return False
        self._save_plan(model_id, planned, placed, standby)
        return True

    def _best_plan(self, model_id: str, num_stages: int,
                   previous: Placement = ()) -> tuple[Plan, list[tuple[str, StageSpec]]]:
        """The planner's best plan for the model over the plannable agents (PlacementError if none fits)."""
        model = self._registry.model(model_id)
        agents = self.plannable()
        if len(agents) < num_stages:
            raise PlacementError(f"cannot place {model_id} yet: {len(agents)} of {num_stages} agents")
        return plan_stages(model_id, model.path, model.config, agents, num_stages, self._registry.links(),
                           previous, _pins(model), self._hosts(agents), model.quantize)

    def _hosts(self, agents: Mapping[str, Capabilities]) -> Hosts:
        """Where the origin computes, and the serving path's CPU per token the agents' telemetry measured."""
        return Hosts(self._origin_host, serving_cpu_of(agents, self._roster.telemetry))

    def _save_plan(self, model_id: str, planned: Plan, placed: list[tuple[str, StageSpec]], standby: bool) -> None:
        plan_id = uuid.uuid4().hex[:12]
        stages = [StagePlacement(f"{plan_id}-{i}", i, agent_id, spec)
                  for i, (agent_id, spec) in enumerate(placed)]
        reason = planned.reason
        self._registry.save_plan(plan_id, model_id, stages, reason, self._clock(), standby=standby,
                                 prediction=prediction(planned))
        self._registry.log_event("standby_plan" if standby else "plan", reason, self._clock())
        self._unplaceable.pop(model_id, None)
        log.info("%s %s: %s", "standby plan for" if standby else "planned", model_id, reason)


def _placement(plan: PlanRecord) -> list[tuple[str, int, int, int]]:
    """(agent, start layer, end layer, tp degree) of each stage of the plan, in pipeline order."""
    return [(s.agent_id, s.spec.start_layer, s.spec.end_layer, s.spec.tp_degree) for s in plan.stages]


def _pins(model: ModelRecord) -> SitePins:
    return SitePins(model.first_site, model.last_site)
