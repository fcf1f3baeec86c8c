"""Structured output at the last stage (agent/engine/grammars.py) through the stage engine: a step's masks are
computed while its forward pass runs and applied at its pick, the picks are transformers' best tokens within the
grammar, and a grammar's end ends the generation: a session held past it is refused alone, and min_tokens cannot
push it past it."""

from __future__ import annotations

import json
import threading
from dataclasses import replace
from pathlib import Path

import jsonschema
import llguidance
import llguidance.numpy
import llguidance.torch
import pytest
import torch

from stratamesh.agent.engine.grammars import Grammars
from stratamesh.fleet.sessions import SamplingParams
from stratamesh.kernels.models.config import read_config
from stratamesh.kernels.tiny_model import ENDOFTEXT, IM_END, train_tokenizer
from tests.patience import patient

from .test_stage_engine import (NUM_LAYERS, VOCAB, Mesh, generation, hf_greedy, hf_model, make_engine, random_prompt,
                                start)

SCHEMA = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 3, "maximum": 9},
                                           "tags": {"type": "array", "items": {"enum": ["edge", "cloud"]},
                                                    "minItems": 1, "maxItems": 2}},
          "required": ["id", "tags"], "additionalProperties": False}
GRAMMAR = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, defaults={"whitespace_flexible": False})
MAX_TOKENS = 40
RENDEZVOUS_S = 20.0     # how long a step's mask and forward wait for each other (only a failing test waits it)


@pytest.fixture(scope="module")
def model_dir(tiny_model) -> Path:
    return tiny_model("llama", num_layers=NUM_LAYERS, hidden_size=64, intermediate_size=128)


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(VOCAB)


@pytest.fixture(scope="module")
def eos(model_dir: Path) -> tuple[int, ...]:
    """The model's EOS ids (ENDOFTEXT's and IM_END's): those a grammar's end allows."""
    return read_config(model_dir).eos_token_ids


