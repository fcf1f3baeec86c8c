"""`stratamesh bench control`: what a fleet of N boxes costs the coordinator's control plane.

For each fleet size: a local mesh (a real coordinator, one real agent serving the demo model), then N simulated
agents (stratamesh/bench/sim_agents.py, in --processes processes) that register, heartbeat with telemetry at the
interval the coordinator asks for and, with --churn-per-min, drop and come back. Measured per size:

- join: from starting the simulated agents to the last one's welcome (and how many were welcomed in --join-timeout);
  and from the joins to the end of the window, the plans the planner computed (with --capable the simulated boxes
  could each hold a stage, so the planner weighs them: joins are weighed in bursts, not one by one) and the agents
  the coordinator declared dead (a storm it cannot keep up with shows here first);
- over a quiet window of --window seconds after that: the coordinator's CPU (cores) and RSS, its registry's
  commits per second (stratamesh:registry_commits), and the heartbeats the simulated agents sent per second (and
  the coordinator's CPU per heartbeat: all its CPU in the window over them, an upper bound);
- then the API's latency under that load, one request after the other: API_REQUESTS 8-token completions, as many
  pages of GET /admin/api/agents (the first 100 agents: what the UI's table asks) and as many GET
  /admin/api/snapshot (what the UI's live stream sends first: the sites summed up, the agents that matter in full),
  with the snapshot's size, and how many of them failed;
- what the load client itself cost (its processes' CPU), since it shares this machine with the coordinator.

With --registry postgresql://..., each size runs twice in the one invocation: on SQLite (the default registry, the
baseline) and on a database of its own made on that PostgreSQL server (dropped after), and the table ends with
PostgreSQL's coordinator cores and commits against SQLite's. Where the server runs on this machine the database's
own CPU (its backends serving the coordinator) is measured too.
"""

from __future__ import annotations

import json
import logging
import math
import os
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from stratamesh.bench.metrics import percentile
from stratamesh.bench.sim_agents import issue_certificates
from stratamesh.fleet.state import is_postgres
from stratamesh.testbed.databases import scratch_database
from stratamesh.launcher import LocalMesh

log = logging.getLogger(__name__)
CLK_TCK = os.sysconf("SC_CLK_TCK")
API_REQUESTS = 20       # of each kind, after the quiet window
AGENTS_PER_PROCESS = 2500


@dataclass(frozen=True, slots=True)
class ControlRow:
    """One fleet size's figures."""

    num_agents: int
    welcomed: int
    join_s: float               # to the last welcome (inf if not all were welcomed)
    join_p50_s: float           # a simulated agent's own wait for its welcome, median
    coordinator_cores: float
    coordinator_rss_mib: float
    commits_per_s: float
    plans_computed: int         # from the first join to the end of the window
    declared_dead: int          # agents the coordinator declared dead, from the first join to the end of the window
    heartbeats_per_s: float
    completion_p50_ms: float
    completion_p99_ms: float
    page_api_p50_ms: float      # GET /admin/api/agents: a page of 100
    page_api_p99_ms: float
    snapshot_api_p50_ms: float  # GET /admin/api/snapshot
    snapshot_api_p99_ms: float
    snapshot_bytes: int         # the largest snapshot of the API_REQUESTS
    api_errors: int             # API requests that failed (each kind: API_REQUESTS)
    load_cores: float           # the simulated agents' processes, over the window
    store: str = "sqlite"       # the registry's store: "sqlite" or "postgresql"
    database_cores: float = math.nan    # PostgreSQL's backends serving the coordinator, over the window (nan: none,
                                        # or a server on another machine)


def process_cpu_s(pid: int) -> float:
    """User and system CPU seconds of a process so far (from /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def process_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def counter(mesh: LocalMesh, name: str) -> float:
    """A counter of the coordinator's /metrics (0 if it has none of that name)."""
    text = httpx.get(f"{mesh.url}/metrics", headers=mesh.headers, timeout=30).text
    return next((s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name), 0.0)


class LoadProcess:
    """One process of simulated agents, and the JSON lines it reports."""

    def __init__(self, mesh: LocalMesh, first: int, count: int, args: list[str]):
        self.process = subprocess.Popen([sys.executable, "-m", "stratamesh.bench.sim_agents",
                                         "--coordinator", mesh.grpc_address, "--mesh", mesh.mesh,
                                         "--first", str(first), "--count", str(count), *args],
                                        stdout=subprocess.PIPE, text=True)
        self.reports: list[dict] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.reports.append(json.loads(line))

    def latest(self, phase: str | None = None) -> dict | None:
        found = [r for r in self.reports if phase is None or r["phase"] == phase]
        return found[-1] if found else None

    def stop(self) -> dict | None:
        """Ends the process (if it still runs) and returns its last report."""
        if self.process.poll() is None:
            self.process.terminate()
        self.process.wait(timeout=60)
        self._reader.join(timeout=10)
        return self.latest("stopped")

    def __enter__(self) -> LoadProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def timed(call) -> tuple[float, httpx.Response | None]:  # noqa: ANN001
    """How long call() took, in ms, and its response (None: it failed, and the log says why)."""
    started = time.perf_counter()
    try:
        response = call().raise_for_status()
    except httpx.HTTPError as e:
        log.warning("API request failed: %s", e)
        response = None
    return (time.perf_counter() - started) * 1e3, response


