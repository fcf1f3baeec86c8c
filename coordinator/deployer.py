"""The placement driver: turns models and connected agents into plans, assignments and ready routes."""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from stratamesh.coordinator.placement import plan_stages
from stratamesh.coordinator.registry import PlannedStage, Registry, StageRecord
from stratamesh.fleet.errors import CheckpointError, ModelNotFound, ModelNotReady, PlacementError
from stratamesh.fleet.types import (Assignment, Capabilities, Hop, LinkMeasurement, Peer, Registration,
                                    StageStatus, Telemetry)
from stratamesh.fleet.wire import convert
from stratamesh.partitioner.profile import profile_from_hf_config

log = logging.getLogger(__name__)

# Heartbeat telemetry kept per agent: an hour, and at most this many rows (an hour of 1 s heartbeats).
TELEMETRY_MAX_AGE_S = 3600.0
TELEMETRY_MAX_ROWS_PER_AGENT = 3600
TELEMETRY_PRUNE_EVERY_S = 60.0
# Every connected agent measures its links to all the others this often (and when one of them connects).
LINK_PROBE_EVERY_S = 300.0


@dataclass(slots=True)
class AgentLink:
    """A connected agent: where its stages listen and how to send it control messages."""

    agent_id: str
    stage_address: str
    capabilities: Capabilities
    send: Callable[[object], None]


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What the coordinator needs of a model without loading it."""

    model_id: str
    path: str
    num_layers: int
    hidden_size: int
    max_context: int
    created: int


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

    def __init__(self, registry: Registry, clock: Callable[[], float], replan_after_s: float = 10.0,
                 link_probe_every_s: float = LINK_PROBE_EVERY_S):
        self._registry = registry
        self._clock = clock
        self._replan_after_s = replan_after_s
        self._link_probe_every_s = link_probe_every_s
        self._probed_at = clock()
        self._links: dict[str, AgentLink] = {}
        self._loaded: dict[str, set[str]] = {}  # agent id -> assignment ids it reported loaded
        self._pending: dict[str, int] = {}     # model id -> stages wanted for its first plan
        self.telemetry: dict[str, Telemetry] = {}  # agent id -> its newest heartbeat telemetry
        self._pruned_at = float("-inf")

    def start(self) -> None:
        """After a (re)start no agent is connected and no stage known loaded until its agent says so."""
        now = self._clock()
        for agent in self._registry.agents():
            if agent.state != "disconnected":
                self._registry.set_agent_state(agent.agent_id, "disconnected", now)
        for model in self._registry.models():
            plan = self._registry.active_plan(model.model_id)
            for stage in plan.stages if plan else ():
                self._registry.set_stage_state(stage.assignment_id, "assigned")

    # ------------------------------------------------------------ models
    def add_model(self, model_id: str, path: str, num_stages: int) -> None:
        """Registers a model (or updates its path) and asks for a plan of num_stages stages."""
        config = read_model_config(path)
        self._registry.add_model(model_id, str(Path(path).resolve()), config["num_hidden_layers"],
                                 config, self._clock())
        if self._registry.active_plan(model_id) is None:
            self._pending[model_id] = num_stages
        self.reconcile()

    def models(self) -> list[ModelInfo]:
        return [ModelInfo(m.model_id, m.path, m.num_layers, m.config["hidden_size"],
                          m.config["max_position_embeddings"], int(m.created))
                for m in self._registry.models()]

    def model(self, model_id: str) -> ModelInfo:
        for info in self.models():
            if info.model_id == model_id:
                return info
        raise ModelNotFound(f"the model '{model_id}' does not exist")

    def is_ready(self, model_id: str) -> bool:
        plan = self._registry.active_plan(model_id)
        return plan is not None and all(self._serving(s) for s in plan.stages)

    def route(self, model_id: str) -> tuple[list[Hop], int]:
        """The hops of a ready replica of the model in pipeline order, and its KV block size."""
        self.model(model_id)
        plan = self._registry.active_plan(model_id)
        if plan is None or not all(self._serving(s) for s in plan.stages):
            raise ModelNotReady(f"the model '{model_id}' is not ready yet: its stages are loading")
        hops = [Hop(self._links[s.agent_id].stage_address, s.assignment_id) for s in plan.stages]
        return hops, plan.stages[0].spec.kv_block_size

    def _serving(self, stage: StageRecord) -> bool:
        return stage.assignment_id in self._loaded.get(stage.agent_id, ())

    # ------------------------------------------------------------ agents
    @property
    def num_agents(self) -> int:
        return len(self._links)

    def peers(self) -> list[Peer]:
        """Every connected agent and the address of its Stage and Link services, by agent id."""
        return [Peer(link.agent_id, link.stage_address) for _, link in sorted(self._links.items())]

    def agent_connected(self, link: AgentLink, registration: Registration) -> None:
        """Adopts a (re)connecting agent and the stages it still holds."""
        now = self._clock()
        self._links[link.agent_id] = link
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
                link.send(convert.release_to_pb(held.assignment_id))
        self._probe_links_of(link)
        self.reconcile()

    def agent_disconnected(self, link: AgentLink) -> None:
        if self._links.get(link.agent_id) is not link:
            return  # a newer stream of the same agent took over
        now = self._clock()
        del self._links[link.agent_id]
        self._loaded.pop(link.agent_id, None)
        self.telemetry.pop(link.agent_id, None)
        for assignment_id in self._planned_for(link.agent_id):
            self._registry.set_stage_state(assignment_id, "assigned")
        self._registry.set_agent_state(link.agent_id, "disconnected", now)
        self._registry.log_event("agent_disconnected", "", now, agent_id=link.agent_id)

    def heartbeat(self, agent_id: str, telemetry: Telemetry | None = None) -> None:
        """Records that the agent is alive, and what it reported about its load."""
        now = self._clock()
        self._registry.touch_agent(agent_id, now)
        if telemetry is not None:
            self._registry.record_telemetry(agent_id, telemetry, now)
            self.telemetry[agent_id] = telemetry

    def links_reported(self, agent_id: str, links: list[LinkMeasurement]) -> None:
        """Stores an agent's link measurements for the planner and the operator."""
        self._registry.record_links(agent_id, links, self._clock())
        for m in links:
            if m.error:
                log.info("agent %s could not measure its link to %s: %s", agent_id, m.peer_agent_id, m.error)

    def _probe_links_of(self, newcomer: AgentLink) -> None:
        """Asks the newcomer to measure its links to every other agent, and each of them its link to it."""
        others = [p for p in self.peers() if p.agent_id != newcomer.agent_id]
        if not others:
            return
        newcomer.send(convert.probe_links_to_pb(others))
        itself = [Peer(newcomer.agent_id, newcomer.stage_address)]
        for other in others:
            self._links[other.agent_id].send(convert.probe_links_to_pb(itself))

    def _probe_all_links(self) -> None:
        """Asks every connected agent to measure its links to all the others again."""
        peers = self.peers()
        for link in self._links.values():
            others = [p for p in peers if p.agent_id != link.agent_id]
            if others:
                link.send(convert.probe_links_to_pb(others))

    def stage_status(self, agent_id: str, status: StageStatus) -> None:
        """Records an agent's report on one of its assignments."""
        if status.assignment_id not in self._planned_for(agent_id):
            return
        loaded = self._loaded.setdefault(agent_id, set())
        if status.state == "ready":
            loaded.add(status.assignment_id)
        else:
            loaded.discard(status.assignment_id)
        self._registry.set_stage_state(status.assignment_id, status.state)
        if status.state == "failed":
            self._registry.log_event("stage_failed", status.error, self._clock(), agent_id=agent_id)
            log.warning("agent %s failed to load %s: %s", agent_id, status.assignment_id, status.error)

    def _planned_for(self, agent_id: str) -> dict[str, StageRecord]:
        stages = {}
        for model in self._registry.models():
            plan = self._registry.active_plan(model.model_id)
            for stage in plan.stages if plan else ():
                if stage.agent_id == agent_id:
                    stages[stage.assignment_id] = stage
        return stages

    # ------------------------------------------------------------ planning
    def tick(self) -> None:
        """Re-plans models whose agents stay gone past the grace period, prunes telemetry, re-probes links when due."""
        now = self._clock()
        if now >= self._pruned_at + TELEMETRY_PRUNE_EVERY_S:
            self._pruned_at = now
            self._registry.prune_telemetry(now, TELEMETRY_MAX_AGE_S, TELEMETRY_MAX_ROWS_PER_AGENT)
        if now >= self._probed_at + self._link_probe_every_s:
            self._probed_at = now
            self._probe_all_links()
        for model in self._registry.models():
            plan = self._registry.active_plan(model.model_id)
            if plan is None or len(self._links) < len(plan.stages):
                continue
            gone = [self._registry.agent(s.agent_id) for s in plan.stages if s.agent_id not in self._links]
            if gone and all(a is None or a.state_since + self._replan_after_s <= now for a in gone):
                log.warning("re-planning %s: agents %s are gone", model.model_id,
                            ", ".join(a.agent_id for a in gone if a is not None))
                self._plan(model.model_id, len(plan.stages))
                self._release_unplanned()
        self.reconcile()

    def _release_unplanned(self) -> None:
        for link in self._links.values():
            loaded = self._loaded.setdefault(link.agent_id, set())
            for assignment_id in sorted(loaded - set(self._planned_for(link.agent_id))):
                loaded.discard(assignment_id)
                link.send(convert.release_to_pb(assignment_id))

    def reconcile(self) -> None:
        """Plans models that wait for agents, and assigns planned stages whose agent lacks them."""
        for model_id, num_stages in list(self._pending.items()):
            if len(self._links) >= num_stages:
                self._plan(model_id, num_stages)
                del self._pending[model_id]
        for model in self._registry.models():
            plan = self._registry.active_plan(model.model_id)
            for stage in plan.stages if plan else ():
                link = self._links.get(stage.agent_id)
                if link is not None and not self._serving(stage) \
                        and stage.state not in ("loading", "failed"):
                    self._registry.set_stage_state(stage.assignment_id, "loading")
                    link.send(convert.assign_to_pb(Assignment(stage.assignment_id, stage.spec)))

    def _plan(self, model_id: str, num_stages: int) -> None:
        model = self._registry.model(model_id)
        agents = {link.agent_id: link.capabilities for link in self._links.values()}
        try:
            planned, placed = plan_stages(model_id, model.path, model.config, agents, num_stages,
                                          self._registry.links())
        except PlacementError as exc:
            log.error("cannot place %s: %s", model_id, exc)
            self._registry.log_event("placement_failed", str(exc), self._clock())
            return
        plan_id = uuid.uuid4().hex[:12]
        stages = [PlannedStage(f"{plan_id}-{i}", i, agent_id, spec)
                  for i, (agent_id, spec) in enumerate(placed)]
        reason = planned.reason
        self._registry.save_plan(plan_id, model_id, stages, reason, self._clock())
        self._registry.log_event("plan", reason, self._clock())
        log.info("planned %s: %s", model_id, reason)
