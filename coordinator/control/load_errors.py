"""The stages agents could not load, and why: what `stratamesh up`'s console, /health, the admin API and the UI show,
so that a load failure is seen where the operator looks and not only in an agent's log."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from stratamesh.coordinator.registry_store import PlanStore


@dataclass(frozen=True, slots=True)
class LoadError:
    """An agent's report that it failed to load a stage: its newest, until the stage loads or leaves every plan."""

    model_id: str
    assignment_id: str
    agent_id: str
    error: str
    at: float

    def as_json(self) -> dict[str, str | float]:
        return {"model_id": self.model_id, "assignment_id": self.assignment_id, "agent_id": self.agent_id,
                "error": self.error, "at": self.at}


class LoadErrors:
    """The newest load failure of each planned stage."""

    def __init__(self) -> None:
        self._errors: dict[str, LoadError] = {}     # assignment id -> its newest failure

    def failed(self, error: LoadError) -> None:
        self._errors[error.assignment_id] = error

    def loaded(self, assignment_id: str) -> None:
        self._errors.pop(assignment_id, None)

    def keep(self, planned: Collection[str]) -> None:
        """Forgets the failures of stages no plan holds any more (re-planned elsewhere, or retired)."""
        self._errors = {a: e for a, e in self._errors.items() if a in planned}

    def all(self) -> list[LoadError]:
        return sorted(self._errors.values(), key=lambda e: (e.model_id, e.at))

    def of_model(self, registry: PlanStore, model_id: str) -> list[LoadError]:
        """The failures of the stages of the model's active plans (those it serves, or is loading)."""
        stages = {s.assignment_id for plan in registry.active_plans(model_id) for s in plan.stages}
        return [e for e in self.all() if e.assignment_id in stages]