def database_cpu_s(url: str) -> float:
    """CPU seconds so far of the PostgreSQL backends connected to url's database, where they run on this machine
    (nan otherwise, or for an SQLite registry)."""
    if not is_postgres(url):
        return math.nan
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        pids = [row[0] for row in conn.execute("SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
                                               "AND pid <> pg_backend_pid()")]
    try:
        return sum(process_cpu_s(pid) for pid in pids)
    except (FileNotFoundError, ProcessLookupError):
        return math.nan


def run_size(model_dir: str, num_agents: int, processes: int, window_s: float, join_timeout_s: float,
             churn_per_min: float, mtls: bool, log_dir: str | None, capable: bool = False,
             registry: str | None = None) -> ControlRow:
    mesh = LocalMesh(model_dir, num_agents=1, insecure=not mtls, log_dir=log_dir, keep_logs=False, db=registry)
    # the simulated agents' processes end with the run however it ends (a run that failed left thousands running)
    with mesh, tempfile.TemporaryDirectory() as tmp, ExitStack() as running:
        pid = mesh.coordinator.pid
        args = ["--churn-per-min", str(churn_per_min), "--join-timeout", str(join_timeout_s), "--report-every", "1"]
        if capable:     # RAM for a stage of the demo model, but too slow to be worth moving a stage to
            args += ["--ram-mib", "8192", "--gflops", "1"]
        plans_before = counter(mesh, "stratamesh:plans_computed_total")
        deaths_before = counter(mesh, "stratamesh:agents_declared_dead_total")
        if mtls:
            pki_dir = mesh.pki_dir()
            started = time.monotonic()
            issue_certificates(pki_dir, mesh.mesh, range(num_agents), tmp)
            log.warning("issued %d certificates in %.1f s", num_agents, time.monotonic() - started)
            args += ["--pki", pki_dir, "--certs", tmp]
        # one process per AGENTS_PER_PROCESS by default: one busier than that falls behind on its own heartbeats in
        # a join storm, and the coordinator rightly declares its agents dead
        processes = processes or -(-num_agents // AGENTS_PER_PROCESS)
        share = -(-num_agents // processes)
        loads = [running.enter_context(LoadProcess(mesh, first, min(share, num_agents - first), args))
                 for first in range(0, num_agents, share)]
        deadline = time.monotonic() + join_timeout_s + 60
        while any(p.latest("joined") is None for p in loads) and time.monotonic() < deadline:
            time.sleep(0.1)
        joined = [p.latest("joined") or {} for p in loads]
        welcomed = sum(j.get("welcomed", 0) for j in joined)
        join_s = max(j.get("elapsed_s", float("inf")) for j in joined) if welcomed == num_agents else float("inf")
        join_p50 = sorted(j.get("join_p50_s") or 0.0 for j in joined)[len(joined) // 2]

        # a quiet window: what the fleet alone costs the coordinator
        before = (time.monotonic(), process_cpu_s(pid), counter(mesh, "stratamesh:registry_commits_total"),
                  sum(p.latest()["heartbeats"] for p in loads), sum(p.latest()["cpu_s"] for p in loads),
                  database_cpu_s(mesh.registry_path()))
        time.sleep(window_s)
        after = (time.monotonic(), process_cpu_s(pid), counter(mesh, "stratamesh:registry_commits_total"),
                 sum(p.latest()["heartbeats"] for p in loads), sum(p.latest()["cpu_s"] for p in loads),
                 database_cpu_s(mesh.registry_path()))
        rss = process_rss_mib(pid)
        plans = int(counter(mesh, "stratamesh:plans_computed_total") - plans_before)
        deaths = int(counter(mesh, "stratamesh:agents_declared_dead_total") - deaths_before)
        # then the API under that load, one request after the other
        completions, pages, snapshots = [], [], []
        body = {"model": Path(model_dir).name, "prompt": "The mesh", "max_tokens": 8, "temperature": 0,
                "ignore_eos": True}
        with httpx.Client(timeout=60, headers=mesh.headers) as client:
            for _ in range(API_REQUESTS):
                completions.append(timed(lambda: client.post(f"{mesh.url}/v1/completions", json=body)))
                pages.append(timed(lambda: client.get(f"{mesh.url}/admin/api/agents")))
                snapshots.append(timed(lambda: client.get(f"{mesh.url}/admin/api/snapshot")))
    elapsed = after[0] - before[0]
    # latencies of the requests that succeeded (nan where none did)
    completion_ms, page_ms, snapshot_ms = ([ms for ms, r in calls if r is not None] or [math.nan]
                                           for calls in (completions, pages, snapshots))
    errors = sum(r is None for calls in (completions, pages, snapshots) for _, r in calls)
    return ControlRow(num_agents, welcomed, join_s, join_p50, (after[1] - before[1]) / elapsed, rss,
                      (after[2] - before[2]) / elapsed, plans, deaths, (after[3] - before[3]) / elapsed,
                      percentile(completion_ms, 50), percentile(completion_ms, 99), percentile(page_ms, 50),
                      percentile(page_ms, 99), percentile(snapshot_ms, 50), percentile(snapshot_ms, 99),
                      max((len(r.content) for _, r in snapshots if r is not None), default=0), errors,
                      (after[4] - before[4]) / elapsed, "postgresql" if registry else "sqlite",
                      (after[5] - before[5]) / elapsed)


def per_heartbeat_us(row: ControlRow) -> float:
    """The coordinator's CPU over the quiet window per heartbeat it took in: an upper bound on what one costs (the
    window's other work, link probes and liveness checks, is counted in)."""
    return row.coordinator_cores / row.heartbeats_per_s * 1e6 if row.heartbeats_per_s else 0.0


def report(rows: list[ControlRow], mtls: bool, window_s: float, capable: bool) -> None:
    boxes = "boxes that could each hold a stage" if capable else "boxes too small for any stage"
    print(f"\nsimulated agents ({boxes}) against one coordinator ({'mTLS' if mtls else 'insecure'}), one real "
          f"agent serving the demo model; steady window {window_s:.0f} s on this {os.cpu_count()}-core machine\n")
    print("| agents | registry | welcomed | join all s | join p50 s | coordinator cores | database cores | RSS MiB | "
          "registry commits/s | plans computed | declared dead | heartbeats/s | CPU µs per heartbeat | "
          "completion p50/p99 ms | agents page p50/p99 ms | UI snapshot p50/p99 ms | UI snapshot KiB | API errors | "
          "load client cores |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        database = "-" if math.isnan(r.database_cores) else f"{r.database_cores:.2f}"
        print(f"| {r.num_agents:,} | {r.store} | {r.welcomed:,} | {r.join_s:.1f} | {r.join_p50_s:.2f} | "
              f"{r.coordinator_cores:.2f} | {database} | {r.coordinator_rss_mib:.0f} | {r.commits_per_s:.0f} | "
              f"{r.plans_computed} | "
              f"{r.declared_dead:,} | "
              f"{r.heartbeats_per_s:.0f} | {per_heartbeat_us(r):.0f} | {r.completion_p50_ms:.0f} / {r.completion_p99_ms:.0f} | "
              f"{r.page_api_p50_ms:.0f} / {r.page_api_p99_ms:.0f} | "
              f"{r.snapshot_api_p50_ms:.0f} / {r.snapshot_api_p99_ms:.0f} | {r.snapshot_bytes / 1024:.1f} | {r.api_errors} | "
              f"{r.load_cores:.2f} |")
    against = {r.num_agents: r for r in rows if r.store == "sqlite"}
    for r in rows:
        if r.store != "sqlite" and r.num_agents in against:
            base = against[r.num_agents]
            print(f"\n{r.num_agents:,} agents, {r.store} against sqlite: coordinator cores "
                  f"{_ratio(r.coordinator_cores, base.coordinator_cores)}, registry commits/s "
                  f"{_ratio(r.commits_per_s, base.commits_per_s)}, completion p50 "
                  f"{_ratio(r.completion_p50_ms, base.completion_p50_ms)}, join all "
                  f"{_ratio(r.join_s, base.join_s)}")


def _ratio(value: float, baseline: float) -> str:
    return f"{value / baseline:.2f}x" if baseline and math.isfinite(value) and math.isfinite(baseline) else "-"


def control_main(model_dir: str, sizes: list[int], processes: int = 0, window_s: float = 20.0,
                 join_timeout_s: float = 60.0, churn_per_min: float = 0.0, mtls: bool = False,
                 log_dir: str = "", capable: bool = False, registry: str = "") -> list[ControlRow]:
    logging.getLogger("httpx").setLevel(logging.WARNING)
    rows = []
    for size in sizes:
        for store in ("sqlite", "postgresql") if registry else ("sqlite",):
            logs = f"{log_dir}/{size}-agents-{store}" if log_dir else None
            with ExitStack() as database:        # a mesh of its own, on a registry of its own
                url = (database.enter_context(scratch_database(registry, "stratamesh_bench"))
                       if store == "postgresql" else None)
                rows.append(run_size(model_dir, size, processes, window_s, join_timeout_s, churn_per_min, mtls,
                                     logs, capable, url))
            log.warning("%d simulated agents on %s: done", size, store)
    report(rows, mtls, window_s, capable)
    return rows
