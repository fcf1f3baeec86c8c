"""Benchmark prompts as token ids: random, or a shared prefix plus a random suffix; seeded."""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

from stratamesh.bench.metrics import BenchError

DATASETS = ("random", "shared-prefix")


@dataclass(frozen=True, slots=True)
class BenchRequest:
    """One prompt to send and how many tokens to ask for."""

    prompt_ids: tuple[int, ...]
    output_len: int

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)


def regular_token_ids(tokenizer_dir: str | Path) -> list[int]:
    """Ids of the tokenizer's regular vocabulary: every id of tokenizer.json but its special tokens."""
    from tokenizers import Tokenizer

    path = Path(tokenizer_dir, "tokenizer.json")
    if not path.is_file():
        raise BenchError(f"{path} does not exist; --tokenizer wants a Hugging Face folder")
    tokenizer = Tokenizer.from_file(str(path))
    special = {tid for tid, token in tokenizer.get_added_tokens_decoder().items() if token.special}
    special |= _config_special_ids(Path(tokenizer_dir))
    return [tid for tid in range(tokenizer.get_vocab_size(with_added_tokens=True)) if tid not in special]


def _config_special_ids(folder: Path) -> set[int]:
    """bos/eos/pad ids config.json names (some tokenizers do not mark them special)."""
    path = folder / "config.json"
    config = json.loads(path.read_text()) if path.is_file() else {}
    ids: set[int] = set()
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = config.get(key)
        ids.update(value if isinstance(value, list) else [value] if isinstance(value, int) else [])
    return ids


def random_requests(vocab_ids: list[int], num_prompts: int, input_len: int, output_len: int,
                    seed: int, range_ratio: float = 0.0) -> list[BenchRequest]:
    """num_prompts prompts of ids drawn uniformly from vocab_ids.

    As vLLM's random dataset: range_ratio 0 gives every prompt input_len ids and output_len tokens to
    generate; r in (0, 1) draws each length uniformly from [len * (1 - r), len * (1 + r)] instead."""
    _check_lengths(vocab_ids, input_len, output_len)
    if not 0 <= range_ratio < 1:
        raise BenchError(f"range ratio {range_ratio} must be in [0, 1)")
    rng = random.Random(seed)

    def length(mean: int) -> int:
        return max(1, rng.randint(math.floor(mean * (1 - range_ratio)), math.ceil(mean * (1 + range_ratio))))

    return [BenchRequest(tuple(rng.choices(vocab_ids, k=length(input_len))), length(output_len))
            for _ in range(num_prompts)]


def shared_prefix_requests(vocab_ids: list[int], num_prompts: int, prefix_len: int, input_len: int,
                           output_len: int, seed: int, num_prefixes: int = 1) -> list[BenchRequest]:
    """Each prompt is one of num_prefixes random prefixes of prefix_len ids followed by its own random input_len
    ids (as SGLang's generated-shared-prefix: a system prompt per group): the prompts are spread evenly over the
    prefixes, in a seeded random order when there are several."""
    _check_lengths(vocab_ids, input_len, output_len)
    if not 1 <= num_prefixes <= num_prompts:
        raise BenchError(f"num-prefixes {num_prefixes} must be in 1..num-prompts ({num_prompts})")
    rng = random.Random(seed)
    prefixes = [tuple(rng.choices(vocab_ids, k=prefix_len)) for _ in range(num_prefixes)]
    groups = [i % num_prefixes for i in range(num_prompts)]
    if num_prefixes > 1:
        rng.shuffle(groups)
    return [BenchRequest(prefixes[group] + tuple(rng.choices(vocab_ids, k=input_len)), output_len)
            for group in groups]


def make_requests(dataset: str, vocab_ids: list[int], num_prompts: int, input_len: int, output_len: int,
                  seed: int, prefix_len: int = 0, range_ratio: float = 0.0,
                  num_prefixes: int = 1) -> list[BenchRequest]:
    """The prompts of a named dataset (one of DATASETS); range_ratio applies to random, num_prefixes to
    shared-prefix."""
    if dataset == "random":
        return random_requests(vocab_ids, num_prompts, input_len, output_len, seed, range_ratio)
    if dataset == "shared-prefix":
        return shared_prefix_requests(vocab_ids, num_prompts, prefix_len, input_len, output_len, seed, num_prefixes)
    raise BenchError(f"dataset {dataset!r} is not one of {DATASETS}")


def _check_lengths(vocab_ids: list[int], input_len: int, output_len: int) -> None:
    if not vocab_ids:
        raise BenchError("no token ids to sample prompts from")
    if input_len < 1 or output_len < 1:
        raise BenchError(f"input-len {input_len} and output-len {output_len} must be at least 1")
