"""A longer run of the Stage-message fuzzer than the test's, against a fresh local mesh, one seed after another.

    python benchmarks/stage_fuzz.py [--cases 1500] [--seeds 7 1 2]

For each seed: a coordinator and 2 agents serving the tiny Llama in 2 stages; both stages are fuzzed at once
(`stratamesh.bench.stage_fuzz`) with --cases cases each. Prints how the stages answered each kind of case and
exits 1 if any answer is other than OK, INVALID_ARGUMENT or the known client-side ENDED_EARLY, or a process died.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections import Counter
from pathlib import Path

import httpx

from stratamesh.bench.stage_fuzz import ENDED_EARLY, FuzzReport, Target, fuzz_concurrently
from stratamesh.launcher import LocalMesh
from stratamesh.sdk.local import builtin_model_dir

EXPECTED = ("OK", "INVALID_ARGUMENT", ENDED_EARLY)


def fuzz_mesh(num_cases: int, seed: int) -> tuple[dict[str, FuzzReport], bool]:
    model_dir = Path(builtin_model_dir())
    config = json.loads((model_dir / "config.json").read_text())
    with LocalMesh(str(model_dir), num_agents=2, num_stages=2, keep_logs=False) as mesh:
        [plan] = httpx.get(f"{mesh.url}/admin/api/plans", headers=mesh.headers).json()["plans"]
        targets = {mesh.agent_addresses[mesh.agent_ids.index(s["agent_id"])]: Target(
            s["assignment_id"], config["hidden_size"], config["vocab_size"], mesh.grpc_address)
            for s in plan["stages"]}

        async def run() -> dict[str, FuzzReport]:
            channels = {address: mesh.channel(address) for address in targets}
            try:
                return await fuzz_concurrently(channels, targets, num_cases, seed)
            finally:
                for channel in channels.values():
                    await channel.close()

        reports = asyncio.run(run())
        alive = all(p.poll() is None for p in [mesh.coordinator, *mesh.agents])
    return reports, alive


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", type=int, default=1500, help="cases per stage and seed")
    parser.add_argument("--seeds", type=int, nargs="+", default=[7, 1, 2])
    args = parser.parse_args()
    totals: Counter[str] = Counter()
    unexpected: dict[tuple[str, str], str] = {}
    all_alive = True
    for seed in args.seeds:
        reports, alive = fuzz_mesh(args.cases, seed)
        all_alive &= alive
        for address, report in reports.items():
            totals.update(report.statuses)
            print(f"seed {seed} stage {address}: {report.num_cases} cases over {len(report.by_case)} kinds, "
                  f"answers {dict(report.statuses)}{'' if alive else '; A PROCESS DIED'}")
            unexpected.update({k: v for k, v in report.details.items() if k[1] not in EXPECTED})
    print(f"\nall seeds: {sum(totals.values())} cases, answers {dict(totals)}, processes alive: {all_alive}")
    for (case, code), details in unexpected.items():
        print(f"  unexpected {code} for {case!r}: {details}")
    if unexpected or not all_alive:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
