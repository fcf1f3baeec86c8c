"""The admin API's bodies, as pydantic models: they validate requests and put every response in the OpenAPI document."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from stratamesh.fleet.states import AgentState, DrainState, ModelState, PlanState, RolloutState
from stratamesh.fleet.boxes import Capabilities, GpuInfo, StageLoad
from stratamesh.fleet.stages import MAX_REPLICAS, QUANTIZATIONS

MAX_STAGES = 64
DEFAULT_AGENTS_PAGE = 100
MAX_AGENTS_PAGE = 10_000     # a fleet of 10,000 in one call: its cost is reading the registry's every agent anyway

# The API's names of the states, derived from the StrEnums the code compares (fleet/states.py)
AgentStateName = Literal[tuple(s.value for s in AgentState)]                  # type: ignore[valid-type]
LivePlanState = Literal[PlanState.ACTIVE.value, PlanState.STANDBY.value]     # the plans the API lists
DrainStateName = Literal[tuple(s.value for s in DrainState)]                  # type: ignore[valid-type]
# what the admin API says of a model (/health says STARTING where this says LOADING or WAITING)
AdminModelState = Literal[tuple(s.value for s in ModelState if s != ModelState.STARTING)]   # type: ignore[valid-type]
RolloutStateName = Literal[tuple(s.value for s in RolloutState)]             # type: ignore[valid-type]
Tier = Literal["edge", "cloud"]


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")


class DeployModel(_Request):
    """POST /admin/api/models: a Hugging Face folder to serve, cut into num_stages stages."""

    path: str = Field(min_length=1, max_length=4096, pattern=r"^[^\x00]+$",
                      description="the model folder, as the agents see it")
    model_id: str | None = Field(None, min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._:/-]+$",
                                 description="the served name; default: the folder's name")
    num_stages: int = Field(1, ge=1, le=MAX_STAGES)
    first_site: str | None = Field(None, max_length=128, description="the site the first stage must run at")
    last_site: str | None = Field(None, max_length=128, description="the site the last stage must run at")
    quantize: Literal[("", *QUANTIZATIONS)] = Field(  # type: ignore[valid-type]
        "", description='"int8" or "int4": quantized weights (kernels.ops.quant) on the single-process stages of '
                        "agents that measured them; never by default")
    num_replicas: int = Field(1, ge=1, le=MAX_REPLICAS, description="pipelines serving it side by side, each on "
                              "agents of its own (planned once the agents the others leave can hold one)")
    speculative_config: dict[str, Any] | None = Field(
        None, description='its speculative decoding, as vLLM\'s speculative_config: {"method": "ngram", '
                          '"num_speculative_tokens": 4, "prompt_lookup_max": 3}; default: the coordinator\'s '
                          "(--speculative-config)")
    min_replicas: int | None = Field(None, ge=0, le=MAX_REPLICAS, description="autoscaling: the fewest replicas "
                                     "(0: it may scale to zero, its next request waiting for a cold start); with "
                                     "max_replicas, the replicas follow the load and num_replicas is ignored")
    max_replicas: int | None = Field(None, ge=1, le=MAX_REPLICAS, description="autoscaling: the most replicas")
    slo_ttft_ms: float | None = Field(None, gt=0, description="autoscaling: the p90 time to first token to keep "
                                      "under, in milliseconds")
    slo_itl_ms: float | None = Field(None, gt=0, description="autoscaling: the p90 inter-token latency to keep "
                                     "under, in milliseconds")
    scale_down_after_s: float | None = Field(None, ge=0, description="autoscaling: a replica is given back once the "
                                             "load has wanted fewer for this long (default 60)")



class StartRollout(_Request):
    """POST /admin/api/models/{model_id}/rollout: another revision of the model, rolled out as a canary."""

    path: str = Field(min_length=1, max_length=4096, pattern=r"^[^\x00]+$",
                      description="the new revision's folder (another one, or the model's own changed), as the agents "
                                  "see it; the same shape of model")
    steps: list[int] | None = Field(None, min_length=1, max_length=16, description="the canary's shares of the "
                                    "requests in percent, rising, the last 100 (default [5, 25, 100])")
    step_s: float | None = Field(None, ge=0, description="each share held at least this long, with 5 requests at "
                                 "least, while the canary does as well as the serving revision (default 60)")


class Replan(_Request):
    """POST /admin/api/models/{model_id}/replan: re-plan over the agents there are now."""

    num_stages: int | None = Field(None, ge=1, le=MAX_STAGES, description="default: as many as now")


# ------------------------------------------------------------------ responses
class TelemetryView(BaseModel):
    unix_s: float
    queue_depth: int
    tokens_per_s: float
    stages: list[StageLoad]
    gpus: list[GpuInfo]
    received: float | None = Field(description="when the coordinator received it (unix s)")


class AgentView(BaseModel):
    agent_id: str
    name: str
    address: str
    capabilities: Capabilities
    state: str
    first_seen: float
    last_seen: float
    state_since: float
    metrics_address: str
    software_version: str = ""      # the build it last joined this coordinator with ("": not since it started)
    protocol_version: int = 0       # ... and the data-plane protocol it speaks (fleet/versions.py)
    telemetry: TelemetryView | None


class AgentsPage(BaseModel):
    """GET /admin/api/agents: one page of agents, in agent id order."""

    agents: list[AgentView]
    next_after: str | None = Field(description="pass it as `after` for the next page; null: this page is the last")
    total: int = Field(description="agents that pass the filters, on every page together")


class WeightsView(BaseModel):
    fetched_bytes: int = Field(description="bytes of the stage's files its agent received and verified")
    reused_bytes: int = Field(description="bytes it found verified on its disk already")
    total_bytes: int = Field(description="everything the stage needs: its tensors, the files' headers, config.json")
    tensor_bytes: int = Field(description="of total_bytes, the stage's tensors")
    done: bool
    source: str = Field(description="where the latest chunk came from: a peer's address, or coordinator")
    num_corrupt: int = Field(description="chunks that failed their sha256 check and were fetched again")


class ExpertsView(BaseModel):
    tokens: list[int] = Field(description="the tokens its routers sent each expert since the stage loaded, summed "
                              "over its sparse layers")
    imbalance: float = Field(description="its last step's most tokens an expert got over the mean per expert, in "
                             "the step's most uneven layer (1: even; 0: no step yet)")
    rank_tokens: list[int] = Field(description="an expert-parallel group's tokens per rank (rank r holds the r-th "
                                   "equal run of experts); one entry where the stage is not split")
    straggler_rank: int | None = Field(description="the rank whose experts got the most tokens, which every step "
                                       "waits for; null while the ranks' loads are even or the stage is not split")


class StageView(BaseModel):
    assignment_id: str
    agent_id: str
    start_layer: int
    end_layer: int
    tp_degree: int
    device: str = "cpu"          # where it runs: "cpu" or "cuda:N" (a TP group's rank 0)
    dtype: str = "float32"       # what it computes in
    runtime: str = "torch"       # what computes its layers: "torch" or "onnxruntime"
    quantize: str = ""           # "int8" / "int4": its weights quantized
    kv_cache_bytes: int = Field(0, description="the KV cache its plan reserved for it, per rank: a CPU stage holds "
                                "that (at least 0.5 GiB) unless its agent's --kv-cache-gib says otherwise, a GPU stage "
                                "what its share of the GPU leaves; 0: a plan stored before plans said")
    state: str
    cached_blocks: int = Field(0, description="KV blocks its prefix cache holds, as its KV events told the router")
    predicted_step_s: float | None = Field(None, description="the planner's predicted time of one step (s)")
    link_codec: str = Field("", description='how activations reach it from the stage before, as routes use it now: '
                            '"" raw in the dtype they travel in (and always into the first stage, which takes token '
                            'ids), or "float16", "bfloat16", "int8" (partitioner/wire_codec.py)')
    weights: WeightsView | None = Field(None, description="how its agent's fetch of its tensors went; null: the "
                                        "agent read them from a folder of its own")
    experts: ExpertsView | None = Field(None, description="a mixture of experts' stage: where its routers sent "
                                        "tokens, as its agent's newest heartbeat says; null for a dense stage")


class PredictedView(BaseModel):
    tokens_per_s: float = Field(description="output tokens/s with `concurrency` sequences generating")
    concurrency: int
    step_s: float = Field(description="one token of one sequence through every stage and hop (s)")
    bottleneck_s: float = Field(description="the slowest stage step or link transfer (s)")
    bottleneck: str


class PlanView(BaseModel):
    plan_id: str
    model_id: str
    state: LivePlanState
    created: float
    reason: str
    num_layers: int
    replica: int = Field(0, description="which of the model's pipelines it plans")
    canary: bool = Field(False, description="it plans a rollout's canary (the model's next revision)")
    revision: str = Field("", description="the revision of the model's folder its stages serve")
    role: Literal["", "prefill", "decode"] = Field("", description="under prefill/decode disaggregation "
                                                   "(--prefill-replicas), what its replica serves; \"\" when off")
    predicted: PredictedView | None = None
    stages: list[StageView]


class Plans(BaseModel):
    plans: list[PlanView]


class LoadErrorView(BaseModel):
    """An agent's report that it could not load a stage of the model (its newest), until the stage loads."""

    model_id: str
    assignment_id: str
    agent_id: str
    error: str
    at: float


