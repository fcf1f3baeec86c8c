"""Two pipeline stages on two hosts of the WAN test bed, per link profile: what the link between them costs.

    sudo .venv/bin/python benchmarks/wan_links.py [--profiles lan,wan-20mbit-80ms] [--codecs auto,float32]
                                                  [--reach direct,nat] [--nat-profiles P,...] [--num-prompts 32]
                                                  [--output-len 32] [--quick]

For every link profile (stratamesh/testbed/netbed.py: LAN; 100 Mbit/s + 20 ms; 20 Mbit/s + 80 ms; 1% loss) and wire codec,
a fresh test bed: the coordinator (and origin) and agent 0 on LAN cables, agent 1 behind a cable of the
profile, so the two stages of the model talk across it (the decode loop, stage 1 -> stage 0, crosses it every
token). One random-weight Llama (8 layers, hidden 512) split in 2 stages, 1 thread per agent. With --reach nat,
agent 1 sits instead on a site behind NAT whose uplink has the profile: nobody can dial it, and whatever must
reach it (the other stage, or the origin) does so over a WebRTC data channel; the table then also holds each
profile's WebRTC throughput against the direct gRPC one (--nat-profiles: of these profiles only; default all).

Printed per profile and codec: output tokens/s at concurrency 1 and 16, TTFT p50 at concurrency 16, activation
bytes per token between the stages (what the agents' /metrics count), and the codec the link used; then each
profile's concurrency-16 throughput against the LAN's, with issue 24's target (at 80 ms RTT, at least 0.7x); and
what float16, bfloat16 and int8 on the link do to the output (greedy agreement over 64 tokens, max logit error).
Every profile runs in this one invocation, on this machine.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import secrets
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import torch

from kv_routing import FULL, serve
from stratamesh.bench.datasets import random_requests, regular_token_ids
from stratamesh.bench.metrics import BenchMetrics
from stratamesh.launcher import LocalMesh
from stratamesh.testbed.netbed import (PROFILES, Netbed, NetbedUnavailable, check_can_build, nat_tool,
                                     stop_on_sigterm)
from stratamesh.fleet.stages import StageSpec
from stratamesh.kernels import codec
from stratamesh.kernels.models.decoder import load_stage, one_sequence
from stratamesh.kernels.tiny_model import write_tiny_model

log = logging.getLogger("wan_links")
# small: a step of a stage takes ~15 ms here, so an 80 ms link dwarfs it; edge: ~1.8 GB of float32 weights, a stage's
# step takes ~100 ms on one core, as a model worth splitting across edge boxes does
MODELS = {
    "small": FULL,        # kv_routing's 8 layers, hidden 512
    "edge": {"num_layers": 16, "hidden_size": 1536, "intermediate_size": 4096, "num_heads": 12, "num_kv_heads": 4},
}
TARGET_PROFILE, TARGET_RATIO = "wan-20mbit-80ms", 0.7
SKIP = 77
EFFECT_TOKENS = 64


@dataclass(frozen=True, slots=True)
class Row:
    """One profile and codec's figures."""

    profile: str
    codec: str
    reach: str              # "direct": agent 1 can be dialed; "nat": it sits behind NAT
    c1: BenchMetrics
    c16: BenchMetrics
    bytes_per_token: float
    link_codecs: str        # what the links between the stages carried, as the agents' /metrics count it
    transports: str         # what carried the agents' messages to each other, as their /metrics count it


def activation_bytes(mesh: LocalMesh) -> dict[str, float]:
    """Bytes of activations the agents have sent to one another, by codec, from their /metrics."""
    return mesh.agent_sums("stratamesh:link_activation_bytes_total", "codec")


