"""Structured output's cost: output tokens/s of JSON-schema completions against the same completions unconstrained,
at concurrency 1 and 32, on one local mesh; and the grammar's share of a step, in this process on the stage engine.

    python benchmarks/structured.py [--rounds 5] [--model small|medium] [--quick]

One random-weight Llama (--model small, `stratamesh model tiny`'s: 6 layers, hidden 256, vocab 1024, a decode step
of a few ms here, where the grammar weighs most; or medium: 12 layers of 768, ~100M parameters), served by a
1-agent mesh. The same token-id prompts, sampled (temperature 1, a seed each), as
  (a) constrained: response_format json_schema (SCHEMA: an enum, bounded integers, a nested object, an array of
      24 to 32 items: about 100 tokens), each ending where its grammar ends;
  (b) unconstrained: ignore_eos, max_tokens the number of tokens (a) gave that request: the same work, unmasked.
C requests at a time (all at once at C=32, one after another at C=1); after a warm-up pass of both, every round
runs both (which goes first alternates). Each cell is the median over the rounds, the ratio the median of the
rounds' ratios (a round's two runs meet the same load of this shared box). Target: (a)/(b) >= 0.90 (at most 10%
slower).

The grammar's share is measured in this process, not read from the agents: a whole-model StageEngine runs 1 and 32
constrained sessions to their grammars' ends, and Grammars.times says how long the masks took on their thread
(beside the forward pass) and how long the picks waited for them (on the step's critical path)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import random
import statistics
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import llguidance
import torch

from stratamesh.agent.engine.stage_engine import EngineConfig, Outbox, StageEngine
from stratamesh.agent.engine.stage_runner import StageRunner
from stratamesh.bench.chaos import StreamJob, run_streams
from stratamesh.bench.datasets import regular_token_ids
from stratamesh.coordinator.api.tool_parsers import COMPACT_JSON
from stratamesh.fleet.sessions import Hop, SamplingParams, SessionOpen, StepChunk
from stratamesh.fleet.stages import Assignment, StageSpec
from stratamesh.kernels.models.config import read_config
from stratamesh.kernels.models.decoder import load_stage
from stratamesh.kernels.tiny_model import write_tiny_model
from stratamesh.launcher import LocalMesh

SCHEMA = {"type": "object", "properties": {
    "tier": {"enum": ["edge", "cloud", "relay"]},
    "layers": {"type": "integer", "minimum": 1, "maximum": 96},
    "link": {"type": "object", "properties": {"rtt_ms": {"type": "integer", "minimum": 1, "maximum": 999},
                                              "lossy": {"type": "boolean"}},
             "required": ["rtt_ms", "lossy"], "additionalProperties": False},
    "stages": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 24,
               "maxItems": 32}},
    "required": ["tier", "layers", "link", "stages"], "additionalProperties": False}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "box", "schema": SCHEMA, "strict": True}}
MODELS = {"small": {},     # write_tiny_model's default: 6 layers of 256
          "medium": {"num_layers": 12, "hidden_size": 768, "intermediate_size": 2048, "num_heads": 12,
                     "num_kv_heads": 4}}
CONCURRENCY = (1, 32)
PROMPT_LEN = 32
MAX_TOKENS = 256        # (a)'s limit: its grammar ends it long before
TARGET = 0.90


@dataclass(frozen=True, slots=True)
class Share:
    """One in-process run of constrained sessions: its steps, and where the grammar's time went (seconds)."""

    num_steps: int
    step_s: float           # schedule + forward + pick + postprocess, all steps
    compute_s: float        # the masks, on the grammars' thread
    wait_s: float           # the picks waiting for them