class SpeculationView(BaseModel):
    """What the model's serving last stages kept of the tokens drafted for them since they loaded."""
    draft_tokens: int = 0
    accepted_tokens: int = 0
    acceptance_rate: float | None = None     # accepted / drafted; None before any draft


class ReplicaPointView(BaseModel):
    t: float            # unix seconds
    desired: int        # the replicas the model wanted
    ready: int          # ... and those serving


class AutoscaleView(BaseModel):
    """An autoscaled model's bounds and targets, its replicas over the last ten minutes and the last decision."""
    min_replicas: int
    max_replicas: int
    slo_ttft_ms: float | None
    slo_itl_ms: float | None
    scale_down_after_s: float
    history: list[ReplicaPointView] = []
    last_decision: str = ""              # the autoscaler's last change and its reason
    last_cold_start_s: float | None = None   # its last start from zero replicas, to a replica serving


class RolloutView(BaseModel):
    """A model's newest rollout of another revision."""
    path: str
    revision: str
    steps: list[int]
    step_s: float
    step: int                   # the index of the share it takes now
    share: int                  # the percentage of new requests its canary takes now (0 once it ended)
    state: RolloutStateName
    started_s: float
    step_since_s: float
    reason: str                 # why it stepped, was promoted or rolled back, last
    canary_ready: bool          # whether the canary's every stage serves


