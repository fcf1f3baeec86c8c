"""Per-token decode latency through 1 and 3 pipeline stages, and what one network hop costs.

    python benchmarks/decode_latency.py [--tokens 96] [--rounds 7] [--model DIR] [--plaintext-too] [--event-engine-too]
                                        [--asyncio-too]

Every mesh serves the same 6-layer tiny Llama (so compute per token is the same), one agent per stage with one
torch thread each, mutual TLS on. A generation's decode loop is a ring: the last stage feeds each sampled token
straight to the first, so a token crosses K network hops for K stages (none for one stage: it feeds itself). The
3-stage mesh therefore pays 3 hops more per token than the 1-stage one, and 2 more stages' fixed step cost:
per-hop cost = (TPOT_3 - TPOT_1) / 3, counting those in.

TPOT is each request's time per output token at the client, (last token - first token) / (tokens - 1), as vLLM
defines it; gaps between single SSE events are no measure (a stage that runs ahead delivers tokens in bursts). All
meshes are up at once and the rounds interleave (one request to each mesh per round), so a slow minute of this
shared machine hits every configuration alike; the table gives the median over rounds.

Where a token's time goes is read from the agents' own histograms over the timed rounds, per stage: its step (the
layers), the hop into it (the previous stage's step ending to the message's arrival here: the sender's serving path,
gRPC, the receiver's wake-up) and the queue (arrival to the step that takes it).

--plaintext-too adds 3 stages without TLS; --event-engine-too adds 3 stages whose daemons' gRPC polls with EventEngine's
threads (gRPC's default) rather than on its completion-queue thread as the mesh's do (fleet/wire/polling.py);
--asyncio-too adds 3 stages whose daemons run asyncio's own event loop, not uvloop's (fleet/event_loop.py): what each
costs a hop.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import socket
import statistics
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import httpx

from stratamesh.launcher import LocalMesh
from stratamesh.kernels.tiny_model import write_tiny_model

PROMPT = "The mesh carries every layer of the model from the edge to the cloud and back"
TARGET_HOP_MS = 0.3
PLAINTEXT = "3 stages, plaintext (--insecure)"
EVENT_ENGINE = "3 stages, gRPC EventEngine polling"
ASYNCIO = "3 stages, asyncio's event loop"


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


def tpot_ms(mesh: LocalMesh, model: str, num_tokens: int) -> float:
    """Time per output token of one streamed greedy completion, at the client: (last - first) / (n - 1)."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": num_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "return_token_ids": True}
    first = last = None
    count = 0
    with httpx.stream("POST", f"{mesh.url}/v1/completions", json=body, headers=mesh.headers,
                      timeout=120) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            num = len(json.loads(line[6:])["choices"][0].get("token_ids", []))
            if num:
                now = time.perf_counter()
                first = now if first is None else first
                last, count = now, count + num
    if count != num_tokens or first is None or last is None:
        raise RuntimeError(f"asked for {num_tokens} tokens, got {count}")
    return (last - first) * 1e3 / (count - 1)


# the agents' histograms that say where a token's time goes at each stage
STAGE_TIMES = {"step": "stratamesh:stage_compute_seconds", "hop in": "stratamesh:hop_transfer_seconds",
               "queue": "stratamesh:stage_queue_seconds"}


def stage_times(mesh: LocalMesh) -> dict[str, dict[str, tuple[float, float]]]:
    """layer range -> what -> (seconds, count) of each STAGE_TIMES histogram, summed over the mesh's agents."""
    out: dict[str, dict[str, tuple[float, float]]] = {}
    for what, name in STAGE_TIMES.items():
        counts = mesh.agent_sums(f"{name}_count", "stage")
        for stage, seconds in mesh.agent_sums(f"{name}_sum", "stage").items():
            out.setdefault(stage, {})[what] = (seconds, counts.get(stage, 0.0))
    return out


def mean_ms(before: dict[str, dict[str, tuple[float, float]]], after: dict[str, dict[str, tuple[float, float]]],
            stage: str, what: str) -> float:
    """The mean of a stage's histogram between two readings, in ms (nan where nothing was observed)."""
    (s0, c0), (s1, c1) = before.get(stage, {}).get(what, (0.0, 0.0)), after[stage].get(what, (0.0, 0.0))
    return (s1 - s0) / (c1 - c0) * 1e3 if c1 > c0 else float("nan")


