"""The placement driver: turns models and connected agents into plans, assignments and ready routes."""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import Callable, Collection
from dataclasses import dataclass, replace
from pathlib import Path

from stratamesh.coordinator.linkprobe import LINK_PROBE_EVERY_S, PeerProbes, peers_of
from stratamesh.coordinator.liveness import CONTROL, DATA, Liveness, LivenessConfig
from stratamesh.coordinator.placement import Placement, SitePins, plan_stages, prediction, repair_stages
from stratamesh.coordinator.registry import ModelRecord, PlanRecord, Registry, StagePlacement, StageRecord
from stratamesh.fleet.errors import (CheckpointError, InvalidInput, MeshError, ModelNotFound, ModelNotReady,
                                     PlacementError)
from stratamesh.fleet.types import (Assignment, Capabilities, ControlMessage, Hop, LinkMeasurement, Peer,
                                    Registration, Release, Shutdown, StageSpec, StageStatus, Telemetry, model_task)
from stratamesh.partitioner.plan import Plan
from stratamesh.partitioner.profile import profile_from_hf_config

log = logging.getLogger(__name__)

# Heartbeat telemetry kept per agent: an hour, and at most this many rows (an hour of 1 s heartbeats).
TELEMETRY_MAX_AGE_S = 3600.0
TELEMETRY_MAX_ROWS_PER_AGENT = 3600
TELEMETRY_PRUNE_EVERY_S = 60.0
# A plan replaced by a better one keeps its stages while generations still run on them, up to this long.
RETIRE_AFTER_S = 600.0


class AgentNotConnected(MeshError, LookupError):
    """No agent of that id is connected to this coordinator."""


