"""`stratamesh agent`: serve the Stage service, advertise on zeroconf, keep the control stream up."""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import socket
import sys
import threading
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace

import grpc
import torch

from stratamesh.agent.control import ControlClient, ControlRefused, Identity, Signalling
from stratamesh.agent.credentials import NotEnrolled, default_state_dir, obtain_credentials
from stratamesh.agent.owner_limits import OwnerLimits, OwnerWatch
from stratamesh.agent.dataplane import StageService
from stratamesh.agent.metrics import AgentMetrics, stage_labels
from stratamesh.agent.cpus import pin_process
from stratamesh.agent.observer import StageObserver
from stratamesh.agent.engine.stage_engine import EngineConfig
from stratamesh.agent.engine.tp_group import GroupFailed
from stratamesh.agent.heap import keep_freed_memory
from stratamesh.agent.probe import probe
from stratamesh.agent.stages import StageHost
from stratamesh.agent.telemetry import TelemetrySampler
from stratamesh.agent.weights import WeightFetcher
from stratamesh.fleet import discovery
from stratamesh.fleet.links import LinkService
from stratamesh.fleet.state import cache_home
from stratamesh.fleet.tracing import SpanStore, span_store
from stratamesh.fleet.boxes import Capabilities, Telemetry
from stratamesh.fleet.states import Runtime
from stratamesh.fleet.weight_service import WeightsService
from stratamesh.fleet.wire import mesh_pb2_grpc as pb_grpc
from stratamesh.fleet.wire import rtc
from stratamesh.fleet.wire.channels import MeshTls, bind, make_server, use_tls, warn_insecure
from stratamesh.fleet.wire.stream import RtcDialer

log = logging.getLogger(__name__)

GROUP_FAILURE_EXIT_S = 15.0   # a clean shutdown after a group failure takes ~1.5 s; past this the agent just exits


@dataclass(frozen=True, slots=True)
class AgentOptions:
    name: str = field(default_factory=socket.gethostname)
    host: str = "127.0.0.1"             # where the Stage service listens
    port: int = 0
    advertise_host: str | None = None   # the address peers dial; defaults to host
    coordinator: str | None = None      # host:port, or several comma-separated (tried in turn); None: zeroconf
    mesh: str = "default"
    interfaces: tuple[str, ...] = ("127.0.0.1",)
    agent_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    num_threads: int = 0                # compute threads (torch's, ONNX Runtime's); 0: one a CPU of cpus, else torch's
                                        # default
    cpus: tuple[int, ...] = ()          # the CPUs every thread is pinned to (agent.cpus); (): not pinned
    discovery_timeout_s: float = 30.0
    engine: EngineConfig = field(default_factory=EngineConfig)
    site: str = ""                      # reported to the planner: where this box is
    tier: str = "edge"
    remeasure: bool = False             # time the matmul and copy again instead of reading the box's cache
    num_ranks: int = 0                  # ranks a tensor-parallel stage here may have; 0: one per GPU, else 1
    dtype: str = ""                     # what every stage here computes in (--dtype); "" lets the planner pick
    runtime: str = ""                   # what computes every stage here (--runtime): "" is torch; "auto" lets the
                                        # planner pick per stage
    use_gpus: bool = True               # False: serve on the CPU alone, reporting no GPU (--no-gpu)
    metrics_port: int | None = 0        # Prometheus /metrics on host; 0 picks a free port, None serves none
    traces_json: str = ""               # append every span as OpenTelemetry JSON to this file
    otlp_traces_endpoint: str = ""      # export spans over OTLP/HTTP to this collector
    insecure: bool = False              # plaintext, no certificate: development only, and it says so
    join_token: str = ""                # presented to the coordinator when the agent holds no certificate
    join_token_file: str = ""           # ... or the token in this file, read when enrolling (--join-token-file)
    state_dir: str = ""                 # its key and certificate; default: default_state_dir(mesh)
    enroll: str | None = None           # host:port of the coordinator's enrollment endpoint (its standbys' after it,
                                        # comma-separated); None: zeroconf
    owner_limits: OwnerLimits = field(default_factory=OwnerLimits)   # when the box's owner wants it to rest
    sensor_file: str = ""               # the owner's sensor readings (agent/owner_limits.py Sensors)
    fetch_weights: str = "missing"      # agent.weights.FETCH_MODES: fetch a stage's tensors when its folder is not
                                        # on this box ("missing"), or always ("always")
    weights_dir: str = ""               # where fetched tensors are kept; "": the cache folder's weights/


async def _mesh_tls(options: AgentOptions, browser: discovery.Browser) -> MeshTls | None:
    """The agent's mesh credentials (enrolling first if it holds none, at the coordinator browser finds), or None in
    insecure mode."""
    if options.insecure:
        warn_insecure("agent")
        return None
    state_dir = options.state_dir or default_state_dir(options.mesh)
    return await obtain_credentials(state_dir, options.agent_id, options.mesh, options.join_token,
                                    enroll_finder(options, browser), options.join_token_file)


