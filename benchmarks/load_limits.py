"""64 concurrent streams for 60 s against a local mesh, under and over its request limit, with memory watched.

    python benchmarks/load_limits.py [--clients 64] [--duration 60] [--under-limit 64] [--over-limit 48]

Two runs of the same load in one invocation, each on a fresh mesh (a coordinator and 2 agents, 2 stages of the
tiny Llama): the first with the coordinator's --max-requests at or above the number of clients, the second
below it. Every client streams completions back to back; a 429 is counted and retried after its Retry-After.
What must hold: no errors at all under the limit; above it, 429s and no other error. Memory: the peak RSS
(VmHWM) of every process, and its mean RSS over 10 s windows through the load (a leak grows to the end; the
KV cache's pages being touched for the first time level off).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from stratamesh.launcher import LocalMesh
from stratamesh.sdk.local import builtin_model_dir

MODEL = "demo-llama"


@dataclass
class LoadResult:
    limit: int
    clients: int
    duration_s: float
    completed: int = 0
    tokens: int = 0
    statuses: Counter[str] = field(default_factory=Counter)   # "200", "429", "error: ..." per attempt
    rss_mib: dict[str, list[tuple[float, float]]] = field(default_factory=dict)   # process -> (t, MiB)
    peak_mib: dict[str, float] = field(default_factory=dict)

    @property
    def num_429(self) -> int:
        return self.statuses["429"]

    @property
    def num_errors(self) -> int:
        return sum(n for status, n in self.statuses.items() if status not in ("200", "429"))


def _status_kib(pid: int, field_name: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field_name + ":"):
            return int(line.split()[1])
    return 0


def _processes(mesh: LocalMesh) -> dict[str, int]:
    return {"coordinator": mesh.coordinator.pid, **{f"agent{i}": p.pid for i, p in enumerate(mesh.agents)}}


async def _client(http: httpx.AsyncClient, rng: random.Random, end_s: float, result: LoadResult) -> None:
    while time.monotonic() < end_s:
        body = {"model": MODEL, "prompt": f"The mesh {rng.randrange(10 ** 6)}", "max_tokens": 32,
                "temperature": 0, "ignore_eos": True, "stream": True}
        try:
            async with http.stream("POST", "/v1/completions", json=body) as response:
                if response.status_code == 429:
                    result.statuses["429"] += 1
                    await response.aread()
                    await asyncio.sleep(float(response.headers.get("retry-after", "1")))
                    continue
                if response.status_code != 200:
                    result.statuses[f"error: HTTP {response.status_code}"] += 1
                    continue
                tokens = 0
                async for line in response.aiter_lines():
                    if line.startswith("data:") and '"error"' in line:
                        result.statuses["error: mid-stream"] += 1
                        break
                    tokens += line.startswith("data:") and line != "data: [DONE]"
                else:
                    result.statuses["200"] += 1
                    result.completed += 1
                    result.tokens += tokens
        except httpx.HTTPError as exc:
            result.statuses[f"error: {type(exc).__name__}"] += 1


def _watch_memory(mesh: LocalMesh, result: LoadResult, stop: threading.Event, start_s: float) -> None:
    while not stop.wait(1.0):
        for name, pid in _processes(mesh).items():
            result.rss_mib.setdefault(name, []).append((time.monotonic() - start_s, _status_kib(pid, "VmRSS") / 1024))


def run_load(limit: int, num_clients: int, duration_s: float, log_dir: str) -> LoadResult:
    result = LoadResult(limit, num_clients, duration_s)
    with LocalMesh(builtin_model_dir(), num_agents=2, num_stages=2, log_dir=log_dir, keep_logs=False,
                   coordinator_args=["--max-requests", str(limit), "--max-requests-per-key", str(limit)]) as mesh:
        stop, start_s = threading.Event(), time.monotonic()
        watcher = threading.Thread(target=_watch_memory, args=(mesh, result, stop, start_s), daemon=True)
        watcher.start()

        async def load() -> None:
            limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
            async with httpx.AsyncClient(base_url=mesh.url, headers=mesh.headers, limits=limits,
                                         timeout=120) as http:
                end_s = time.monotonic() + duration_s
                await asyncio.gather(*(_client(http, random.Random(i), end_s, result) for i in range(num_clients)))

        asyncio.run(load())
        stop.set()
        watcher.join()
        result.peak_mib = {name: _status_kib(pid, "VmHWM") / 1024 for name, pid in _processes(mesh).items()}
    return result


def _window_mean(samples: list[tuple[float, float]], lo: float, hi: float) -> float:
    values = [mib for t, mib in samples if lo <= t < hi]
    return statistics.fmean(values) if values else float("nan")


def report(results: list[LoadResult]) -> str:
    lines = [f"{'run':<22}{'limit':>6}{'clients':>8}{'done':>7}{'tok/s':>8}{'429s':>7}{'errors':>8}  verdict"]
    for r in results:
        under = r.limit >= r.clients
        ok = r.num_errors == 0 and (r.num_429 == 0 if under else r.num_429 > 0)
        verdict = ("0 errors, no 429" if under else "429s, 0 other errors") if ok else f"FAIL {dict(r.statuses)}"
        lines.append(f"{'under the limit' if under else 'over the limit':<22}{r.limit:>6}{r.clients:>8}"
                     f"{r.completed:>7}{r.tokens / r.duration_s:>8.0f}{r.num_429:>7}{r.num_errors:>8}  {verdict}")
    lines.append("")
    quarters = ("0-10 s", "25%", "50%", "75%", "last 10 s")
    lines.append(f"{'RSS (MiB)':<22}{'process':>12}{'peak':>8}" + "".join(f"{q:>11}" for q in quarters))
    for r in results:
        starts = [0, r.duration_s * 0.25, r.duration_s * 0.5, r.duration_s * 0.75, r.duration_s - 10]
        for name, samples in r.rss_mib.items():
            windows = "".join(f"{_window_mean(samples, lo, lo + 10):>11.0f}" for lo in starts)
            lines.append(f"{'limit ' + str(r.limit):<22}{name:>12}{r.peak_mib.get(name, 0):>8.0f}{windows}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of load per run")
    parser.add_argument("--under-limit", type=int, default=64, help="--max-requests of the first run")
    parser.add_argument("--over-limit", type=int, default=48, help="--max-requests of the second run")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        results = [run_load(limit, args.clients, args.duration, str(Path(tmp, f"limit-{limit}")))
                   for limit in (args.under_limit, args.over_limit)]
    print(report(results))
    if args.json:
        print(json.dumps([{**{k: v for k, v in r.__dict__.items() if k != "rss_mib"}, "statuses": dict(r.statuses)}
                          for r in results], indent=2))
    if any(r.num_errors for r in results) or results[1].num_429 == 0 or results[0].num_429:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
