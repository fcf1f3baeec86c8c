"""`stratamesh coordinator`: registry, control and origin gRPC services, zeroconf, and the HTTP API."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import re
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import grpc
import uvicorn

from stratamesh.coordinator.access import AccessStore
from stratamesh.coordinator.autoscaler import TICK_S, Autoscaler
from stratamesh.coordinator.mesh_admin import MeshAdmin
from stratamesh.coordinator.bootstrap import write_bootstrap
from stratamesh.coordinator.api.admin import admin_router
from stratamesh.coordinator.api.admission import Limits
from stratamesh.coordinator.api.auth import install_access
from stratamesh.coordinator.api.openai import create_app
from stratamesh.coordinator.api.ui import mount_ui
from stratamesh.coordinator.control.deployer import Deployer
from stratamesh.coordinator.control.drainer import Drainer
from stratamesh.coordinator.control.models import check_model
from stratamesh.coordinator.control.servicer import ControlService
from stratamesh.coordinator.credentials import CredentialStore
from stratamesh.coordinator.enrollment import (Enroller, EnrollService, MeshCa, Revoker, default_pki_dir)
from stratamesh.coordinator.fleet_metrics import (ControlPlaneCollector, FleetCollector, LinkCodecCollector,
                                                  OriginCollector, ReplicaCollector, active_stages, hop_histogram)
from stratamesh.coordinator.metrics import ApiMetrics
from stratamesh.coordinator.linkprobe import OriginLinkProber
from stratamesh.coordinator.liveness import LivenessConfig
from stratamesh.coordinator.placement import SitePins
from stratamesh.coordinator.records import Autoscale
from stratamesh.coordinator import leadership
from stratamesh.coordinator.leadership import LEASE_TTL_S, Deposed, open_lease
from stratamesh.coordinator.registry_store import RegistryStore, open_registry, sqlite_path
from stratamesh.fleet.errors import InvalidInput
from stratamesh.fleet.state import is_postgres
from stratamesh.coordinator.rollouts import Rollouts
from stratamesh.coordinator.serving.origin import ROUTE_WAIT_S, Origin
from stratamesh.coordinator.serving.records import RequestLog
from stratamesh.coordinator.serving.router import Disaggregation, Router
from stratamesh.coordinator.serving.servicer import OriginService
from stratamesh.coordinator.serving.sessions import SessionTable
from stratamesh.coordinator.weights import ModelWeights
from stratamesh.fleet import discovery
from stratamesh.fleet.tracing import span_store
from stratamesh.fleet.states import DEFAULT_ROUTER_MODE
from stratamesh.fleet.model_folder import default_model_id
from stratamesh.fleet.sessions import Speculation
from stratamesh.fleet.weight_service import WeightsService
from stratamesh.fleet.wire import mesh_pb2_grpc as pb_grpc
from stratamesh.fleet.wire import rtc
from stratamesh.fleet.wire.channels import bind, make_server, revoked, use_tls, warn_insecure
from stratamesh.fleet.wire.stream import RtcDialer

log = logging.getLogger(__name__)


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


# How often agents' leases are checked: the delay it adds to declaring a hung agent dead.
LIVENESS_CHECK_S = 0.1


async def _tick(deployer: Deployer, interval_s: float = 1.0) -> None:
    ticks_per_interval = round(interval_s / LIVENESS_CHECK_S)
    loop = asyncio.get_running_loop()
    woke = loop.time()
    for n in itertools.count(1):
        await asyncio.sleep(LIVENESS_CHECK_S)
        # how late this check came: time the event loop spent on other work (a storm of joins), in which the
        # coordinator read nobody's heartbeats either
        slept, woke = loop.time() - woke, loop.time()
        try:
            deployer.check_liveness(stalled_s=max(slept - LIVENESS_CHECK_S, 0.0))
            if n % ticks_per_interval == 0:
                deployer.tick()
        except Exception:  # placement trouble is logged; the coordinator keeps serving
            log.exception("placement tick failed")


async def _steer(autoscaler: Autoscaler, rollouts: Rollouts) -> None:
    """The autoscaler's and the rollouts' decisions, every TICK_S."""
    while True:
        await asyncio.sleep(TICK_S)
        for name, tick in (("autoscaler", autoscaler.tick), ("rollouts", rollouts.tick)):
            try:
                tick()
            except Exception:  # a decision that fails is logged; the coordinator keeps serving
                log.exception("%s tick failed", name)


async def _log_discovered(browser: discovery.Browser, mesh: str, registry: RegistryStore) -> None:
    """Records every agent seen on zeroconf, joined or not: an operator sees who could join."""
    async with contextlib.aclosing(browser.watch("agent", mesh)) as records:
        async for record in records:
            detail = f"{record.instance} at {record.host}:{record.port}"
            registry.log_event("agent_discovered", detail, time.time(), record.properties.get("agent_id"))
            log.info("discovered agent %s", detail)


class _Server(uvicorn.Server):
    """uvicorn without its own signal handlers: the daemon owns shutdown."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


