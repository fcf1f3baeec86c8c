"""Rollouts: a model's new revision comes in as a canary replica taking a share of the requests that steps up
(5%, 25%, 100% by default) while it does as well as the serving revision, and is rolled back by itself when it does
not (control/rollout.py judges, Plans acts). Each step an event with its figures; the requests' records say which
revision served each (serving/records.py)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace

from stratamesh.coordinator.control.deployer import Deployer
from stratamesh.coordinator.control.rollout import Action, RevisionFigures, judge
from stratamesh.coordinator.records import CANARY_REPLICA, ModelRecord, Rollout
from stratamesh.coordinator.serving.records import RequestLog, RequestRecord
from stratamesh.fleet.errors import InvalidInput, ModelNotFound

log = logging.getLogger(__name__)

LOAD_TIMEOUT_S = 600.0      # a canary whose stages have not all loaded by then is rolled back


class Rollouts:
    """Starts rollouts (the admin API's), and every tick weighs each running one's canary against the serving
    revision from the origin's records of the requests that ended since the canary took its share."""

    def __init__(self, deployer: Deployer, requests: RequestLog, clock: Callable[[], float] = time.time) -> None:
        self._deployer = deployer
        self._requests = requests
        self._clock = clock

    def start(self, model_id: str, path: str, steps: Sequence[int] | None = None,
              step_s: float | None = None) -> Rollout:
        """Starts rolling out the folder as the model's next revision (Plans.start_rollout's errors)."""
        rollout = self._deployer.plans.start_rollout(model_id, path, steps, step_s)
        self._event("rollout_started", model_id, f"revision {rollout.revision} from {rollout.path}: a canary takes "
                    f"{rollout.share}% of the requests once it loads, then {', '.join(map(str, rollout.steps[1:]))}%")
        return rollout

    def roll_back(self, model_id: str, why: str) -> None:
        """An operator's (or the verdict's) roll-back of the model's running rollout (InvalidInput if none runs)."""
        model = self._deployer.registry.model(model_id)
        if model is None:
            raise ModelNotFound(f"the model '{model_id}' does not exist")
        if model.rollout is None or not model.rollout.active:
            raise InvalidInput(f"no rollout of {model_id!r} is running")
        self._deployer.plans.roll_back(model_id, why)
        self._event("rollout_rolled_back", model_id, f"revision {model.rollout.revision}: {why}")

    def tick(self) -> None:
        for model in self._deployer.registry.models():
            if model.rollout is not None and model.rollout.active:
                self._weigh(model, model.rollout)

    def _weigh(self, model: ModelRecord, rollout: Rollout) -> None:
        now, deployer = self._clock(), self._deployer
        canary = deployer.registry.active_plan(model.model_id, CANARY_REPLICA)
        stages = {s.assignment_id for s in canary.stages} if canary else set()
        failed = [e for e in deployer.load_errors.of_model(deployer.registry, model.model_id)
                  if e.assignment_id in stages]
        if failed:
            self.roll_back(model.model_id, f"its stage could not load on {failed[0].agent_id}: {failed[0].error}")
            return
        if canary is None or not deployer.routes.serves(canary):
            if now - rollout.started_s > LOAD_TIMEOUT_S:
                self.roll_back(model.model_id, f"its stages did not load in {LOAD_TIMEOUT_S:.0f} s")
            return
        ended = [r for r in self._requests.recent.values()
                 if r.end_unix_ns and r.end_unix_ns / 1e9 >= rollout.step_since_s and r.revision]
        verdict = judge(rollout, _figures(r for r in ended if r.revision == rollout.revision),
                        _figures(r for r in ended if r.revision != rollout.revision), now)
        if verdict.action == Action.ROLL_BACK:
            self.roll_back(model.model_id, verdict.reason)
        elif verdict.action == Action.STEP and rollout.step + 1 < len(rollout.steps):
            stepped = replace(rollout, step=rollout.step + 1, step_since_s=now, reason=verdict.reason)
            deployer.registry.set_rollout(model.model_id, stepped)
            self._event("rollout_step", model.model_id, f"revision {rollout.revision} takes {stepped.share}% of the "
                        f"requests: {verdict.reason}")
        elif verdict.action == Action.STEP:
            deployer.plans.promote_canary(model.model_id, verdict.reason)
            self._event("rollout_promoted", model.model_id, f"revision {rollout.revision} serves every request "
                        f"now; the replicas of {model.revision or 'the old revision'} retire: {verdict.reason}")

    def _event(self, kind: str, model_id: str, detail: str) -> None:
        self._deployer.registry.log_event(kind, f"{model_id}: {detail}", self._clock())
        log.info("%s: %s: %s", kind, model_id, detail)


def _figures(records: Iterable[RequestRecord]) -> RevisionFigures:
    """A revision's figures from its requests' records: failed or not, and seconds a token end to end."""
    return RevisionFigures.of((bool(r.error), (r.end_unix_ns - r.start_unix_ns) / 1e9 / max(r.num_tokens, 1))
                              for r in records)
