"""What a coordinator is started with (`stratamesh coordinator`'s flags, as values): the models to deploy, and
its options."""

from __future__ import annotations

from dataclasses import dataclass, field

from stratamesh.coordinator.api.admission import Limits
from stratamesh.coordinator.leadership import LEASE_TTL_S
from stratamesh.coordinator.liveness import LivenessConfig
from stratamesh.coordinator.placement import SitePins
from stratamesh.coordinator.records import Autoscale
from stratamesh.coordinator.serving.origin import ROUTE_WAIT_S
from stratamesh.coordinator.serving.router import Disaggregation
from stratamesh.fleet.model_folder import default_model_id
from stratamesh.fleet.sessions import Speculation
from stratamesh.fleet.states import DEFAULT_ROUTER_MODE

__all__ = ["CoordinatorOptions", "ModelRequest"]


@dataclass(frozen=True, slots=True)
class ModelRequest:
    """A model to deploy at start: a Hugging Face folder, its served name, its number of stages."""

    path: str
    model_id: str = ""
    num_stages: int = 1
    pins: SitePins = SitePins()
    quantize: str = ""             # "int8" / "int4": quantized weights (the operator's choice; never by default)
    num_replicas: int = 1          # pipelines serving it side by side, each on agents of its own
    autoscale: Autoscale | None = None     # its replicas follow its load within these (num_replicas ignored)

    @property
    def served_id(self) -> str:
        return self.model_id or default_model_id(self.path)


@dataclass(frozen=True, slots=True)
class CoordinatorOptions:
    db: str = "stratamesh.db"    # the registry: SQLite file or URL, or PostgreSQL URL (registry_store.open_registry)
    host: str = "127.0.0.1"
    grpc_port: int = 0
    http_port: int = 8000
    advertise_host: str | None = None
    mesh: str = "default"
    interfaces: tuple[str, ...] = ("127.0.0.1",)
    models: tuple[ModelRequest, ...] = field(default_factory=tuple)
    heartbeat_interval_s: float = 0.5
    liveness: LivenessConfig = field(default_factory=LivenessConfig)
    trace_sample_rate: float = 1.0       # fraction of requests traced at every stage
    traces_json: str = ""                # append every span as OpenTelemetry JSON to this file
    otlp_traces_endpoint: str = ""       # export spans over OTLP/HTTP to this collector
    insecure: bool = False               # plaintext gRPC, no CA, no enrollment: development only, said loudly
    pki_dir: str = ""                    # the mesh's CA; default: beside the registry (default_pki_dir)
    enroll_port: int = 0                 # the plaintext endpoint agents present join tokens to
    limits: Limits = field(default_factory=Limits)   # requests in flight, body size, prompt and completion tokens
    bootstrap_file: str = ""             # credentials for `up`, kept while they work (coordinator/bootstrap.py)
    router_mode: str = DEFAULT_ROUTER_MODE   # how a request picks among a model's replicas (serving.router)
    disaggregation: Disaggregation = field(default_factory=Disaggregation)   # prefill/decode (serving.router)
    codec_policy: str = "auto"           # what activations cross links in: --wire-codec (partitioner/wire_codec.py)
    route_wait_s: float = ROUTE_WAIT_S   # how long a request waits for its model to load or recover (--route-wait)
    tool_call_parser: str | None = None  # how models write tool calls (--tool-call-parser); None: their templates'
    speculation: Speculation | None = None   # speculative decoding of generations (--speculative-config)
    name: str = ""                       # this coordinator's name in its mesh's lease (PostgreSQL); default_name
    lease_ttl_s: float = LEASE_TTL_S     # a leader that does not renew its lease for this long is taken over
