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


class LoadErrors:
    """The newest load failure of each planned stage."""

    def __init__(self) -> None:
        self._errors: dict[str, LoadError] = {}     # assignment id -> its newest failure

    def __len__(self) -> int:
        return len(self._errors)

    def failed(self, error: LoadError) -> None:
        self._errors[error.assignment_id] = error

    def loaded(self, assignment_id: str) -> None:
        self._errors.pop(assignment_id, None)

    def keep(self, planned: Collection[str]) -> None:
        """Forgets the failures of stages no plan holds any more (re-planned elsewhere, or retired)."""
        self._errors = {a: e for a, e in self._errors.items() if a in planned}

    def of_model(self, registry: PlanStore, model_id: str) -> list[LoadError]:
        """The failures of the stages of the model's active plans (those it serves, or is loading); none, without
        reading the registry, while every stage loads (as /health, polled, asks)."""
        errors = [e for e in self._errors.values() if e.model_id == model_id]
        if not errors:
            return []
        stages = {s.assignment_id for plan in registry.active_plans(model_id) for s in plan.stages}
        return sorted((e for e in errors if e.assignment_id in stages), key=lambda e: e.at)
