"""What a coordinator runs while it leads its mesh: the control plane (the Deployer over the agents' control
streams, the planner, liveness), drains, the autoscaler and rollouts, enrollment, link probes and zeroconf. A lone
coordinator (on SQLite) leads from its start; one of several on PostgreSQL from when it takes their lease
(docs/registry.md), as a restarted coordinator does: the agents it knew are expected back."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import socket
import time
from dataclasses import dataclass

import grpc

from stratamesh.coordinator.autoscaler import TICK_S, Autoscaler
from stratamesh.coordinator.bootstrap import write_bootstrap
from stratamesh.coordinator.control.deployer import Deployer
from stratamesh.coordinator.control.drainer import Drainer
from stratamesh.coordinator.control.servicer import ControlService
from stratamesh.coordinator.credentials import CredentialStore
from stratamesh.coordinator.enrollment import Enroller, EnrollService, MeshCa, Revoker
from stratamesh.coordinator.fleet_metrics import (ControlPlaneCollector, FleetCollector, LinkCodecCollector,
                                                  OriginCollector, ReplicaCollector, active_stages)
from stratamesh.coordinator.front import Front
from stratamesh.coordinator.linkprobe import OriginLinkProber
from stratamesh.coordinator.options import CoordinatorOptions
from stratamesh.coordinator.registry_store import RegistryStore
from stratamesh.coordinator.rollouts import Rollouts
from stratamesh.coordinator.weights import ModelWeights
from stratamesh.fleet import discovery
from stratamesh.fleet.wire import mesh_pb2_grpc as pb_grpc
from stratamesh.fleet.wire.channels import bind, make_server, revoked


log = logging.getLogger(__name__)

# How often agents' leases are checked: the delay it adds to declaring a hung agent dead.
LIVENESS_CHECK_S = 0.1


@dataclass
class _Enrollment:
    """The CA-backed half of a secure coordinator: who may join, and who is cut off."""

    enroller: Enroller
    revoker: Revoker
    server: grpc.aio.Server
    port: int


@dataclass
class Leader:
    """The parts a leading coordinator runs beside its front, and their tasks."""

    deployer: Deployer
    control: ControlService
    drainer: Drainer
    enrollment: _Enrollment | None
    advertiser: discovery.Advertiser
    browser: discovery.Browser
    tasks: list[asyncio.Task[None]]

    async def close(self) -> None:
        """Stops the loops, the drains (as they stand: the next leader resumes them), zeroconf and enrollment; the
        agents' streams end with the front's gRPC server."""
        for task in self.tasks:
            task.cancel()
        await self.drainer.close()
        await self.browser.close()
        await self.advertiser.close()
        if self.enrollment is not None:
            await self.enrollment.server.stop(grace=None)


async def take_control(options: CoordinatorOptions, registry: RegistryStore, front: Front) -> Leader:
    """Starts leading: the control plane from the registry (drains left half done resumed), the Control gate open,
    the origin routing over the Deployer; advertises the coordinator and says where it listens."""
    deployer = _deployer(options, registry, front)
    front.weights = ModelWeights(deployer.model_path, deployer.weight_sources)
    control = ControlService(deployer, options.mesh, options.heartbeat_interval_s, front.weights)
    front.control = control
    _collect(front, registry, deployer)
    enrollment = await _start_enrollment(options, front.ca, registry, control) if front.ca is not None else None
    if options.bootstrap_file and enrollment is not None and front.access is not None:
        write_bootstrap(options.bootstrap_file, enrollment.enroller, front.access, time.time())
    drainer = Drainer(deployer, front.sessions, registry)
    deployer.on_rest = drainer.rest     # an agent's owner asks it to rest: its stages move off as in a drain
    drainer.resume()                # drains a previous leader of this mesh left half done
    autoscaler = Autoscaler(deployer, front.metrics.demand, time.time)
    rollouts = Rollouts(deployer, front.requests, time.time)
    front.metrics.register(ReplicaCollector(registry, deployer.routes))
    front.admin.lead(deployer, drainer, control.metrics_addresses, enrollment.revoker if enrollment else None,
                     autoscaler, rollouts)
    front.origin.serve_from(deployer)
    front.gate.open(control)
    front.leading = True
    advertiser = await _advertise(options, front, enrollment.port if enrollment else None)
    browser = discovery.Browser(interfaces=list(options.interfaces))
    tasks = [asyncio.create_task(_tick(deployer)), asyncio.create_task(_steer(autoscaler, rollouts)),
             asyncio.create_task(OriginLinkProber(deployer.roster, time.time).run()),
             asyncio.create_task(_log_discovered(browser, options.mesh, registry))]
    return Leader(deployer, control, drainer, enrollment, advertiser, browser, tasks)


def _deployer(options: CoordinatorOptions, registry: RegistryStore, front: Front) -> Deployer:
    """The control plane, started from the registry (agents it knew are expected back), with the options' models."""
    deployer = Deployer(registry, clock=time.time, liveness=options.liveness, origin_host=socket.gethostname(),
                        sessions=front.sessions, codec_policy=options.codec_policy)
    deployer.start()
    for model in options.models:
        deployer.plans.add_model(model.served_id, model.path, model.num_stages, model.pins, model.quantize,
                                 model.num_replicas, autoscale=model.autoscale)
    return deployer


def _collect(front: Front, registry: RegistryStore, deployer: Deployer) -> None:
    """/metrics beyond the API's own: the fleet, the origin's generations, the links' codecs, the control plane."""
    metrics = front.metrics
    metrics.register(FleetCollector(deployer.roster.telemetry, lambda: active_stages(registry)))
    metrics.register(OriginCollector(front.requests.stats))
    metrics.register(LinkCodecCollector(deployer.codec_links))
    metrics.register(ControlPlaneCollector(registry, lambda: deployer.plans.num_computed, deployer.roster.liveness))


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


async def _advertise(options: CoordinatorOptions, front: Front, enroll_port: int | None) -> discovery.Advertiser:
    """Advertises the coordinator on zeroconf, and says where it listens (`up` and LocalMesh read the line)."""
    enroll = f"{front.host}:{enroll_port}" if enroll_port else "-"
    advertiser = discovery.Advertiser(interfaces=list(options.interfaces))
    await advertiser.start(discovery.ServiceRecord(
        kind="coordinator", instance=f"coordinator-{options.mesh}", mesh=options.mesh, host=front.host,
        port=front.grpc_port, properties={"http": str(front.http_port),
                                          **({"enroll": str(enroll_port)} if enroll_port else {})}))
    log.info("coordinator of mesh %s: grpc %s, http %s:%d, enroll %s", options.mesh, front.grpc_address,
             options.host, front.http_port, enroll)
    print(f"stratamesh coordinator: http=http://{options.host}:{front.http_port} grpc={front.grpc_address} "
          f"enroll={enroll}", flush=True)
    return advertiser


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
