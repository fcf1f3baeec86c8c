"""Drains, their stage-moving half: the agents being drained and the replacements loading for their stages."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace

from stratamesh.coordinator.control.roster import Roster
from stratamesh.coordinator.records import StageRecord
from stratamesh.coordinator.registry_store import RegistryStore
from stratamesh.fleet.states import PlanState

log = logging.getLogger(__name__)

Move = tuple[StageRecord]     # (a stage of a drained agent, its replacement on a spare)


class Drains:
    """The agents being drained: planned on no more, each of their stages replaced by one loading on a spare,
    layer range unchanged. A loaded replacement takes its stage's place in the plan; a failed one fails its
    agent's drain. It also remembers the agents told to exit, so that their leaving is not taken for a death, and
    the agents resting (a drain the owner's limits asked for, after which the agent stays, planned on no more)."""

    def __init__(self, registry: RegistryStore, clock: Callable[[], float], roster: Roster):
        self._registry = registry
        self._clock = clock
        self._roster = roster
        self.draining: set[str] = set()        # agents planned on no more
        self._drained: set[str] = set()        # agents told to exit
        self._replacements: dict[str, Move] = {}  # new assignment id -> (old, new)
        self.failures: dict[str, str] = {}     # agent id -> why a replacement of its stages failed
        self.resting: dict[str, str] = {}      # agent id -> why its owner's limits rest it (planned on no more)
        self.rest_asked: dict[str, float] = {}  # agent id -> when its rest was last asked for (until it serves again)

    def start(self, agent_id: str, moves: list[Move]) -> None:
        """Starts loading the replacements of the agent's stages; its stages in a standby plan abandon it."""
        self.draining.add(agent_id)
        self.failures.pop(agent_id, None)
        for old, new in moves:
            self._replacements[new.assignment_id] = (old, new)
            for standby in self._registry.live_plans(old.spec.model_id):
                if standby.state == PlanState.STANDBY and any(s.agent_id == agent_id for s in standby.stages):
                    self._registry.abandon_standby(old.spec.model_id, standby.replica)
        described = ", ".join(f"{o.spec.model_id} [{o.spec.start_layer}, {o.spec.end_layer}) to {n.agent_id}"
                              for o, n in moves)
        self._registry.log_event("drain", described or "no stages", self._clock(), agent_id=agent_id)
        log.info("draining agent %s: %s", agent_id, described or "it serves no stage")

    def replacing(self, agent_id: str) -> list[Move]:
        """The agent's stages whose replacements are still loading."""
        return [pair for pair in self._replacements.values() if pair[0].agent_id == agent_id]

    def stages(self) -> list[StageRecord]:
        """The replacements still loading."""
        return [new for _, new in self._replacements.values()]

    def set_stage_state(self, assignment_id: str, state: str) -> bool:
        """Records the state of a replacement; False if the assignment is none."""
        if assignment_id not in self._replacements:
            return False
        old, new = self._replacements[assignment_id]
        self._replacements[assignment_id] = (old, replace(new, state=state))
        return True

    def finish_replacements(self, now: float) -> list[str]:
        """Puts each loaded replacement in its stage's place; returns the assignment ids of the stages replaced."""
        replaced = []
        for new_id, (old, new) in list(self._replacements.items()):
            if not self._roster.serving(new):
                continue
            del self._replacements[new_id]
            self._registry.replace_stage(old.assignment_id, StageRecord(new_id, new.stage_index, new.agent_id,
                                                                         new.spec))
            replaced.append(old.assignment_id)
            self._registry.log_event("stage_moved", f"{old.spec.model_id} [{old.spec.start_layer}, "
                                     f"{old.spec.end_layer}) from {old.agent_id} to {new.agent_id}", now)
        return replaced

    def replacement_failed(self, assignment_id: str, error: str) -> None:
        pair = self._replacements.pop(assignment_id, None)
        if pair is not None:
            self.failures[pair[0].agent_id] = f"{pair[1].agent_id} failed to load its stage: {error}"

    def cancel(self, agent_id: str) -> None:
        """Gives up a drain: the replacements not loaded yet are dropped, and the agent is planned on again."""
        for new_id, (old, _) in list(self._replacements.items()):
            if old.agent_id == agent_id:
                del self._replacements[new_id]
        self.draining.discard(agent_id)

    def told_to_exit(self, agent_id: str) -> None:
        self._drained.add(agent_id)

    def left(self, agent_id: str) -> bool:
        """Whether the agent whose stream ended had been told to exit: then its drain is over."""
        if agent_id not in self._drained:
            return False
        self._drained.discard(agent_id)
        self.draining.discard(agent_id)
        return True

    @property
    def excluded(self) -> set[str]:
        """Agents no plan may use: those being drained and those resting."""
        return self.draining | set(self.resting)

    def forget(self, agent_id: str) -> None:
        """An agent gone: it rests no more (a rest asked for again, if it comes back resting)."""
        self.resting.pop(agent_id, None)
        self.rest_asked.pop(agent_id, None)