def enroll_finder(options: AgentOptions, browser: discovery.Browser) -> Callable[[], Awaitable[str]]:
    """Where the agent enrolls, asked anew at each try: the --enroll addresses in turn (a coordinator's and its
    standbys', comma-separated: only the leader's answers), else the one zeroconf finds with the coordinator."""
    if options.enroll:
        return _in_turn(options.enroll)
    if options.coordinator:
        async def not_given() -> str:
            raise NotEnrolled("--coordinator was given without --enroll (the coordinator's enroll=host:port)")
        return not_given

    async def found() -> str:
        record = await browser.find("coordinator", options.mesh, options.discovery_timeout_s)
        if "enroll" not in record.properties:     # discovery checked it is a port when present
            raise NotEnrolled(f"the coordinator of mesh {options.mesh} offers no enrollment: it runs --insecure")
        return f"{record.host}:{record.properties['enroll']}"

    return found


def _in_turn(addresses: str) -> Callable[[], Awaitable[str]]:
    """Each of the comma-separated addresses in turn, round and round."""
    cycle = itertools.cycle([a.strip() for a in addresses.split(",") if a.strip()])

    async def next_address() -> str:
        return next(cycle)

    return next_address


def exit_now(reason: str) -> None:
    """Ends the process at once with status 1, after logging why (no interpreter teardown: after a rank died, gloo's
    threads may still wait on it, and joining them can take the whole collective timeout)."""
    log.error("%s", reason)
    logging.shutdown()
    sys.stdout.flush()
    os._exit(1)


@dataclass(slots=True)
class _StageServer:
    """The agent's gRPC server: its Stage service (and the Link and Weights services beside it), where it listens."""

    server: grpc.aio.Server
    service: StageService
    signalling: Signalling
    weights: WeightFetcher
    port: int
    address: str            # host:port peers dial


async def _serve_stages(options: AgentOptions, host: StageHost, metrics: AgentMetrics,
                        spans: SpanStore) -> _StageServer:
    """Starts the Stage, Link and Weights services. A next stage behind NAT is reached over WebRTC, signalled over
    the control stream; so are this agent's stages by peers outside its NAT, if it is behind one."""
    rtc.offer_addresses([options.advertise_host or options.host])
    signalling = Signalling()
    service = StageService(host, options.agent_id, StageObserver(options.agent_id, metrics, spans),
                           RtcDialer(signalling.offer, lambda: signalling.nat))
    signalling.on_channel = service.take_channel
    server = make_server()
    pb_grpc.add_StageServicer_to_server(service, server)
    pb_grpc.add_LinkServicer_to_server(LinkService(), server)
    weights = WeightFetcher(options.weights_dir or cache_home(os.environ) / "weights", options.agent_id,
                            options.fetch_weights)
    # peers fetch from what this agent holds: its fetched copies, and the folders its stages read
    pb_grpc.add_WeightsServicer_to_server(WeightsService(
        lambda model_id, revision: [weights.mirror_dir(model_id, revision), *host.model_paths(model_id)]), server)
    port = bind(server, options.host, options.port)
    await server.start()
    service.start()
    service.address = f"{options.advertise_host or options.host}:{port}"
    return _StageServer(server, service, signalling, weights, port, service.address)


def coordinator_finder(options: AgentOptions, browser: discovery.Browser) -> Callable[[], Awaitable[str]]:
    """Where the control stream dials, asked anew at each (re)connection: the --coordinator addresses in turn (a
    coordinator and its standbys, comma-separated: a stream that failed or ended goes on at the next), else the one
    of the agent's mesh that zeroconf finds."""
    if options.coordinator:
        return _in_turn(options.coordinator)

    async def found() -> str:
        record = await browser.find("coordinator", options.mesh, options.discovery_timeout_s)
        return f"{record.host}:{record.port}"

    return found


def _on_group_failure(stop: asyncio.Event, failures: list[str]) -> Callable[[str], None]:
    """What a tensor-parallel stage calls when its group went down (on whichever thread saw it; the loop may be stuck
    in a collective): the agent stops, and exits at once if it has not within GROUP_FAILURE_EXIT_S. Such a stage
    cannot serve again: the coordinator sees the agent gone (its sessions fail over, its stages are re-planned), and
    whatever supervises the agent restarts it."""
    loop = asyncio.get_running_loop()

    def down(reason: str) -> None:
        failures.append(reason)
        stop.set()

    def failed(reason: str) -> None:
        deadline = threading.Timer(GROUP_FAILURE_EXIT_S, exit_now, (f"{reason}; the agent did not shut down "
                                                                    f"within {GROUP_FAILURE_EXIT_S:.0f} s",))
        deadline.daemon = True
        deadline.start()
        loop.call_soon_threadsafe(down, reason)
    return failed