def pct(samples: list[float], q: float) -> float:
    return statistics.quantiles(samples, n=100)[int(q) - 1] if len(samples) > 1 else samples[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a Hugging Face folder; default: a 6-layer tiny Llama")
    parser.add_argument("--tokens", type=int, default=96, help="tokens per request")
    parser.add_argument("--rounds", type=int, default=7, help="requests per configuration, interleaved")
    parser.add_argument("--plaintext-too", action="store_true",
                        help="also run 3 stages in --insecure mode: what mTLS costs per token")
    parser.add_argument("--event-engine-too", action="store_true",
                        help="also run 3 stages with gRPC's default polling (EventEngine): what it costs per token")
    parser.add_argument("--asyncio-too", action="store_true",
                        help="also run 3 stages on asyncio's own event loop: what it costs per token")
    args = parser.parse_args()
    model_dir = Path(args.model) if args.model else write_tiny_model(
        Path(tempfile.mkdtemp()) / "tiny-llama", arch="llama", num_layers=6)
    hidden = json.loads((model_dir / "config.json").read_text())["hidden_size"]
    # name -> (stages, insecure, the daemons' extra environment)
    configs: dict[str, tuple[int, bool, dict[str, str]]] = {"1 stage (0 hops per token)": (1, False, {}),
                                                            "3 stages (3 hops per token)": (3, False, {})}
    if args.plaintext_too:
        configs[PLAINTEXT] = (3, True, {})
    if args.event_engine_too:
        configs[EVENT_ENGINE] = (3, False, {"GRPC_EXPERIMENTS": ""})      # "": gRPC's default
    if args.asyncio_too:
        configs[ASYNCIO] = (3, False, {"STRATAMESH_EVENT_LOOP": "asyncio"})

    with ExitStack() as stack:
        meshes = {name: stack.enter_context(LocalMesh(str(model_dir), num_agents=k, threads_per_agent=1,
                                                      insecure=insecure, extra_env=env))
                  for name, (k, insecure, env) in configs.items()}
        for mesh in meshes.values():
            tpot_ms(mesh, model_dir.name, 16)   # warm-up: first-touch allocations, streams
        samples: dict[str, list[float]] = {name: [] for name in configs}
        before = {name: stage_times(mesh) for name, mesh in meshes.items()}
        for _ in range(args.rounds):
            for name, mesh in meshes.items():
                samples[name].append(tpot_ms(mesh, model_dir.name, args.tokens))
        after = {name: stage_times(mesh) for name, mesh in meshes.items()}
    tcp = tcp_round_trips_ms(hidden * 4)

    print(f"model {model_dir.name}, {args.rounds} interleaved rounds of one {args.tokens}-token greedy request per "
          f"configuration; TPOT = (last token - first token) / (tokens - 1) at the client\n")
    print(f"| {'configuration':<36} | {'TPOT median ms':>14} | {'min ms':>7} | {'max ms':>7} |")
    print(f"|{'-' * 38}|{'-' * 16}|{'-' * 9}|{'-' * 9}|")
    for name, values in samples.items():
        print(f"| {name:<36} | {statistics.median(values):14.3f} | {min(values):7.3f} | {max(values):7.3f} |")
    print(f"| {f'raw TCP round trip, {hidden * 4} B':<36} | {statistics.median(tcp):14.3f} | {min(tcp):7.3f} | "
          f"{pct(tcp, 99):7.3f} |")
    one, three = (statistics.median(samples[name]) for name in list(configs)[:2])
    per_hop = (three - one) / 3
    verdict = "PASS" if per_hop <= TARGET_HOP_MS else "FAIL"
    print(f"\nper-hop cost = (TPOT_3 - TPOT_1) / 3 = {per_hop:.3f} ms (target <= {TARGET_HOP_MS} ms with mTLS: "
          f"{verdict}) = {per_hop / statistics.median(tcp):.1f}x a raw loopback TCP round trip")
    if args.plaintext_too:
        plain = statistics.median(samples[PLAINTEXT])
        print(f"mTLS cost per hop = (TPOT_3 - TPOT_3 plaintext) / 3 = {(three - plain) / 3:.3f} ms")
    if args.event_engine_too:
        engine = statistics.median(samples[EVENT_ENGINE])
        print(f"EventEngine's polling cost per hop = (TPOT_3 EventEngine - TPOT_3) / 3 = {(engine - three) / 3:.3f} ms")
    if args.asyncio_too:
        loop = statistics.median(samples[ASYNCIO])
        print(f"asyncio's loop cost per hop = (TPOT_3 asyncio - TPOT_3) / 3 = {(loop - three) / 3:.3f} ms")

    print("\nwhere a token's time goes, per stage (means over the timed rounds, from the agents' histograms; the hop "
          "into the first stage of a single stage is its feeding itself):\n")
    print(f"| {'configuration':<36} | {'layers':>6} | {'step ms':>8} | {'hop in ms':>9} | {'queue ms':>8} |")
    print(f"|{'-' * 38}|{'-' * 8}|{'-' * 10}|{'-' * 11}|{'-' * 10}|")
    for name in configs:
        for stage in sorted(after[name], key=lambda layers: int(layers.split("-")[0])):
            step, hop, queue = (mean_ms(before[name], after[name], stage, what) for what in STAGE_TIMES)
            print(f"| {name:<36} | {stage:>6} | {step:8.3f} | {hop:9.3f} | {queue:8.3f} |")


if __name__ == "__main__":
    main()
