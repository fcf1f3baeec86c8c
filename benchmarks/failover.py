"""What kill -9 of a stage's agent costs the streams running through it, and whether they stay identical.

    python benchmarks/failover.py [--runs 3] [--streams 8] [--tokens 64] [--stage 1] [--model DIR] [--drain]

One local mesh: 3 stages on 4 agents (one spare). Each run streams the same completions twice, once
undisturbed and once with the agent of one stage killed (SIGKILL) after 16 tokens; the killed agent is
started again before the next run, as a spare. Half the streams are greedy, half sample with a seed. The
table gives, per run, the streams that completed identical to their undisturbed run and the stall: the
time from the kill to each stream's next token.

The peers have no figure to compare with: vLLM fails every request of a dead engine, exo deletes the
instance, Petals retries only inside its own client. So the baseline is the undisturbed run's own gap
between tokens (median), and the ratio says how many token gaps a failover costs.

With --drain each run also drains the stage's agent (`stratamesh drain`) instead of killing it, and a
second table compares the two ways off an agent: the longest wait for a token after the kill or the drain
order, per stream, and the tokens computed again (a drain moves the KV: none should be). Give the streams
enough tokens (--tokens 160) to outlast the replacement's load, or they end before they can move.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from stratamesh.bench.chaos import FailoverRun, drain_stage_mid_stream, kill_stage_mid_stream, make_jobs
from stratamesh.bench.datasets import regular_token_ids
from stratamesh.bench.margins import decisive
from stratamesh.bench.metrics import percentile
from stratamesh.launcher import LocalMesh
from stratamesh.kernels.tiny_model import write_tiny_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--stage", type=int, default=1, help="which stage's agent to kill (0-based)")
    parser.add_argument("--model", help="a Hugging Face folder; default: a 6-layer tiny Llama")
    parser.add_argument("--drain", action="store_true", help="also drain the agent instead of killing it")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model or str(write_tiny_model(Path(tmp, "tiny-llama"), arch="llama", num_layers=6))
        model = Path(model_dir).resolve().name
        # greedy prompts whose every step leads by bench.margins.MIN_MARGIN: a failover reorders float sums, and a
        # closer step could then take the other token with nothing wrong
        jobs = decisive(make_jobs(args.streams, regular_token_ids(model_dir), prompt_len=20, max_tokens=args.tokens,
                                  seed=3), model_dir)
        print("| run | streams identical | stall p50 ms | stall max ms | undisturbed token gap ms | ratio p50 |")
        print("|---|---|--:|--:|--:|--:|")
        all_stalls, ways = [], []
        with LocalMesh(model_dir, num_agents=4, num_stages=3, log_dir=str(Path(tmp, "logs"))) as mesh:
            for r in range(args.runs):
                run = asyncio.run(kill_stage_mid_stream(mesh, model, jobs, stage=args.stage))
                ways.append(("kill -9", run, _recomputed(mesh, len(jobs))))
                same = sum(1 for o, ref in zip(run.outcomes, run.reference) if not o.error and o.tokens == ref.tokens)
                gap = statistics.median(b - a for o in run.reference for a, b in zip(o.times, o.times[1:]) if b > a)
                stalls = run.stalls
                all_stalls += stalls
                print(f"| {r + 1} | {same}/{len(jobs)} | {percentile(stalls, 50) * 1e3:.0f} | "
                      f"{max(stalls, default=float('nan')) * 1e3:.0f} | {gap * 1e3:.1f} | "
                      f"{percentile(stalls, 50) / gap:.1f} |", flush=True)
                mesh.start_agent(mesh.agent_index(run.killed_address))
                mesh.wait_ready(60)
                _wait_connected(mesh, 4)
                if args.drain:
                    drained = asyncio.run(drain_stage_mid_stream(mesh, model, jobs, stage=args.stage))
                    ways.append(("drain", drained, _recomputed(mesh, len(jobs))))
                    if drained.drain_exit != 0:
                        raise SystemExit(f"the drain failed:\n{drained.drain_output}")
                    index = mesh.agent_index(drained.killed_address)
                    mesh.agents[index].wait(60)
                    mesh.start_agent(index)
                    mesh.wait_ready(60)
                    _wait_connected(mesh, 4)
        print(f"\nall runs: stall p50 {percentile(all_stalls, 50) * 1e3:.0f} ms, "
              f"max {max(all_stalls) * 1e3:.0f} ms over {len(all_stalls)} streams")
        if args.drain:
            _compare(ways, len(jobs))


def _wait_connected(mesh: LocalMesh, num_agents: int, timeout_s: float = 60.0) -> None:
    """Until num_agents agents are connected: a restarted agent is a spare only once it has registered."""
    deadline = time.monotonic() + timeout_s
    while True:
        agents = httpx.get(f"{mesh.url}/admin/api/agents", headers=mesh.headers, timeout=10).json()["agents"]
        if sum(a["state"] == "connected" for a in agents) >= num_agents:
            return
        if time.monotonic() > deadline:
            raise SystemExit(f"fewer than {num_agents} agents connected after {timeout_s:.0f} s")
        time.sleep(0.1)


def _recomputed(mesh: LocalMesh, num_requests: int) -> int:
    """Tokens the newest requests computed again after changing route (the admin API's records)."""
    records = httpx.get(f"{mesh.url}/admin/api/requests", params={"limit": num_requests}, headers=mesh.headers,
                        timeout=10).json()["requests"]
    return sum(r["num_replayed_tokens"] for r in records)


def _compare(ways: list[tuple[str, FailoverRun, int]], num_streams: int) -> None:
    print("\n| way off the agent | streams identical | longest token gap p50 ms | max ms | tokens recomputed |")
    print("|---|---|--:|--:|--:|")
    gaps: dict[str, list[float]] = {}
    for how in ("kill -9", "drain"):
        runs = [(run, recomputed) for way, run, recomputed in ways if way == how]
        same = sum(1 for run, _ in runs for o, ref in zip(run.outcomes, run.reference)
                   if not o.error and o.tokens == ref.tokens)
        gaps[how] = [g for run, _ in runs for g in run.largest_gaps]
        print(f"| {how} | {same}/{num_streams * len(runs)} | {percentile(gaps[how], 50) * 1e3:.0f} | "
              f"{max(gaps[how]) * 1e3:.0f} | {sum(r for _, r in runs)} |")
    print(f"\ndrain / kill, longest gap p50: {percentile(gaps['drain'], 50) / percentile(gaps['kill -9'], 50):.2f}")


if __name__ == "__main__":
    main()