def valid(tokenizer, tokens: list[int]) -> bool:
    """Whether tokens are a JSON document of SCHEMA and then an EOS."""
    if not tokens or tokens[-1] not in (tokenizer.token_to_id(ENDOFTEXT), tokenizer.token_to_id(IM_END)):
        return False
    try:
        jsonschema.validate(json.loads(tokenizer.decode(tokens[:-1])), SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def test_each_greedy_pick_is_the_best_token_its_grammar_allows_by_transformers_logits(model_dir: Path, tokenizer,
                                                                                        eos: tuple[int, ...]) -> None:
    """Two sessions of one grammar in the same steps (each a copy of its compiled matcher, each its own row of the
    masks): a fresh matcher fed a session's output so far gives its allowed tokens, and the engine's pick is
    transformers' argmax among them: the mask applied at a pick is that session's at that step."""
    prompts = {"g0": random_prompt(51, 7), "g1": random_prompt(55, 12)}
    mesh = Mesh(make_engine(model_dir))
    for session_id, prompt in prompts.items():
        start(mesh, replace(generation(session_id, prompt, max_new_tokens=MAX_TOKENS, stop_token_ids=eos),
                            sampling=SamplingParams(grammar=GRAMMAR)))
    mesh.run()
    ll_tokenizer = llguidance.LLTokenizer(tokenizer.to_str(), n_vocab=VOCAB, eos_token=list(eos))
    bitmask = llguidance.torch.allocate_token_bitmask(1, VOCAB)
    for session_id, prompt in prompts.items():
        tokens = mesh.tokens(session_id)
        assert valid(tokenizer, tokens), tokenizer.decode(tokens)
        matcher = llguidance.LLMatcher(ll_tokenizer, GRAMMAR)
        for i, token in enumerate(tokens):
            with torch.inference_mode():
                logits = hf_model(model_dir)(torch.tensor([prompt + tokens[:i]])).logits[0, -1]
            llguidance.torch.fill_next_token_bitmask(matcher, bitmask)
            allowed = ((bitmask[0, :, None] >> torch.arange(32, dtype=torch.int32)) & 1).flatten()[:VOCAB].bool()
            assert token == int(logits.masked_fill(~allowed, float("-inf")).argmax()), f"{session_id}'s pick {i}"
            assert matcher.consume_token(token)
        assert hf_greedy(model_dir, prompt, len(tokens)) != tokens      # guards it: the masks changed the picks
    assert mesh.tokens("g0") != mesh.tokens("g1")


def test_a_steps_masks_are_computed_while_its_forward_pass_runs(model_dir: Path, tokenizer, eos: tuple[int, ...],
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Every step's mask computation and forward pass meet at a barrier: masks computed before the forward on the
    step's thread, or only once the pick wants them, leave one of the two waiting alone until the barrier breaks."""
    barrier = threading.Barrier(2, timeout=patient(RENDEZVOUS_S))
    engine = make_engine(model_dir)
    forward_steps = engine.runner.forward_steps

    def meeting_forward(inputs, seqs):
        barrier.wait()
        return (yield from forward_steps(inputs, seqs))

    def meeting(fill):
        def fill_after_meeting(*args) -> None:
            barrier.wait()
            fill(*args)
        return fill_after_meeting

    monkeypatch.setattr(engine.runner, "forward_steps", meeting_forward)
    for name in ("fill_next_token_bitmask", "fill_next_token_bitmask_par"):    # one mask a step: one of the two
        monkeypatch.setattr(llguidance.numpy, name, meeting(getattr(llguidance.numpy, name)))
    mesh = Mesh(engine)
    start(mesh, replace(generation("s", random_prompt(52, 9), max_new_tokens=MAX_TOKENS, stop_token_ids=eos),
                        sampling=SamplingParams(temperature=1.0, seed=4, grammar=GRAMMAR)))
    mesh.run()
    tokens = mesh.tokens("s")
    assert valid(tokenizer, tokens), tokenizer.decode(tokens)
    assert engine.grammars.times.num_steps == len(tokens) == mesh.num_steps


def test_a_session_held_past_its_grammars_end_is_refused_alone(model_dir: Path, tokenizer) -> None:
    """No EOS among its stop ids (ignore_eos): the grammar's end picks EOS, the only token it allows, and the step
    after refuses the session with an error saying so: no token past the end. Its step-mate goes on unharmed."""
    engine = make_engine(model_dir)
    mesh = Mesh(engine)
    free_prompt = random_prompt(54, 6)
    start(mesh, replace(generation("held", random_prompt(53, 7), max_new_tokens=MAX_TOKENS),
                        sampling=SamplingParams(temperature=1.0, seed=2, grammar=GRAMMAR)))
    start(mesh, generation("free", free_prompt, max_new_tokens=MAX_TOKENS))
    mesh.run()
    tokens = mesh.tokens("held")
    assert valid(tokenizer, tokens), tokenizer.decode(tokens)
    (refusal,) = [e for e in mesh.events_of("held") if e.error]
    assert "past the end of its grammar" in refusal.error and refusal.step == -1
    assert mesh.events_of("held")[-1] == refusal and "held" not in engine.sessions
    assert mesh.tokens("free") == hf_greedy(model_dir, free_prompt, MAX_TOKENS)
    assert len(tokens) + 1 < MAX_TOKENS         # guards it: the refusal, not max_new_tokens, ended it


def test_min_tokens_cannot_push_a_generation_past_its_grammars_end(model_dir: Path, tokenizer,
                                                                    eos: tuple[int, ...]) -> None:
    """min_tokens bans EOS, the only token the grammar's end allows: the grammar wins, its EOS ends the generation
    (sampled: a row of -inf alone would draw garbage)."""
    params = SamplingParams(temperature=1.0, seed=2, grammar=GRAMMAR, min_tokens=MAX_TOKENS, stop_token_ids=eos)
    mesh = Mesh(make_engine(model_dir))
    start(mesh, replace(generation("m", random_prompt(53, 7), max_new_tokens=MAX_TOKENS, stop_token_ids=eos),
                        sampling=params))
    mesh.run()
    tokens = mesh.tokens("m")
    assert valid(tokenizer, tokens), tokenizer.decode(tokens)
    assert len(tokens) < MAX_TOKENS and not [e for e in mesh.events_of("m") if e.error]


def test_a_pool_of_mask_threads_gives_the_masks_one_thread_gives(model_dir: Path, tokenizer,
                                                                 eos: tuple[int, ...]) -> None:
    """Three sessions of one grammar at three points of one JSON document, masked by llguidance's pool and by
    Grammars' thread alone: the same rows, each the allowed tokens of a fresh matcher fed that session's output."""
    text = '{"id":7,"tags":["edge","cloud"]}'
    document = tokenizer.encode(text).ids
    wanted = {f"s{n}": (GRAMMAR, document[:n]) for n in (0, 3, len(document))}
    pooled = Grammars(model_dir, VOCAB, eos, mask_threads=2).start(wanted).wait()
    alone = Grammars(model_dir, VOCAB, eos, mask_threads=1).start(wanted).wait()
    assert torch.equal(pooled.bitmask, alone.bitmask) and not pooled.refused and not alone.refused
    ll_tokenizer = llguidance.LLTokenizer(tokenizer.to_str(), n_vocab=VOCAB, eos_token=list(eos))
    for row, (_, output) in enumerate(wanted.values()):
        matcher = llguidance.LLMatcher(ll_tokenizer, GRAMMAR)
        assert matcher.consume_tokens(output)
        expected = llguidance.torch.allocate_token_bitmask(1, VOCAB)
        llguidance.torch.fill_next_token_bitmask(matcher, expected)
        assert torch.equal(pooled.bitmask[row], expected[0]), row
    assert len({tuple(r.tolist()) for r in pooled.bitmask}) == 3     # guards it: three different masks
