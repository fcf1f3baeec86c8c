"""The single-process reference: Hugging Face transformers on the same checkpoint."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


@lru_cache(maxsize=4)
def _load(model_dir: str):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(model_dir)


def greedy_tokens(model_dir: Path, prompt_ids: list[int], num_tokens: int) -> list[int]:
    """transformers' greedy generate of exactly num_tokens new tokens (EOS does not stop it)."""
    model, _ = _load(str(model_dir))
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=num_tokens, do_sample=False,
                             eos_token_id=None, pad_token_id=0,
                             attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long))
    return out[0, len(prompt_ids):].tolist()


def encode(model_dir: Path, text: str) -> list[int]:
    return _load(str(model_dir))[1](text)["input_ids"]


def greedy_processed_tokens(model_dir: Path, prompt_ids: list[int], num_tokens: int, params) -> list[int]:
    """The greedy tokens of transformers' logits, each step's processed by params' formulas written out
    (tests/sampling_reference.py): what a mesh must pick with those sampling parameters at temperature 0."""
    from tests.sampling_reference import reference_processed

    model, _ = _load(str(model_dir))
    out: list[int] = []
    with torch.inference_mode():
        for _ in range(num_tokens):
            logits = model(torch.tensor([prompt_ids + out])).logits[0, -1].float()
            out.append(int(reference_processed(logits, params, prompt_ids, out).argmax()))
    return out


def log_softmax_of(model_dir: Path, token_ids: list[int]) -> torch.Tensor:
    """transformers' log-probabilities [len(token_ids), vocab]: row i is the distribution of token i + 1."""
    model, _ = _load(str(model_dir))
    with torch.inference_mode():
        return torch.log_softmax(model(torch.tensor([token_ids])).logits[0].float(), dim=-1)
