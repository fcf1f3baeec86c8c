"""What this box's agent reports: the capability probe (NVML, backends) and its measured speeds, as a table.

    python benchmarks/probe_report.py [--remeasure]

Prints each GPU as NVML reports it and each (backend, dtype) speed the planner will use: matmul FLOP/s
and copy bandwidth (bytes read + written per second).
"""

from __future__ import annotations

import argparse

from stratamesh.agent.probe import probe


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--remeasure", action="store_true", help="ignore the box's cached speeds")
    args = parser.parse_args()
    caps = probe(remeasure=args.remeasure)
    print(f"{caps.hostname}: {caps.cpu_model}, {caps.num_cpus} CPUs, {caps.ram_total_bytes / 1e9:.1f} GB RAM; "
          f"backends {', '.join(caps.backends)}\n")
    if caps.gpus:
        print("| GPU | name | CC | memory total (GB) | free (GB) | util % | temp C | power W | limit W |")
        print("|---|---|---|---:|---:|---:|---:|---:|---:|")
        for g in caps.gpus:
            cells = [g.utilization_pct, g.temperature_c, g.power_w, g.power_limit_w]
            print(f"| {g.index} | {g.name} | {g.compute_capability} | {g.mem_total_bytes / 1e9:.1f} | "
                  f"{g.mem_free_bytes / 1e9:.1f} | " + " | ".join("-" if c is None else f"{c:.0f}" for c in cells) + " |")
        print()
    print("| backend | dtype | matmul TFLOP/s | copy GB/s |\n|---|---|---:|---:|")
    for s in caps.speeds:
        print(f"| {s.backend} | {s.dtype} | {s.flops / 1e12:.2f} | {s.mem_bandwidth / 1e9:.0f} |")


if __name__ == "__main__":
    main()
