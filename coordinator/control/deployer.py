"""The placement driver: turns models and connected agents into plans, assignments and ready routes."""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Sequence

from stratamesh.coordinator.control.drains import Drains, Move
from stratamesh.coordinator.control.events import ControlEvents, NoSessions, Sessions
from stratamesh.coordinator.control.models import ModelInfo, find_model, model_infos
from stratamesh.coordinator.control.plans import Plans
from stratamesh.coordinator.control.roster import AgentLink, AgentNotConnected, Roster
from stratamesh.coordinator.control.routes import Disaggregation, Routes
from stratamesh.coordinator.linkprobe import LINK_PROBE_EVERY_S
from stratamesh.coordinator.liveness import Liveness, LivenessConfig
from stratamesh.coordinator.placement import SitePins
from stratamesh.coordinator.records import PlanRecord
from stratamesh.coordinator.registry_store import RegistryStore
from stratamesh.fleet.states import AgentState, StageState
from stratamesh.fleet.types import (
    DEFAULT_ROUTER_MODE, Capabilities, Hop, KvEvents, LinkMeasurement, Peer, Registration, StageStatus, Telemetry,
)
from stratamesh.fleet.weights import WeightsProgress

log = logging.getLogger(__name__)
# Peers an agent fetching weights is told to try before the coordinator, at most
MAX_WEIGHT_SOURCES = 4
# While an agent's owner's limits ask it to rest and its rest cannot begin (no spare), how often it is asked again
REST_RETRY_S = 10.0


