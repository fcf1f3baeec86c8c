"""What a pipeline hop costs the transport alone: a ring of processes forwarding one activation message over gRPC.

    python benchmarks/hop_floor.py [--processes 2 4] [--messages 3000] [--hidden 256] [--plaintext-too]
                                   [--step-us 0] [--awake-too] [--event-engine-too] [--asyncio-too]

Each process runs a real Stage gRPC server (fleet.wire.channels: the mesh's limits, keepalive and mutual TLS with
certificates of a fresh CA) and forwards every StepBatch it receives to the next process over a persistent
OutboundStream, as stages do; the first process times each lap. No model runs: per hop = lap / processes is the
floor a stage-to-stage hop cannot go under with gRPC-Python on this machine, to read beside
benchmarks/decode_latency.py's per-hop cost (which adds the stages' own work and their contention for the cores).

--step-us N: each process works N microseconds on a message before it forwards it (a busy loop, as a stage's step
holds its core), and per hop is given net of that work: (lap - processes x N) / processes. In a ring where stages
step, each process waits most of a lap for its next message, and its core may halt meanwhile (on a VM the hypervisor
takes it back): the wake-up is paid on every hop. --awake-too runs each ring a second time beside idle-priority
spinners, one per core (SCHED_IDLE: they take a core only when nothing else wants it), which keep the cores from
halting: the difference between the two rows is what the halted cores cost a hop.

The rings' gRPC polls as the mesh's daemons do (fleet/wire/polling.py: on grpc.aio's completion-queue thread,
EventEngine off), on the daemons' event loop (fleet/event_loop.py: uvloop's). --event-engine-too runs each ring a
second time with gRPC's default, EventEngine's threads polling the sockets; --asyncio-too, on asyncio's own loop: the
difference is what each costs a hop.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import multiprocessing as mp
import os
import statistics
import time

os.environ.setdefault("GRPC_VERBOSITY", "ERROR")   # before grpc loads: a terminated peer's GOAWAY is expected here

from stratamesh.fleet import event_loop  # noqa: E402
from stratamesh.fleet.wire.polling import CLASSIC_POLLING, use_classic_polling  # noqa: E402

use_classic_polling()       # before grpc loads: as the mesh's daemons poll (a ring's processes inherit it)

from stratamesh.fleet import pki  # noqa: E402
from stratamesh.fleet.wire.channels import MeshTls  # noqa: E402


def _credentials(ca: tuple[bytes, bytes], index: int) -> MeshTls:
    key = pki.new_key()
    cert = pki.issue(ca[0], ca[1], pki.make_csr(key, f"hop-{index}"), 1000 + index, time.time() - 60, 3600)
    return MeshTls(ca[1], cert, key)


def node(index: int, ports, ready, stop, laps, ca: tuple[bytes, bytes] | None, hidden: int, messages: int,
         step_us: int) -> None:
    """One process of the ring; process 0 starts the message and times each lap into laps (microseconds); each
    works step_us on a message before it forwards it."""
    logging.getLogger("stratamesh").setLevel(logging.ERROR)   # a ring that stops breaks its streams: expected
    from stratamesh.fleet.wire import mesh_pb2 as pb
    from stratamesh.fleet.wire import mesh_pb2_grpc as pb_grpc
    from stratamesh.fleet.wire.channels import bind, make_server, use_tls
    from stratamesh.fleet.wire.stream import StreamPool

    use_tls(_credentials(ca, index) if ca else None)
    n = len(ports)

    async def main() -> None:
        done = asyncio.get_running_loop().create_future()
        pool = StreamPool(lambda ch, it: pb_grpc.StageStub(ch).Push(it))
        lap_us: list[float] = []

        class Forward(pb_grpc.StageServicer):
            async def Push(self, request_iterator, context):   # noqa: N802
                async for message in request_iterator:
                    if index == 0:
                        lap_us.append((time.perf_counter_ns() - message.batch.sent_unix_ns) / 1e3)
                        if len(lap_us) >= messages and not done.done():
                            done.set_result(None)
                            continue
                        message.batch.sent_unix_ns = time.perf_counter_ns()
                    _work(step_us)
                    pool.get(f"127.0.0.1:{ports[(index + 1) % n]}").send(message)
                return pb.PushSummary()

        server = make_server()
        pb_grpc.add_StageServicer_to_server(Forward(), server)
        ports[index] = bind(server, "127.0.0.1", 0)
        await server.start()
        ready.set()
        if index != 0:
            await asyncio.get_running_loop().run_in_executor(None, stop.wait)   # until the laps are done
            await pool.close()
            await server.stop(None)
            return
        while not all(ports):
            await asyncio.sleep(0.01)
        message = pb.StageMessage(batch=pb.StepBatch(
            chunks=[pb.StepChunk(session_id="s", token_ids=[1], sample=True)],
            hidden=pb.Tensor(dtype="float32", shape=[1, hidden], data=bytes(4 * hidden))))
        message.batch.sent_unix_ns = time.perf_counter_ns()
        pool.get(f"127.0.0.1:{ports[1 % n]}").send(message)
        await done
        laps.extend(lap_us[len(lap_us) // 10:])    # the first tenth warms the streams up
        await pool.close()
        await server.stop(None)

    event_loop.run(main())      # the loop STRATAMESH_EVENT_LOOP names, as in a daemon


def _work(step_us: int) -> None:
    """A step's stand-in: step_us of a busy core."""
    end = time.perf_counter_ns() + step_us * 1000
    while time.perf_counter_ns() < end:
        pass


