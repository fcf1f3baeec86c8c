"""Simulated agents for `stratamesh bench control`: many real Control streams from one process, none serving anything.

Each one registers over its own Connect stream (by default with 1 MiB of RAM, so the planner places nothing on it;
with --ram-mib and --gflops a box that could hold a stage, which the planner weighs), waits for its welcome, heartbeats with telemetry at the interval the coordinator asks for, answers nothing else it
is sent, and (with churn) drops its stream and comes back. Over mTLS each presents a certificate of its own, issued
in bulk for the run from the mesh's CA (`issue_certificates`): the coordinator checks it names the agent.

    python -m stratamesh.bench.sim_agents --coordinator HOST:PORT --mesh M --count N [--first K] [--pki DIR] ...

prints one JSON line when every agent has been welcomed (or at --join-timeout), then one per --report-every
seconds, and a last one when it is stopped (SIGTERM, SIGINT).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import resource
import signal
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from stratamesh.fleet import pki
from stratamesh.fleet.boxes import Capabilities, Registration, Speed, Telemetry
from stratamesh.fleet.control_messages import Welcome
from stratamesh.fleet.versions import PROTOCOL_VERSION, software_version
from stratamesh.fleet.wire import convert
from stratamesh.fleet.wire import mesh_pb2 as pb
from stratamesh.fleet.wire import mesh_pb2_grpc as pb_grpc
from stratamesh.fleet.wire.channels import MeshTls, make_channel

AGENTS_PER_CHANNEL = 100     # insecure: simulated agents share HTTP/2 connections (mTLS: one each, for its cert)
SITES = 50                   # simulated agents spread over this many sites
MiB = 1 << 20


@dataclass(slots=True)
class Counts:
    """What the simulated agents of this process did."""

    welcomed: set[str] = field(default_factory=set)       # agents welcomed at least once
    join_s: list[float] = field(default_factory=list)     # from opening the stream to the welcome, per join
    heartbeats: int = 0
    refused: int = 0
    reconnects: int = 0
    messages_in: int = 0


def agent_id(mesh: str, index: int) -> str:
    return f"{mesh}-sim{index:05d}"


def issue_certificates(pki_dir: str, mesh: str, indexes: range, out_dir: str) -> None:
    """Signs a certificate for each simulated agent with the mesh's CA key (in pki_dir), into out_dir."""
    ca_key, ca_cert = (Path(pki_dir, name).read_bytes() for name in ("ca.key", "ca.pem"))
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    now = time.time()
    for index in indexes:
        key = pki.new_key()
        cert = pki.issue(ca_key, ca_cert, pki.make_csr(key, agent_id(mesh, index)), pki.random_serial(), now, 86400)
        Path(out_dir, f"{index}.pem").write_bytes(cert)
        Path(out_dir, f"{index}.key").write_bytes(key)


class SimAgent:
    """One simulated agent: its Connect stream, welcome and heartbeats."""

    def __init__(self, index: int, mesh: str, channel: grpc.aio.Channel, counts: Counts, rng: random.Random,
                 ram_mib: int = 1, gflops: float = 0.0):
        self.agent_id = agent_id(mesh, index)
        self._mesh = mesh
        self._channel = channel
        self._counts = counts
        site = f"site-{rng.randrange(SITES)}"
        # a measured speed (a tenth as many bytes/s as FLOP/s, as CPUs measure) makes it a box the planner can price
        speeds = (Speed("torch-cpu", "float32", gflops * 1e9, gflops * 1e8),) if gflops > 0 else ()
        self._capabilities = Capabilities(f"sim-{index}", "simulated", 1, ram_mib * MiB, ram_mib * MiB, site=site,
                                          tier=rng.choice(("edge", "edge", "edge", "cloud")), speeds=speeds)
        self._outbox: asyncio.Queue[pb.AgentMessage | None] = asyncio.Queue()
        # where it would serve: a loopback port nothing listens on (the origin's link probe finds it refused)
        self._stage_address = f"127.0.0.1:{20000 + index % 40000}"

    async def run(self, churn_per_s: float, rng: random.Random, stop: asyncio.Event) -> None:
        """Connects, and reconnects after each drop (and after each churn), until stop is set."""
        while not stop.is_set():
            lifetime = rng.expovariate(churn_per_s) if churn_per_s > 0 else None
            try:
                await asyncio.wait_for(self._session(stop), lifetime)
            except asyncio.TimeoutError:
                pass                    # churn: the stream drops, and the agent comes back
            except grpc.aio.AioRpcError as exc:
                if exc.code() in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED):
                    self._counts.refused += 1
                    return
            if not stop.is_set():
                self._counts.reconnects += 1
                await asyncio.sleep(rng.uniform(0.5, 1.5))

    async def _session(self, stop: asyncio.Event) -> None:
        self._outbox = asyncio.Queue()
        registration = Registration(self.agent_id, self._capabilities.hostname, self._stage_address,
                                    self._capabilities, mesh=self._mesh, software_version=software_version(),
                                    protocol_version=PROTOCOL_VERSION)
        self._outbox.put_nowait(convert.registration_to_pb(registration))
        started = time.monotonic()
        call = pb_grpc.ControlStub(self._channel).Connect(self._drain())
        heartbeat: asyncio.Task[None] | None = None
        try:
            async for message in call:
                self._counts.messages_in += 1
                match convert.coordinator_message_from_pb(message):
                    case Welcome(heartbeat_interval_s=interval_s):
                        if heartbeat is None:
                            self._counts.welcomed.add(self.agent_id)
                            self._counts.join_s.append(time.monotonic() - started)
                        else:               # the coordinator changed the pace: the fleet grew or shrank
                            heartbeat.cancel()
                        heartbeat = asyncio.create_task(self._heartbeat(interval_s))
                if stop.is_set():
                    break
        finally:
            if heartbeat is not None:
                heartbeat.cancel()
            self._outbox.put_nowait(None)
            call.cancel()

    async def _heartbeat(self, interval_s: float) -> None:
        await asyncio.sleep(random.uniform(0, interval_s))     # spread, as agents that joined apart would be
        for seq in itertools.count(1):
            self._outbox.put_nowait(convert.heartbeat_to_pb(seq, 0, Telemetry(time.time())))
            self._counts.heartbeats += 1
            await asyncio.sleep(interval_s)

    async def _drain(self) -> AsyncIterator[pb.AgentMessage]:
        while (message := await self._outbox.get()) is not None:
            yield message