def constrained_jobs(model_dir: Path, count: int, seed: int) -> list[StreamJob]:
    """count random prompts, sampled with a seed each, kept to SCHEMA."""
    vocab, rng = regular_token_ids(model_dir), random.Random(seed)
    return [StreamJob(tuple(rng.choice(vocab) for _ in range(PROMPT_LEN)), MAX_TOKENS, 1.0, seed * 1000 + i,
                      constraint={"response_format": RESPONSE_FORMAT}) for i in range(count)]


async def tok_s(mesh: LocalMesh, model: str, jobs: list[StreamJob], concurrency: int) -> tuple[float, list[int]]:
    """(output tokens/s, each job's token count) of the jobs run concurrency at a time; SystemExit on a failure."""
    started, outcomes = time.perf_counter(), []
    for i in range(0, len(jobs), concurrency):
        outcomes += await run_streams(mesh.url, model, jobs[i:i + concurrency], headers=mesh.headers)
    took = time.perf_counter() - started
    errors = [o.error for o in outcomes if o.error]
    if errors:
        raise SystemExit(f"{len(errors)} of {len(jobs)} requests failed; the first: {errors[0]}")
    counts = [len(o.tokens) for o in outcomes]
    return sum(counts) / took, counts


def mesh_rounds(model_dir: Path, sets: dict[int, list[StreamJob]], rounds: int) -> dict[str, dict[int, list[float]]]:
    """Tokens/s per variant, concurrency and round, after a warm-up pass of each that also counts (a)'s tokens,
    which (b) asks for; the rounds alternate which variant goes first."""
    samples: dict[str, dict[int, list[float]]] = {"a": {c: [] for c in sets}, "b": {c: [] for c in sets}}
    with LocalMesh(str(model_dir), num_agents=1) as mesh:
        model, jobs = model_dir.name, {"a": sets, "b": {}}
        for c, constrained in sets.items():
            counts = asyncio.run(tok_s(mesh, model, constrained, c))[1]
            jobs["b"][c] = [replace(j, max_tokens=n, constraint={}) for j, n in zip(constrained, counts, strict=True)]
            asyncio.run(tok_s(mesh, model, jobs["b"][c], c))
        for r in range(rounds):
            for c in sets:
                for key in ("a", "b") if r % 2 == 0 else ("b", "a"):
                    samples[key][c].append(asyncio.run(tok_s(mesh, model, jobs[key][c], c))[0])
            logging.warning("round %d of %d done", r + 1, rounds)     # progress on stderr
    return samples


def engine_share(model_dir: Path, num_sessions: int) -> Share:
    """num_sessions constrained sessions run to their grammars' ends on a whole-model stage engine in this process,
    its decode loop fed back to itself."""
    config = read_config(model_dir)
    spec = StageSpec("m", str(model_dir), 0, config.num_layers, config.num_layers)
    engine = StageEngine(Assignment("a", spec), StageRunner(load_stage(spec), 64 * num_sessions),
                         EngineConfig(enable_prefix_cache=False))
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, defaults=COMPACT_JSON)
    for i, job in enumerate(constrained_jobs(model_dir, num_sessions, seed=7)):
        params = SamplingParams(temperature=1.0, seed=i, grammar=grammar)
        engine.open(SessionOpen(f"s{i}", "a", (), "o:1", params, prompt_token_ids=job.prompt_ids,
                                feed=Hop("self:1", "a"), max_new_tokens=MAX_TOKENS,
                                stop_token_ids=config.eos_token_ids), Outbox())
        engine.add(StepChunk(f"s{i}", 0, 0, job.prompt_ids, True), None)
    num_steps, step_s = 0, 0.0
    with torch.inference_mode():
        while (batch := engine.schedule()) is not None:
            started, outbox = time.perf_counter(), Outbox()
            engine.postprocess(batch, engine.run(batch), outbox)
            step_s += time.perf_counter() - started
            num_steps += 1
            for _, message in outbox.stage_messages:      # the decode loop's next tokens, back into this stage
                for chunk in message.chunks:
                    engine.add(chunk, None)
    if len(engine.sessions) != num_sessions or engine.scheduler.has_work:
        raise SystemExit("the in-process sessions did not all end at their grammars' ends")
    times = engine.grammars.times
    return Share(num_steps, step_s, times.compute_s, times.wait_s)


