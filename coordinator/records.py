"""What the registry stores and returns: frozen rows of agents, models, plans, stages and events, and drains."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from stratamesh.fleet.errors import InvalidInput
from stratamesh.fleet.states import DrainState, RolloutState
from stratamesh.fleet.boxes import Capabilities
from stratamesh.fleet.sessions import Speculation
from stratamesh.fleet.stages import MAX_REPLICAS, StageSpec

# An autoscaled model gives back a replica once its load has wanted fewer for this long (--scale-down-after).
SCALE_DOWN_AFTER_S = 60.0


@dataclass(frozen=True, slots=True)
class AgentRecord:
    agent_id: str
    name: str
    address: str
    capabilities: Capabilities
    state: str
    first_seen: float
    last_seen: float
    state_since: float


@dataclass(frozen=True, slots=True)
class Autoscale:
    """An operator's bounds and targets for a model's replicas, which the autoscaler keeps between min_replicas
    (0: the model may scale to zero, its next request waiting for a cold start) and max_replicas, adding one before
    the load would miss the targets (time to first token and inter-token latency, p90 in milliseconds; None: no
    target) and giving one back once the rest have carried the load for scale_down_after_s."""

    min_replicas: int = 1
    max_replicas: int = 1
    slo_ttft_ms: float | None = None
    slo_itl_ms: float | None = None
    scale_down_after_s: float = SCALE_DOWN_AFTER_S

    def __post_init__(self) -> None:
        if not 0 <= self.min_replicas <= self.max_replicas <= MAX_REPLICAS or self.max_replicas < 1:
            raise InvalidInput(f"replicas must be 0 <= min_replicas <= max_replicas <= {MAX_REPLICAS} and "
                               f"max_replicas >= 1; got min {self.min_replicas}, max {self.max_replicas}")
        for name in ("slo_ttft_ms", "slo_itl_ms"):
            value = getattr(self, name)
            if value is not None and not 0 < value < float("inf"):
                raise InvalidInput(f"{name} must be a number of milliseconds > 0, got {value}")
        if not 0 <= self.scale_down_after_s < float("inf"):
            raise InvalidInput(f"scale_down_after_s must be >= 0 seconds, got {self.scale_down_after_s}")

    @classmethod
    def of(cls, min_replicas: int | None = None, max_replicas: int | None = None, slo_ttft_ms: float | None = None,
           slo_itl_ms: float | None = None, scale_down_after_s: float | None = None) -> Autoscale | None:
        """The autoscaling an operator's optional settings ask for (the flags', the admin API's): None where they
        name no bound nor target; min_replicas defaults to 1, max_replicas to the minimum (one at least)
        (InvalidInput for bad ones)."""
        if all(v is None for v in (min_replicas, max_replicas, slo_ttft_ms, slo_itl_ms, scale_down_after_s)):
            return None
        low = 1 if min_replicas is None else min_replicas
        return cls(low, max(low, 1) if max_replicas is None else max_replicas, slo_ttft_ms, slo_itl_ms,
                   SCALE_DOWN_AFTER_S if scale_down_after_s is None else scale_down_after_s)

    @property
    def start(self) -> int:
        """The replicas a model starts with: its minimum, and one at least (a model deployed serves)."""
        return max(self.min_replicas, 1)

    def bound(self, replicas: int) -> int:
        return min(max(replicas, self.min_replicas), self.max_replicas)


CANARY_REPLICA = 1000          # the replica number of a model's canary (a rollout's new revision): apart from 0..n-1
ROLLOUT_STEPS = (5, 25, 100)     # the canary's shares of the requests, in percent, by default
ROLLOUT_STEP_S = 60.0            # ... each held this long at least, while the canary does as well as the serving one


@dataclass(frozen=True, slots=True)
class Rollout:
    """A new revision of a model on its way in: its folder, the shares of the requests it takes in turn (the last
    100), and how far it got."""

    path: str
    revision: str
    steps: tuple[int, ...] = ROLLOUT_STEPS
    step_s: float = ROLLOUT_STEP_S
    step: int = 0                   # the index of the share it takes now
    state: RolloutState = RolloutState.CANARY
    started_s: float = 0.0
    step_since_s: float = 0.0       # when it took its current share (its figures are counted from then)
    reason: str = ""                # why it stepped, was promoted or rolled back, last

    def __post_init__(self) -> None:
        self.check_steps(self.steps)
        if not 0 <= self.step_s < float("inf"):
            raise InvalidInput(f"a rollout's step_s must be >= 0 seconds, got {self.step_s}")

    @staticmethod
    def check_steps(steps: Sequence[int]) -> None:
        """A rollout's shares: rising percentages from 1, ending at 100 (InvalidInput otherwise)."""
        if not steps or list(steps) != sorted(set(steps)) or steps[0] < 1 or steps[-1] != 100:
            raise InvalidInput(f"a rollout's steps are rising percentages ending at 100, got {list(steps)}")

    @property
    def share(self) -> int:
        """The percentage of new requests the canary takes now (0 once it ended)."""
        return self.steps[self.step] if self.state == RolloutState.CANARY else 0

    @property
    def active(self) -> bool:
        return self.state == RolloutState.CANARY