class Deployer:
    """Keeps every deployed model's active plan served: plans, pushes assignments, tracks readiness.

    It composes the roster, the routes, the plans and the drains, and runs what crosses them: an agent joins,
    reports a stage, leaves or dies; a drain starts or ends. sessions: the origin's (a dead agent's sessions
    fail over; stages in use are not released). events: where the origin reports unreachable stages."""

    def __init__(self, registry: RegistryStore, clock: Callable[[], float],
                 liveness: LivenessConfig = LivenessConfig(), link_probe_every_s: float = LINK_PROBE_EVERY_S,
                 origin_host: str = "", sessions: Sessions = NoSessions(), events: ControlEvents | None = None,
                 router_mode: str = DEFAULT_ROUTER_MODE, disaggregation: Disaggregation = Disaggregation(),
                 wire_codec: str = "auto"):
        self._registry = registry
        self._clock = clock
        self._sessions = sessions
        self._roster = Roster(registry, clock, liveness, link_probe_every_s)
        self._routes = Routes(registry, self._roster, router_mode, sessions, clock, disaggregation, wire_codec)
        self._drains = Drains(registry, clock, self._roster)
        self._plans = Plans(registry, clock, self._roster, self._routes, self._drains, sessions, origin_host)
        self._events = events or ControlEvents()
        self._events.on_unreachable(self.report_unreachable)
        self.weights: dict[str, WeightsProgress] = {}   # assignment id -> how its agent's fetch of its tensors went

    @property
    def liveness(self) -> Liveness:
        return self._roster.liveness

    @property
    def telemetry(self) -> dict[str, Telemetry]:
        """agent id -> its newest heartbeat telemetry."""
        return self._roster.telemetry

    @property
    def plans_computed(self) -> int:
        """How many plans the planner has computed since this coordinator started."""
        return self._plans.num_computed

    @property
    def telemetry_at(self) -> dict[str, float]:
        """agent id -> when its newest heartbeat telemetry came."""
        return self._roster.telemetry_at

    @property
    def drain_failures(self) -> dict[str, str]:
        """agent id -> why a replacement of its stages failed."""
        return self._drains.failures

    def start(self) -> None:
        """After a (re)start no agent is connected and no stage known loaded until its agent says so."""
        now = self._clock()
        self._roster.start(now)
        for agent_id in self._plans.restart():
            self.liveness.expect(agent_id, now)

    # ------------------------------------------------------------ models
    def add_model(self, model_id: str, path: str, num_stages: int, pins: SitePins = SitePins(),
                  quantize: str = "", num_replicas: int = 1) -> None:
        """Registers a model (or updates its path, site pins, quantization and replicas) and asks for a plan of
        num_stages stages for each of num_replicas replicas."""
        self._plans.add_model(model_id, path, num_stages, pins, quantize, num_replicas)

    def num_stages(self, model_id: str) -> int:
        return self._plans.num_stages(model_id)

    def ready_replicas(self, model_id: str) -> int:
        """How many of the model's replicas have every stage loaded."""
        return len(self._routes.ready_plans(model_id))

    def cached_blocks(self, assignment_id: str) -> int:
        """The KV blocks the stage's prefix cache holds, as its KV events told the router."""
        return self._routes.prefixes.num_cached(assignment_id)

    def replan(self, model_id: str, num_stages: int | None = None) -> tuple[str, str]:
        return self._plans.replan(model_id, num_stages)

    def models(self) -> list[ModelInfo]:
        return model_infos(self._registry)

    def model(self, model_id: str) -> ModelInfo:
        return find_model(self._registry, model_id)

    # ------------------------------------------------------------ routes
    def is_ready(self, model_id: str) -> bool:
        return self._routes.is_ready(model_id)

    def accepts(self, model_id: str) -> bool:
        return self._routes.accepts(model_id)

    def route(self, model_id: str, avoid: Collection[str] = (), token_ids: Sequence[int] = ()) -> tuple[list[Hop], int]:
        return self._routes.route(model_id, avoid, token_ids)

    def link_codecs(self, plan: PlanRecord) -> list[str]:
        """The codec of the link into each stage of plan, as routes through it use now (control.routes.hop_codecs)."""
        return self._routes.link_codecs(plan)

    def codec_links(self) -> list[tuple[str, str, str, str]]:
        """(model id, sender agent id, receiver agent id, codec) of every link between two stages of an active
        plan."""
        return [(plan.model_id, sender.agent_id, receiver.agent_id, codec)
                for model in self._registry.models() for plan in self._registry.active_plans(model.model_id)
                for sender, receiver, codec in zip(plan.stages, plan.stages[1:], self.link_codecs(plan)[1:])]

    def role(self, plan: PlanRecord) -> str:
        """What a replica's plan serves under prefill/decode disaggregation: "prefill" or "decode"; "" when off."""
        return self._routes.disaggregation.role(plan)

    def prefill_route(self, model_id: str, decode: Sequence[Hop], token_ids: Sequence[int],
                      avoid: Collection[str] = ()) -> list[Hop] | None:
        return self._routes.prefill_route(model_id, decode, token_ids, avoid)

    async def wait_route(self, model_id: str, timeout_s: float, avoid: Collection[str] = (),
                         token_ids: Sequence[int] = ()) -> tuple[list[Hop], int]:
        return await self._routes.wait_route(model_id, timeout_s, avoid, token_ids)

    # ------------------------------------------------------------ agents
    @property
    def num_agents(self) -> int:
        return self._roster.num_agents

    def peers(self) -> list[Peer]:
        return self._roster.peers()

    @property
    def membership(self) -> int:
        """A count bumped whenever an agent connects or leaves: peers() is the same while it stays."""
        return self._roster.membership

    def stage_address(self, agent_id: str) -> str:
        return self._roster.stage_address(agent_id)

    def agent_connected(self, link: AgentLink, registration: Registration) -> None:
        """Adopts a (re)connecting agent and the stages it still holds."""
        # A box that has the memory for no stage of any model (and holds none) is in no plan and changes none: its
        # join costs no planning, which is what lets thousands of small boxes join at once. One that could hold a
        # stage gets its planned stages and may complete a first plan now; whether it makes a better plan is
        # weighed with the boxes joining around it once they settle (Plans.joined; tick).
        useful = bool(registration.held) or self._plans.could_hold_a_stage(registration.capabilities) \
            or self._plans.is_planned(link.agent_id)
        planned = self._plans.planned_for(link.agent_id) if useful else {}
        self._roster.connect(link, registration, planned=planned)
        if useful:
            self._plans.joined()
            self._plans.reconcile()

    def agent_disconnected(self, link: AgentLink) -> None:
        if not self._roster.disconnect(link):
            return  # a newer stream of the same agent took over, or the agent was declared dead
        self._drains.forget(link.agent_id)
        if self._drains.left(link.agent_id):     # it left as told: not a failure
            self._roster.record_drained(link.agent_id)
        else:
            self._plans.unload(link.agent_id)
            if self._roster.lost(link.agent_id):
                self._agent_dead(link.agent_id)
        self._routes.notify()

    def kv_events(self, agent_id: str, reports: list[KvEvents]) -> None:
        """An agent's stages' prefix-cache changes, for the router (a stage it does not hold is not its to report)."""
        self._routes.kv_events([r for r in reports if self._roster.holds(agent_id, r.assignment_id)])

    def weights_progress(self, agent_id: str, progress: WeightsProgress) -> None:
        """An agent's report on fetching a planned stage's tensors (kept while the stage is planned)."""
        if progress.assignment_id not in self._plans.planned_for(agent_id):
            return
        self.weights[progress.assignment_id] = progress
        if progress.done:
            self._registry.log_event(
                "weights_fetched", f"{progress.assignment_id}: {progress.fetched_bytes} bytes fetched (its tensors: "
                f"{progress.tensor_bytes}), {progress.reused_bytes} already on disk, {progress.num_corrupt} corrupt "
                f"chunk(s) fetched again", self._clock(), agent_id=agent_id)

    def weight_sources(self, model_id: str, agent_id: str) -> list[str]:
        """Where an agent may fetch a model's chunks before asking the coordinator: the other agents serving a stage
        of it, those on its site first (a peer without a chunk says so, and the agent asks the next)."""
        holders = [s.agent_id for plan in self._registry.live_plans(model_id) for s in plan.stages
                   if self._roster.serving(s)]
        return self._roster.nearest(agent_id, holders)[:MAX_WEIGHT_SOURCES]

    def model_path(self, model_id: str) -> str | None:
        """A deployed model's folder on the coordinator's disk; None if there is no such model."""
        model = self._registry.model(model_id)
        return model.path if model is not None else None

    def heartbeat(self, agent_id: str, telemetry: Telemetry | None = None) -> None:
        self._roster.heartbeat(agent_id, telemetry)
        if telemetry is not None and self._roster.is_connected(agent_id):
            self._owner_says(agent_id, telemetry.resting)

    def _owner_says(self, agent_id: str, resting: str) -> None:
        """An agent's telemetry says whether its owner's limits rest it: a rest is asked for (the drainer moves its
        stages off; finish_rest), again every REST_RETRY_S while it could not begin (no spare could take a stage,
        or a replacement failed), and ends when the agent serves again (end_rest)."""
        drains = self._drains
        if resting:
            if agent_id in drains.resting or agent_id in drains.draining:
                return
            now, last = self._clock(), drains.rest_asked.get(agent_id)
            if last is not None and now - last < REST_RETRY_S:
                return
            drains.rest_asked[agent_id] = now
            if last is None:
                log.info("agent %s asks to rest: %s", agent_id, resting)
            self._events.rest_asked(agent_id, resting)
        elif agent_id in drains.resting:
            self.end_rest(agent_id)
        else:
            drains.rest_asked.pop(agent_id, None)      # its limits cleared before it could rest

    def report_unreachable(self, address: str) -> None:
        """The data plane could not reach this Stage address: a sign that its agent died."""
        agent_id = self._roster.unreachable(address)
        if agent_id is not None:
            self._agent_dead(agent_id)

    def check_liveness(self, stalled_s: float = 0.0) -> None:
        """Declares dead every agent whose lease ran out (call it often: it is how fast a hung box is found).
        stalled_s: how long the coordinator could not read its streams since the last call; leases get it back."""
        if stalled_s > 0:
            self._roster.liveness.stalled(stalled_s)
        for agent_id in self._roster.expired():
            self._agent_dead(agent_id)

    def _agent_dead(self, agent_id: str) -> None:
        """Cuts a dead agent off, fails over the sessions routed through it and re-plans its models."""
        self._drains.forget(agent_id)
        for address in self._roster.cut_off(agent_id):
            self._sessions.route_lost(address)
        self._plans.replan_lost()

    def links_reported(self, agent_id: str, links: list[LinkMeasurement]) -> None:
        self._roster.links_reported(agent_id, links)

    def stage_status(self, agent_id: str, status: StageStatus) -> None:
        """Records an agent's report on one of its assignments."""
        if status.assignment_id not in self._plans.planned_for(agent_id):
            return
        self._roster.record_loaded(agent_id, status.assignment_id, status.state == StageState.READY)
        self._plans.set_stage_state(status.assignment_id, status.state)
        if status.state == StageState.FAILED:
            self._registry.log_event("stage_failed", status.error, self._clock(), agent_id=agent_id)
            log.warning("agent %s failed to load %s: %s", agent_id, status.assignment_id, status.error)
            self._drains.replacement_failed(status.assignment_id, status.error)
        now = self._clock()
        self._plans.retire(self._drains.finish_replacements(now), now)   # the stages replaced retire once idle
        self._plans.promote_standbys()
        self._routes.notify()

    # ------------------------------------------------------------ planning
    def tick(self) -> None:
        """Prunes telemetry, re-probes links when due, re-plans models that lost agents once others can hold them."""
        self._roster.tick()
        self._plans.replan_lost()
        self._plans.improve()
        self._plans.release_unplanned()
        self._routes.prune()
        if self.weights:
            planned = self._plans.planned_ids()
            self.weights = {a: p for a, p in self.weights.items() if a in planned}

    def reconcile(self) -> None:
        """Plans models that wait for agents, and assigns planned stages whose agent lacks them."""
        self._plans.reconcile()

    def _plannable(self) -> dict[str, Capabilities]:
        """The agents a plan may use now (the tests look at it)."""
        return self._plans.plannable()

    # ------------------------------------------------------------ drains
    def drain(self, agent_id: str) -> list[Move]:
        """Starts moving every stage of the agent to a spare, layer range unchanged, and plans on it no more.

        Returns (stage, replacement) pairs; the replacement takes the stage's place in its plan once loaded.
        AgentNotConnected or PlacementError (no spare fits) leave everything as it was."""
        if not self._roster.is_connected(agent_id):
            raise AgentNotConnected(f"agent {agent_id!r} is not connected")
        if agent_id in self._drains.draining:
            return self._drains.replacing(agent_id)
        moves = self._plans.moves_off(agent_id)
        self._drains.start(agent_id, moves)
        self._plans.reconcile()
        return moves

    def replacing(self, agent_id: str) -> list[Move]:
        """The agent's stages whose replacements are still loading."""
        return self._drains.replacing(agent_id)

    def cancel_drain(self, agent_id: str) -> None:
        """Gives up a drain: the replacements not loaded yet are dropped, and the agent is planned on again."""
        self._drains.cancel(agent_id)
        self._plans.release_unplanned()

    def finish_rest(self, agent_id: str, why: str) -> None:
        """Ends the drain of a resting agent: what it still holds is released, and it stays connected, planned on
        no more until it serves again (end_rest)."""
        if not self._roster.is_connected(agent_id):
            return
        self._drains.draining.discard(agent_id)
        self._drains.resting[agent_id] = why
        self._plans.stop_retiring(self._roster.release_held(agent_id))
        self._registry.set_agent_state(agent_id, AgentState.RESTING, self._clock())
        self._registry.log_event("agent_resting", why, self._clock(), agent_id=agent_id)
        log.info("agent %s rests: %s", agent_id, why)

    def end_rest(self, agent_id: str) -> None:
        """A resting agent serves again: plans may use it (a clearly better plan with it becomes a standby)."""
        why = self._drains.resting.pop(agent_id, None)
        self._drains.rest_asked.pop(agent_id, None)
        if why is None:
            return
        self._registry.set_agent_state(agent_id, AgentState.CONNECTED, self._clock())
        self._registry.log_event("agent_serving", f"its owner's limits allow it again (it rested: {why})",
                                 self._clock(), agent_id=agent_id)
        log.info("agent %s serves again", agent_id)
        self._plans.reconcile()
        self._plans.improve()

    def finish_drain(self, agent_id: str) -> None:
        """Releases what the drained agent still holds and tells it to exit."""
        if not self._roster.is_connected(agent_id):
            return
        self._drains.told_to_exit(agent_id)
        self._plans.stop_retiring(self._roster.shut_down(agent_id, "drained: its stages moved to other agents"))
        log.info("agent %s drained; told to exit", agent_id)