def print_throughput(samples: dict[str, dict[int, list[float]]], sets: dict[int, list[StreamJob]]) -> None:
    """The tokens/s table (medians over the rounds) and the ratio row (the median of each round's (a)/(b)) against
    the target."""
    rounds = len(samples["a"][next(iter(sets))])
    print(f"output tokens/s, 1-agent mesh, median of {rounds} round(s)\n")
    print(f"| {'':<44} |" + "".join(f" {f'C={c} ({len(sets[c])} req)':>14} |" for c in sets))
    print(f"|{'-' * 46}|" + f"{'-' * 16}|" * len(sets))
    for key, name in (("a", "(a) response_format json_schema"), ("b", "(b) unconstrained, same tokens (ignore_eos)")):
        print(f"| {name:<44} |" + "".join(f" {statistics.median(samples[key][c]):14.1f} |" for c in sets))
    ratios = {c: statistics.median(a / b for a, b in zip(samples["a"][c], samples["b"][c], strict=True)) for c in sets}
    print(f"| {'ratio (a)/(b), median of the rounds':<44} |" + "".join(f" {ratios[c]:13.3f}x |" for c in sets))
    verdict = "PASS" if min(ratios.values()) >= TARGET else "FAIL"
    print(f"\ntarget: (a)/(b) >= {TARGET} at every concurrency: {verdict}")


def print_share(shares: dict[int, Share]) -> None:
    """The grammar's share of a step, per batch size."""
    print("\nthe grammar's share of a step (this process, the stage engine: Grammars.times), ms per step\n")
    print(f"| {'constrained sessions':<20} | {'steps':>5} | {'step':>6} | {'masks (beside)':>14} | "
          f"{'pick waits':>10} | {'share: wait / step':>18} | {'masks / step':>12} |")
    print(f"|{'-' * 22}|{'-' * 7}|{'-' * 8}|{'-' * 16}|{'-' * 12}|{'-' * 20}|{'-' * 14}|")
    for n, s in shares.items():
        per = 1e3 / s.num_steps
        print(f"| {n:>20} | {s.num_steps:>5} | {s.step_s * per:6.2f} | {s.compute_s * per:14.3f} | "
              f"{s.wait_s * per:10.3f} | {s.wait_s / s.step_s:17.1%} | {s.compute_s / s.step_s:11.1%} |")
    print("\n(masks: the time computing them on the grammars' thread, beside the forward pass; pick waits: what the "
          "step waited for them; masks / step: the share they would take if computed before the forward)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5, help="rounds of (a) and (b); each cell is their median")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", choices=list(MODELS), default="small",
                        help="small: a step of a few ms, where the grammar weighs most; medium: ~100M parameters")
    parser.add_argument("--quick", action="store_true", help="a smaller model, one round, fewer requests")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    shape = {"num_layers": 2, "hidden_size": 64, "intermediate_size": 128} if args.quick else MODELS[args.model]
    model_dir = write_tiny_model(Path(tempfile.mkdtemp()) / "tiny-llama", **shape)
    rounds = 1 if args.quick else args.rounds
    sets = {c: constrained_jobs(model_dir, (2 if args.quick else 4) if c == 1 else c, args.seed + c)
            for c in CONCURRENCY}
    samples = mesh_rounds(model_dir, sets, rounds)
    shares = {n: engine_share(model_dir, n) for n in CONCURRENCY}
    print(f"model {model_dir.name} ({read_config(model_dir).num_layers} layers), prompts of {PROMPT_LEN} tokens, "
          f"{torch.get_num_threads()} torch threads here\n")
    print_throughput(samples, sets)
    print_share(shares)


if __name__ == "__main__":
    main()