@dataclass(frozen=True, slots=True)
class ModelRecord:
    model_id: str
    path: str
    num_layers: int
    config: dict[str, Any]
    created: float
    first_site: str = ""        # the site the first stage (it sees token ids) must run at; "" for any
    last_site: str = ""         # ... and the last stage (it produces them)
    quantize: str = ""          # "int8" / "int4": the operator chose quantized weights for it (StageSpec.quantize)
    num_replicas: int = 1       # pipelines serving it side by side, each planned on agents of its own
    num_stages: int = 0         # the stages its plans were asked for (0: unknown, a model of an older registry)
    speculation: Speculation | None = None      # its speculative decoding; None: the coordinator's default
    autoscale: Autoscale | None = None          # its replicas follow its load within these; None: num_replicas fixed
    revision: str = ""          # which revision of its folder it was last deployed from (model_folder.revision_of)
    rollout: Rollout | None = None      # its newest rollout of another revision (active, or how it ended)

    @property
    def scaled_to_zero(self) -> bool:
        """Whether it is autoscaled to no replica (its next request asks for one)."""
        return self.autoscale is not None and self.num_replicas == 0


@dataclass(frozen=True, slots=True)
class StageRecord:
    """One stage of a plan: which agent serves which layer range, as what. A stage about to be saved (a new plan's,
    or a replacement) has no plan id or state yet: the registry gives them."""

    assignment_id: str
    stage_index: int
    agent_id: str
    spec: StageSpec
    plan_id: str = ""
    state: str = ""


@dataclass(frozen=True, slots=True)
class PlanRecord:
    plan_id: str
    model_id: str
    created: float
    state: str
    reason: str
    stages: tuple[StageRecord, ...]
    prediction: dict[str, Any] = field(default_factory=dict)   # see coordinator/placement.py prediction()
    replica: int = 0            # which of the model's pipelines it plans (ModelRecord.num_replicas)

    @property
    def canary(self) -> bool:
        """Whether it plans a rollout's canary rather than one of the model's serving replicas."""
        return self.replica == CANARY_REPLICA


@dataclass(frozen=True, slots=True)
class EventRecord:
    id: int
    ts: float
    kind: str
    agent_id: str | None
    detail: str


DRAIN_RUNNING = (DrainState.MOVING_STAGES, DrainState.MOVING_SESSIONS)


@dataclass(slots=True)
class DrainStatus:
    """One drain, as the registry keeps it and the admin API shows it (a driver updates it as it goes)."""

    agent_id: str
    started_unix_s: float
    state: str = DrainState.MOVING_STAGES    # -> moving_sessions -> drained, or failed
    stages: list[dict[str, Any]] = field(default_factory=list)    # model, layers, from and to agent
    sessions_asked: int = 0         # live sessions asked to move (a few may finish first)
    finished_unix_s: float = 0.0
    error: str = ""
    resumed: int = 0                # times a restarted coordinator took it up again
    rest: str = ""                  # a rest the owner's limits asked for (why): the agent stays, planned on no more

    @property
    def running(self) -> bool:
        return self.state in DRAIN_RUNNING

    def as_json(self) -> dict[str, Any]:
        return asdict(self)
