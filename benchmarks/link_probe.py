"""The link probe on loopback against raw TCP: echo round trips and bulk throughput, measured in one run.

    python benchmarks/link_probe.py [--pings 200] [--bulk-mib 64] [--repeats 5] [--separate-process]

Starts the agents' Link service (gRPC, as fleet/wire/channels.py makes it) and an asyncio TCP echo and sink
server, then times the same work on both: round trips of one message on one open stream (256 B, as the probe
sends, and 8 KiB), and a stream of the probe's chunks (fleet/links.py: BULK_CHUNK_BYTES; the gRPC side keeps
the probe's window of them on their way). Bulk MB/s is the median over the repeats. With
--separate-process both servers run in a child process, as a peer agent would.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import statistics
import struct
import time

import grpc

from stratamesh.fleet.links import BULK_CHUNK_BYTES, PAYLOAD_BYTES, LinkService, bulk_bandwidth, echo_round_trips_s
from stratamesh.fleet.wire import mesh_pb2_grpc as pb_grpc
from stratamesh.fleet.wire.channels import bind, make_channel, make_server

SIZES = (PAYLOAD_BYTES, 8192)


async def _tcp_session(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """First 9 bytes: b"E" + payload size (echo each message back) or b"B" + 0 (count bytes to EOF, answer it)."""
    kind, size = struct.unpack("!cQ", await reader.readexactly(9))
    try:
        if kind == b"E":
            while True:
                writer.write(await reader.readexactly(size))
                await writer.drain()
        num_bytes = 0
        while chunk := await reader.read(1 << 20):
            num_bytes += len(chunk)
        writer.write(struct.pack("!Q", num_bytes))
        await writer.drain()
    except asyncio.IncompleteReadError:
        pass
    writer.close()


async def _start_servers() -> tuple[grpc.aio.Server, asyncio.Server, int, int]:
    grpc_server = make_server()
    pb_grpc.add_LinkServicer_to_server(LinkService(), grpc_server)
    grpc_port = bind(grpc_server, "127.0.0.1", 0)
    await grpc_server.start()
    tcp_server = await asyncio.start_server(_tcp_session, "127.0.0.1", 0)
    return grpc_server, tcp_server, grpc_port, tcp_server.sockets[0].getsockname()[1]


def _serve_forever(ports: multiprocessing.SimpleQueue) -> None:
    async def main() -> None:
        servers = await _start_servers()      # held: a grpc.aio server that is collected stops
        ports.put(servers[2:])
        await asyncio.Event().wait()
    asyncio.run(main())


async def _tcp_round_trips_s(port: int, num_pings: int, size: int) -> list[float]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(struct.pack("!cQ", b"E", size))
    payload, rtts_s = bytes(size), []
    for k in range(3 + num_pings):
        start = time.perf_counter()
        writer.write(payload)
        await writer.drain()
        await reader.readexactly(size)
        if k >= 3:
            rtts_s.append(time.perf_counter() - start)
    writer.close()
    return rtts_s


async def _tcp_bulk_bytes_per_s(port: int, num_bytes: int) -> float:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(struct.pack("!cQ", b"B", 0))
    chunk, start = bytes(BULK_CHUNK_BYTES), time.perf_counter()
    for _ in range(num_bytes // BULK_CHUNK_BYTES):
        writer.write(chunk)
        await writer.drain()
    writer.write_eof()
    (received,) = struct.unpack("!Q", await reader.readexactly(8))
    elapsed_s = time.perf_counter() - start
    writer.close()
    return received / elapsed_s


def _pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


async def run(args: argparse.Namespace) -> None:
    if args.separate_process:
        ports: multiprocessing.SimpleQueue = multiprocessing.get_context("spawn").SimpleQueue()
        child = multiprocessing.get_context("spawn").Process(target=_serve_forever, args=(ports,), daemon=True)
        child.start()
        grpc_port, tcp_port = ports.get()
    else:
        grpc_server, tcp_server, grpc_port, tcp_port = await _start_servers()
    where = "a child process" if args.separate_process else "this process (one event loop)"
    print(f"loopback, servers in {where}; {args.pings} round trips per size, bulk {args.bulk_mib} MiB "
          f"x {args.repeats}\n")
    print("| payload B | gRPC echo p50 us | p90 us | raw TCP p50 us | p90 us | p50 ratio | gRPC bulk MB/s | "
          "raw TCP bulk MB/s |\n|---:|---:|---:|---:|---:|---:|---:|---:|")
    async with make_channel(f"127.0.0.1:{grpc_port}") as channel:
        stub = pb_grpc.LinkStub(channel)
        grpc_bulk, tcp_bulk = [], []
        rtt_s = statistics.median(await echo_round_trips_s(stub, 20, PAYLOAD_BYTES))   # sizes the bulk window
        for _ in range(args.repeats):
            grpc_bulk.append(await bulk_bandwidth(stub, args.bulk_mib << 20, 60.0, rtt_s))
            tcp_bulk.append(await _tcp_bulk_bytes_per_s(tcp_port, args.bulk_mib << 20))
        for size in SIZES:
            grpc_rtts = await echo_round_trips_s(stub, args.pings, size)
            tcp_rtts = await _tcp_round_trips_s(tcp_port, args.pings, size)
            g50, t50 = statistics.median(grpc_rtts), statistics.median(tcp_rtts)
            print(f"| {size} | {g50 * 1e6:.0f} | {_pct(grpc_rtts, 90) * 1e6:.0f} | {t50 * 1e6:.0f} | "
                  f"{_pct(tcp_rtts, 90) * 1e6:.0f} | {g50 / t50:.2f} | {statistics.median(grpc_bulk) / 1e6:.0f} | "
                  f"{statistics.median(tcp_bulk) / 1e6:.0f} |")
    if args.separate_process:
        child.kill()
    else:
        tcp_server.close()
        await grpc_server.stop(grace=None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pings", type=int, default=200, help="timed round trips per payload size")
    parser.add_argument("--bulk-mib", type=int, default=64, help="MiB per bulk run")
    parser.add_argument("--repeats", type=int, default=5, help="bulk runs per transport")
    parser.add_argument("--separate-process", action="store_true", help="serve from a child process")
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