def wait_for_link(mesh: LocalMesh, a: str, b: str, timeout_s: float = 120.0) -> None:
    """Waits until the coordinator holds a measurement of the link between agents a and b (either way): until then
    a route's link runs in what the planner chose without it (raw), and the runs would time that."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        links = httpx.get(f"{mesh.url}/admin/api/links", headers=mesh.headers, timeout=10).json()["links"]
        if any({link["agent_id"], link["peer_id"]} == {a, b} and link["bandwidth_bytes_per_s"] > 0 and not link["error"]
               for link in links):
            return
        time.sleep(0.2)
    raise TimeoutError(f"the link between {a} and {b} was not measured in {timeout_s:.0f} s")


def send_all(mesh: LocalMesh, model: str, vocab: list[int], num_prompts: int, output_len: int, concurrency: int,
             seed: int) -> BenchMetrics:
    """All of num_prompts random 16-token prompts sent at once, at most concurrency in flight; none may fail."""
    metrics = serve(mesh, model, random_requests(vocab, num_prompts, 16, output_len, seed), concurrency)
    if metrics.failed:
        raise SystemExit(f"{metrics.failed} requests failed: {metrics.errors[:3]}")
    return metrics


def run_profile(model_dir: Path, profile: str, codec: str, reach: str, args: argparse.Namespace) -> Row:
    """A fresh test bed and mesh for one profile, codec and reach, its runs, and its teardown."""
    vocab = regular_token_ids(model_dir)
    with Netbed(f"sm-{secrets.token_hex(3)}") as bed:
        bed.attach_here()
        coordinator, near = bed.add_host("coord"), bed.add_host("near")
        if reach == "nat":
            bed.add_site("edge", PROFILES[profile])
            far = bed.add_site_host("edge", "far")
        else:
            far = bed.add_host("far", PROFILES[profile])
        mesh = LocalMesh(str(model_dir), num_agents=2, threads_per_agent=1, coordinator_host=coordinator,
                         agent_hosts={0: near, 1: far}, coordinator_args=["--wire-codec", codec],
                         log_dir=args.log_dir or None)
        with mesh:
            wait_for_link(mesh, mesh.agent_ids[0], mesh.agent_ids[1])
            send_all(mesh, model_dir.name, vocab, 4, 4, 4, seed=99)   # warm-up: connections, first steps
            c1 = send_all(mesh, model_dir.name, vocab, args.num_prompts // 4, args.output_len, 1, args.seed)
            before = activation_bytes(mesh)
            c16 = send_all(mesh, model_dir.name, vocab, args.num_prompts, args.output_len, 16, args.seed + 1)
            sent = {k: v - before.get(k, 0.0) for k, v in activation_bytes(mesh).items()}
            transports = mesh.agent_sums("stratamesh:transport_messages_total", "transport", direction="sent")
    tokens = c16.total_input_tokens + c16.total_output_tokens
    return Row(profile, codec, reach, c1, c16, sum(sent.values()) / tokens, ",".join(k for k, v in sent.items() if v),
               ",".join(sorted(k for k, v in transports.items() if v)))


def codec_effect(model_dir: Path, wire_codec: str, vocab: list[int], num_tokens: int = 64,
                 seed: int = 0) -> tuple[int, float]:
    """What coding the activations between the model's two stages with wire_codec does to its output, against
    float32 throughout, in this process: (how many of num_tokens greedy tokens agree before the first that differs,
    the largest logit error on the float32 run's tokens)."""
    config = json.loads((model_dir / "config.json").read_text())
    num_layers = config["num_hidden_layers"]
    stages = [load_stage(StageSpec("m", str(model_dir), a, b, num_layers))
              for a, b in ((0, num_layers // 2), (num_layers // 2, num_layers))]
    prompt = random.Random(seed).choices(vocab, k=16)

    def run(coded: str, forced: list[int] | None) -> tuple[list[int], torch.Tensor]:
        """Greedy tokens (or, given forced, those tokens fed in) and the logits at every step."""
        first, last = (one_sequence(stage, len(prompt) + num_tokens) for stage in stages)
        inputs, position, tokens, logits = torch.tensor(prompt), 0, [], []
        with torch.inference_mode():
            for i in range(num_tokens):
                hidden = first(inputs, position)
                blob = codec.encode(hidden.to(codec.TORCH_DTYPES[coded if coded in codec.TORCH_DTYPES else "float32"]),
                                    "int8" if coded == "int8" else "raw")
                step_logits = stages[1].logits(last(codec.decode(blob).float(), position)[-1:])[0]
                logits.append(step_logits)
                tokens.append(forced[i] if forced is not None else int(step_logits.argmax()))
                position += len(inputs)
                inputs = torch.tensor(tokens[-1:])
        return tokens, torch.stack(logits)

    reference, reference_logits = run("float32", None)
    greedy, _ = run(wire_codec, None)
    _, forced_logits = run(wire_codec, reference)
    agree = next((i for i, (a, b) in enumerate(zip(greedy, reference)) if a != b), num_tokens)
    return agree, float((forced_logits - reference_logits).abs().max())


def report(rows: list[Row], args: argparse.Namespace) -> None:
    shape = MODELS[args.model]
    print(f"2 stages of a random-weight Llama ({args.model}: {shape['num_layers']} layers, hidden "
          f"{shape['hidden_size']}), 1 thread per agent; "
          f"{args.num_prompts} prompts of 16 tokens, {args.output_len} output tokens each\n")
    print(f"| {'link profile':<18} | {'reach':<6} | {'transports':<11} | {'--wire-codec':<12} | {'link used':<9} | "
          f"{'tok/s c1':>8} | {'tok/s c16':>9} | {'TTFT p50 ms c16':>15} | {'bytes/token':>11} |")
    print(f"|{'-' * 20}|{'-' * 8}|{'-' * 13}|{'-' * 14}|{'-' * 11}|{'-' * 10}|{'-' * 11}|{'-' * 17}|{'-' * 13}|")
    for row in rows:
        print(f"| {row.profile:<18} | {row.reach:<6} | {row.transports:<11} | {row.codec:<12} | {row.link_codecs:<9} | "
              f"{row.c1.output_throughput:8.1f} | {row.c16.output_throughput:9.1f} | {row.c16.ttft.median_ms:15.1f} | "
              f"{row.bytes_per_token:11.0f} |")
    # like with like: per codec and reach against the LAN, per profile and codec WebRTC against direct gRPC
    lan = {(r.codec, r.reach): r.c16.output_throughput for r in rows if r.profile == "lan"}
    direct = {(r.profile, r.codec): r.c16.output_throughput for r in rows if r.reach == "direct"}
    print()
    for row in rows:
        if row.profile != "lan" and (row.codec, row.reach) in lan:
            ratio = row.c16.output_throughput / lan[row.codec, row.reach]
            target = ""
            if row.profile == TARGET_PROFILE:
                target = f" (issue 24: at least {TARGET_RATIO}x: {'PASS' if ratio >= TARGET_RATIO else 'FAIL'})"
            print(f"{row.profile} / lan, codec {row.codec}, {row.reach}, concurrency 16: {ratio:.2f}x{target}")
    for row in rows:
        if row.reach == "nat" and (row.profile, row.codec) in direct:
            ratio = row.c16.output_throughput / direct[row.profile, row.codec]
            print(f"{row.profile}, codec {row.codec}, concurrency 16: WebRTC (behind NAT) / direct gRPC: {ratio:.2f}x")


def report_codecs(effects: dict[str, tuple[int, float]], num_tokens: int) -> None:
    print(f"\nwhat a codec on the link does to the output, against float32 throughout ({num_tokens} greedy tokens, "
          f"in one process):\n")
    print(f"| {'codec':<8} | {'greedy tokens agreeing':>22} | {'max logit error':>15} |")
    print(f"|{'-' * 10}|{'-' * 24}|{'-' * 17}|")
    for name, (agree, error) in effects.items():
        print(f"| {name:<8} | {f'{agree} of {num_tokens}':>22} | {error:15.4f} |")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profiles", default=",".join(PROFILES), help="comma-separated, from stratamesh/testbed/netbed.py")
    parser.add_argument("--codecs", default="auto", help="comma-separated wire codecs: auto, float32, float16, int8")
    parser.add_argument("--reach", default="direct",
                        help="comma-separated: direct (agent 1 can be dialed), nat (it sits behind NAT: WebRTC)")
    parser.add_argument("--nat-profiles", default="",
                        help="comma-separated: the profiles --reach nat runs for (default: every one of --profiles)")
    parser.add_argument("--num-prompts", type=int, default=32, help="at concurrency 16 (a quarter at 1)")
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-dir", default="", help="keep the daemons' logs here (one run at a time)")
    parser.add_argument("--model", choices=list(MODELS), default="small")
    parser.add_argument("--quick", action="store_true", help="few prompts and tokens (a smoke run)")
    args = parser.parse_args()
    if stray := set(args.nat_profiles.split(",")) - set(args.profiles.split(",")) - {""}:
        parser.error(f"--nat-profiles {','.join(sorted(stray))}: not among --profiles")
    return args


def main() -> None:
    args = parse_args()
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        check_can_build(f"sm-{secrets.token_hex(3)}")
        if "nat" in args.reach.split(","):
            nat_tool()      # before the first run, not after the direct ones
    except NetbedUnavailable as exc:
        print(f"skipped: {exc}", file=sys.stderr)
        sys.exit(SKIP)
    stop_on_sigterm()     # a `kill` stops the meshes and deletes the test bed, as Ctrl-C does
    if args.quick:
        args.num_prompts, args.output_len = 16, 8
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_tiny_model(Path(tmp) / f"llama-{args.model}", arch="llama", vocab_size=1024,
                                     **MODELS[args.model])
        rows = []
        nat_profiles = (args.nat_profiles or args.profiles).split(",")
        for profile in args.profiles.split(","):
            for codec in args.codecs.split(","):
                for reach in args.reach.split(","):
                    if reach == "nat" and profile not in nat_profiles:
                        continue
                    started = time.monotonic()
                    rows.append(run_profile(model_dir, profile, codec, reach, args))
                    log.warning("%s, codec %s, %s: done in %.0f s", profile, codec, reach, time.monotonic() - started)
        report(rows, args)
        vocab = regular_token_ids(model_dir)
        report_codecs({c: codec_effect(model_dir, c, vocab, EFFECT_TOKENS, args.seed)
                       for c in ("float16", "bfloat16", "int8")}, EFFECT_TOKENS)


if __name__ == "__main__":
    main()
