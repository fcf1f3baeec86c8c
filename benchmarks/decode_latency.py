"""Per-token decode latency through 1 and 3 pipeline stages, next to a raw loopback TCP round trip.

    python benchmarks/decode_latency.py [--tokens 64] [--repeats 3] [--model DIR]

Both meshes serve the same 6-layer tiny Llama (so compute per token is the same), one agent per
stage with one torch thread each. A decode step costs K+1 network hops for K stages, so the 3-stage
mesh pays 2 hops more per token than the 1-stage one: per-hop cost = (ITL_3 - ITL_1) / 2.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import socket
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from stratamesh.fleet.launcher import LocalMesh
from stratamesh.tiny_model import write_tiny_model

PROMPT = "The mesh carries every layer of the model from the edge to the cloud and back"


def _echo_server(port_queue: multiprocessing.Queue, payload_bytes: int) -> None:
    server = socket.create_server(("127.0.0.1", 0))
    port_queue.put(server.getsockname()[1])
    conn, _ = server.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while data := conn.recv(payload_bytes, socket.MSG_WAITALL):
        conn.sendall(data)


def tcp_round_trips_ms(payload_bytes: int, count: int = 2000) -> list[float]:
    """Round trips of payload_bytes to an echo server in another process (blocking sockets)."""
    ports: multiprocessing.Queue = multiprocessing.Queue()
    server = multiprocessing.Process(target=_echo_server, args=(ports, payload_bytes), daemon=True)
    server.start()
    client = socket.create_connection(("127.0.0.1", ports.get(timeout=10)))
    client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    payload, samples = b"x" * payload_bytes, []
    for _ in range(count):
        start = time.perf_counter()
        client.sendall(payload)
        client.recv(payload_bytes, socket.MSG_WAITALL)
        samples.append((time.perf_counter() - start) * 1e3)
    client.close()
    server.join(timeout=5)
    return samples[count // 10:]  # drop the warm-up


def decode_gaps_ms(mesh: LocalMesh, model: str, num_tokens: int) -> list[float]:
    """Per-token gaps of one streamed greedy completion, measured at the client."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": num_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "return_token_ids": True}
    gaps, last = [], None
    with httpx.stream("POST", f"{mesh.url}/v1/completions", json=body, headers=mesh.headers,
                      timeout=120) as response:
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            now = time.perf_counter()
            num = len(json.loads(line[6:])["choices"][0].get("token_ids", []))
            if last is not None and num:
                gaps.extend([(now - last) * 1e3 / num] * num)
            last = now if num else last
    return gaps


def measure_mesh(model_dir: Path, num_stages: int, num_tokens: int, repeats: int,
                 insecure: bool = False) -> list[float]:
    with LocalMesh(str(model_dir), num_agents=num_stages, threads_per_agent=1, insecure=insecure) as mesh:
        decode_gaps_ms(mesh, model_dir.name, 8)  # warm-up: first-touch allocations, streams
        return [g for _ in range(repeats) for g in decode_gaps_ms(mesh, model_dir.name, num_tokens)]


def pct(samples: list[float], q: float) -> float:
    return statistics.quantiles(samples, n=100)[int(q) - 1] if len(samples) > 1 else samples[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a Hugging Face folder; default: a 6-layer tiny Llama")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--plaintext-too", action="store_true",
                        help="also run 3 stages in --insecure mode: what mTLS costs per token")
    args = parser.parse_args()
    model_dir = Path(args.model) if args.model else write_tiny_model(
        Path(tempfile.mkdtemp()) / "tiny-llama", arch="llama", num_layers=6)
    hidden = json.loads((model_dir / "config.json").read_text())["hidden_size"]

    itl = {k: measure_mesh(model_dir, k, args.tokens, args.repeats) for k in (1, 3)}
    plaintext = measure_mesh(model_dir, 3, args.tokens, args.repeats, insecure=True) if args.plaintext_too else []
    tcp = tcp_round_trips_ms(hidden * 4)

    print(f"model {model_dir.name}, {args.repeats} x {args.tokens} greedy tokens per config\n")
    print(f"| {'configuration':<36} | {'median ms':>9} | {'p90 ms':>7} | {'samples':>7} |")
    print(f"|{'-' * 38}|{'-' * 11}|{'-' * 9}|{'-' * 9}|")
    for k, samples in itl.items():
        name = f"{k} stage{'s' if k > 1 else ''} ({k + 1} hops per token)"
        print(f"| {name:<36} | {statistics.median(samples):9.3f} | {pct(samples, 90):7.3f} | {len(samples):7d} |")
    if plaintext:
        print(f"| {'3 stages, plaintext (--insecure)':<36} | {statistics.median(plaintext):9.3f} | "
              f"{pct(plaintext, 90):7.3f} | {len(plaintext):7d} |")
    print(f"| {f'raw TCP round trip, {hidden * 4} B':<36} | {statistics.median(tcp):9.3f} | "
          f"{pct(tcp, 90):7.3f} | {len(tcp):7d} |")
    per_hop = (statistics.median(itl[3]) - statistics.median(itl[1])) / 2
    print(f"\nper-hop cost = (ITL_3 - ITL_1) / 2 = {per_hop:.3f} ms"
          f" = {per_hop / statistics.median(tcp):.1f}x a raw loopback TCP round trip")
    if plaintext:
        tls = (statistics.median(itl[3]) - statistics.median(plaintext)) / 4
        share = f" ({tls / per_hop * 100:.0f}% of the per-hop cost)" if per_hop > 0 else ""
        print(f"mTLS cost per hop = (ITL_3 - ITL_3 plaintext) / 4 = {tls:.3f} ms{share}")


if __name__ == "__main__":
    main()
