"""`stratamesh plan`: the planner on a model folder (or a config.json) and a fleet file, as a table or JSON."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from stratamesh.fleet.errors import InvalidInput
from stratamesh.partitioner.fleet import fleet_from_dict
from stratamesh.partitioner.plan import OBJECTIVES, Plan, PlanRequest
from stratamesh.partitioner.planner import plan_pipeline
from stratamesh.partitioner.profile import DTYPE_BYTES, profile_from_hf_config


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    d = PlanRequest()
    parser.add_argument("--model", required=True, help="a Hugging Face folder, or its config.json")
    parser.add_argument("--fleet", required=True, help="fleet JSON: {devices: [...], links: [...], origin_site}; "
                        "a device may name the dtype it computes in (dtype)")
    parser.add_argument("--objective", choices=OBJECTIVES, default=d.objective)
    parser.add_argument("--dtype", choices=sorted(DTYPE_BYTES),
                        help="what devices whose entry names no dtype compute in; default: the config's")
    parser.add_argument("--context-len", type=int, default=d.context_len, help="KV reserved per sequence")
    parser.add_argument("--concurrency", type=int, default=d.concurrency, help="sequences per step")
    parser.add_argument("--first-site", help="pin the first stage to this site")
    parser.add_argument("--last-site", help="pin the last stage to this site")
    parser.add_argument("--exclude", nargs="*", default=[], metavar="DEVICE", help="device ids never to use")
    parser.add_argument("--max-stages", type=int)
    parser.add_argument("--replicas", type=int, default=d.max_replicas, help="pipelines at most")
    parser.add_argument("--no-tensor-parallel", action="store_true")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")


def run_plan(args: argparse.Namespace) -> str:
    """The plan for the flags, rendered; InvalidInput / CheckpointError / PlacementError say what is wrong."""
    path = Path(args.model)
    config_path = path / "config.json" if path.is_dir() else path
    name = path.name if path.is_dir() or path.name != "config.json" else path.parent.name
    profile = profile_from_hf_config(_read_json(config_path), args.dtype, name=name)
    fleet = fleet_from_dict(_read_json(Path(args.fleet)))
    request = PlanRequest(
        objective=args.objective, context_len=args.context_len, concurrency=args.concurrency,
        first_site=args.first_site, last_site=args.last_site, exclude=frozenset(args.exclude),
        max_stages=args.max_stages, max_replicas=args.replicas, tensor_parallel=not args.no_tensor_parallel)
    plan = plan_pipeline(profile, fleet, request)
    return plan.to_json() if args.json else render(plan)


def render(plan: Plan) -> str:
    """The plan as a markdown table per replica, then its reason."""
    lines = [f"model {plan.model}, objective {plan.objective}, search {plan.search}, "
             f"{plan.tokens_per_s:,.0f} tokens/s predicted", ""]
    for r, pipeline in enumerate(plan.pipelines):
        lines += [f"replica {r}: bottleneck {pipeline.bottleneck_s * 1e3:.3f} ms ({pipeline.bottleneck}), "
                  f"step {pipeline.step_s * 1e3:.3f} ms", "",
                  "| stage | devices | layers | backend | compute ms | send ms | memory GB | headroom GB |",
                  "|---|---|---|---|---|---|---|---|"]
        for k, s in enumerate(pipeline.stages):
            lines.append(f"| {k} | {'+'.join(s.devices)} | [{s.start_layer}, {s.end_layer}) | {s.backend} "
                         f"{s.dtype} | {s.compute_s * 1e3:.3f} | {s.send_s * 1e3:.3f} | "
                         f"{s.memory_bytes / 1e9:.2f} | {s.headroom_bytes / 1e9:.2f} |")
        lines.append("")
    lines.append(plan.reason)
    return "\n".join(lines)


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise InvalidInput(f"cannot read {path}: {exc}") from None