async def run(args: argparse.Namespace) -> None:
    counts, stop = Counts(), asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    indexes = range(args.first, args.first + args.count)
    ca_pem = Path(args.pki, "ca.pem").read_bytes() if args.pki else b""
    channels: list[grpc.aio.Channel] = []

    def channel_for(index: int) -> grpc.aio.Channel:
        if args.certs:
            cert, key = (Path(args.certs, f"{index}.{ext}").read_bytes() for ext in ("pem", "key"))
            channels.append(make_channel(args.coordinator, MeshTls(ca_pem, cert, key)))
        elif (index - args.first) % AGENTS_PER_CHANNEL == 0:
            channels.append(make_channel(args.coordinator, None))
        return channels[-1]

    rng = random.Random(args.seed + args.first)
    agents = [SimAgent(i, args.mesh, channel_for(i), counts, rng, args.ram_mib, args.gflops) for i in indexes]
    started = time.monotonic()
    tasks = []
    for n, agent in enumerate(agents):
        tasks.append(asyncio.create_task(agent.run(args.churn_per_min / 60.0, random.Random(rng.random()), stop)))
        if args.join_rate and n % 50 == 49:
            await asyncio.sleep(50 / args.join_rate)
    while len(counts.welcomed) < len(agents) and time.monotonic() - started < args.join_timeout and not stop.is_set():
        await asyncio.sleep(0.05)
    report(counts, "joined", time.monotonic() - started)
    while not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), args.report_every)
        except asyncio.TimeoutError:
            report(counts, "running", time.monotonic() - started)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    report(counts, "stopped", time.monotonic() - started)
    await asyncio.gather(*(c.close(grace=None) for c in channels), return_exceptions=True)


def report(counts: Counts, phase: str, elapsed_s: float) -> None:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    joins = sorted(counts.join_s)
    print(json.dumps({"phase": phase, "elapsed_s": round(elapsed_s, 3), "welcomed": len(counts.welcomed),
                      "joins": len(joins), "join_max_s": joins[-1] if joins else None,
                      "join_p50_s": joins[len(joins) // 2] if joins else None, "heartbeats": counts.heartbeats,
                      "refused": counts.refused, "reconnects": counts.reconnects, "messages_in": counts.messages_in,
                      "cpu_s": usage.ru_utime + usage.ru_stime, "max_rss_kib": usage.ru_maxrss}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--coordinator", required=True, help="the coordinator's gRPC host:port")
    parser.add_argument("--mesh", required=True)
    parser.add_argument("--count", type=int, required=True)
    parser.add_argument("--first", type=int, default=0, help="index of the first simulated agent (ids are by index)")
    parser.add_argument("--pki", default="", help="the mesh's CA folder (mTLS): ca.pem")
    parser.add_argument("--certs", default="", help="the simulated agents' certificates, by index (mTLS)")
    parser.add_argument("--churn-per-min", type=float, default=0.0, help="drops per agent per minute")
    parser.add_argument("--join-rate", type=float, default=0.0, help="agents started per second (0: all at once)")
    parser.add_argument("--join-timeout", type=float, default=60.0)
    parser.add_argument("--report-every", type=float, default=5.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ram-mib", type=int, default=1, help="the RAM each reports (1: too little for any stage)")
    parser.add_argument("--gflops", type=float, default=0.0, help="the speed each reports it measured (0: none)")
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
