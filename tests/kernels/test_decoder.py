"""Our stage-able decoder against transformers, the single-process reference, on tiny random checkpoints."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from stratamesh.fleet.errors import CheckpointError, InvalidInput
from stratamesh.fleet.stages import StageSpec
from stratamesh.kernels.models.decoder import StageModel, load_stage
from stratamesh.kernels.ops.kv_cache import KVCache
from stratamesh.kernels.tiny_model import TINY_ARCHS

transformers = pytest.importorskip("transformers")

NUM_LAYERS = 6
LOGITS_ATOL = 1e-4   # float32 on CPU; observed max |diff| is about 6e-6
PROMPT_LEN = 40      # > the tiny Mistral's sliding window of 32, so the window is exercised
NUM_NEW_TOKENS = 32
SPLIT = ((0, 2), (2, 5), (5, NUM_LAYERS))

_hf_models: dict[Path, object] = {}


def hf_model(model_dir: Path):
    if model_dir not in _hf_models:
        _hf_models[model_dir] = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    return _hf_models[model_dir]


def hf_logits(model_dir: Path, ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return hf_model(model_dir)(ids[None]).logits[0].float()


def prompt(seed: int, length: int = PROMPT_LEN, vocab: int = 700) -> torch.Tensor:
    return torch.randint(3, vocab, (length,), generator=torch.Generator().manual_seed(seed))


def load_stages(model_dir: Path, ranges=((0, NUM_LAYERS),)) -> list[StageModel]:
    return [load_stage(StageSpec("tiny", str(model_dir), s, e, NUM_LAYERS)) for s, e in ranges]


def run_pipeline(stages: list[StageModel], caches: list[KVCache], ids: torch.Tensor, start: int) -> torch.Tensor:
    """Pass a chunk of token ids through every stage; logits of the last stage."""
    positions = torch.arange(start, start + ids.numel())
    x: torch.Tensor = ids
    for stage, cache in zip(stages, caches):
        x = stage.forward(x, positions, cache)
    return stages[-1].logits(x)


def greedy_decode(stages: list[StageModel], ids: torch.Tensor, num_new: int) -> list[int]:
    """Prefill in two chunks, then one token at a time with the KV cache."""
    caches = [s.new_cache(chunk_tokens=16) for s in stages]   # small chunks so the cache grows mid-run
    half = ids.numel() // 2
    run_pipeline(stages, caches, ids[:half], 0)
    logits = run_pipeline(stages, caches, ids[half:], half)
    out = [int(logits[-1].argmax())]
    while len(out) < num_new:
        pos = ids.numel() + len(out) - 1
        logits = run_pipeline(stages, caches, torch.tensor([out[-1]]), pos)
        out.append(int(logits[-1].argmax()))
    return out


def hf_greedy(model_dir: Path, ids: torch.Tensor, num_new: int) -> list[int]:
    gen = transformers.GenerationConfig(max_new_tokens=num_new, do_sample=False, eos_token_id=None,
                                        pad_token_id=0)
    with torch.inference_mode():
        out = hf_model(model_dir).generate(ids[None], attention_mask=torch.ones_like(ids)[None],
                                           generation_config=gen)
    return out[0, ids.numel():].tolist()


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_full_model_logits_match_transformers(tiny_model, arch):
    model_dir = tiny_model(arch)
    ids = prompt(seed=1)
    (stage,) = load_stages(model_dir)
    ours = run_pipeline([stage], [stage.new_cache()], ids, 0)
    torch.testing.assert_close(ours, hf_logits(model_dir, ids), atol=LOGITS_ATOL, rtol=0)


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_three_stages_chained_match_transformers(tiny_model, arch):
    model_dir = tiny_model(arch)
    ids = prompt(seed=2)
    stages = load_stages(model_dir, SPLIT)
    ours = run_pipeline(stages, [s.new_cache() for s in stages], ids, 0)
    torch.testing.assert_close(ours, hf_logits(model_dir, ids), atol=LOGITS_ATOL, rtol=0)


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_greedy_decode_with_cache_matches_generate(tiny_model, arch):
    model_dir = tiny_model(arch)
    ids = prompt(seed=3)
    expected = hf_greedy(model_dir, ids, NUM_NEW_TOKENS)
    assert len(expected) == NUM_NEW_TOKENS
    assert greedy_decode(load_stages(model_dir, SPLIT), ids, NUM_NEW_TOKENS) == expected


@pytest.mark.parametrize("variant", [
    {"tie_word_embeddings": True},
    {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64}},
    {"rope_scaling": {"rope_type": "linear", "factor": 4.0}},
    {"rope_spelling": "parameters"},
    {"rope_spelling": "parameters", "rope_scaling": {"rope_type": "llama3", "factor": 8.0,
     "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}},
    {"shard_size_bytes": 2_000_000},
    {"arch": "gemma3_text", "tie_word_embeddings": True},
    {"arch": "gemma3_text", "rope_spelling": "parameters"},    # a rope per layer type
    {"arch": "gemma3_text", "rope_scaling": {"rope_type": "linear", "factor": 8.0}},    # the full layers' (4B-27B)
    {"arch": "gemma3_text", "rope_spelling": "parameters", "rope_scaling": {"rope_type": "linear", "factor": 8.0}},
    {"arch": "qwen3", "tie_word_embeddings": True},      # Qwen3 0.6B-4B's
    {"arch": "phi3", "tie_word_embeddings": True},       # Phi-4-mini's
    {"arch": "phi3", "rope_spelling": "parameters"},     # transformers 5 spelling (the factor in rope_parameters)
], ids=["tied", "llama3", "linear", "rope_parameters", "rope_parameters_llama3", "sharded", "gemma3_tied",
        "gemma3_rope_parameters", "gemma3_linear", "gemma3_rope_parameters_linear", "qwen3_tied", "phi3_tied",
        "phi3_rope_parameters"])
def test_variants_match_transformers(tiny_model, variant):
    model_dir = tiny_model(**{"arch": "llama", **variant})
    ids = prompt(seed=4, length=40)
    stages = load_stages(model_dir, SPLIT)
    caches = [s.new_cache() for s in stages]
    ours = run_pipeline(stages, caches, ids, 0)
    torch.testing.assert_close(ours, hf_logits(model_dir, ids), atol=LOGITS_ATOL, rtol=0)
    expected = hf_greedy(model_dir, ids, 12)   # a tied tiny model may stop early at an eos
    assert greedy_decode(stages, ids, 12)[:len(expected)] == expected


def test_rope_scaling_changes_the_logits(tiny_model):
    """Guards the variant tests: the llama3 checkpoint must actually differ from the plain one."""
    ids = prompt(seed=4, length=24)
    scaled = tiny_model("llama", rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                               "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    assert (hf_logits(scaled, ids) - hf_logits(tiny_model("llama"), ids)).abs().max() > 1e-2


def test_stage_holds_only_its_own_tensors(tiny_model):
    first, middle, last = load_stages(tiny_model("qwen2"), SPLIT)
    for stage, (start, end) in zip((first, middle, last), SPLIT):
        layers = {int(n.split(".")[2]) for n in stage.tensor_names if n.startswith("model.layers.")}
        assert layers == set(range(start, end))
    assert "model.embed_tokens.weight" in first.tensor_names
    assert not any(n in middle.tensor_names for n in ("model.embed_tokens.weight", "lm_head.weight",
                                                      "model.norm.weight"))
    assert {"lm_head.weight", "model.norm.weight"} <= set(last.tensor_names)
    assert "model.embed_tokens.weight" not in last.tensor_names
    assert "model.layers.2.self_attn.q_proj.bias" in middle.tensor_names
    assert middle.param_bytes == 3 * middle.config.num_params_per_layer * 4
    with pytest.raises(InvalidInput):
        middle.logits(torch.randn(1, middle.config.hidden_size))


def test_tied_last_stage_holds_the_embedding(tiny_model):
    (last,) = load_stages(tiny_model("llama", tie_word_embeddings=True), [(4, NUM_LAYERS)])
    assert "model.embed_tokens.weight" in last.tensor_names and "lm_head.weight" not in last.tensor_names


def test_bad_inputs_are_rejected(tiny_model):
    first, middle, _ = load_stages(tiny_model("llama"), SPLIT)
    cache = first.new_cache()
    with pytest.raises(InvalidInput, match="token ids"):
        first.forward(torch.tensor([5, 5000]), torch.arange(2), cache)
    with pytest.raises(InvalidInput, match="hidden states"):
        middle.forward(torch.tensor([1, 2]), torch.arange(2), middle.new_cache())
    with pytest.raises(InvalidInput, match="cache holds"):
        first.forward(torch.tensor([5, 6]), torch.arange(3, 5), cache)
    with pytest.raises(InvalidInput, match="consecutive"):
        first.forward(torch.tensor([5, 6]), torch.tensor([0, 2]), cache)


def test_layer_count_mismatch_is_a_checkpoint_error(tiny_model):
    with pytest.raises(CheckpointError, match="layers"):
        load_stage(StageSpec("tiny", str(tiny_model("llama")), 0, 2, 8))


def test_replay_from_a_position_overwrites_the_cache(tiny_model):
    """Re-running a suffix after a rollback gives the same logits as the first time."""
    (stage,) = load_stages(tiny_model("mistral"))
    ids = prompt(seed=5, length=36)
    cache = stage.new_cache()
    first = run_pipeline([stage], [cache], ids, 0)
    run_pipeline([stage], [cache], prompt(seed=6, length=6), 30)   # diverge after position 30
    replay = run_pipeline([stage], [cache], ids[30:], 30)
    torch.testing.assert_close(replay, first[30:], atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_stage_tracks_float32(tiny_model, dtype):
    model_dir = tiny_model("qwen2")
    ids = prompt(seed=7, length=16)
    (ref,) = load_stages(model_dir)
    half = load_stage(StageSpec("tiny", str(model_dir), 0, NUM_LAYERS, NUM_LAYERS, dtype=dtype))
    assert half.param_bytes * 2 == ref.param_bytes
    a = run_pipeline([ref], [ref.new_cache()], ids, 0)
    b = run_pipeline([half], [half.new_cache()], ids, 0)
    assert b.dtype == torch.float32
    assert float(torch.nn.functional.cosine_similarity(a, b, dim=-1).min()) > 0.999
