"""Plans: which agent serves which layers of each model, re-planned as agents come, go and get better."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path

from stratamesh.coordinator.control.drains import Drains, Move
from stratamesh.coordinator.control.sessions import Sessions
from stratamesh.coordinator.control.models import check_model, check_quantize, find_model
from stratamesh.fleet.model_folder import revision_of, stored_quantize
from stratamesh.fleet.sessions import Speculation
from stratamesh.coordinator.control.roster import Roster
from stratamesh.coordinator.control.routes import Routes
from stratamesh.coordinator.placement import (Hosts, Placement, SitePins, plan_stages, prediction, repair_stages,
                                              serving_cpu_of, smallest_stage_bytes)
from stratamesh.coordinator.records import (CANARY_REPLICA, ROLLOUT_STEP_S, ROLLOUT_STEPS, Autoscale, ModelRecord,
                                            PlanRecord, Rollout, StageRecord)
from stratamesh.coordinator.registry_store import RegistryStore
from stratamesh.fleet.errors import InvalidInput, ModelNotFound, PlacementError
from stratamesh.fleet.states import PlanState, RolloutState, StageState
from stratamesh.fleet.boxes import Capabilities
from stratamesh.fleet.stages import Assignment, StageSpec
from stratamesh.partitioner.plan import Plan

log = logging.getLogger(__name__)

# A plan replaced by a better one keeps its stages while generations still run on them, up to this long.
RETIRE_AFTER_S = 600.0
# Boxes that could hold a stage and join in a burst (a site powering up, a fleet rollout) are weighed together: the
# planner looks for a better plan, and for a first plan or a replica that did not fit before, once the joins pause
# for JOINS_SETTLE_S, and while they keep coming, every JOINS_SETTLE_MAX_S. A thousand joins cost a few plans.
JOINS_SETTLE_S = 1.0
JOINS_SETTLE_MAX_S = 5.0


class Plans:
    """Every deployed model's plans: for each of its replicas (pipelines serving it side by side, each on agents
    of its own) the active plan serving, a standby loading beside it to take over; and the models waiting for
    enough agents to get a first one. It re-plans a replica over the plannable agents when one of its agents dies
    or a clearly better plan appears, plans a further replica once the agents the others leave can hold one,
    assigns planned stages to agents that lack them, and keeps stages no plan wants (retiring ones, while
    generations still run on them) until they can be released."""

    def __init__(self, registry: RegistryStore, clock: Callable[[], float], roster: Roster, routes: Routes,
                 drains: Drains, sessions: Sessions, origin_host: str):
        self._registry = registry
        self._clock = clock
        self._roster = roster
        self._routes = routes
        self._drains = drains
        self._sessions = sessions
        self._origin_host = origin_host          # the host the origin computes on (planned as a CPU user there)
        self._pending: dict[str, int] = {}     # model id -> stages wanted for its first plan
        # (model id, replica) -> the agents a plan of it failed with / its plan was last weighed against
        self._unplaceable: dict[tuple[str, int], frozenset[str]] = {}
        self._considered: dict[tuple[str, int], frozenset[str]] = {}
        self._stage_bytes: dict[str, int] = {}     # model id -> smallest_stage_bytes
        self._least_stage_bytes: int | None = None     # ... the least of them over every model (None: unknown)
        self.num_computed = 0       # plans the planner computed (kept or not): what joins and losses cost
        self._retiring: dict[str, float] = {}  # assignment id of a replaced plan -> when it goes regardless
        self._joins: tuple[float, float] | None = None     # (first, last) join of a burst not weighed yet
        self._weighed_at = float("-inf")                   # when the last burst was

    # ------------------------------------------------------------ models
    def add_model(self, model_id: str, path: str, num_stages: int, pins: SitePins = SitePins(),
                  quantize: str = "", num_replicas: int = 1, speculation: Speculation | None = None,
                  autoscale: Autoscale | None = None) -> None:
        """Registers a model (or updates its path, site pins, quantization, replicas, speculative decoding and
        autoscaling: a served one takes the first three at its next re-plan, fewer replicas and its speculation at
        once) and asks for a plan of num_stages stages for each of num_replicas replicas. quantize: "int8" or
        "int4" for quantized weights (check_quantize); "": as stored (a GGUF file's nearest format:
        fleet.model_folder.stored_quantize). speculation: its generations' (None: the coordinator's default).
        autoscale: its replicas follow its load within these bounds (coordinator/autoscaler.py), starting from
        its minimum (one at least); num_replicas is then ignored."""
        config = check_model(path, num_stages)
        check_quantize(quantize)
        quantize = quantize or stored_quantize(path)
        if autoscale is not None:
            served = self._registry.model(model_id)
            num_replicas = autoscale.bound(served.num_replicas) if served and served.autoscale else autoscale.start
        self._stage_bytes.pop(model_id, None)       # its config or quantization may be new
        self._least_stage_bytes = None
        self._registry.add_model(model_id, str(Path(path).resolve()), config["num_hidden_layers"],
                                 config, self._clock(), first_site=pins.first, last_site=pins.last, quantize=quantize,
                                 num_replicas=num_replicas, num_stages=num_stages, speculation=speculation,
                                 autoscale=autoscale, revision=revision_of(path))
        self._registry.drop_replicas(model_id, keep=num_replicas)
        self._wait_for_first_plan(model_id, num_stages)
        self.release_unplanned()
        self.reconcile()

    def start_rollout(self, model_id: str, path: str, steps: Sequence[int] | None = None,
                      step_s: float | None = None) -> Rollout:
        """Starts rolling out another revision of a served model (a folder of the same shape: another one, or its own
        changed): a canary replica of it is planned on agents of its own and takes the first of steps' shares of the
        requests (coordinator/rollouts.py steps it up, promotes or rolls it back). ModelNotFound; InvalidInput for a
        model not serving yet, a rollout already running, a folder that is no other revision or bad steps."""
        model = self._registry.model(model_id)
        if model is None:
            raise ModelNotFound(f"the model '{model_id}' does not exist")
        if model.rollout is not None and model.rollout.active:
            raise InvalidInput(f"a rollout of {model_id!r} (revision {model.rollout.revision}) is running: let it end, "
                               "or roll it back, first")
        if self._registry.active_plan(model_id) is None:
            raise InvalidInput(f"{model_id!r} serves no replica yet: deploy it rather than roll it out")
        num_stages = self.num_stages(model_id)
        check_model(path, num_stages)
        revision = revision_of(path)
        if revision == model.revision:
            raise InvalidInput(f"{path} is the revision {model_id!r} serves ({revision}): nothing to roll out")
        now = self._clock()
        rollout = Rollout(str(Path(path).resolve()), revision, tuple(steps or ROLLOUT_STEPS),
                          ROLLOUT_STEP_S if step_s is None else step_s, started_s=now, step_since_s=now)
        self._registry.set_rollout(model_id, rollout)
        self._unplaceable.pop((model_id, CANARY_REPLICA), None)
        self.reconcile()
        return rollout

    def promote_canary(self, model_id: str, why: str) -> None:
        """The rollout's revision serves the model from now: the canary becomes its first replica, the serving
        replicas retire (their generations finish) and the others are planned again, of the new revision."""
        model = self._registry.model(model_id)
        rollout = model.rollout
        num_stages = self.num_stages(model_id)
        config = check_model(rollout.path, num_stages)
        self._registry.add_model(model_id, rollout.path, config["num_hidden_layers"], config, self._clock(),
                                 model.first_site, model.last_site, model.quantize, model.num_replicas,
                                 model.num_stages, model.speculation, model.autoscale, rollout.revision)
        serving = [plan for plan in self._registry.active_plans(model_id) if not plan.canary]
        for plan in serving:
            self._registry.drop_replica(model_id, plan.replica)
        self._registry.move_replica(model_id, CANARY_REPLICA, 0)
        self.retire([s.assignment_id for plan in serving for s in plan.stages], self._clock())
        self._registry.set_rollout(model_id, replace(rollout, state=RolloutState.PROMOTED, reason=why))
        self._forget_weighings(model_id)
        self._stage_bytes.pop(model_id, None)
        self.release_unplanned()
        self.reconcile()

    def roll_back(self, model_id: str, why: str) -> None:
        """Gives the rollout's canary back (its generations finish); the serving revision serves on alone."""
        model = self._registry.model(model_id)
        canary = self._registry.active_plan(model_id, CANARY_REPLICA)
        self._registry.drop_replica(model_id, CANARY_REPLICA)
        self.retire([s.assignment_id for s in canary.stages] if canary else [], self._clock())
        self._registry.set_rollout(model_id, replace(model.rollout, state=RolloutState.ROLLED_BACK, reason=why))
        self._forget_weighings(model_id)
        self.release_unplanned()
        self.reconcile()

    def _forget_weighings(self, model_id: str) -> None:
        """Its replicas changed: the plans refused or weighed for them say nothing of them any more."""
        for key in [k for k in (*self._unplaceable, *self._considered) if k[0] == model_id]:
            self._unplaceable.pop(key, None)
            self._considered.pop(key, None)

    def _wait_for_first_plan(self, model_id: str, num_stages: int) -> None:
        """A model with replicas wanted and no plan waits for the agents of a first one; one scaled to zero waits
        for nothing."""
        model = self._registry.model(model_id)
        if model.num_replicas == 0:
            self._pending.pop(model_id, None)
        elif self._registry.active_plan(model_id) is None:
            self._pending[model_id] = num_stages
            self._unplaceable.pop((model_id, 0), None)

    def scale(self, model_id: str, num_replicas: int, give_back: Sequence[int] = ()) -> list[str]:
        """An autoscaled model's replicas become num_replicas (within its bounds: InvalidInput). Fewer: the
        replicas in give_back go first (then the last ones), each planned on no more, their stages kept while
        generations still run on them (retired: none is aborted), and the rest numbered 0..n-1 again; more: the
        new ones are planned on free agents as any replica is (one from zero waits for a first plan as a new
        model does). Returns the assignment ids of the stages given back."""
        model = self._registry.model(model_id)
        if model is None:
            raise ModelNotFound(f"the model '{model_id}' does not exist")
        num_stages = self.num_stages(model_id) or model.num_stages or 1
        self._registry.set_num_replicas(model_id, num_replicas)
        plans = {plan.replica: plan for plan in self._registry.active_plans(model_id)}
        replicas = range(model.num_replicas)
        dropped = [r for r in give_back if r in replicas][:max(model.num_replicas - num_replicas, 0)]
        fewer = model.num_replicas - num_replicas - len(dropped)
        dropped += [r for r in reversed(replicas) if r not in dropped][:max(fewer, 0)]
        given_back = [s.assignment_id for r in dropped if r in plans for s in plans[r].stages]
        for replica in dropped:
            self._registry.drop_replica(model_id, replica)
        for to, replica in enumerate(r for r in replicas if r not in dropped):
            if to != replica:
                self._registry.move_replica(model_id, replica, to)
        self._forget_weighings(model_id)
        self.retire(given_back, self._clock())
        self._wait_for_first_plan(model_id, num_stages)
        self.release_unplanned()
        self.reconcile()
        return given_back

    def scaled_to_zero(self, model_id: str) -> bool:
        """Whether the model is autoscaled to no replica (its next request asks for one)."""
        model = self._registry.model(model_id)
        return model is not None and model.scaled_to_zero

    def num_stages(self, model_id: str) -> int:
        """Stages of the model's serving plan, of the plan it waits for, or (scaled to zero) of the plans it was asked
        for; 0 if none."""
        plan = self._registry.active_plan(model_id)
        if plan is not None:
            return len(plan.stages)
        if model_id in self._pending:
            return self._pending[model_id]
        return self._registry.model(model_id).num_stages if self.scaled_to_zero(model_id) else 0

    def replan(self, model_id: str, num_stages: int | None = None) -> tuple[str, str]:
        """An operator's re-plan: for each replica, the best plan over the agents there are now (and the other
        replicas leave) loads beside the serving one and takes over once ready ("standby"). ("unchanged", why) if
        every serving plan is that plan; ("waiting", why) if the model has no plan yet and too few agents.
        ModelNotFound, or PlacementError if no plan fits."""
        find_model(self._registry, model_id)
        num_stages = num_stages or self.num_stages(model_id) or 1
        if num_stages < 1:
            raise InvalidInput(f"num_stages must be >= 1, got {num_stages}")
        if self._registry.active_plan(model_id) is None:
            self._pending[model_id] = num_stages
            self._unplaceable.pop((model_id, 0), None)
            self.reconcile()
            plan = self._registry.active_plan(model_id)
            return ("planned", plan.reason) if plan else (
                "waiting", f"waiting for {num_stages} agent(s); {len(self._capable(model_id))} can take a stage")
        outcome = ("unchanged", "")
        for plan in self._registry.active_plans(model_id):
            planned, placed = self._best_plan(model_id, num_stages, replica=plan.replica)
            if [(agent, s.start_layer, s.end_layer, s.tp_degree, s.revision) for agent, s in placed] == [
                    (*where, s.spec.revision) for where, s in zip(_placement(plan), plan.stages, strict=True)]:
                if outcome[0] == "unchanged":
                    outcome = ("unchanged", f"the serving plan is still the best one. {planned.reason}")
                continue
            self._save_plan(model_id, planned, placed, standby=True, replica=plan.replica)
            outcome = ("standby", planned.reason)
        self.reconcile()
        return outcome

    # ------------------------------------------------------------ planned stages
    def plannable(self) -> dict[str, Capabilities]:
        """Connected agents not banned for flapping nor being drained, and what they can do."""
        return self._roster.plannable(excluded=self._drains.excluded)

    def _capable(self, model_id: str) -> dict[str, Capabilities]:
        """The plannable agents with the memory for at least one stage of the model (smallest_stage_bytes)."""
        need = self._smallest_stage(model_id)
        return {a: caps for a, caps in self.plannable().items() if caps.usable_mem_bytes >= need}

    def _capable_ids(self, model_id: str) -> frozenset[str]:
        """The ids of _capable: what a plan was made or refused with (a read of every agent)."""
        return frozenset(self._capable(model_id))

    def could_hold_a_stage(self, capabilities: Capabilities) -> bool:
        """Whether a box has the memory for at least one stage of some model."""
        if self._least_stage_bytes is None:
            self._least_stage_bytes = min((self._smallest_stage(m.model_id) for m in self._registry.models()),
                                          default=None)
        return self._least_stage_bytes is not None and capabilities.usable_mem_bytes >= self._least_stage_bytes

    def _smallest_stage(self, model_id: str) -> int:
        need = self._stage_bytes.get(model_id)
        if need is None:
            model = self._registry.model(model_id)
            need = self._stage_bytes[model_id] = smallest_stage_bytes(model.config, model.quantize)
        return need

    def is_planned(self, agent_id: str) -> bool:
        """Whether any planned stage (planned_for) is the agent's, without reading every plan."""
        return any(s.agent_id == agent_id for s in self._drains.stages()) or self._registry.in_live_plan(agent_id)

    def planned_for(self, agent_id: str) -> dict[str, StageRecord]:
        return {s.assignment_id: s for s in self._planned_stages() if s.agent_id == agent_id}

    def planned_ids(self) -> set[str]:
        """The assignment id of every planned stage."""
        return {s.assignment_id for s in self._planned_stages()}

    def _planned_stages(self) -> list[StageRecord]:
        """Every stage of each replica's active plan, of the standby plan it moves to next, and of a drain."""
        stages = self._drains.stages()
        for model in self._registry.models():
            for plan in self._registry.live_plans(model.model_id):
                stages += plan.stages
        return stages

    def _taken(self, model_id: str, replica: int) -> frozenset[str]:
        """The agents the model's other replicas plan on (active and standby): a replica's own are apart."""
        return frozenset(s.agent_id for plan in self._registry.live_plans(model_id) if plan.replica != replica
                         for s in plan.stages)

    def set_stage_state(self, assignment_id: str, state: str) -> None:
        if not self._drains.set_stage_state(assignment_id, state):
            self._registry.set_stage_state(assignment_id, state)

    def restart(self) -> list[str]:
        """After a (re)start no stage is known loaded: every active stage is assigned again; returns their agents.
        A model that was still waiting for its first plan waits again, for as many stages as it asked for."""
        agents = []
        for model in self._registry.models():
            if self._registry.active_plan(model.model_id) is None and model.num_replicas > 0:
                self._pending.setdefault(model.model_id, model.num_stages or 1)
            for plan in self._registry.active_plans(model.model_id):
                for stage in plan.stages:
                    self._registry.set_stage_state(stage.assignment_id, StageState.ASSIGNED)
                    agents.append(stage.agent_id)
        return agents

    def unload(self, agent_id: str) -> None:
        """The agent's stream ended: its planned stages are assigned, not loaded."""
        for assignment_id in self.planned_for(agent_id):
            self._registry.set_stage_state(assignment_id, StageState.ASSIGNED)

    # ------------------------------------------------------------ planning
    def replan_lost(self) -> None:
        """Re-plans each replica whose active plan has a stage on a dead agent, over the agents there are."""
        liveness = self._roster.liveness
        for model in self._registry.models():
            for plan in self._registry.active_plans(model.model_id):
                key = (model.model_id, plan.replica)
                # the agents that could take a stage are read (from every agent) only where a plan needs them:
                # this runs every tick, and nearly always finds nothing dead
                if key in self._unplaceable and self._unplaceable[key] == self._capable_ids(model.model_id):
                    continue
                standby = self._registry.standby_plan(model.model_id, plan.replica)
                if standby and any(liveness.is_dead(s.agent_id) for s in standby.stages):
                    self._registry.abandon_standby(model.model_id, plan.replica)
                dead = sorted({s.agent_id for s in plan.stages if liveness.is_dead(s.agent_id)})
                if dead:
                    log.warning("re-planning %s: agents %s are dead", _named(model.model_id, plan.replica),
                                ", ".join(dead))
                    if not self._plan(model.model_id, len(plan.stages), previous=plan, replica=plan.replica):
                        self._unplaceable[key] = self._capable_ids(model.model_id)
        self.release_unplanned()
        self.reconcile()

    def joined(self) -> None:
        """A box that could hold a stage joined: what it changes is weighed once the burst it came in settles."""
        now = self._clock()
        self._joins = (self._joins[0] if self._joins else now, now)

    def _joins_settled(self) -> bool:
        """Whether no burst of joins is still coming (JOINS_SETTLE_S); True also ends the burst: it is weighed now."""
        if self._joins is None:
            return True
        now, (first, last) = self._clock(), self._joins
        paused = now - last >= JOINS_SETTLE_S and now - self._weighed_at >= JOINS_SETTLE_MAX_S
        if not paused and now - first < JOINS_SETTLE_MAX_S:
            return False
        self._joins, self._weighed_at = None, now
        return True

    def improve(self) -> None:
        """Weighs each ready replica's plan against the agents there are now (boxes joined, or a ban ended), once
        joins settle: a clearly better plan becomes a standby, loaded beside the serving one and switched to once
        ready. The planner stays close to the serving plan (minimal movement), and over thousands of agents weighs
        its agents and a shortlist of the rest (placement.shortlist)."""
        if not self._joins_settled():
            return
        for model in self._registry.models():
            plannable = self._capable_ids(model.model_id)    # a box too small for any stage changes nothing
            for plan in self._registry.active_plans(model.model_id):
                key = (model.model_id, plan.replica)
                if self._considered.get(key) == plannable or not self._routes.serves(plan) \
                        or self._registry.standby_plan(model.model_id, plan.replica) is not None:
                    continue
                self._considered[key] = plannable
                if self._plan(model.model_id, len(plan.stages), previous=plan, standby=True, replica=plan.replica):
                    self.reconcile()

    def promote_standbys(self) -> None:
        """Switches each replica whose standby plan is loaded to it; the replaced stages retire."""
        now = self._clock()
        for model in self._registry.models():
            plans = self._registry.live_plans(model.model_id)
            for standby in (p for p in plans if p.state == PlanState.STANDBY and self._routes.serves(p)):
                replaced = next((p for p in plans if p.state == PlanState.ACTIVE and p.replica == standby.replica), None)
                self._registry.activate_plan(model.model_id, standby.plan_id)
                self._registry.log_event("plan_activated", standby.reason, now)
                log.info("%s switched to plan %s; the stages it replaces retire once idle",
                         _named(model.model_id, standby.replica), standby.plan_id)
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
        """Plans models that wait for agents and further replicas the agents left can hold, and assigns planned
        stages whose agent lacks them. A first plan or replica that did not fit is tried again once the agents
        that could hold it change and their joins settle."""
        for model_id, num_stages in list(self._pending.items()):
            capable, key = self._capable_ids(model_id), (model_id, 0)
            if len(capable) < num_stages or key in self._unplaceable \
                    and (self._unplaceable[key] == capable or not self._joins_settled()):
                continue
            if self._plan(model_id, num_stages):
                del self._pending[model_id]
            else:
                self._unplaceable[key] = capable
        self._plan_replicas()
        for stage in self._planned_stages():
            if self._roster.lacks(stage) and stage.state not in (StageState.LOADING, StageState.FAILED):
                self.set_stage_state(stage.assignment_id, StageState.LOADING)
                self._roster.send(stage.agent_id, Assignment(stage.assignment_id, stage.spec))
        self._routes.notify()

    def _plan_replicas(self) -> None:
        """Plans each served model's missing replicas (as many stages as its first) where the agents its other
        replicas leave could hold one; one that did not fit waits for the plannable agents to change and settle."""
        for model in self._registry.models():
            first = self._registry.active_plan(model.model_id)
            replicas = [*range(1, model.num_replicas if first else 0),
                        *([CANARY_REPLICA] if first and model.rollout and model.rollout.active else [])]
            if not replicas:    # one replica (or none yet): no need to read every agent, as this runs every tick
                continue
            plannable = self._capable_ids(model.model_id)
            for replica in replicas:
                key = (model.model_id, replica)
                if self._registry.active_plan(model.model_id, replica) is not None or key in self._unplaceable \
                        and (self._unplaceable[key] == plannable or not self._joins_settled()):
                    continue
                if len(plannable - self._taken(model.model_id, replica)) < len(first.stages):
                    continue            # too few agents: nothing to weigh yet
                if not self._plan(model.model_id, len(first.stages), replica=replica):
                    self._unplaceable[key] = plannable

    def moves_off(self, agent_id: str) -> list[Move]:
        """A spare for every stage of the agent, layer range unchanged (PlacementError if none fits); a spare is
        none of the agents of the stage's model's other replicas."""
        plannable = {a: caps for a, caps in self.plannable().items() if a != agent_id}
        moves = []
        for model in self._registry.models():
            for plan in self._registry.active_plans(model.model_id):
                if all(s.agent_id != agent_id for s in plan.stages):
                    continue
                moves += self._moves(model, plan, agent_id, plannable)
        return moves

    def _moves(self, model: ModelRecord, plan: PlanRecord, agent_id: str,
               plannable: Mapping[str, Capabilities]) -> list[Move]:
        taken = self._taken(model.model_id, plan.replica)
        agents = {a: caps for a, caps in plannable.items() if a not in taken}
        chosen = repair_stages(model.model_id, model.path, model.config, agents, _placement(plan),
                               self._roster.links(), _pins(model), self._hosts(agents), model.quantize)
        # the spare's own device, dtype and KV cache (a KV move needs the same dtype: else the session is replayed)
        return [(s, StageRecord(f"{s.assignment_id}-m{uuid.uuid4().hex[:6]}", s.stage_index, spare,
                                replace(s.spec, device=spec.device, dtype=spec.dtype, quantize=spec.quantize,
                                        kv_cache_bytes=spec.kv_cache_bytes), plan.plan_id, "assigned"))
                for s, (spare, spec) in zip(plan.stages, chosen, strict=True) if s.agent_id == agent_id]

    def _plan(self, model_id: str, num_stages: int, previous: PlanRecord | None = None,
              standby: bool = False, replica: int = 0) -> bool:
        """Saves a new plan for the model's replica over the plannable agents its other replicas leave; False if
        none fits.

        previous: the plan serving now, kept where it still fits unless moving is clearly better (its lost
        stages go to spares). standby: the new plan loads beside it, and is saved only if it moves layers."""
        try:
            planned, placed = self._best_plan(model_id, num_stages, _placement(previous) if previous else [],
                                              replica)
        except PlacementError as exc:
            log.error("cannot place %s: %s", _named(model_id, replica), exc)
            self._registry.log_event("placement_failed", str(exc), self._clock())
            return False
        if standby and planned.search == "kept":
            return False
        self._save_plan(model_id, planned, placed, standby, replica)
        return True

    def _best_plan(self, model_id: str, num_stages: int, previous: Placement = (),
                   replica: int = 0) -> tuple[Plan, list[tuple[str, StageSpec]]]:
        """The planner's best plan for the model's replica over the plannable agents its other replicas leave
        (PlacementError if none fits)."""
        model = self._registry.model(model_id)
        taken = self._taken(model_id, replica)
        agents = {a: caps for a, caps in self._capable(model_id).items() if a not in taken}
        if len(agents) < num_stages:
            raise PlacementError(f"cannot place {_named(model_id, replica)} yet: {len(agents)} of {num_stages} "
                                 f"agents")
        self.num_computed += 1
        path, config, revision = model.path, model.config, model.revision
        if replica == CANARY_REPLICA and model.rollout is not None:     # a rollout's new revision
            path, revision = model.rollout.path, model.rollout.revision
            config = check_model(path, num_stages)
        plan, placed = plan_stages(model_id, path, config, agents, num_stages, self._roster.links(),
                                   previous, _pins(model), self._hosts(agents), model.quantize)
        return plan, [(agent, replace(spec, revision=revision)) for agent, spec in placed]

    def _hosts(self, agents: Mapping[str, Capabilities]) -> Hosts:
        """Where the origin computes, and the serving path's CPU per token the agents' telemetry measured."""
        return Hosts(self._origin_host, serving_cpu_of(agents, self._roster.telemetry))

    def _save_plan(self, model_id: str, planned: Plan, placed: list[tuple[str, StageSpec]], standby: bool,
                   replica: int = 0) -> None:
        plan_id = uuid.uuid4().hex[:12]
        stages = [StageRecord(f"{plan_id}-{i}", i, agent_id, spec)
                  for i, (agent_id, spec) in enumerate(placed)]
        reason = planned.reason if replica == 0 else \
            f"{'canary' if replica == CANARY_REPLICA else f'replica {replica}'}: {planned.reason}"
        self._registry.save_plan(plan_id, model_id, stages, reason, self._clock(), standby=standby,
                                 prediction=prediction(planned), replica=replica)
        self._registry.log_event("standby_plan" if standby else "plan", reason, self._clock())
        self._unplaceable.pop((model_id, replica), None)
        self._considered[(model_id, replica)] = self._capable_ids(model_id)   # made with these: weighed
        log.info("%s %s: %s", "standby plan for" if standby else "planned", _named(model_id, replica), reason)


def _placement(plan: PlanRecord) -> list[tuple[str, int, int, int]]:
    """(agent, start layer, end layer, tp degree) of each stage of the plan, in pipeline order."""
    return [(s.agent_id, s.spec.start_layer, s.spec.end_layer, s.spec.tp_degree) for s in plan.stages]


def _named(model_id: str, replica: int) -> str:
    """The model, its replica after the first, or its rollout's canary: how logs and plans name what they plan."""
    if replica == CANARY_REPLICA:
        return f"{model_id} (canary)"
    return model_id if replica == 0 else f"{model_id} (replica {replica})"


def _pins(model: ModelRecord) -> SitePins:
    return SitePins(model.first_site, model.last_site)
