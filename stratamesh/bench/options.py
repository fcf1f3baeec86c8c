"""The flags of `stratamesh bench serve` and the options value they become; no I/O, cheap to import."""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass, field

from stratamesh.bench.datasets import DATASETS
from stratamesh.bench.metrics import BenchError, parse_goodput


RateSchedule = tuple[tuple[float, float], ...]


def parse_rate_schedule(text: str) -> RateSchedule:
    """"RATE:SECONDS,RATE:SECONDS,...": Poisson arrivals at each rate (requests/s, 0 for none) for that long."""
    schedule = []
    for part in text.split(","):
        rate, sep, seconds = part.partition(":")
        try:
            step = (float(rate), float(seconds))
        except ValueError:
            step = (-1.0, -1.0)
        if not sep or not (0 <= step[0] < math.inf and 0 < step[1] < math.inf):
            raise BenchError(f"--rate-schedule: {part!r} is not RATE:SECONDS (a rate >= 0, a time > 0)")
        schedule.append(step)
    return tuple(schedule)


@dataclass(frozen=True, slots=True)
class ServeOptions:
    """One `bench serve` run: where to send what, how fast, and the SLOs for goodput."""

    url: str = "http://127.0.0.1:8000"
    model: str = ""                        # "" -> the first model /v1/models lists
    tokenizer: str | None = None           # a Hugging Face folder to sample token ids from
    vocab_size: int | None = None          # without a tokenizer: sample ids from [0, vocab_size)
    dataset: str = "random"
    num_prompts: int = 100
    request_rate: float = math.inf         # requests per second, Poisson arrivals; inf: all at once
    rate_schedule: RateSchedule = ()       # (requests/s, seconds) in turn: a load that rises and falls; it sets
                                           # the number of requests and takes request_rate's place
    max_concurrency: int | None = None
    input_len: int = 128
    output_len: int = 64
    prefix_len: int = 256                  # shared-prefix only
    num_prefixes: int = 1                  # shared-prefix only: prompts spread over this many prefixes
    range_ratio: float = 0.0               # random only: lengths uniform in [len * (1 - r), len * (1 + r)]
    seed: int = 0
    goodput_ms: dict[str, float] = field(default_factory=dict)
    warmup: int = 0                        # requests sent (and not counted) before the run
    timeout_s: float = 600.0
    api_key: str = field(default="", repr=False)   # sent as "Authorization: Bearer KEY"; "" sends none

    def __post_init__(self) -> None:
        if self.num_prompts < 1:
            raise BenchError("--num-prompts must be at least 1")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise BenchError("--max-concurrency must be at least 1")
        if not self.request_rate > 0:
            raise BenchError("--request-rate must be positive (or inf)")
        if not 0 <= self.range_ratio < 1:
            raise BenchError("--random-range-ratio must be in [0, 1)")
        if self.tokenizer is None and not self.vocab_size:
            raise BenchError("give --tokenizer DIR or --vocab-size N to sample prompt token ids")


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the flags of `bench serve`, vLLM's names where vLLM has one."""
    d = ServeOptions(vocab_size=1)
    parser.add_argument("--url", default=d.url, help="the server's base URL")
    parser.add_argument("--api-key", help="the API key sent as a bearer token (default: $STRATAMESH_API_KEY)")
    parser.add_argument("--model", default=d.model, help="served model id; default: the first listed")
    parser.add_argument("--tokenizer", help="a Hugging Face folder: prompts use its regular token ids")
    parser.add_argument("--vocab-size", type=int, help="without --tokenizer: ids in [0, N)")
    parser.add_argument("--dataset", choices=DATASETS, default=d.dataset)
    parser.add_argument("--num-prompts", type=int, default=d.num_prompts)
    parser.add_argument("--request-rate", type=float, default=d.request_rate,
                        help="requests/s, Poisson arrivals (seeded); inf sends all at once")
    parser.add_argument("--rate-schedule", default="", metavar="RATE:SECONDS,...",
                        help="a load that rises and falls: Poisson arrivals at each rate for its seconds, in turn "
                             "(e.g. 1:30,6:60,0.5:30); it replaces --request-rate and --num-prompts")
    parser.add_argument("--max-concurrency", type=int, help="requests in flight at most")
    parser.add_argument("--input-len", type=int, default=d.input_len)
    parser.add_argument("--output-len", type=int, default=d.output_len)
    parser.add_argument("--prefix-len", type=int, default=d.prefix_len, help="shared-prefix: prefix tokens")
    parser.add_argument("--num-prefixes", type=int, default=d.num_prefixes,
                        help="shared-prefix: prompts spread evenly over this many prefixes")
    parser.add_argument("--random-range-ratio", type=float, default=d.range_ratio,
                        help="random: draw each input and output length from [len*(1-r), len*(1+r)]")
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--goodput", nargs="+", default=[], metavar="NAME:MS",
                        help="SLOs in ms, e.g. ttft:200 tpot:50 (ttft, tpot, e2el)")
    parser.add_argument("--warmup", type=int, default=d.warmup, help="uncounted requests sent first")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")


def options_from_args(args: argparse.Namespace) -> ServeOptions:
    """ServeOptions from parsed flags; BenchError names a bad one."""
    return ServeOptions(
        url=args.url.rstrip("/"),
        api_key=args.api_key if args.api_key is not None else os.environ.get("STRATAMESH_API_KEY", ""),
        model=args.model, tokenizer=args.tokenizer, vocab_size=args.vocab_size,
        dataset=args.dataset, num_prompts=args.num_prompts, request_rate=args.request_rate,
        rate_schedule=parse_rate_schedule(args.rate_schedule) if args.rate_schedule else (),
        max_concurrency=args.max_concurrency, input_len=args.input_len, output_len=args.output_len,
        prefix_len=args.prefix_len, num_prefixes=args.num_prefixes, range_ratio=args.random_range_ratio,
        seed=args.seed, goodput_ms=parse_goodput(args.goodput), warmup=args.warmup)