async def _serve_http(origin: Origin, admin: MeshAdmin, metrics: ApiMetrics, access: AccessStore | None,
                      options: CoordinatorOptions) -> tuple[_Server, asyncio.Task[None], int]:
    """Starts the HTTP API on the running loop; returns the server, its task and the port bound."""
    app = create_app(origin, metrics, options.limits, options.tool_call_parser)
    app.include_router(admin_router(admin))
    install_access(app, access, limits=options.limits)
    mount_ui(app)
    http = _Server(uvicorn.Config(app, host=options.host, port=options.http_port,
                                  log_config=None, access_log=False, timeout_graceful_shutdown=2))
    task = asyncio.create_task(http.serve())
    while not http.started and not task.done():
        await asyncio.sleep(0.02)
    if task.done():
        await task
        raise OSError(f"the HTTP API could not start on {options.host}:{options.http_port}")
    return http, task, http.servers[0].sockets[0].getsockname()[1]


@dataclass
class _Enrollment:
    """The CA-backed half of a secure coordinator: who may join, and who is cut off."""

    enroller: Enroller
    revoker: Revoker
    server: grpc.aio.Server
    port: int


def _mesh_tls(options: CoordinatorOptions) -> MeshCa | None:
    """The mesh's CA (created on first start), or None in insecure mode; sets this process's credentials."""
    if options.insecure:
        warn_insecure("coordinator")
        use_tls(None)
        return None
    if not options.pki_dir and is_postgres(options.db):
        raise InvalidInput("a coordinator on a PostgreSQL registry needs --pki-dir: every coordinator of the mesh "
                           "signs with the same CA (docs/registry.md section 7)")
    ca = MeshCa.load_or_create(options.pki_dir or default_pki_dir(sqlite_path(options.db)), options.mesh,
                               time.time())
    use_tls(ca.coordinator_tls(time.time()))
    return ca


async def _start_enrollment(options: CoordinatorOptions, ca: MeshCa, registry: RegistryStore,
                            control: ControlService) -> _Enrollment:
    store = CredentialStore(registry)

    def publish(serials: frozenset[str]) -> None:
        revoked.replace(serials)
        control.broadcast_revocations(serials)

    revoker = Revoker(store, time.time, publish)
    revoked.replace(revoker.current())
    server = make_server(tls=None)
    enroller = Enroller(store, ca, options.mesh, time.time)
    pb_grpc.add_EnrollServicer_to_server(EnrollService(enroller, lambda agent_id: registry.log_event(
        "agent_enrolled", f"certificate issued to {agent_id}", time.time(), agent_id)), server)
    port = bind(server, options.host, options.enroll_port, tls=None)
    await server.start()
    return _Enrollment(enroller, revoker, server, port)


