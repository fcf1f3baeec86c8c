"""Speculative decoding across the pipeline: what drafted tokens give one user, and cost many, per link profile.

    sudo .venv/bin/python benchmarks/speculative.py [--profiles lan,wan-100mbit-20ms,wan-20mbit-80ms] [--stages 2,3]
                                                    [--num-prompts 8] [--output-len 64] [--quick]

For every link profile (stratamesh/testbed/netbed.py) and number of stages, a fresh test bed: the coordinator (the
origin) and agent 0 (the first stage) on LAN cables, every other agent behind a cable of the profile, so each trip
of the decode loop around the pipeline crosses the profile's links. One random-weight Llama (8 layers, hidden 512),
1 thread per agent, served by two meshes side by side on that bed, each on hosts of its own: one decoding a token a
step, one with `--speculative-config` (ngram, 4 tokens, prompt_lookup_max 3); each run goes to both, in rounds that
alternate which goes first. Workloads, every request greedy (the tokens are the same both ways):
  - grounded: each prompt is a span of 24 tokens, then its first 8 again: the lookup drafts the span's rest, which
    pays as far as the model goes on repeating it (a random model does so only where its greedy output loops);
  - random: 16 random tokens (vLLM's random dataset).
Printed per profile and stages: output tokens/s at concurrency 1 without and with drafts and their ratio, the
acceptance rate (drafted tokens kept, as the last stage's vllm:spec_decode counters say) and the mean tokens a
trip yields (1 + kept / steps with drafts); then at concurrency 16 (random) without and with, whose ratio must
not fall below 0.95. The issue's targets (at 80 ms, at least 2.5x at concurrency 1 with a draft model on the demo
model's text; on loopback with ngram, at least 1.5x on an input-grounded workload) are checked where this run has
what they need. Every run is in this one invocation, on this machine.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import secrets
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass, replace
from pathlib import Path

from kv_routing import FULL, serve
from stratamesh.bench.datasets import BenchRequest, random_requests, regular_token_ids
from stratamesh.bench.metrics import BenchMetrics
from stratamesh.kernels.tiny_model import write_tiny_model
from stratamesh.launcher import LocalMesh
from stratamesh.testbed.netbed import PROFILES, Netbed, NetbedUnavailable, check_can_build, stop_on_sigterm

log = logging.getLogger("speculative")
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
SPAN, REPEATED = 24, 8          # a grounded prompt: a span, then its first REPEATED tokens again
C16_FLOOR = 0.95                # with drafts, concurrency 16 keeps at least this share of its throughput
LOOPBACK_TARGET, WAN_TARGET = 1.5, 2.5
SKIP = 77


@dataclass(frozen=True, slots=True)
class Run:
    """One mesh's figures: per workload at concurrency 1, random at 16, and its last stage's spec_decode counters."""

    c1: dict[str, float]            # output tokens/s by workload, at concurrency 1
    c16: float
    drafts: float = 0.0             # steps that carried drafted tokens
    draft_tokens: float = 0.0
    accepted: float = 0.0


@dataclass(frozen=True, slots=True)
class Row:
    profile: str
    stages: int
    plain: Run
    drafted: Run


def grounded_requests(vocab: list[int], num_prompts: int, output_len: int, seed: int) -> list[BenchRequest]:
    """Prompts of a span of SPAN tokens and its first REPEATED again (the answer would repeat the rest)."""
    rng = random.Random(seed)
    out = []
    for _ in range(num_prompts):
        span = [rng.choice(vocab) for _ in range(SPAN)]
        out.append(BenchRequest(tuple(span + span[:REPEATED]), output_len))
    return out


def spec_counts(mesh: LocalMesh) -> tuple[float, float, float]:
    """The agents' vllm:spec_decode counters: (steps with drafts, drafted tokens, tokens kept)."""
    return tuple(sum(mesh.agent_sums(f"vllm:spec_decode_num_{name}_total", "stage").values())
                 for name in ("drafts", "draft_tokens", "accepted_tokens"))


def run_pair(model_dir: Path, profile: str, stages: int, args: argparse.Namespace) -> tuple[Run, Run]:
    """A fresh test bed with two meshes on it, one decoding a token a step and one drafting, each on hosts of its own
    (the same cables); their runs, in rounds that alternate which goes first (this VM's speed drifts); teardown."""
    vocab = regular_token_ids(model_dir)
    with Netbed(f"sm-{secrets.token_hex(3)}") as bed, ExitStack() as stack:
        bed.attach_here()
        meshes = {}
        for speculate in (False, True):
            tag = "d" if speculate else "p"
            hosts = {0: bed.add_host(f"near-{tag}")}
            for i in range(1, stages):
                hosts[i] = bed.add_host(f"far{i}-{tag}", PROFILES[profile])
            extra = ["--speculative-config", json.dumps(NGRAM)] if speculate else []
            meshes[speculate] = stack.enter_context(LocalMesh(
                str(model_dir), num_agents=stages, num_stages=stages, threads_per_agent=1,
                coordinator_host=bed.add_host(f"coord-{tag}"), agent_hosts=hosts, coordinator_args=extra,
                log_dir=args.log_dir or None))
        for mesh in meshes.values():
            serve(mesh, model_dir.name, random_requests(vocab, 4, 16, 4, seed=99), 4)     # warm-up
        c1: dict[bool, dict[str, list[BenchMetrics]]] = {s: {"grounded": [], "random": []} for s in meshes}
        c16: dict[bool, list[BenchMetrics]] = {s: [] for s in meshes}
        before = spec_counts(meshes[True])
        for r in range(args.rounds):
            seed = args.seed + 10 * r
            workloads = {"grounded": grounded_requests(vocab, args.num_prompts, args.output_len, seed),
                         "random": random_requests(vocab, args.num_prompts, 16, args.output_len, seed)}
            for speculate in ((False, True) if r % 2 == 0 else (True, False)):
                for name, requests in workloads.items():
                    c1[speculate][name].append(checked(serve(meshes[speculate], model_dir.name, requests, 1)))
        drafts, draft_tokens, accepted = (b - a for a, b in zip(before, spec_counts(meshes[True]), strict=True))
        for r in range(args.rounds):
            requests = random_requests(vocab, 2 * args.num_prompts, 16, args.output_len, args.seed + 10 * r + 1)
            for speculate in ((False, True) if r % 2 == 0 else (True, False)):
                c16[speculate].append(checked(serve(meshes[speculate], model_dir.name, requests, 16)))
    runs = [Run({name: _pooled(ms) for name, ms in c1[s].items()}, _pooled(c16[s])) for s in (False, True)]
    return runs[0], replace(runs[1], drafts=drafts, draft_tokens=draft_tokens, accepted=accepted)


