"""bench.margins: greedy prompts whose every step leads its runner-up by the margin, checked with transformers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from stratamesh.bench import margins
from stratamesh.bench.chaos import make_jobs
from stratamesh.bench.datasets import regular_token_ids
from stratamesh.fleet.errors import InvalidInput


def transformers_margins(model, prompt_ids: tuple[int, ...], num_tokens: int) -> list[float]:
    """Each greedy step's lead of the best logit over the second best, by transformers over the whole sequence."""
    ids = list(prompt_ids)
    leads = []
    with torch.inference_mode():
        for _ in range(num_tokens):
            top = model(torch.tensor([ids])).logits[0, -1].float().topk(2)
            leads.append(float(top.values[0] - top.values[1]))
            ids.append(int(top.indices[0]))
    return leads


def test_decisive_redraws_exactly_the_greedy_prompts_with_a_close_step(tiny_model) -> None:
    model_dir: Path = tiny_model("llama")
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    jobs = make_jobs(12, regular_token_ids(model_dir), prompt_len=8, max_tokens=24, seed=4)
    close = [j for j in jobs if j.temperature == 0 and min(transformers_margins(reference, j.prompt_ids, 24)) < 1e-2]
    assert close, "no greedy job with a step closer than 1e-2: the test would show nothing"
    out = margins.decisive(jobs, model_dir, seed=1, min_margin=1e-2)
    for before, after in zip(jobs, out):
        if before.temperature != 0:
            assert after == before                                     # sampled jobs as they were
            continue
        assert (after.max_tokens, len(after.prompt_ids)) == (before.max_tokens, len(before.prompt_ids))
        # transformers agrees with the stage's float32 run to ~1e-6: a hundredth less is still a clear lead
        assert min(transformers_margins(reference, after.prompt_ids, 24)) > 0.99e-2
        assert (after == before) == (before not in close)              # only the close ones drawn again


def test_a_margin_no_prompt_has_is_a_clear_error(tiny_model, monkeypatch: pytest.MonkeyPatch) -> None:
    model_dir: Path = tiny_model("llama")
    monkeypatch.setattr(margins, "MAX_DRAWS", 3)
    jobs = make_jobs(2, regular_token_ids(model_dir), prompt_len=4, max_tokens=2, seed=0)
    with pytest.raises(InvalidInput, match="in 3 draws"):
        margins.decisive(jobs, model_dir, min_margin=1e9)