def _access(options: CoordinatorOptions, registry: RegistryStore, enrollment: _Enrollment | None) -> AccessStore | None:
    """Who may call the APIs (None in insecure mode); for `up`, the credentials it prints, kept in a file."""
    access = None if options.insecure else AccessStore(registry)
    if options.bootstrap_file and enrollment is not None and access is not None:
        write_bootstrap(options.bootstrap_file, enrollment.enroller, access, time.time())
    return access


def _deployer(options: CoordinatorOptions, registry: RegistryStore, sessions: SessionTable) -> Deployer:
    """The control plane, started from the registry (agents it knew are expected back), with the options' models."""
    deployer = Deployer(registry, clock=time.time, liveness=options.liveness, origin_host=socket.gethostname(),
                        sessions=sessions, codec_policy=options.codec_policy)
    deployer.start()
    for model in options.models:
        deployer.plans.add_model(model.served_id, model.path, model.num_stages, model.pins, model.quantize,
                                 model.num_replicas, autoscale=model.autoscale)
    return deployer


def _collect(metrics: ApiMetrics, registry: RegistryStore, deployer: Deployer, requests: RequestLog) -> None:
    """/metrics beyond the API's own: the fleet, the origin's generations, the links' codecs, the control plane."""
    metrics.register(FleetCollector(deployer.roster.telemetry, lambda: active_stages(registry)))
    metrics.register(OriginCollector(requests.stats))
    metrics.register(LinkCodecCollector(deployer.codec_links))
    metrics.register(ControlPlaneCollector(registry, lambda: deployer.plans.num_computed, deployer.roster.liveness))


async def _advertise(options: CoordinatorOptions, host: str, grpc_port: int, http_port: int,
                     enroll_port: int | None) -> discovery.Advertiser:
    """Advertises the coordinator on zeroconf, and says where it listens (`up` and LocalMesh read the line)."""
    enroll = f"{host}:{enroll_port}" if enroll_port else "-"
    advertiser = discovery.Advertiser(interfaces=list(options.interfaces))
    await advertiser.start(discovery.ServiceRecord(
        kind="coordinator", instance=f"coordinator-{options.mesh}", mesh=options.mesh, host=host, port=grpc_port,
        properties={"http": str(http_port), **({"enroll": str(enroll_port)} if enroll_port else {})}))
    log.info("coordinator of mesh %s: grpc %s:%d, http %s:%d, enroll %s", options.mesh, host, grpc_port,
             options.host, http_port, enroll)
    print(f"stratamesh coordinator: http=http://{options.host}:{http_port} grpc={host}:{grpc_port} enroll={enroll}",
          flush=True)
    return advertiser


async def run_coordinator(options: CoordinatorOptions, stop: asyncio.Event) -> None:
    """Runs the coordinator until stop is set. On a PostgreSQL registry it leads only while it holds the mesh's
    lease: until it takes it, a standby that binds nothing; Deposed once it lost it (docs/registry.md)."""
    if not is_postgres(options.db):
        await _lead(options, stop, open_registry(options.db))
        return
    lease = open_lease(options.db, options.mesh, options.name or default_name(options), options.lease_ttl_s)
    try:
        if not await leadership.take(lease, stop):
            return
        log.info("coordinator %s leads mesh %s (epoch %d)", lease.holder, lease.mesh, lease.epoch)
        lost: list[str] = []
        keeper = asyncio.create_task(leadership.keep(lease, lambda why: (lost.append(why), stop.set())))
        try:
            await _lead(options, stop, open_registry(options.db, fence=lease.fence))
        finally:
            keeper.cancel()
        if lost:
            raise Deposed(lost[0])
        await asyncio.to_thread(lease.release)     # a clean stop: a standby takes over at once
    finally:
        lease.close()