class ModelView(BaseModel):
    model_id: str
    path: str
    num_layers: int
    max_context: int
    state: AdminModelState
    num_stages: int
    first_site: str
    last_site: str
    quantize: str = ""           # the operator's choice: "" (as stored), "int8" or "int4"
    num_replicas: int = 1        # the operator's choice: pipelines serving it side by side
    ready_replicas: int = 0      # of them, those whose every stage is loaded
    created: float
    speculation: SpeculationView = SpeculationView()    # speculative decoding (--speculative-config)
    speculative_config: dict[str, Any] | None = None    # the model's own (None: the coordinator's default)
    autoscale: AutoscaleView | None = None   # its replicas follow its load (None: num_replicas is fixed)
    revision: str = ""                       # the revision of its folder it serves
    rollout: RolloutView | None = None       # its newest rollout of another revision
    load_errors: list[LoadErrorView] = []    # the stages of its plans that an agent could not load, and why


class Models(BaseModel):
    models: list[ModelView]


class DeployedModel(BaseModel):
    model: ModelView


class ReplanView(BaseModel):
    model_id: str
    outcome: Literal["standby", "unchanged", "planned", "waiting"]
    reason: str


class ReplanResult(BaseModel):
    replan: ReplanView


class StatsPoint(BaseModel):
    t: float = Field(description="the second (unix s)")
    tokens_per_s: int
    requests_per_s: int
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    itl_p50_s: float | None
    itl_p99_s: float | None
    running: int
    waiting: int