def _pooled(rounds: list[BenchMetrics]) -> float:
    """Output tokens/s over every round: all their tokens over all their time."""
    return sum(m.total_output_tokens for m in rounds) / sum(m.duration_s for m in rounds)


def checked(metrics: BenchMetrics) -> BenchMetrics:
    if metrics.failed:
        raise SystemExit(f"{metrics.failed} requests failed: {metrics.errors[:3]}")
    return metrics


def report(rows: list[Row], args: argparse.Namespace) -> None:
    print(f"a random-weight Llama (8 layers, hidden 512) in 2 or 3 stages, 1 thread per agent; --speculative-config "
          f"{json.dumps(NGRAM)}; {args.num_prompts} prompts a workload at concurrency 1, "
          f"{2 * args.num_prompts} at 16, {args.output_len} output tokens each, greedy; {args.rounds} rounds, "
          "alternating which mesh goes first; output tokens/s over all the rounds\n")
    print("| link profile | stages | workload | tok/s c1 | with drafts | ratio | drafted | acceptance | tokens/trip |")
    print("|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        run = row.drafted
        acceptance = run.accepted / run.draft_tokens if run.draft_tokens else 0.0
        per_trip = 1 + run.accepted / run.drafts if run.drafts else 1.0
        for name in row.plain.c1:
            plain, drafted = row.plain.c1[name], run.c1[name]
            print(f"| {row.profile} | {row.stages} | {name} | {plain:.1f} | {drafted:.1f} | {drafted / plain:.2f}x "
                  f"| {run.draft_tokens:.0f} in {run.drafts:.0f} steps | {acceptance:.0%} | {per_trip:.2f} |")
    print("\n(drafted, acceptance and tokens/trip: over both workloads at concurrency 1)\n")
    print("| link profile | stages | tok/s c16 | with drafts | ratio |")
    print("|---|---|---|---|---|")
    for row in rows:
        plain, drafted = row.plain.c16, row.drafted.c16
        print(f"| {row.profile} | {row.stages} | {plain:.1f} | {drafted:.1f} | {drafted / plain:.2f}x |")
    print("\ntargets")
    for row in rows:
        ratio = row.drafted.c16 / row.plain.c16
        print(f"  {row.profile}, {row.stages} stages: concurrency 16 with drafts {ratio:.2f}x (at least "
              f"{C16_FLOOR}x): {'met' if ratio >= C16_FLOOR else 'NOT met'}")
        grounded = row.drafted.c1["grounded"] / row.plain.c1["grounded"]
        if row.profile == "lan":
            print(f"  lan, {row.stages} stages: ngram on the grounded workload {grounded:.2f}x (at least "
                  f"{LOOPBACK_TARGET}x): {'met' if grounded >= LOOPBACK_TARGET else 'NOT met'}")
    print(f"  80 ms, draft model on the demo model's text (at least {WAN_TARGET}x): not measured: no draft model yet")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profiles", default="lan,wan-100mbit-20ms,wan-20mbit-80ms",
                        help="comma-separated, from stratamesh/testbed/netbed.py")
    parser.add_argument("--stages", default="2,3", help="comma-separated numbers of stages")
    parser.add_argument("--num-prompts", type=int, default=8, help="a workload's at concurrency 1 (twice at 16)")
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=2, help="of each run, alternating which mesh goes first")
    parser.add_argument("--log-dir", default="", help="keep the daemons' logs here (one run at a time)")
    parser.add_argument("--quick", action="store_true", help="few prompts and tokens, LAN and 2 stages (a smoke run)")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        check_can_build(f"sm-{secrets.token_hex(3)}")
    except NetbedUnavailable as exc:
        print(f"skipped: {exc}", file=sys.stderr)
        sys.exit(SKIP)
    stop_on_sigterm()     # a `kill` stops the meshes and deletes the test bed, as Ctrl-C does
    if args.quick:
        args.num_prompts, args.output_len, args.profiles, args.stages, args.rounds = 2, 12, "lan", "2", 1
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_tiny_model(Path(tmp) / "llama-small", arch="llama", vocab_size=1024, **FULL)
        rows = []
        for profile in args.profiles.split(","):
            for stages in (int(n) for n in args.stages.split(",")):
                started = time.monotonic()
                rows.append(Row(profile, stages, *run_pair(model_dir, profile, stages, args)))
                log.warning("%s, %d stages: done in %.0f s", profile, stages, time.monotonic() - started)
        report(rows, args)


if __name__ == "__main__":
    main()
