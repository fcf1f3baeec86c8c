"""Speculative decoding's drafts (agent/engine/proposers.py) and its configuration (fleet.sessions.Speculation):
prompt lookup against a plain search of every n-gram, and vLLM's speculative_config keys with their defaults."""

from __future__ import annotations

import random

import pytest

from stratamesh.agent.engine.proposers import ngram_draft
from stratamesh.fleet.errors import InvalidInput
from stratamesh.fleet.sessions import Speculation


def plain_lookup(tokens: list[int], min_n: int, max_n: int, num_tokens: int) -> tuple[int, ...]:
    """The definition, spelled out: longest n first, each n's first occurrence before the end."""
    end = len(tokens)
    for n in range(min(max_n, end - 1), min_n - 1, -1):
        for start in range(end - n):
            if tokens[start:start + n] == tokens[end - n:]:
                return tuple(tokens[start + n:start + n + num_tokens])
    return ()


def test_the_longest_ngram_ending_the_tokens_proposes_what_followed_its_first_occurrence() -> None:
    edit = [10, 11, 12, 13, 14, 15, 99, 10, 11, 12]     # the output repeats the prompt's 10 11 12 ...
    assert ngram_draft(edit, 1, 3, 4) == (13, 14, 15, 99)
    assert ngram_draft([7, 1, 2, 8, 2, 9, 1, 2], 1, 2, 3) == (8, 2, 9)     # "1 2" beats the later "2"
    assert ngram_draft([7, 1, 2, 8, 2, 9, 1, 2], 1, 1, 3) == (8, 2, 9)     # "2": its first occurrence
    assert ngram_draft([1, 2, 3], 1, 3, 4) == ()                           # nothing repeats
    assert ngram_draft([5, 6, 5, 6], 3, 3, 2) == ()                        # shorter than prompt_lookup_min
    assert ngram_draft([0, 0, 0, 0], 1, 2, 8) == (0, 0)                    # all it has after the occurrence


def test_ngram_draft_agrees_with_the_plain_search_on_random_tokens() -> None:
    rng = random.Random(0)
    for _ in range(2000):
        tokens = [rng.choice([0, 1, 2, 256, 65_536, 2**31 - 1]) for _ in range(rng.randint(1, 40))]
        low = rng.randint(1, 3)
        high, count = rng.randint(low, 5), rng.randint(1, 6)
        assert ngram_draft(tokens, low, high, count) == plain_lookup(tokens, low, high, count), tokens


@pytest.mark.parametrize("config, expected", [
    ({"method": "ngram", "num_speculative_tokens": 4}, Speculation("ngram", 4, 5, 5)),
    ({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}, Speculation("ngram", 4, 3, 3)),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 2, "prompt_lookup_max": 4},
     Speculation("ngram", 2, 2, 4)),
    ({"method": "draft_model", "model": "/models/draft", "num_speculative_tokens": 3},
     Speculation("draft_model", 3, model="/models/draft")),
])
def test_a_speculative_config_takes_vllms_keys_and_defaults(config: dict, expected: Speculation) -> None:
    assert Speculation.of(config) == expected
    assert Speculation.of(expected.config()) == expected       # (as the admin API shows it, and `up` passes it on)


@pytest.mark.parametrize("config, match", [
    ({"method": "eagle", "num_speculative_tokens": 4}, "is not one of"),
    ({"method": "draft_model", "num_speculative_tokens": 4}, "names its draft's folder"),
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 0}, r"\[1, 16\]"),
    ({"method": "ngram", "num_speculative_tokens": 99}, r"\[1, 16\]"),
    ({"method": "ngram", "num_speculative_tokens": "4"}, "integers"),
    ({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "min <= max"),
    ({"method": "ngram", "num_speculative_tokens": 4, "model": "x"}, "names its draft's folder"),
    ({"method": "draft_model", "num_speculative_tokens": 4, "model": 7}, "folder's path"),
    ({"method": "ngram", "num_speculative_tokens": 4, "draft_tensor_parallel_size": 1}, "not among"),
    (["ngram"], "JSON object"),
])
def test_a_bad_speculative_config_says_what_is_wrong(config, match: str) -> None:
    with pytest.raises(InvalidInput, match=match):
        Speculation.of(config)
