"""The demo model: the book's split, the shipped model's size and stated figure, and that it speaks the book's
words (where a random-weight model does not)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer

from stratamesh.kernels.demo_model import (DEMO_DIR, DEMO_SHAPE, DRAFT_DIR, DRAFT_SHAPE, TrainSettings,
                                           greedy_agreement, read_book, served_perplexity, train_demo, train_draft,
                                           words_of)
from stratamesh.kernels.models.config import read_config
from stratamesh.kernels.tiny_model import train_tokenizer
from tests.readme import readme_completion, readme_perplexity

MAX_MODEL_BYTES = 10 * 2**20


def test_the_held_out_chapter_is_the_last_and_is_not_trained_on() -> None:
    book = read_book()
    assert book.held_out.startswith("CHAPTER XI.") and "CHAPTER XI." not in book.train
    assert book.train.startswith("BOTCHAN") and "CHAPTER X." in book.train
    middle = book.held_out[len(book.held_out) // 2:][:80]
    assert middle not in book.train
    assert "\n" not in book.held_out.strip(), "the hard line breaks are joined into running text"


def test_words_are_lower_case_letters_with_inner_apostrophes() -> None:
    assert words_of('"Don\'t go," Red Shirt said -- 3 times.') == ["don't", "go", "red", "shirt", "said", "times"]


def test_the_shipped_model_is_small_and_shaped_as_declared() -> None:
    sizes = {p.name: p.stat().st_size for p in DEMO_DIR.iterdir()}
    assert set(sizes) == {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                          "tokenizer_config.json"}
    assert sum(sizes.values()) < MAX_MODEL_BYTES
    c = read_config(DEMO_DIR)
    assert (c.num_layers, c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads, c.vocab_size) == tuple(
        DEMO_SHAPE[k] for k in ("num_layers", "hidden_size", "intermediate_size", "num_heads", "num_kv_heads",
                                "vocab_size"))
    assert c.torch_dtype == "float16"


def test_the_shipped_tokenizer_is_the_one_training_makes() -> None:
    shipped = Tokenizer.from_file(str(DEMO_DIR / "tokenizer.json"))
    assert train_tokenizer(DEMO_SHAPE["vocab_size"], [read_book().train]).to_str() == shipped.to_str()


def test_the_readme_states_the_shipped_models_held_out_perplexity() -> None:
    assert served_perplexity(DEMO_DIR, read_book().held_out) == pytest.approx(readme_perplexity(), abs=0.01)


def greedy_words(model_dir: Path, prompt: str, max_tokens: int) -> list[str]:
    """The words of transformers' greedy continuation of prompt (the single-process reference)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False)
    return words_of(tokenizer.decode(out[0, ids.shape[1]:]))


def test_its_greedy_answer_to_the_readme_call_is_words_of_the_book() -> None:
    call = readme_completion()
    words = greedy_words(DEMO_DIR, call["prompt"], call["max_tokens"])
    assert len(words) >= call["max_tokens"] // 3, words
    assert set(words) <= set(words_of(read_book().train)), words


def test_a_random_weight_model_does_not_pass_for_one(tiny_model) -> None:
    call = readme_completion()
    words = greedy_words(tiny_model(), call["prompt"], call["max_tokens"])
    assert not set(words) <= set(words_of(read_book().train)), words


def test_training_writes_a_model_the_stage_loader_serves(tmp_path: Path) -> None:
    lines: list[str] = []
    report = train_demo(tmp_path / "demo", TrainSettings(steps=30, batch=4, warmup_steps=5), log=lines.append)
    assert report.out_dir == tmp_path / "demo" and report.steps == 30
    # untrained, it is a uniform guess over the vocabulary (perplexity 1024)
    assert report.held_out_perplexity < DEMO_SHAPE["vocab_size"] / 2, "it learned something in 30 steps"
    assert report.held_out_perplexity == served_perplexity(report.out_dir, read_book().held_out)
    assert report.weights_bytes == (report.out_dir / "model.safetensors").stat().st_size < MAX_MODEL_BYTES
    assert any(line.startswith("step    29") for line in lines) and "held-out perplexity" in lines[-1]


def test_the_shipped_draft_is_the_demo_models_shape_with_fewer_layers_and_its_tokenizer() -> None:
    sizes = {p.name: p.stat().st_size for p in DRAFT_DIR.iterdir()}
    assert sum(sizes.values()) < MAX_MODEL_BYTES / 2
    c = read_config(DRAFT_DIR)
    assert (c.num_layers, c.hidden_size, c.vocab_size) == (DRAFT_SHAPE["num_layers"], DEMO_SHAPE["hidden_size"],
                                                          DEMO_SHAPE["vocab_size"])
    assert c.num_layers < DEMO_SHAPE["num_layers"]
    assert (DRAFT_DIR / "tokenizer.json").read_bytes() == (DEMO_DIR / "tokenizer.json").read_bytes()


def test_a_draft_learns_to_predict_its_target(tmp_path: Path) -> None:
    """30 steps of distillation: its greedy picks agree with the demo model's on the held-out chapter far more often
    than chance (1 in 1024), and its held-out perplexity as the stage loader serves it is far below chance."""
    report = train_draft(tmp_path / "draft", DEMO_DIR, TrainSettings(steps=30, batch=4, warmup_steps=5))
    assert greedy_agreement(report.out_dir, DEMO_DIR, read_book().held_out, max_tokens=512) > 0.1
    assert report.held_out_perplexity < DEMO_SHAPE["vocab_size"] / 2
