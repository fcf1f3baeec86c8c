"""What a coordinator serves from its start to its stop, whether it leads its mesh or stands by (docs/registry.md):
the gRPC server (the Control service behind a gate only a leader opens, the Weights service, and the Origin service
last stages deliver tokens to), the HTTP API, the origin and the generations it runs.

A standby's origin routes over the registry the leader writes (standby.py); once it leads, over its own Deployer
(leader.py): Origin.serve_from switches it, the generations running carry on."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass

import grpc
import uvicorn

from stratamesh.coordinator.access import AccessStore
from stratamesh.coordinator.api.admin import admin_router
from stratamesh.coordinator.api.auth import install_access
from stratamesh.coordinator.api.forward import ForwardToLeader
from stratamesh.coordinator.api.openai import create_app
from stratamesh.coordinator.api.ui import mount_ui
from stratamesh.coordinator.control.servicer import ControlGate, ControlService
from stratamesh.coordinator.credentials import CredentialStore
from stratamesh.coordinator.enrollment import MeshCa, default_pki_dir
from stratamesh.coordinator.fleet_metrics import LeadershipCollector, hop_histogram
from stratamesh.coordinator.mesh_admin import MeshAdmin
from stratamesh.coordinator.metrics import ApiMetrics
from stratamesh.coordinator.options import CoordinatorOptions
from stratamesh.coordinator.registry_store import RegistryStore, sqlite_path
from stratamesh.coordinator.serving.origin import Origin
from stratamesh.coordinator.serving.records import RequestLog
from stratamesh.coordinator.serving.router import Router
from stratamesh.coordinator.serving.servicer import OriginService
from stratamesh.coordinator.serving.sessions import SessionTable
from stratamesh.coordinator.standby import Standby
from stratamesh.coordinator.weights import ModelWeights
from stratamesh.fleet.errors import InvalidInput
from stratamesh.fleet.state import is_postgres
from stratamesh.fleet.tracing import SpanStore, span_store
from stratamesh.fleet.weight_service import WeightsService
from stratamesh.fleet.wire import mesh_pb2_grpc as pb_grpc
from stratamesh.fleet.wire import rtc
from stratamesh.fleet.wire.channels import bind, make_server, revoked, use_tls, warn_insecure
from stratamesh.fleet.wire.stream import RtcDialer



class _Server(uvicorn.Server):
    """uvicorn without its own signal handlers: the daemon owns shutdown."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


@dataclass
class Front:
    """A coordinator's serving front; leading says whether it leads (its Control gate open)."""

    server: grpc.aio.Server
    host: str                   # where agents, last stages and the other coordinators reach it (--advertise-host)
    grpc_port: int
    http_port: int
    http: _Server
    http_task: asyncio.Task[None]
    spans: SpanStore
    metrics: ApiMetrics
    sessions: SessionTable
    requests: RequestLog
    router: Router
    origin: Origin
    standby: Standby
    gate: ControlGate
    admin: MeshAdmin
    access: AccessStore | None
    ca: MeshCa | None
    leading: bool = False
    control: ControlService | None = None       # the leader's, once it leads
    weights: ModelWeights | None = None         # ... and the folders it serves weights from

    @property
    def grpc_address(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    @property
    def http_url(self) -> str:
        return f"http://{self.host}:{self.http_port}"

    async def close(self) -> None:
        """Stops the HTTP API, ends the origin's generations, stops the gRPC server and waits for the agents'
        streams to end (each records its agent's disconnection in the registry, still open)."""
        self.http.should_exit = True
        await asyncio.gather(self.http_task, return_exceptions=True)
        await self.sessions.close()
        await self.server.stop(grace=1.0)
        if self.control is not None:
            await self.control.streams_ended(timeout_s=5.0)
        self.spans.close()


def mesh_tls(options: CoordinatorOptions) -> MeshCa | None:
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


async def open_front(options: CoordinatorOptions, registry: RegistryStore,
                     coordinators: Callable[[], Awaitable[dict]] | None,
                     leader_url: Callable[[], Awaitable[str | None]] | None,
                     lease_epoch: Callable[[], int | None] = lambda: None) -> Front:
    """Binds the gRPC server and the HTTP API; the origin serves from a Standby until the coordinator leads.
    leader_url: where a standby forwards the admin calls it does not answer itself (None: it never stands by);
    lease_epoch: the epoch of the lease it leads in, if any (what /metrics shows)."""
    ca = mesh_tls(options)
    if ca is not None:      # what the leader revoked (it broadcasts revocations to its agents; a standby reads them)
        revoked.replace(CredentialStore(registry).revoked_serials(time.time()))
    server = make_server()
    grpc_port = bind(server, options.host, options.grpc_port)
    advertise_host = options.advertise_host or options.host
    spans = span_store("stratamesh-coordinator", options.traces_json, options.otlp_traces_endpoint)
    metrics = ApiMetrics()
    last_hop = hop_histogram(metrics.registry).labels("origin")
    holder: list[Front] = []     # (the front, once made: what the callbacks below read)
    # a first stage behind NAT is reached over WebRTC, offered over its agent's control stream (the leader's only:
    # a standby's routes give no NAT address)
    rtc.offer_addresses([advertise_host])
    sessions = SessionTable(spans=spans, on_hop=last_hop.observe, rtc_dialer=RtcDialer(
        lambda offer: holder[0].control.rtc.offer(offer)))
    standby = Standby(registry, options.liveness.lease_s, options.codec_policy)
    requests = RequestLog(spans, options.trace_sample_rate)
    router = Router(standby.routes, options.router_mode, options.disaggregation)
    origin = Origin(f"{advertise_host}:{grpc_port}", standby, router, sessions, requests, options.route_wait_s,
                    options.speculation)
    gate = ControlGate()
    pb_grpc.add_ControlServicer_to_server(gate, server)
    pb_grpc.add_WeightsServicer_to_server(WeightsService(
        lambda model_id, revision: holder[0].weights.roots(model_id, revision) if holder and holder[0].weights
        else []), server)
    pb_grpc.add_OriginServicer_to_server(OriginService(sessions), server)
    await server.start()
    admin = MeshAdmin(registry, requests, {}, live=metrics.live, disaggregation=options.disaggregation,
                      coordinators=coordinators)
    access = None if options.insecure else AccessStore(registry)
    http, http_task, http_port = await _serve_http(options, origin, admin, metrics, access,
                                                   lambda: not (holder and holder[0].leading), leader_url)
    holder.append(Front(server, advertise_host, grpc_port, http_port, http, http_task, spans, metrics, sessions,
                        requests, router, origin, standby, gate, admin, access, ca))
    metrics.register(LeadershipCollector(lambda: holder[0].leading, lease_epoch))
    return holder[0]


async def _serve_http(options: CoordinatorOptions, origin: Origin, admin: MeshAdmin, metrics: ApiMetrics,
                      access: AccessStore | None, standing_by: Callable[[], bool],
                      leader_url: Callable[[], Awaitable[str | None]] | None,
                      ) -> tuple[_Server, asyncio.Task[None], int]:
    """Starts the HTTP API on the running loop; returns the server, its task and the port bound."""
    app = create_app(origin, metrics, options.limits, options.tool_call_parser)
    app.include_router(admin_router(admin))
    install_access(app, access, limits=options.limits)
    if leader_url is not None:      # outermost: the leader checks who calls what a standby forwards
        app.add_middleware(ForwardToLeader, standing_by=standing_by, leader_url=leader_url)
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
