"""The placement driver: turns models and connected agents into plans, assignments and ready routes."""

from __future__ import annotations

import logging
from collections.abc import Callable

from stratamesh.coordinator.control.drains import Drains, Move
from stratamesh.coordinator.control.load_errors import LoadError, LoadErrors
from stratamesh.coordinator.control.plans import Plans
from stratamesh.coordinator.control.probes import LINK_PROBE_EVERY_S, AgentLink
from stratamesh.coordinator.control.roster import AgentNotConnected, Roster
from stratamesh.coordinator.control.routes import Routes
from stratamesh.coordinator.control.sessions import NoSessions, Sessions
from stratamesh.coordinator.liveness import LivenessConfig
from stratamesh.coordinator.registry_store import RegistryStore
from stratamesh.fleet.states import AgentState, StageState
from stratamesh.fleet.boxes import Registration, Telemetry
from stratamesh.fleet.kv import KvEvents
from stratamesh.fleet.stages import StageStatus
from stratamesh.fleet.weights import WeightsProgress

log = logging.getLogger(__name__)
# Peers an agent fetching weights is told to try before the coordinator, at most
MAX_WEIGHT_SOURCES = 4
# While an agent's owner's limits ask it to rest and its rest cannot begin (no spare), how often it is asked again
REST_RETRY_S = 10.0


