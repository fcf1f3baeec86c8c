"""What a standby coordinator's view of the mesh costs it each second (coordinator/standby.py): its refresh, which
reads the agents of live plans and their telemetry, against reading the whole fleet (every agent, every agent's
newest telemetry, every link), the first way it was written.

    python benchmarks/standby_refresh.py [--registry postgresql://USER@HOST/DB] [--agents 5000] [--rounds 5]

The registry (an SQLite file in a temporary folder by default; a PostgreSQL database, which must be empty, when
given) is filled as a leader would leave it: N connected agents, a minute of their telemetry (a row per agent every
5 s), 8 measured links per agent, and one model served by a 2-stage plan. Prints each way's wall and CPU time per
refresh (median of --rounds), and the ratio."""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from stratamesh.coordinator.records import StageRecord
from stratamesh.coordinator.registry_store import RegistryStore, open_registry
from stratamesh.coordinator.standby import RegistryRoster
from stratamesh.fleet.boxes import Capabilities, Telemetry
from stratamesh.fleet.control_messages import LinkMeasurement
from stratamesh.fleet.stages import StageSpec

T0 = 1_700_000_000.0


def fill(registry: RegistryStore, num_agents: int) -> None:
    with registry.transaction():
        for i in range(num_agents):
            registry.upsert_agent(f"a{i}", f"a{i}", f"10.{i // 62500}.{i // 250 % 250}.{i % 250}:7000",
                                  Capabilities(f"host{i}", "cpu", 8, 16 << 30, 12 << 30), T0)
            registry.set_agent_state(f"a{i}", "connected", T0)
    for beat in range(12):
        registry.record_heartbeats({}, [(f"a{i}", Telemetry(T0 + 5 * beat, queue_depth=1), T0 + 5 * beat)
                                        for i in range(num_agents)])
    with registry.transaction():
        for i in range(num_agents):
            registry.record_links(f"a{i}", [LinkMeasurement(f"a{(i + k) % num_agents}", 0.001, 1e8)
                                            for k in range(1, 9)], T0)
    registry.add_model("m", "/models/m", 8, {}, T0)
    registry.save_plan("p1", "m", [StageRecord(f"p1-{i}", i, f"a{i}", StageSpec("m", "/models/m", 4 * i, 4 * i + 4,
                                                                                8)) for i in (0, 1)], "", T0)


def whole_fleet(registry: RegistryStore) -> Callable[[], object]:
    """The first refresh: every agent, every agent's newest telemetry, every link."""
    return lambda: (registry.agents(), registry.latest_telemetry(), registry.links())


def timed(refresh: Callable[[], object], rounds: int) -> tuple[float, float]:
    """Median wall and CPU milliseconds of one call, after one to warm up."""
    refresh()
    walls, cpus = [], []
    for _ in range(rounds):
        wall, cpu = time.perf_counter(), time.process_time()
        refresh()
        walls.append((time.perf_counter() - wall) * 1e3)
        cpus.append((time.process_time() - cpu) * 1e3)
    return statistics.median(walls), statistics.median(cpus)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--registry", default="", help="a PostgreSQL database (empty); default: SQLite in /tmp")
    parser.add_argument("--agents", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        registry = open_registry(args.registry or str(Path(folder) / "registry.db"))
        fill(registry, args.agents)
        roster = RegistryRoster(registry, agent_lease_s=2.0, clock=lambda: 0.0)   # links: read at the first only
        rows = [("whole fleet (baseline)", *timed(whole_fleet(registry), args.rounds)),
                ("live plans' agents", *timed(roster.refresh, args.rounds))]
        registry.close()
    store = "postgresql" if args.registry else "sqlite"
    print(f"\nstandby refresh, {args.agents:,} agents on {store}, median of {args.rounds}\n")
    print("| refresh | wall ms | CPU ms |\n|---|---|---|")
    for name, wall, cpu in rows:
        print(f"| {name} | {wall:.1f} | {cpu:.1f} |")
    print(f"\nlive plans' agents against the whole fleet: wall {rows[1][1] / rows[0][1]:.3f}x, "
          f"CPU {rows[1][2] / rows[0][2]:.3f}x")


if __name__ == "__main__":
    main()
