"""Replicas that follow the load: an autoscaled model against fixed 1 and fixed 3 replicas, one load for all three.

    python benchmarks/autoscale.py [--schedule 0.3:30,3:60,0.3:40] [--input-len 64] [--output-len 32]
                                   [--slo-ttft-ms 1500] [--slo-tpot-ms 150] [--scale-down-after 10] [--quick]

Six agents on this machine serve a random-weight Llama (8 layers of 512) in pipelines of two stages, three times
in turn: `--replicas 1`, `--replicas 3`, and autoscaled with `--min-replicas 1 --max-replicas 3` and the SLOs as
its targets (--slo-ttft-ms, and --slo-tpot-ms as its inter-token target). Each gets the same load: `bench serve`'s
seeded Poisson arrivals on a rate schedule that rises and falls (--schedule RATE:SECONDS,...). While the load
runs, the agents holding a stage of a live plan are counted every half second.

Printed per configuration: requests completed and failed, SLO attainment (the share of requests within both
SLOs, vLLM's goodput over the throughput), goodput (requests/s within the SLOs), TTFT and TPOT p90, box-seconds
held (agents holding a stage, integrated over the run), and the autoscaler's decisions. The ratios set the
autoscaled mesh against fixed 1 (attainment) and fixed 3 (box-seconds). On a box of few cores the replicas share
the same cores, so more replicas cannot add speed here: the table says what the autoscaler holds and when.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from stratamesh.bench.datasets import random_requests, regular_token_ids
from stratamesh.bench.metrics import BenchMetrics, compute_metrics
from stratamesh.bench.options import parse_rate_schedule
from stratamesh.bench.serve import run_requests, scheduled_offsets_s
from stratamesh.kernels.tiny_model import write_tiny_model
from stratamesh.launcher import LocalMesh

log = logging.getLogger("autoscale")
FULL = {"num_layers": 8, "hidden_size": 512, "intermediate_size": 1376, "num_heads": 8, "num_kv_heads": 4}
QUICK = {"num_layers": 2, "hidden_size": 64, "intermediate_size": 128, "num_heads": 4, "num_kv_heads": 2}
NUM_AGENTS, NUM_STAGES = 6, 2
SAMPLE_S = 0.5


@dataclass
class Result:
    name: str
    metrics: BenchMetrics
    box_seconds: float
    decisions: list[str]


def configurations(args: argparse.Namespace) -> dict[str, list[str]]:
    return {"fixed 1": ["--replicas", "1"], "fixed 3": ["--replicas", "3"],
            "autoscaled 1..3": ["--min-replicas", "1", "--max-replicas", "3", "--slo-ttft-ms", f"{args.slo_ttft_ms:g}",
                                "--slo-itl-ms", f"{args.slo_tpot_ms:g}", "--scale-down-after",
                                f"{args.scale_down_after:g}"]}


def admin(mesh: LocalMesh, path: str, **params: object) -> dict:
    return httpx.get(f"{mesh.url}/admin/api/{path}", params=params, headers=mesh.headers, timeout=30).json()


def boxes_held(mesh: LocalMesh) -> int:
    """The agents holding a stage of a live plan of the model now."""
    return len({s["agent_id"] for plan in admin(mesh, "plans")["plans"] for s in plan["stages"]})


def run(model_dir: Path, name: str, coordinator_args: list[str], args: argparse.Namespace) -> Result:
    agent_args = ["--kv-cache-gib", f"{args.kv_cache_gib:g}"] if args.kv_cache_gib else []
    mesh = LocalMesh(str(model_dir), num_agents=NUM_AGENTS, num_stages=NUM_STAGES, coordinator_args=coordinator_args,
                     agent_args=agent_args)
    mesh.start(timeout_s=300)
    try:
        deadline = time.monotonic() + 300
        while (model := admin(mesh, "models")["models"][0])["ready_replicas"] < model["num_replicas"]:
            if time.monotonic() > deadline:    # (every replica it starts with serves before the load begins)
                raise SystemExit(f"{name}: {model['num_replicas']} replicas were not ready in 300 s")
            time.sleep(0.2)
        vocab = regular_token_ids(model_dir)
        offsets = scheduled_offsets_s(parse_rate_schedule(args.schedule), args.seed)
        requests = random_requests(vocab, len(offsets), args.input_len, args.output_len, args.seed)
        held, done = [0.0], threading.Event()

        def sample() -> None:
            last = time.monotonic()
            while not done.wait(SAMPLE_S):
                now, boxes = time.monotonic(), boxes_held(mesh)
                held[0] += boxes * (now - last)
                last = now

        sampler = threading.Thread(target=sample)
        sampler.start()
        try:
            records, duration_s = asyncio.run(run_requests(mesh.url, model_dir.name, requests, 0.0, None, args.seed,
                                                           api_key=mesh.api_key, offsets=offsets))
        finally:
            done.set()
            sampler.join()
        slos = {"ttft": args.slo_ttft_ms, "tpot": args.slo_tpot_ms}
        events = admin(mesh, "events", limit=500)["events"]
        decisions = [e["detail"] for e in reversed(events) if e["kind"] == "replicas_scaled"]
        return Result(name, compute_metrics(records, duration_s, slos), held[0], decisions)
    finally:
        mesh.stop()


def report(results: list[Result], args: argparse.Namespace) -> None:
    kv = f"; KV cache {args.kv_cache_gib:g} GiB per agent" if args.kv_cache_gib else ""
    print(f"{NUM_AGENTS} agents, pipelines of {NUM_STAGES} stages; load: Poisson arrivals on the schedule "
          f"{args.schedule} (requests/s:seconds), {args.input_len} prompt and {args.output_len} output tokens; "
          f"SLOs: TTFT {args.slo_ttft_ms:g} ms, TPOT {args.slo_tpot_ms:g} ms{kv}\n")
    print("| replicas | completed | failed | SLO attainment | goodput req/s | TTFT p90 ms | TPOT p90 ms "
          "| box-seconds |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        m = r.metrics
        attained = (m.request_goodput or 0.0) / m.request_throughput if m.request_throughput else 0.0
        print(f"| {r.name} | {m.completed} | {m.failed} | {100 * attained:.1f}% | {m.request_goodput or 0.0:.3f} | "
              f"{m.ttft.p90_ms:.0f} | {m.tpot.p90_ms:.0f} | {r.box_seconds:.0f} |")
    by_name = {r.name: r for r in results}
    auto, one, three = by_name["autoscaled 1..3"], by_name["fixed 1"], by_name["fixed 3"]

    def attainment(r: Result) -> float:
        m = r.metrics
        return (m.request_goodput or 0.0) / m.request_throughput if m.request_throughput else 0.0
    print(f"\nautoscaled / fixed 1: SLO attainment {attainment(auto) / max(attainment(one), 1e-9):.2f}x; "
          f"autoscaled / fixed 3: box-seconds {auto.box_seconds / max(three.box_seconds, 1e-9):.2f}x, "
          f"SLO attainment {attainment(auto) / max(attainment(three), 1e-9):.2f}x")
    print(f"failed requests, all runs: {sum(r.metrics.failed for r in results)}")
    for r in results:
        for error in sorted(set(r.metrics.errors))[:3]:
            print(f"  {r.name} failed: {error[:300]}")
    print("\nthe autoscaler's decisions:")
    for line in auto.decisions:
        print(f"  {line}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--schedule", default="0.3:30,3:60,0.3:40", help="RATE:SECONDS,... (bench serve's)")
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--slo-ttft-ms", type=float, default=1500.0)
    parser.add_argument("--slo-tpot-ms", type=float, default=150.0)
    parser.add_argument("--scale-down-after", type=float, default=10.0)
    parser.add_argument("--kv-cache-gib", type=float, default=0.0,
                        help="each agent's KV cache (0: as the planner sizes it): a small one makes a replica hold "
                             "few sequences at once, where replicas add memory rather than compute")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="a small model and a short schedule (a smoke run)")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.WARNING)
    if args.quick:
        args.schedule = "1:4,0.2:4"
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_tiny_model(Path(tmp) / "autoscale-llama", arch="llama", **(QUICK if args.quick else FULL))
        results = [run(model_dir, name, extra, args) for name, extra in configurations(args).items()]
    report(results, args)


if __name__ == "__main__":
    main()