def _telemetry(options: AgentOptions, host: StageHost, stages: _StageServer, metrics: AgentMetrics,
               capabilities: Capabilities) -> Callable[[], Awaitable[Telemetry]]:
    """What each heartbeat carries: the stages' load and the box's, and, while its owner's limits rest the agent,
    why; the agent's /metrics follow it."""
    observer = stages.service.observer
    observer.read_bandwidth = read_bandwidth(capabilities)
    sampler = TelemetrySampler(host, stages.service.inbox_depth, has_gpus=bool(capabilities.gpus),
                               decode=observer.decode)
    watch = OwnerWatch(options.owner_limits, options.sensor_file) if options.owner_limits.any else None

    async def sample() -> Telemetry:
        telemetry = await sampler.sample()
        if watch is not None:
            telemetry = watch.check(telemetry)
        metrics.load.update(telemetry, {a: stage_labels(e.assignment.stage) for a, e in host.engines.items()})
        return telemetry
    return sample


def read_bandwidth(capabilities: Capabilities) -> float:
    """The box's streaming read bandwidth, bytes/s, as its probe measured it (a CPU's mem_bandwidth); 0: unknown."""
    return next((s.mem_bandwidth for s in capabilities.speeds if s.backend == "torch-cpu"), 0.0)


async def run_agent(options: AgentOptions, stop: asyncio.Event) -> None:
    """Runs the agent until stop is set."""
    keep_freed_memory()
    if options.cpus:
        pin_process(options.cpus)
    if options.num_threads > 0 or options.cpus:
        torch.set_num_threads(options.num_threads or len(options.cpus))
    # One browser finds the coordinator to enroll and then to connect: the second find answers from its cache at
    # once, where a second browser's query waited ~1.1 s (mDNS multicasts a record at most once a second).
    browser = discovery.Browser(interfaces=list(options.interfaces))
    try:
        use_tls(await _mesh_tls(options, browser))   # before anything listens or dials
    except BaseException:
        await browser.close()
        raise
    if options.runtime == Runtime.ONNXRUNTIME:    # its stages' sessions take the threads torch has (see below)
        options = replace(options, engine=replace(options.engine, onnx_threads=torch.get_num_threads()))
    group_failures: list[str] = []
    host = StageHost(options.engine, _on_group_failure(stop, group_failures))
    metrics = AgentMetrics()
    spans = span_store(f"stratamesh-agent-{options.agent_id}", options.traces_json, options.otlp_traces_endpoint)
    stages = await _serve_stages(options, host, metrics, spans)
    advertiser = discovery.Advertiser(interfaces=list(options.interfaces))
    await advertiser.start(discovery.ServiceRecord(
        kind="agent", instance=f"{options.name}-{options.agent_id}", mesh=options.mesh,
        host=options.advertise_host or options.host, port=stages.port, properties={"agent_id": options.agent_id}))

    metrics_server, metrics_address = None, ""
    if options.metrics_port is not None:
        metrics_server, metrics_port = metrics.serve(options.host, options.metrics_port)
        metrics_address = f"{options.advertise_host or options.host}:{metrics_port}"
    capabilities = probe(options.site, options.tier, remeasure=options.remeasure, num_ranks=options.num_ranks,
                         dtype=options.dtype, use_gpus=options.use_gpus, runtime=options.runtime)
    if options.runtime == Runtime.ONNXRUNTIME:
        # Every stage here runs in ONNX Runtime, on options.engine.onnx_threads: torch computes what is between its
        # runs (embedding lookups, sampling), on one thread: on more, its idle OpenMP workers spin through the
        # sessions' runs, on the cores the sessions need.
        torch.set_num_threads(1)
    identity = Identity(options.agent_id, options.name, stages.address, options.mesh, capabilities, metrics_address)
    control_client = ControlClient(identity, host, coordinator_finder(options, browser),
                                   telemetry=_telemetry(options, host, stages, metrics, capabilities),
                                   on_shutdown=lambda reason: stop.set(), weights=stages.weights,
                                   signalling=stages.signalling)
    control = asyncio.create_task(control_client.run())
    log.info("agent %s serving stages on %s (mesh %s)", options.agent_id, stages.address, options.mesh)
    print(f"stratamesh agent: id={options.agent_id} stage={stages.address} metrics={metrics_address or '-'}",
          flush=True)
    try:
        await stop.wait()
    finally:
        control.cancel()
        await asyncio.gather(control, return_exceptions=True)
        await advertiser.close()
        await browser.close()
        await stages.service.close()
        await stages.server.stop(grace=1.0)
        host.close()
        if metrics_server is not None:
            metrics_server.shutdown()
        spans.close()
    if group_failures:
        raise GroupFailed(f"{group_failures[0]}; the agent exits")
    if control_client.refused:
        raise ControlRefused(control_client.refused)