@dataclass(slots=True)
class AgentLink:
    """A connected agent: where its stages listen and how to send it control messages."""

    agent_id: str
    stage_address: str
    capabilities: Capabilities
    send: Callable[[ControlMessage], None]      # the control service puts it on the agent's stream
    close: Callable[[], None] = lambda: None     # ends the control stream (an agent declared dead)


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What the coordinator needs of a model without loading it."""

    model_id: str
    path: str
    num_layers: int
    hidden_size: int
    max_context: int
    created: int
    task: str = "generate"      # or "embed": fleet.types.model_task of its config


def read_model_config(path: str) -> dict:
    """config.json of a Hugging Face folder, checked for the fields placement needs."""
    try:
        config = json.loads(Path(path, "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot read {path}/config.json: {exc}") from exc
    for key in ("num_hidden_layers", "hidden_size", "max_position_embeddings"):
        if not isinstance(config.get(key), int) or config[key] <= 0:
            raise CheckpointError(f"{path}/config.json: {key} must be a positive integer")
    profile_from_hf_config(config)     # the planner's fields: CheckpointError names a missing one
    return config


class Deployer:
    """Keeps every deployed model's active plan served: plans, pushes assignments, tracks readiness."""

    def __init__(self, registry: Registry, clock: Callable[[], float],
                 liveness: LivenessConfig = LivenessConfig(), link_probe_every_s: float = LINK_PROBE_EVERY_S,
                 origin_host: str = ""):
        self._registry = registry
        self._origin_host = origin_host          # the host the origin computes on (planned as a CPU user there)
        self._clock = clock
        self.liveness = Liveness(liveness)
        self._probes = PeerProbes(clock, link_probe_every_s)
        self._links: dict[str, AgentLink] = {}
        self._loaded: dict[str, set[str]] = {}  # agent id -> assignment ids it reported loaded
        self._addresses: dict[str, str] = {}   # Stage address -> the agent last seen serving there
        self._unplaceable: dict[str, frozenset[str]] = {}   # model id -> agents a re-plan failed with
        self._considered: dict[str, frozenset[str]] = {}    # model id -> agents its plan was last weighed against
        self._retiring: dict[str, float] = {}  # assignment id of a replaced plan -> when it goes regardless
        # The assignment ids live generations run on: a replaced plan's stages stay until none does.
        self.assignments_in_use: Callable[[], Collection[str]] = frozenset
        self._pending: dict[str, int] = {}     # model id -> stages wanted for its first plan
        self.telemetry: dict[str, Telemetry] = {}  # agent id -> its newest heartbeat telemetry
        self._pruned_at = float("-inf")
        self._served: set[str] = set()         # models that were ready since this coordinator started
        self._waiters: list[asyncio.Future[None]] = []
        # Told the Stage address of each agent declared dead: the origin fails over the sessions routed there.
        self.on_agent_dead: Callable[[str], None] = lambda address: None
        # A drain moves an agent's stages to spares, one replacement per stage, then lets the agent go.
        self._draining: set[str] = set()       # agents planned on no more
        self._drained: set[str] = set()        # agents told to exit
        self._replacements: dict[str, tuple[StageRecord, StageRecord]] = {}  # new assignment id -> (old, new)
        self.drain_failures: dict[str, str] = {}   # agent id -> why a replacement of its stages failed

    def start(self) -> None:
        """After a (re)start no agent is connected and no stage known loaded until its agent says so."""
        now = self._clock()
        for agent in self._registry.agents():
            if agent.state not in ("disconnected", "dead"):
                self._registry.set_agent_state(agent.agent_id, "disconnected", now)
        for model in self._registry.models():
            plan = self._registry.active_plan(model.model_id)
            for stage in plan.stages if plan else ():
                self._registry.set_stage_state(stage.assignment_id, "assigned")
                self.liveness.expect(stage.agent_id, now)

    # ------------------------------------------------------------ models
    def add_model(self, model_id: str, path: str, num_stages: int, pins: SitePins = SitePins()) -> None:
        """Registers a model (or updates its path and site pins: a served one takes them at its next re-plan)
        and asks for a plan of num_stages stages."""
        if num_stages < 1:
            raise InvalidInput(f"num_stages must be >= 1, got {num_stages}")
        config = read_model_config(path)
        self._registry.add_model(model_id, str(Path(path).resolve()), config["num_hidden_layers"],
                                 config, self._clock(), first_site=pins.first, last_site=pins.last)
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
        self.model(model_id)
        plan = self._registry.active_plan(model_id)
        num_stages = num_stages or self.num_stages(model_id) or 1
        if num_stages < 1:
            raise InvalidInput(f"num_stages must be >= 1, got {num_stages}")
        if plan is None:
            self._pending[model_id] = num_stages
            self.reconcile()
            plan = self._registry.active_plan(model_id)
            return ("planned", plan.reason) if plan else (
                "waiting", f"waiting for {num_stages} agent(s); {len(self._plannable())} can take a stage")
        planned, placed = self._best_plan(model_id, num_stages)
        if [(agent, s.start_layer, s.end_layer, s.tp_degree) for agent, s in placed] == _placement(plan):
            return "unchanged", f"the serving plan is still the best one. {planned.reason}"
        if self._registry.standby_plan(model_id) is not None:
            self._registry.abandon_standby(model_id)
        self._save_plan(model_id, planned, placed, standby=True)
        self.reconcile()
        return "standby", planned.reason

    def models(self) -> list[ModelInfo]:
        return [ModelInfo(m.model_id, m.path, m.num_layers, m.config["hidden_size"],
                          m.config["max_position_embeddings"], int(m.created), model_task(m.config))
                for m in self._registry.models()]

    def model(self, model_id: str) -> ModelInfo:
        for info in self.models():
            if info.model_id == model_id:
                return info
        raise ModelNotFound(f"the model '{model_id}' does not exist")

    def is_ready(self, model_id: str) -> bool:
        plan = self._registry.active_plan(model_id)
        return plan is not None and all(self._serving(s) for s in plan.stages)

    def accepts(self, model_id: str) -> bool:
        """Ready, or recovering from a lost agent after having been ready: requests wait for a route."""
        return model_id in self._served or self.is_ready(model_id)

    def route(self, model_id: str, avoid: Collection[str] = ()) -> tuple[list[Hop], int]:
        """The hops of a ready replica of the model in pipeline order, and its KV block size.

        avoid: Stage addresses just found unreachable; a route through one of them is not ready."""
        self.model(model_id)
        plan = self._registry.active_plan(model_id)
        if plan is None or not all(self._serving(s) for s in plan.stages):
            raise ModelNotReady(f"the model '{model_id}' is not ready yet: its stages are loading")
        hops = [Hop(self._links[s.agent_id].stage_address, s.assignment_id, s.spec.dtype) for s in plan.stages]
        if any(hop.address in avoid for hop in hops):
            raise ModelNotReady(f"the model '{model_id}' is recovering: its route lost a stage")
        return hops, plan.stages[0].spec.kv_block_size

    async def wait_route(self, model_id: str, timeout_s: float,
                         avoid: Collection[str] = ()) -> tuple[list[Hop], int]:
        """route(), waiting up to timeout_s while the model loads or recovers (ModelNotReady after).

        The addresses in avoid are trusted again after an agent's lease: if nobody declared their agent
        dead by then, the failure was the link's, and the route through them is the one there is."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        trust_at = loop.time() + self.liveness.config.lease_s + 1.0
        while True:
            now = loop.time()
            try:
                return self.route(model_id, avoid if now < trust_at else ())
            except ModelNotReady:
                if now >= deadline:
                    raise
            waiter: asyncio.Future[None] = loop.create_future()
            self._waiters.append(waiter)
            wake = min(deadline, trust_at) if now < trust_at else deadline
            try:
                await asyncio.wait_for(waiter, max(wake - now, 0.0))
            except asyncio.TimeoutError:
                pass

    def _notify(self) -> None:
        """Wakes every wait_route(): a plan, a stage or an agent changed."""
        for model in self._registry.models():
            if model.model_id not in self._served and self.is_ready(model.model_id):
                self._served.add(model.model_id)
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    def _serving(self, stage: StageRecord) -> bool:
        return stage.assignment_id in self._loaded.get(stage.agent_id, ())

    # ------------------------------------------------------------ agents
    @property
    def num_agents(self) -> int:
        return len(self._links)

    def peers(self) -> list[Peer]:
        """Every connected agent and the address of its Stage and Link services, by agent id."""
        return peers_of(self._links)

    def agent_connected(self, link: AgentLink, registration: Registration) -> None:
        """Adopts a (re)connecting agent and the stages it still holds."""
        now = self._clock()
        self.liveness.heard(link.agent_id, now)
        self._links[link.agent_id] = link
        # A restarted agent listens on a new port: its old address points nowhere now.
        self._addresses = {addr: a for addr, a in self._addresses.items() if a != link.agent_id}
        self._addresses[link.stage_address] = link.agent_id
        self._registry.upsert_agent(link.agent_id, registration.name, link.stage_address,
                                    registration.capabilities, now)
        self._registry.set_agent_state(link.agent_id, "connected", now)
        self._registry.log_event("agent_connected", link.stage_address, now, agent_id=link.agent_id)
        planned = self._planned_for(link.agent_id)
        loaded = self._loaded[link.agent_id] = set()
        for held in registration.held:
            if held.assignment_id in planned:
                loaded.add(held.assignment_id)
                self._registry.set_stage_state(held.assignment_id, "ready")
            else:
                link.send(Release(held.assignment_id))
        self._probes.joined(link, self._links)
        self.reconcile()
        self._improve_plans()

    def agent_disconnected(self, link: AgentLink) -> None:
        if self._links.get(link.agent_id) is not link:
            return  # a newer stream of the same agent took over, or the agent was declared dead
        now = self._clock()
        self._forget(link.agent_id)
        if link.agent_id in self._drained:     # it left as told: not a failure
            self._drained.discard(link.agent_id)
            self._draining.discard(link.agent_id)
            self.liveness.forget(link.agent_id)
            self._registry.set_agent_state(link.agent_id, "drained", now)
            self._registry.log_event("agent_drained", "", now, agent_id=link.agent_id)
            self._notify()
            return
        for assignment_id in self._planned_for(link.agent_id):
            self._registry.set_stage_state(assignment_id, "assigned")
        self._registry.set_agent_state(link.agent_id, "disconnected", now)
        self._registry.log_event("agent_disconnected", "", now, agent_id=link.agent_id)
        if self.liveness.suspect(link.agent_id, CONTROL, now):
            self._agent_dead(link.agent_id)
        self._notify()

    def heartbeat(self, agent_id: str, telemetry: Telemetry | None = None) -> None:
        """Records that the agent is alive, and what it reported about its load."""
        if agent_id not in self._links:
            return  # a stream the coordinator is closing: its agent was declared dead
        now = self._clock()
        self.liveness.heard(agent_id, now)
        self._registry.touch_agent(agent_id, now)
        if telemetry is not None:
            self._registry.record_telemetry(agent_id, telemetry, now)
            self.telemetry[agent_id] = telemetry

    def report_unreachable(self, address: str) -> None:
        """The data plane could not reach this Stage address: a sign that its agent died."""
        agent_id = self._addresses.get(address)
        if agent_id is not None and self.liveness.suspect(agent_id, DATA, self._clock()):
            self._agent_dead(agent_id)

    def check_liveness(self) -> None:
        """Declares dead every agent whose lease ran out (call it often: it is how fast a hung box is found)."""
        for agent_id in self.liveness.expired(self._clock()):
            self._agent_dead(agent_id)

    def _agent_dead(self, agent_id: str) -> None:
        """Cuts a dead agent off, fails over the sessions routed through it and re-plans its models."""
        now = self._clock()
        link = self._links.get(agent_id)
        if link is not None:
            self._forget(agent_id)
            link.close()
        banned = self.liveness.banned_until(agent_id)
        detail = f"flapping: banned from plans for {banned - now:.0f} s" if banned > now else ""
        if self._registry.agent(agent_id) is not None:
            self._registry.set_agent_state(agent_id, "dead", now)
        self._registry.log_event("agent_dead", detail, now, agent_id=agent_id)
        log.warning("agent %s declared dead%s", agent_id, f" ({detail})" if detail else "")
        for address, owner in self._addresses.items():
            if owner == agent_id:
                self.on_agent_dead(address)
        self._replan_lost()

    def _forget(self, agent_id: str) -> None:
        del self._links[agent_id]
        self._loaded.pop(agent_id, None)
        self.telemetry.pop(agent_id, None)

    def links_reported(self, agent_id: str, links: list[LinkMeasurement]) -> None:
        """Stores an agent's link measurements for the planner and the operator."""
        self._registry.record_links(agent_id, links, self._clock())
        for m in links:
            if m.error:
                log.info("agent %s could not measure its link to %s: %s", agent_id, m.peer_agent_id, m.error)

    def stage_status(self, agent_id: str, status: StageStatus) -> None:
        """Records an agent's report on one of its assignments."""
        if status.assignment_id not in self._planned_for(agent_id):
            return
        loaded = self._loaded.setdefault(agent_id, set())
        if status.state == "ready":
            loaded.add(status.assignment_id)
        else:
            loaded.discard(status.assignment_id)
        self._set_stage_state(status.assignment_id, status.state)
        if status.state == "failed":
            self._registry.log_event("stage_failed", status.error, self._clock(), agent_id=agent_id)
            log.warning("agent %s failed to load %s: %s", agent_id, status.assignment_id, status.error)
            self._replacement_failed(status.assignment_id, status.error)
        self._finish_replacements()
        self._promote_standbys()
        self._notify()

    def _set_stage_state(self, assignment_id: str, state: str) -> None:
        if assignment_id in self._replacements:
            old, new = self._replacements[assignment_id]
            self._replacements[assignment_id] = (old, replace(new, state=state))
        else:
            self._registry.set_stage_state(assignment_id, state)

    def _planned_for(self, agent_id: str) -> dict[str, StageRecord]:
        return {s.assignment_id: s for s in self._planned_stages() if s.agent_id == agent_id}

    def _planned_stages(self) -> list[StageRecord]:
        """Every stage of every model's active plan, of the standby plan it moves to next, and of a drain."""
        stages = [new for _, new in self._replacements.values()]
        for model in self._registry.models():
            for plan in (self._registry.active_plan(model.model_id), self._registry.standby_plan(model.model_id)):
                stages += plan.stages if plan else ()
        return stages

    # ------------------------------------------------------------ planning
    def tick(self) -> None:
        """Prunes telemetry, re-probes links when due, re-plans models that lost agents once others can hold them."""
        now = self._clock()
        if now >= self._pruned_at + TELEMETRY_PRUNE_EVERY_S:
            self._pruned_at = now
            self._registry.prune_telemetry(now, TELEMETRY_MAX_AGE_S, TELEMETRY_MAX_ROWS_PER_AGENT)
        self._probes.tick(self._links)
        self._replan_lost()
        self._improve_plans()
        self._release_unplanned()

    def _replan_lost(self) -> None:
        """Re-plans every model whose active plan has a stage on a dead agent, over the agents there are."""
        plannable = frozenset(self._plannable())
        for model in self._registry.models():
            plan = self._registry.active_plan(model.model_id)
            if plan is None or self._unplaceable.get(model.model_id) == plannable:
                continue
            standby = self._registry.standby_plan(model.model_id)
            if standby and any(self.liveness.is_dead(s.agent_id) for s in standby.stages):
                self._registry.abandon_standby(model.model_id)
            dead = sorted({s.agent_id for s in plan.stages if self.liveness.is_dead(s.agent_id)})
            if dead:
                log.warning("re-planning %s: agents %s are dead", model.model_id, ", ".join(dead))
                if not self._plan(model.model_id, len(plan.stages), previous=plan):
                    self._unplaceable[model.model_id] = plannable
        self._release_unplanned()
        self.reconcile()

    def _improve_plans(self) -> None:
        """Weighs each ready model's plan against the agents there are now (one joined, or a ban ended): a
        clearly better plan becomes a standby, loaded beside the serving one and switched to once ready."""
        plannable = frozenset(self._plannable())
        for model in self._registry.models():
            plan = self._registry.active_plan(model.model_id)
            if plan is None or self._considered.get(model.model_id) == plannable or not self.is_ready(model.model_id) \
                    or self._registry.standby_plan(model.model_id) is not None:
                continue
            self._considered[model.model_id] = plannable
            if self._plan(model.model_id, len(plan.stages), previous=plan, standby=True):
                self.reconcile()

    def _promote_standbys(self) -> None:
        """Switches each model whose standby plan is loaded to it; the replaced stages retire."""
        now = self._clock()
        for model in self._registry.models():
            standby = self._registry.standby_plan(model.model_id)
            if standby is None or not all(self._serving(s) for s in standby.stages):
                continue
            replaced = self._registry.active_plan(model.model_id)
            self._registry.activate_plan(model.model_id, standby.plan_id)
            self._registry.log_event("plan_activated", standby.reason, now)
            log.info("%s switched to plan %s; the stages it replaces retire once idle", model.model_id,
                     standby.plan_id)
            for stage in replaced.stages if replaced else ():
                self._retiring[stage.assignment_id] = now + RETIRE_AFTER_S
        self._release_unplanned()

    def _release_unplanned(self) -> None:
        """Releases loaded stages that no plan wants, once no generation runs on them (or they retired long ago)."""
        now, in_use = self._clock(), set(self.assignments_in_use())
        for assignment_id, until in list(self._retiring.items()):
            if assignment_id not in in_use or now >= until:
                del self._retiring[assignment_id]
        wanted = {s.assignment_id for s in self._planned_stages()} | set(self._retiring)
        for link in self._links.values():
            loaded = self._loaded.setdefault(link.agent_id, set())
            for assignment_id in sorted(loaded - wanted):
                loaded.discard(assignment_id)
                link.send(Release(assignment_id))

    def reconcile(self) -> None:
        """Plans models that wait for agents, and assigns planned stages whose agent lacks them."""
        for model_id, num_stages in list(self._pending.items()):
            if len(self._plannable()) >= num_stages and self._plan(model_id, num_stages):
                del self._pending[model_id]
        for stage in self._planned_stages():
            link = self._links.get(stage.agent_id)
            if link is not None and not self._serving(stage) and stage.state not in ("loading", "failed"):
                self._set_stage_state(stage.assignment_id, "loading")
                link.send(Assignment(stage.assignment_id, stage.spec))
        self._notify()

    def _plannable(self) -> dict[str, Capabilities]:
        """Connected agents not banned for flapping, and what they can do."""
        now = self._clock()
        return {a: link.capabilities for a, link in self._links.items()
                if not self.liveness.is_banned(a, now) and a not in self._draining}

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
        agents = self._plannable()
        if len(agents) < num_stages:
            raise PlacementError(f"cannot place {model_id} yet: {len(agents)} of {num_stages} agents")
        return plan_stages(model_id, model.path, model.config, agents, num_stages, self._registry.links(),
                           previous, _pins(model), self._origin_host)

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

    # ------------------------------------------------------------ drains
    def drain(self, agent_id: str) -> list[tuple[StageRecord, StageRecord]]:
        """Starts moving every stage of the agent to a spare, layer range unchanged, and plans on it no more.

        Returns (stage, replacement) pairs; the replacement takes the stage's place in its plan once loaded.
        AgentNotConnected or PlacementError (no spare fits) leave everything as it was."""
        if agent_id not in self._links:
            raise AgentNotConnected(f"agent {agent_id!r} is not connected")
        if agent_id in self._draining:
            return self.replacing(agent_id)
        agents = {a: caps for a, caps in self._plannable().items() if a != agent_id}
        pairs = []
        for model in self._registry.models():
            plan = self._registry.active_plan(model.model_id)
            if plan is None or all(s.agent_id != agent_id for s in plan.stages):
                continue
            chosen = repair_stages(model.model_id, model.path, model.config, agents, _placement(plan),
                                   self._registry.links(), _pins(model), self._origin_host)
            # the spare's own device and dtype (a KV move needs the same dtype: else the session is replayed)
            pairs += [(s, StageRecord(f"{s.assignment_id}-m{uuid.uuid4().hex[:6]}", plan.plan_id, s.stage_index,
                                      spare, replace(s.spec, device=spec.device, dtype=spec.dtype), "assigned"))
                      for s, (spare, spec) in zip(plan.stages, chosen, strict=True) if s.agent_id == agent_id]
        self._draining.add(agent_id)
        self.drain_failures.pop(agent_id, None)
        for old, new in pairs:
            self._replacements[new.assignment_id] = (old, new)
            standby = self._registry.standby_plan(old.spec.model_id)
            if standby is not None and any(s.agent_id == agent_id for s in standby.stages):
                self._registry.abandon_standby(old.spec.model_id)
        moves = ", ".join(f"{o.spec.model_id} [{o.spec.start_layer}, {o.spec.end_layer}) to {n.agent_id}"
                          for o, n in pairs)
        self._registry.log_event("drain", moves or "no stages", self._clock(), agent_id=agent_id)
        log.info("draining agent %s: %s", agent_id, moves or "it serves no stage")
        self.reconcile()
        return pairs

    def replacing(self, agent_id: str) -> list[tuple[StageRecord, StageRecord]]:
        """The agent's stages whose replacements are still loading."""
        return [pair for pair in self._replacements.values() if pair[0].agent_id == agent_id]

    def stage_address(self, agent_id: str) -> str:
        """Where a connected agent's Stage service listens (AgentNotConnected otherwise)."""
        link = self._links.get(agent_id)
        if link is None:
            raise AgentNotConnected(f"agent {agent_id!r} is not connected")
        return link.stage_address

    def _finish_replacements(self) -> None:
        """Puts each loaded replacement in its stage's place; the stage it replaces retires once idle."""
        now = self._clock()
        for new_id, (old, new) in list(self._replacements.items()):
            if not self._serving(new):
                continue
            del self._replacements[new_id]
            self._registry.replace_stage(old.assignment_id, StagePlacement(new_id, new.stage_index, new.agent_id,
                                                                         new.spec))
            self._retiring[old.assignment_id] = now + RETIRE_AFTER_S
            self._registry.log_event("stage_moved", f"{old.spec.model_id} [{old.spec.start_layer}, "
                                     f"{old.spec.end_layer}) from {old.agent_id} to {new.agent_id}", now)

    def _replacement_failed(self, assignment_id: str, error: str) -> None:
        pair = self._replacements.pop(assignment_id, None)
        if pair is not None:
            self.drain_failures[pair[0].agent_id] = f"{pair[1].agent_id} failed to load its stage: {error}"

    def cancel_drain(self, agent_id: str) -> None:
        """Gives up a drain: the replacements not loaded yet are dropped, and the agent is planned on again."""
        for new_id, (old, _) in list(self._replacements.items()):
            if old.agent_id == agent_id:
                del self._replacements[new_id]
        self._draining.discard(agent_id)
        self._release_unplanned()

    def finish_drain(self, agent_id: str) -> None:
        """Releases what the drained agent still holds and tells it to exit."""
        link = self._links.get(agent_id)
        if link is None:
            return
        self._drained.add(agent_id)
        for assignment_id in sorted(self._loaded.pop(agent_id, set())):
            self._retiring.pop(assignment_id, None)
            link.send(Release(assignment_id))
        link.send(Shutdown("drained: its stages moved to other agents"))
        self._registry.set_agent_state(agent_id, "drained", self._clock())
        log.info("agent %s drained; told to exit", agent_id)


def _placement(plan: PlanRecord) -> list[tuple[str, int, int, int]]:
    """(agent, start layer, end layer, tp degree) of each stage of the plan, in pipeline order."""
    return [(s.agent_id, s.spec.start_layer, s.spec.end_layer, s.spec.tp_degree) for s in plan.stages]


def _pins(model: ModelRecord) -> SitePins:
    return SitePins(model.first_site, model.last_site)
