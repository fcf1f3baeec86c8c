"""Decode tokens/s of a small mixture of experts: transformers in one process against the mesh served three ways.

    python benchmarks/moe.py [--concurrency 1 32] [--input-len 64] [--output-len 64] [--rounds 2] [--quick]

One random-weight Qwen3-MoE checkpoint (8 layers, hidden 512; 16 experts of 256 units, 4 of them a token, in
layers 1-7; layer 0 dense), the same token-id prompts (at C: max(2C, 4) of them) for:
  (a) transformers, one process: generate on batches of C prompts (greedy; its default experts kernel,
      grouped_mm) -- the baseline;
  (b) stratamesh, 1 stage on one agent;
  (c) stratamesh, 3 stages on 3 agents;
  (d) stratamesh, 1 stage as an expert-parallel group: one agent with 2 ranks (--ranks 2, gloo), each holding 8
      of each layer's 16 experts (and half of attention's heads).
All three meshes are up from the start; each round runs every configuration at every concurrency in turn, so a slow
minute of this shared machine hits them alike; each cell is the median over the rounds. Then each mesh's ratio to
(a) at the same concurrency, and the experts' figures the agents report: the mean over steps of a step's imbalance
(the most tokens an expert got over the mean per expert, in the step's most uneven layer: the
stratamesh:expert_step_imbalance histogram) and, for the group, each rank's share of the routed tokens (the admin
API's experts of its stage) -- the rank with the most is the straggler every step waits for.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import statistics
import sys
import tempfile
from pathlib import Path

import httpx

from stratamesh.bench.datasets import BenchRequest, random_requests, regular_token_ids
from stratamesh.kernels.tiny_model import write_tiny_model
from stratamesh.launcher import LaunchError, LocalMesh

sys.path.insert(0, str(Path(__file__).parent))
from serve_compare import hf_tok_s, load_hf, mesh_tok_s, run_mesh  # noqa: E402  (a sibling script, not a package)

log = logging.getLogger("moe")
FULL = {"num_layers": 8, "hidden_size": 512, "intermediate_size": 506, "num_heads": 8, "num_kv_heads": 4,
        "num_experts": 16}      # moe_intermediate_size: 506 // 2 + 3 = 256 (kernels/tiny_model.py)
QUICK = {"num_layers": 3, "hidden_size": 64, "intermediate_size": 122, "num_heads": 4, "num_kv_heads": 2,
         "num_experts": 8}
TOP_K = 4
MESHES = {"(b) stratamesh, 1 stage": {"num_agents": 1, "num_stages": 1},
          "(c) stratamesh, 3 stages": {"num_agents": 3, "num_stages": 3},
          "(d) stratamesh, EP=2 group": {"num_agents": 1, "num_stages": 1, "agent_args": ["--ranks", "2"]}}
BASELINE = "(a) transformers, one process"


def write_model(root: Path, quick: bool) -> Path:
    """The benchmark's Qwen3-MoE: the tiny-model writer's layout, TOP_K experts a token, and transformers left to
    its default experts kernel (the suite's references pin the one-by-one loop, which any shape takes)."""
    model_dir = write_tiny_model(root / ("quick-qwen3-moe" if quick else "qwen3-moe-8x512"), arch="qwen3_moe",
                                 vocab_size=1024, **(QUICK if quick else FULL))
    config = json.loads((model_dir / "config.json").read_text())
    config["num_experts_per_tok"] = TOP_K
    del config["experts_implementation"]
    (model_dir / "config.json").write_text(json.dumps(config, indent=2))
    return model_dir


def start_mesh(model_dir: Path, shape: dict) -> LocalMesh | None:
    """A warmed-up mesh of that shape, or None (logged) if it does not start."""
    mesh = LocalMesh(str(model_dir), **shape)
    try:
        mesh.start()
        run_mesh(mesh, model_dir.name, random_requests(regular_token_ids(model_dir), 2, 16, 4, seed=99), 2)
    except LaunchError as exc:
        log.warning("mesh %s did not start: %s", shape, exc)
        mesh.stop()
        return None
    return mesh


def stages_of(mesh: LocalMesh, model_id: str) -> list[dict]:
    plans = httpx.get(f"{mesh.url}/admin/api/plans", headers=mesh.headers, timeout=30).json()["plans"]
    return next(p for p in plans if p["model_id"] == model_id and p["state"] == "active")["stages"]


def mean_imbalance(mesh: LocalMesh) -> float:
    """The mean over every stage's steps of a step's expert imbalance (the agents' histogram)."""
    total = sum(mesh.agent_sums("stratamesh:expert_step_imbalance_sum", "stage").values())
    steps = sum(mesh.agent_sums("stratamesh:expert_step_imbalance_count", "stage").values())
    return total / steps if steps else math.nan


def rank_shares(mesh: LocalMesh, model_id: str) -> str:
    """Each rank's share of the routed tokens of the mesh's expert-parallel stages, the straggler marked."""
    out = []
    for stage in stages_of(mesh, model_id):
        experts = stage.get("experts")
        if stage["tp_degree"] < 2 or not experts:
            continue
        total = sum(experts["rank_tokens"]) or 1
        out.append(" / ".join(f"rank {r}{' (straggler)' if r == experts['straggler_rank'] else ''}: "
                              f"{100 * n / total:.1f}%" for r, n in enumerate(experts["rank_tokens"])))
    return "; ".join(out) or "-"


def interleaved_rounds(model_dir: Path, sets: dict[int, list[BenchRequest]], rounds: int
                       ) -> tuple[dict[str, dict[int, float]], dict[str, str]]:
    """Every configuration at every concurrency, round after round; the median per cell; and each mesh's layout
    and expert figures."""
    hf = load_hf(model_dir)
    meshes = {name: start_mesh(model_dir, shape) for name, shape in MESHES.items()}
    samples: dict[str, dict[int, list[float]]] = {name: {c: [] for c in sets} for name in (BASELINE, *MESHES)}
    notes: dict[str, str] = {}
    try:
        for r in range(rounds):
            for c, requests in sets.items():
                samples[BASELINE][c].append(hf_tok_s(hf, requests, c))
                for name, mesh in meshes.items():
                    samples[name][c].append(mesh_tok_s(mesh, model_dir.name, requests, c))
            log.warning("round %d of %d done", r + 1, rounds)   # progress on stderr
        for name, mesh in meshes.items():
            if mesh is None:
                notes[name] = "did not start"
                continue
            layout = ", ".join(f"[{s['start_layer']}, {s['end_layer']}) TP/EP={s['tp_degree']}"
                               for s in stages_of(mesh, model_dir.name))
            notes[name] = (f"{layout}; mean step imbalance {mean_imbalance(mesh):.2f}; routed tokens per rank: "
                           f"{rank_shares(mesh, model_dir.name)}")
    finally:
        for mesh in meshes.values():
            if mesh is not None:
                mesh.stop()
    return {name: {c: statistics.median(v) for c, v in row.items()} for name, row in samples.items()}, notes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds; each cell is their median")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="a tiny model, C=1 and 4, short prompts, one round")
    args = parser.parse_args()
    if args.quick:
        args.concurrency, args.input_len, args.output_len, args.rounds = [1, 4], 16, 8, 1
    logging.basicConfig(level=logging.WARNING)
    model_dir = write_model(Path(tempfile.mkdtemp()), args.quick)
    vocab = regular_token_ids(model_dir)
    sets = {c: random_requests(vocab, max(2 * c, 4), args.input_len, args.output_len, args.seed + c)
            for c in args.concurrency}
    rows, notes = interleaved_rounds(model_dir, sets, args.rounds)
    config = json.loads((model_dir / "config.json").read_text())
    print(f"model {model_dir.name}: {config['num_hidden_layers']} layers, hidden {config['hidden_size']}, "
          f"{config['num_experts']} experts of {config['moe_intermediate_size']} units, {TOP_K} a token; input "
          f"{args.input_len} tokens, output {args.output_len}; prompts at C: max(2C, 4); {os.cpu_count()} CPUs\n")
    print(f"output tokens/s (higher is better), median of {args.rounds} interleaved round(s); ratio: to {BASELINE[:3]} "
          f"at the same C\n")
    print("| configuration | " + " | ".join(f"C={c} | ratio" for c in args.concurrency) + " |")
    print("|---|" + "--:|--:|" * len(args.concurrency))
    for name, row in rows.items():
        cells = " | ".join(f"{row[c]:.1f} | {row[c] / rows[BASELINE][c]:.2f}x" for c in args.concurrency)
        print(f"| {name} | {cells} |")
    print()
    for name, note in notes.items():
        print(f"{name[:3]} {note}")


if __name__ == "__main__":
    main()