def _spin() -> None:
    """Keeps a core from halting, at the lowest priority there is: any other thread that wants the core gets it."""
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    while True:
        pass


def ring_per_hop_us(num_processes: int, tls: bool, hidden: int, messages: int, step_us: int = 0,
                    awake: bool = False, event_engine: bool = False, loop: str = "uvloop") -> list[float]:
    """Per-hop microseconds of each lap of a ring of num_processes, net of their step_us; awake: beside a spinner per
    core (_spin); event_engine: its processes' gRPC polls with EventEngine (gRPC's default), not as the mesh's; loop:
    the event loop they run on (fleet/event_loop.py)."""
    os.environ["GRPC_EXPERIMENTS"] = "" if event_engine else CLASSIC_POLLING     # what the processes started inherit
    os.environ["STRATAMESH_EVENT_LOOP"] = loop
    ctx = mp.get_context("spawn")
    ports = ctx.Array("i", [0] * num_processes)
    ca = pki.create_ca("hop-floor", time.time() - 60) if tls else None
    manager = ctx.Manager()
    laps = manager.list()
    events, stop = [ctx.Event() for _ in range(num_processes)], ctx.Event()
    procs = [ctx.Process(target=node, args=(i, ports, events[i], stop, laps, ca, hidden, messages, step_us),
                         daemon=True) for i in range(num_processes)]
    spinners = [ctx.Process(target=_spin, daemon=True) for _ in range(os.cpu_count() or 1)] if awake else []
    try:
        for p in spinners + procs[1:]:
            p.start()
        for e in events[1:]:
            e.wait(60)
        procs[0].start()
        procs[0].join(300)
        return [lap / num_processes - step_us for lap in laps]
    finally:
        stop.set()
        for p in spinners:
            p.terminate()
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.terminate()
        manager.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--processes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--messages", type=int, default=3000, help="laps timed per ring")
    parser.add_argument("--hidden", type=int, default=256, help="floats per message (one token's activations)")
    parser.add_argument("--plaintext-too", action="store_true", help="also without TLS")
    parser.add_argument("--step-us", type=int, default=0, help="each process's work on a message before forwarding")
    parser.add_argument("--awake-too", action="store_true",
                        help="also with an idle-priority spinner per core, so that no core halts between messages")
    parser.add_argument("--event-engine-too", action="store_true",
                        help="also with gRPC's default polling (EventEngine's threads), not the mesh's")
    parser.add_argument("--asyncio-too", action="store_true", help="also on asyncio's own event loop, not uvloop's")
    args = parser.parse_args()
    modes = [True, False] if args.plaintext_too else [True]
    awake_modes = [False, True] if args.awake_too else [False]
    # what runs as the mesh does (""), then each variant asked for
    variants = [""] + ["gRPC EventEngine"] * args.event_engine_too + ["asyncio loop"] * args.asyncio_too
    print(f"one [1, {args.hidden}] float32 activation message around a ring of processes, {args.messages} laps; "
          f"each process works {args.step_us} us on a message before forwarding it (per hop is net of it)\n")
    print(f"| {'ring':<46} | {'per hop p50 us':>14} | {'p90 us':>7} |\n|{'-' * 48}|{'-' * 16}|{'-' * 9}|")
    medians = {}
    for n in args.processes:
        for tls in modes:
            for awake in awake_modes:
                for variant in variants:
                    hops = ring_per_hop_us(n, tls, args.hidden, args.messages, args.step_us, awake,
                                           event_engine=variant == "gRPC EventEngine",
                                           loop="asyncio" if variant == "asyncio loop" else "uvloop")
                    name = (f"{n} processes, {'mTLS' if tls else 'plaintext'}" + (", cores kept awake" if awake else "")
                            + (f", {variant}" if variant else ""))
                    medians[n, tls, awake, variant] = median = statistics.median(hops)
                    print(f"| {name:<46} | {median:14.0f} | {statistics.quantiles(hops, n=10)[8]:7.0f} |")
    for (n, tls, awake, variant), median in medians.items():
        ring = f"{n} processes, {'mTLS' if tls else 'plaintext'}"
        if awake and not variant:
            asleep = medians[n, tls, False, ""]
            print(f"\n{ring}: halting cores cost a hop {asleep - median:.0f} us "
                  f"(cores kept awake / not: {median / asleep:.2f}x)")
        if variant and not awake:
            mesh = medians[n, tls, False, ""]
            print(f"\n{ring}: the {variant} costs a hop {median - mesh:.0f} us "
                  f"(the mesh's / the {variant}'s: {mesh / median:.2f}x)")


if __name__ == "__main__":
    main()