class Deployer:
    """Keeps every deployed model's active plan served: plans, pushes assignments, tracks readiness.

    It composes the rooms of the control plane, which callers reach directly: the registry, the roster (agents,
    links, liveness), the routes (readiness, hops, prefix caches), the plans and the drains. Its own methods run what
    crosses them: an agent joins, reports a stage, leaves or dies; a drain starts or ends. sessions: the origin's (a
    dead agent's sessions fail over; stages in use are not released). on_rest: told (agent id, why) when an agent's
    owner asks it to rest (the coordinator's Drainer moves its stages off)."""

    def __init__(self, registry: RegistryStore, clock: Callable[[], float],
                 liveness: LivenessConfig = LivenessConfig(), link_probe_every_s: float = LINK_PROBE_EVERY_S,
                 origin_host: str = "", sessions: Sessions = NoSessions(), codec_policy: str = "auto"):
        self.registry = registry
        self._clock = clock
        self._sessions = sessions
        self.roster = Roster(registry, clock, liveness, link_probe_every_s)
        self.routes = Routes(registry, self.roster, clock, codec_policy)
        self.drains = Drains(registry, clock, self.roster)
        self.plans = Plans(registry, clock, self.roster, self.routes, self.drains, sessions, origin_host)
        self.on_rest: Callable[[str, str], None] = lambda agent_id, why: None
        self.weights: dict[str, WeightsProgress] = {}   # assignment id -> how its agent's fetch of its tensors went
        self.load_errors = LoadErrors()                 # the stages agents could not load, and why

    def start(self) -> None:
        """After a (re)start no agent is connected and no stage known loaded until its agent says so."""
        now = self._clock()
        self.roster.start(now)
        for agent_id in self.plans.restart():
            self.roster.liveness.expect(agent_id, now)

    def codec_links(self) -> list[tuple[str, str, str, str]]:
        """(model id, sender agent id, receiver agent id, codec) of every link between two stages of an active
        plan."""
        return [(plan.model_id, sender.agent_id, receiver.agent_id, codec)
                for model in self.registry.models() for plan in self.registry.active_plans(model.model_id)
                for sender, receiver, codec in zip(plan.stages, plan.stages[1:], self.routes.link_codecs(plan)[1:])]

    # ------------------------------------------------------------ agents
    def agent_refused(self, agent_id: str, reason: str) -> None:
        """An agent this coordinator would not let join (fleet/versions.py): an event says why."""
        self.registry.log_event("agent_refused", reason, self._clock(), agent_id)

    def agent_connected(self, link: AgentLink, registration: Registration) -> None:
        """Adopts a (re)connecting agent and the stages it still holds."""
        # A box that has the memory for no stage of any model (and holds none) is in no plan and changes none: its
        # join costs no planning, which is what lets thousands of small boxes join at once. One that could hold a
        # stage gets its planned stages and may complete a first plan now; whether it makes a better plan is
        # weighed with the boxes joining around it once they settle (Plans.joined; tick).
        useful = bool(registration.held) or self.plans.could_hold_a_stage(registration.capabilities) \
            or self.plans.is_planned(link.agent_id)
        planned = self.plans.planned_for(link.agent_id) if useful else {}
        self.roster.connect(link, registration, planned=planned)
        if useful:
            self.plans.joined()
            self.plans.reconcile()

    def agent_disconnected(self, link: AgentLink) -> None:
        if not self.roster.disconnect(link):
            return  # a newer stream of the same agent took over, or the agent was declared dead
        self.drains.forget(link.agent_id)
        if self.drains.left(link.agent_id):     # it left as told: not a failure
            self.roster.record_drained(link.agent_id)
        else:
            self.plans.unload(link.agent_id)
            if self.roster.lost(link.agent_id):
                self._agent_dead(link.agent_id)
        self.routes.notify()

    def kv_events(self, agent_id: str, reports: list[KvEvents]) -> None:
        """An agent's stages' prefix-cache changes, for the router (a stage it does not hold is not its to report)."""
        self.routes.kv_events([r for r in reports if self.roster.holds(agent_id, r.assignment_id)])

    def weights_progress(self, agent_id: str, progress: WeightsProgress) -> None:
        """An agent's report on fetching a planned stage's tensors (kept while the stage is planned)."""
        if progress.assignment_id not in self.plans.planned_for(agent_id):
            return
        self.weights[progress.assignment_id] = progress
        if progress.done:
            self.registry.log_event(
                "weights_fetched", f"{progress.assignment_id}: {progress.fetched_bytes} bytes fetched (its tensors: "
                f"{progress.tensor_bytes}), {progress.reused_bytes} already on disk, {progress.num_corrupt} corrupt "
                f"chunk(s) fetched again", self._clock(), agent_id=agent_id)

    def weight_sources(self, model_id: str, agent_id: str) -> list[str]:
        """Where an agent may fetch a model's chunks before asking the coordinator: the other agents serving a stage
        of it, those on its site first (a peer without a chunk says so, and the agent asks the next)."""
        holders = [s.agent_id for plan in self.registry.live_plans(model_id) for s in plan.stages
                   if self.roster.serving(s)]
        return self.roster.nearest(agent_id, holders)[:MAX_WEIGHT_SOURCES]

    def model_path(self, model_id: str) -> str | None:
        """A deployed model's folder on the coordinator's disk; None if there is no such model."""
        model = self.registry.model(model_id)
        return model.path if model is not None else None

    def heartbeat(self, agent_id: str, telemetry: Telemetry | None = None) -> None:
        self.roster.heartbeat(agent_id, telemetry)
        if telemetry is not None and self.roster.is_connected(agent_id):
            self._owner_says(agent_id, telemetry.resting)

    def _owner_says(self, agent_id: str, resting: str) -> None:
        """An agent's telemetry says whether its owner's limits rest it: a rest is asked for (the drainer moves its
        stages off; finish_rest), again every REST_RETRY_S while it could not begin (no spare could take a stage,
        or a replacement failed), and ends when the agent serves again (end_rest)."""
        drains = self.drains
        if resting:
            if agent_id in drains.resting or agent_id in drains.draining:
                return
            now, last = self._clock(), drains.rest_asked.get(agent_id)
            if last is not None and now - last < REST_RETRY_S:
                return
            drains.rest_asked[agent_id] = now
            if last is None:
                log.info("agent %s asks to rest: %s", agent_id, resting)
            self.on_rest(agent_id, resting)
        elif agent_id in drains.resting:
            self.end_rest(agent_id)
        else:
            drains.rest_asked.pop(agent_id, None)      # its limits cleared before it could rest

    def report_unreachable(self, address: str) -> None:
        """The data plane could not reach this Stage address: a sign that its agent died."""
        agent_id = self.roster.unreachable(address)
        if agent_id is not None:
            self._agent_dead(agent_id)

    def check_liveness(self, stalled_s: float = 0.0) -> None:
        """Declares dead every agent whose lease ran out (call it often: it is how fast a hung box is found).
        stalled_s: how long the coordinator could not read its streams since the last call; leases get it back."""
        if stalled_s > 0:
            self.roster.liveness.stalled(stalled_s)
        for agent_id in self.roster.expired():
            self._agent_dead(agent_id)

    def _agent_dead(self, agent_id: str) -> None:
        """Cuts a dead agent off, fails over the sessions routed through it and re-plans its models."""
        self.drains.forget(agent_id)
        for address in self.roster.cut_off(agent_id):
            self._sessions.route_lost(address)
        self.plans.replan_lost()

    def stage_status(self, agent_id: str, status: StageStatus) -> None:
        """Records an agent's report on one of its assignments."""
        stage = self.plans.planned_for(agent_id).get(status.assignment_id)
        if stage is None:
            return
        self.roster.record_loaded(agent_id, status.assignment_id, status.state == StageState.READY)
        self.plans.set_stage_state(status.assignment_id, status.state)
        if status.state == StageState.READY:
            self.load_errors.loaded(status.assignment_id)
        if status.state == StageState.FAILED:
            self.load_errors.failed(LoadError(stage.spec.model_id, status.assignment_id, agent_id, status.error,
                                              self._clock()))
            self.registry.log_event("stage_failed", status.error, self._clock(), agent_id=agent_id)
            log.warning("agent %s failed to load %s: %s", agent_id, status.assignment_id, status.error)
            self.drains.replacement_failed(status.assignment_id, status.error)
        now = self._clock()
        self.plans.retire(self.drains.finish_replacements(now), now)   # the stages replaced retire once idle
        self.plans.promote_standbys()
        self.routes.notify()

    # ------------------------------------------------------------ planning
    def tick(self) -> None:
        """Prunes telemetry, re-probes links when due, re-plans models that lost agents once others can hold them."""
        self.roster.tick()
        self.plans.replan_lost()
        self.plans.improve()
        self.plans.release_unplanned()
        self.routes.prune()
        if self.load_errors:
            self.load_errors.keep(self.plans.planned_ids())
        if self.weights:
            planned = self.plans.planned_ids()
            self.weights = {a: p for a, p in self.weights.items() if a in planned}

    # ------------------------------------------------------------ drains
    def drain(self, agent_id: str) -> list[Move]:
        """Starts moving every stage of the agent to a spare, layer range unchanged, and plans on it no more.

        Returns (stage, replacement) pairs; the replacement takes the stage's place in its plan once loaded.
        AgentNotConnected or PlacementError (no spare fits) leave everything as it was."""
        if not self.roster.is_connected(agent_id):
            raise AgentNotConnected(f"agent {agent_id!r} is not connected")
        if agent_id in self.drains.draining:
            return self.drains.replacing(agent_id)
        moves = self.plans.moves_off(agent_id)
        self.drains.start(agent_id, moves)
        self.plans.reconcile()
        return moves

    def cancel_drain(self, agent_id: str) -> None:
        """Gives up a drain: the replacements not loaded yet are dropped, and the agent is planned on again."""
        self.drains.cancel(agent_id)
        self.plans.release_unplanned()

    def finish_rest(self, agent_id: str, why: str) -> None:
        """Ends the drain of a resting agent: what it still holds is released, and it stays connected, planned on
        no more until it serves again (end_rest)."""
        if not self.roster.is_connected(agent_id):
            return
        self.drains.draining.discard(agent_id)
        self.drains.resting[agent_id] = why
        self.plans.stop_retiring(self.roster.release_held(agent_id))
        self.registry.set_agent_state(agent_id, AgentState.RESTING, self._clock())
        self.registry.log_event("agent_resting", why, self._clock(), agent_id=agent_id)
        log.info("agent %s rests: %s", agent_id, why)

    def end_rest(self, agent_id: str) -> None:
        """A resting agent serves again: plans may use it (a clearly better plan with it becomes a standby)."""
        why = self.drains.resting.pop(agent_id, None)
        self.drains.rest_asked.pop(agent_id, None)
        if why is None:
            return
        self.registry.set_agent_state(agent_id, AgentState.CONNECTED, self._clock())
        self.registry.log_event("agent_serving", f"its owner's limits allow it again (it rested: {why})",
                                 self._clock(), agent_id=agent_id)
        log.info("agent %s serves again", agent_id)
        self.plans.reconcile()
        self.plans.improve()

    def finish_drain(self, agent_id: str) -> None:
        """Releases what the drained agent still holds and tells it to exit."""
        if not self.roster.is_connected(agent_id):
            return
        self.drains.told_to_exit(agent_id)
        self.plans.stop_retiring(self.roster.shut_down(agent_id, "drained: its stages moved to other agents"))
        log.info("agent %s drained; told to exit", agent_id)
