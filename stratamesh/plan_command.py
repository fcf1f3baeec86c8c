"""`stratamesh plan`: the planner on a model folder (or a config.json) and a fleet file, as a table or JSON."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

from stratamesh.fleet.errors import InvalidInput, MeshError
from stratamesh.partitioner.fleet_snapshot import DEFAULT_LINKS, ORIGIN, SCHEMA_PATH, FleetSnapshot
from stratamesh.partitioner.plan import OBJECTIVES, Plan, PlanRequest
from stratamesh.partitioner.profile import DTYPE_BYTES, profile_from_hf_config

# The fleet file's pydantic models and the planner (numpy) are imported where a plan is made: every `stratamesh`
# process builds this command's parser, and most never plan (an agent's start, a CLI call).

log = logging.getLogger(__name__)

FLEET_EXAMPLE = """\
  {"origin_site": "home",
   "devices": [
     {"id": "gpu0", "memory_bytes": 22e9, "site": "home",
      "speeds": [{"backend": "torch-cuda", "dtype": "bfloat16",
                  "flops": 1.5e14, "mem_bandwidth": 8e11}]},
     {"id": "nuc", "memory_bytes": 12e9, "site": "office", "step_overhead_s": 0.002,
      "speeds": [{"backend": "torch-cpu", "dtype": "bfloat16",
                  "flops": 8e11, "mem_bandwidth": 5e10}]}],
   "links": [{"a": "gpu0", "b": "nuc", "bandwidth": 1.1e7, "rtt_s": 0.025}]}"""


def _fleet_help() -> str:
    """The fleet file in brief, for `stratamesh plan --help`."""
    paragraphs = [
        f"The fleet file (--fleet) is JSON; `stratamesh plan --fleet-schema` prints its JSON Schema ({SCHEMA_PATH} "
        "in the repository). Units: bytes, FLOP/s, bytes/s, seconds.",
        "devices[]: id, memory_bytes (bytes usable), speeds[] (backend, dtype, flops in FLOP/s, mem_bandwidth in "
        'bytes/s); optional: tier (edge|cloud, default edge), site (default ""), node (default "": a node of its '
        "own), step_overhead_s, layer_overhead_s and token_overhead_s (seconds, default 0), dtype (default: --dtype, else the "
        "config's). A device with no speed for the dtype it computes in is left out, with a warning.",
        f'links[] (optional): a, b (device ids, or "{ORIGIN}" for where requests enter), bandwidth (bytes/s), '
        f"rtt_s (seconds), the same both ways. A pair not listed gets the default: {DEFAULT_LINKS}.",
        f'origin_site (optional): the site where requests enter; a link from "{ORIGIN}" not listed is the one-site '
        'default to a device there and the different-sites one elsewhere; default "": the one-site default to '
        "every device.",
    ]
    wrapped = [textwrap.fill(p, width=78) for p in paragraphs]
    return "\n\n".join([*wrapped[:1], "For example:\n" + FLEET_EXAMPLE, *wrapped[1:]])


class _PrintFleetSchema(argparse.Action):
    """--fleet-schema: prints the fleet file's JSON Schema and exits 0 (as --help, so no --model or --fleet)."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *_: Any) -> None:
        from stratamesh.partitioner.fleet_file import fleet_schema_text

        print(fleet_schema_text(), end="")
        parser.exit()


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    d = PlanRequest()
    parser.formatter_class = argparse.RawDescriptionHelpFormatter    # the fleet file's example keeps its lines
    parser.epilog = _fleet_help()
    parser.add_argument("--model", required=True, help="a Hugging Face folder, or its config.json")
    parser.add_argument("--fleet", required=True, metavar="FILE",
                        help="the fleet as JSON: devices, links, origin_site (see below)")
    parser.add_argument("--fleet-schema", action=_PrintFleetSchema, help="print the fleet file's JSON Schema")
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


def plan_main(args: argparse.Namespace) -> int:
    """`stratamesh plan`: the plan on stdout, each warning and an error as one plain line on stderr; exit status."""
    try:
        print(run_plan(args, warn=lambda line: _say(f"warning: {line}")))
    except MeshError as exc:
        _say(str(exc))
        return 1
    return 0


def _say(line: str) -> None:
    print("stratamesh plan: " + " ".join(line.splitlines()), file=sys.stderr)


def run_plan(args: argparse.Namespace, warn: Callable[[str], None] = log.warning) -> str:
    """The plan for the flags, rendered; InvalidInput / CheckpointError / PlacementError say what is wrong, and
    warn hears of each device the plan must leave out."""
    path = Path(args.model)
    config_path = path / "config.json" if path.is_dir() else path
    name = path.name if path.is_dir() or path.name != "config.json" else path.parent.name
    profile = profile_from_hf_config(_read_json(config_path), args.dtype, name=name)
    fleet = _read_fleet(Path(args.fleet))
    request = PlanRequest(
        objective=args.objective, context_len=args.context_len, concurrency=args.concurrency,
        first_site=args.first_site, last_site=args.last_site, exclude=frozenset(args.exclude),
        max_stages=args.max_stages, max_replicas=args.replicas, tensor_parallel=not args.no_tensor_parallel)
    for line in speed_warnings(fleet, profile.dtype, request.exclude):
        warn(line)
    from stratamesh.partitioner.planner import plan_pipeline

    plan = plan_pipeline(profile, fleet, request)
    return plan.to_json() if args.json else render(plan)


def speed_warnings(fleet: FleetSnapshot, model_dtype: str, exclude: frozenset[str] = frozenset()) -> list[str]:
    """A line for each device (not excluded) with no measured speed for the dtype it computes in: the plan leaves
    it out."""
    lines = []
    for device in fleet.devices:
        dtype = device.dtype or model_dtype
        if device.id not in exclude and device.speed(dtype) is None:
            measured = ", ".join(sorted({s.dtype for s in device.speeds})) or "none"
            lines.append(f"device {device.id!r} has no measured speed for {dtype} (it has: {measured}); "
                         f"the plan leaves it out")
    return lines


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


def _read_fleet(path: Path) -> FleetSnapshot:
    """The fleet file at path; InvalidInput names the file and the bad field's path."""
    from stratamesh.partitioner.fleet_file import fleet_from_dict

    raw = _read_json(path)
    try:
        return fleet_from_dict(raw)
    except InvalidInput as exc:
        raise InvalidInput(f"{path}: {exc}") from None


def _read_json(path: Path) -> Any:
    try:
        text = path.read_text()
    except (OSError, ValueError) as exc:       # ValueError: not UTF-8
        raise InvalidInput(f"{path}: cannot read it: {getattr(exc, 'strerror', None) or exc}") from None
    try:
        return json.loads(text)
    except ValueError as exc:
        raise InvalidInput(f"{path}: not JSON: {exc}") from None
