"""How long a local mesh takes to start, and where an agent's start goes (what every e2e test and `stratamesh up` pay).

    python benchmarks/mesh_start.py [--starts 4] [--agents 3]

Starts a LocalMesh of the tiny Llama with mutual TLS (agents enroll) and --insecure, alternately, --starts times
each, and times LocalMesh.start(): from nothing to /health ready with every agent connected. From each agent's log:
how long after it began serving stages it registered with the coordinator (finding it by zeroconf, then the control
stream's welcome), and the CPU seconds each agent process had used once the mesh was ready (its imports, probe,
enrollment and stage load: what every agent start costs a shared box). A third kind forks the agents from a fork
server that imported torch once (stratamesh/forked.py: what the test suite's meshes do). The last lines are the ratios
mTLS / insecure (what enrolling costs a start) and an agent's CPU at ready, started / forked.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from datetime import datetime
from pathlib import Path

from stratamesh.launcher import LocalMesh
from stratamesh.kernels.tiny_model import write_tiny_model

SERVING, REGISTERED = "serving stages on", "registered with coordinator"


def registration_s(log: Path) -> float:
    """Seconds from an agent's 'serving stages' log line to its 'registered' one."""
    stamps = {}
    for line in log.read_text().splitlines():
        for mark in (SERVING, REGISTERED):
            if mark in line and mark not in stamps:
                stamps[mark] = datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
    return stamps[REGISTERED] - stamps[SERVING]


def cpu_s(pid: int) -> float:
    """The CPU seconds (user + system) process pid has used so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start_once(model_dir: Path, agents: int, insecure: bool, fork: bool = False
               ) -> tuple[float, list[float], list[float]]:
    """(seconds LocalMesh.start() took, each agent's registration_s, each agent's CPU seconds at ready)."""
    with tempfile.TemporaryDirectory(prefix="mesh-start-") as logs:
        mesh = LocalMesh(str(model_dir), num_agents=agents, insecure=insecure, log_dir=logs, fork_agents=fork)
        started = time.perf_counter()
        with mesh:
            took = time.perf_counter() - started
            cpu = [cpu_s(agent.pid) for agent in mesh.agents]
        return took, [registration_s(Path(logs, f"agent{i}.log")) for i in range(agents)], cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--starts", type=int, default=4, help="starts of each kind, interleaved")
    parser.add_argument("--agents", type=int, default=3)
    args = parser.parse_args()
    model_dir = write_tiny_model(Path(tempfile.mkdtemp()) / "tiny-llama", arch="llama", num_layers=6)
    kinds = {"mTLS (agents enroll)": (False, False), "insecure": (True, False), "forked agents, mTLS": (False, True)}
    starts: dict[str, list[float]] = {k: [] for k in kinds}
    registrations: dict[str, list[float]] = {k: [] for k in kinds}
    cpus: dict[str, list[float]] = {k: [] for k in kinds}
    start_once(model_dir, 1, True)      # the box's speeds measured and cached: every start below reads them
    for _ in range(args.starts):
        for kind, (insecure, fork) in kinds.items():
            took, registered, cpu = start_once(model_dir, args.agents, insecure, fork)
            starts[kind].append(took)
            registrations[kind] += registered
            cpus[kind] += cpu

    print(f"a LocalMesh of {args.agents} agents (tiny Llama), {args.starts} interleaved starts of each kind\n")
    print(f"| {'kind':<22} | {'start median s':>14} | {'min s':>6} | {'max s':>6} | {'agent CPU s p50':>15} | "
          f"{'agent registers ms p50':>22} |")
    print(f"|{'-' * 24}|{'-' * 16}|{'-' * 8}|{'-' * 8}|{'-' * 17}|{'-' * 24}|")
    for kind in kinds:
        s, r, c = starts[kind], registrations[kind], cpus[kind]
        print(f"| {kind:<22} | {statistics.median(s):14.2f} | {min(s):6.2f} | {max(s):6.2f} | "
              f"{statistics.median(c):15.2f} | {statistics.median(r) * 1e3:22.0f} |")
    secure, insecure, _ = (statistics.median(starts[k]) for k in kinds)
    started, forked = (statistics.median(cpus[k]) for k in ("mTLS (agents enroll)", "forked agents, mTLS"))
    print(f"\nstart, mTLS / insecure: {secure / insecure:.2f}x")
    print(f"agent CPU at ready, started / forked: {started / forked:.2f}x")


if __name__ == "__main__":
    main()