class Stats(BaseModel):
    interval_s: float
    points: list[StatsPoint]


class EventView(BaseModel):
    id: int
    ts: float
    kind: str
    agent_id: str | None
    detail: str


class Events(BaseModel):
    events: list[EventView]


class CoordinatorView(BaseModel):
    name: str
    http_url: str
    grpc_address: str
    leads: bool
    seen_s_ago: float = Field(description="since it last announced itself (0: the one answering)")


class LeaseView(BaseModel):
    holder: str
    epoch: int = Field(description="grows by one at each takeover: the fencing token of the leader's writes")
    expires_in_s: float = Field(description="until it passes to a standby unless renewed (< 0: expired)")


class Coordinators(BaseModel):
    coordinators: list[CoordinatorView] = Field(description="the mesh's coordinators, the leader first")
    lease: LeaseView | None = Field(description="the coordinators' lease (null: one coordinator on SQLite)")


class LinkView(BaseModel):
    agent_id: str
    peer_id: str
    rtt_s: float
    bandwidth_bytes_per_s: float
    error: str
    ts: float


class Links(BaseModel):
    links: list[LinkView]


class DrainView(BaseModel):
    agent_id: str
    started_unix_s: float
    state: DrainStateName
    stages: list[dict]
    sessions_asked: int
    finished_unix_s: float
    error: str
    resumed: int = Field(description="times a restarted coordinator took this drain up again")
    rest: str = Field("", description="why the agent's owner's limits rest it (it stays connected); \"\": a drain")


class Drain(BaseModel):
    drain: DrainView


class RevocationView(BaseModel):
    agent_id: str
    revoked_serials: list[str]


class Revocation(BaseModel):
    revocation: RevocationView


class SiteView(BaseModel):
    """A site's agents summed up ("" names the agents that name no site)."""

    site: str
    num_agents: int
    num_up: int = Field(description="agents online or connected")
    num_serving: int = Field(description="agents holding or planned for a stage of a live plan")
    states: dict[str, int] = Field(description="agents per state")
    tiers: dict[str, int] = Field(description="agents per tier")
    num_gpus: int
    gpu_mem_bytes: int
    ram_total_bytes: int
    num_cpus: int
    tokens_per_s: float = Field(description="the sum of what the newest telemetry of its agents up reports")
    queue_depth: int


class SiteLinkView(BaseModel):
    """The links measured between the agents of two sites (a and b in name order; a == b: within one)."""

    a: str
    b: str
    num_links: int
    num_failed: int = Field(description="links whose latest probe failed")
    rtt_s: float | None = Field(description="the median round trip of the others; null: none")
    bandwidth_bytes_per_s: float | None


class Snapshot(BaseModel):
    """The fleet as the admin UI draws it: every site summed up, and in full only the agents that matter to the
    drawing (every agent of a fleet of up to 100; of a larger one those the plans use, those being drained or resting,
    and the 20 whose state changed last, in the last minute); the links among those, and per pair of sites."""

    ts: float = Field(description="the coordinator's clock (unix s)")
    num_agents: int = Field(description="every agent the registry knows")
    sites: list[SiteView]
    agents: list[AgentView]
    plans: list[PlanView]
    links: list[LinkView]
    site_links: list[SiteLinkView]
    models: list[ModelView]
    drains: list[DrainView]
    events: list[EventView] = Field(description="the newest, newest first")
    stats: StatsPoint | None = Field(description="the newest point")


class SnapshotDelta(BaseModel):
    """What changed since the stream's event before: agents and sites added or changed (in full) and removed (an agent
    no longer among those that matter is removed, and its site's summary still counts it); plans, links, site links,
    models, drains and events only when they changed, then whole."""

    ts: float
    num_agents: int
    stats: StatsPoint | None
    agents: list[AgentView]
    agents_removed: list[str]
    sites: list[SiteView]
    sites_removed: list[str]
    plans: list[PlanView] | None = None
    links: list[LinkView] | None = None
    site_links: list[SiteLinkView] | None = None
    models: list[ModelView] | None = None
    drains: list[DrainView] | None = None
    events: list[EventView] | None = None