def default_name(options: CoordinatorOptions) -> str:
    """This coordinator's name in its mesh's lease when not given one: its host's, and its HTTP port."""
    host = re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname())[:100]
    return f"{host}:{options.http_port}" if options.http_port else f"{host}-{os.getpid()}"


async def _lead(options: CoordinatorOptions, stop: asyncio.Event, registry: RegistryStore) -> None:
    """Runs the coordinator on its registry until stop is set."""
    for model in options.models:  # a bad model folder fails here, before anything listens
        check_model(model.path, model.num_stages)
    ca = _mesh_tls(options)
    server = make_server()
    grpc_port = bind(server, options.host, options.grpc_port)
    advertise_host = options.advertise_host or options.host
    spans = span_store("stratamesh-coordinator", options.traces_json, options.otlp_traces_endpoint)
    metrics = ApiMetrics()
    last_hop = hop_histogram(metrics.registry).labels("origin")
    # a first stage behind NAT is reached over WebRTC, offered over its agent's control stream
    rtc.offer_addresses([advertise_host])
    sessions = SessionTable(spans=spans, on_hop=last_hop.observe,
                            rtc_dialer=RtcDialer(lambda offer: control.rtc.offer(offer)))
    deployer = _deployer(options, registry, sessions)
    requests = RequestLog(spans, options.trace_sample_rate)
    router = Router(deployer.routes, options.router_mode, options.disaggregation)
    origin = Origin(f"{advertise_host}:{grpc_port}", deployer, router, sessions, requests, options.route_wait_s,
                    options.speculation)
    _collect(metrics, registry, deployer, requests)
    weights = ModelWeights(deployer.model_path, deployer.weight_sources)
    control = ControlService(deployer, options.mesh, options.heartbeat_interval_s, weights)
    pb_grpc.add_ControlServicer_to_server(control, server)
    pb_grpc.add_WeightsServicer_to_server(WeightsService(weights.roots), server)
    pb_grpc.add_OriginServicer_to_server(OriginService(sessions), server)
    enrollment = await _start_enrollment(options, ca, registry, control) if ca is not None else None
    await server.start()

    drainer = Drainer(deployer, sessions, registry)
    deployer.on_rest = drainer.rest     # an agent's owner asks it to rest: its stages move off as in a drain
    drainer.resume()                # drains a previous run of this coordinator left half done
    autoscaler = Autoscaler(deployer, metrics.demand, time.time)
    rollouts = Rollouts(deployer, requests, time.time)
    metrics.register(ReplicaCollector(registry, deployer.routes))
    admin = MeshAdmin(registry, requests, control.metrics_addresses, drainer, deployer, metrics.live,
                      revoker=enrollment.revoker if enrollment else None, disaggregation=options.disaggregation,
                      autoscaler=autoscaler, rollouts=rollouts)
    access = _access(options, registry, enrollment)
    http, http_task, http_port = await _serve_http(origin, admin, metrics, access, options)

    advertiser = await _advertise(options, advertise_host, grpc_port, http_port,
                                  enrollment.port if enrollment else None)
    ticker = asyncio.create_task(_tick(deployer))
    scaler = asyncio.create_task(_steer(autoscaler, rollouts))
    origin_links = asyncio.create_task(OriginLinkProber(deployer.roster, time.time).run())
    browser = discovery.Browser(interfaces=list(options.interfaces))
    watcher = asyncio.create_task(_log_discovered(browser, options.mesh, registry))
    try:
        await stop.wait()
    finally:
        ticker.cancel()
        scaler.cancel()
        origin_links.cancel()
        await drainer.close()
        watcher.cancel()
        await browser.close()
        await advertiser.close()
        http.should_exit = True
        await asyncio.gather(http_task, return_exceptions=True)
        await sessions.close()
        await server.stop(grace=1.0)
        await control.streams_ended(timeout_s=5.0)   # each records its agent's disconnection in the registry
        if enrollment is not None:
            await enrollment.server.stop(grace=None)
        spans.close()
        registry.close()
