"""Each rope scaling's frequencies (and attention factor) against transformers' own rope functions, from the same
config.json, at the positions past the original context that the scaling is for; then a checkpoint with it served
over three stages against transformers."""

from __future__ import annotations

import pytest
import torch

from stratamesh.kernels.models.config import parse_config
from stratamesh.kernels.ops.rope import rope_attention_factor, rope_cos_sin, rope_inv_freq
from tests.kernels.test_decoder import LOGITS_ATOL, SPLIT, greedy_decode, hf_greedy, hf_logits, load_stages, \
    run_pipeline

transformers = pytest.importorskip("transformers")
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

SHAPE = {"vocab_size": 64, "hidden_size": 256, "intermediate_size": 64, "num_hidden_layers": 1,
         "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 128, "max_position_embeddings": 4096,
         "rope_theta": 1e6}
YARN = [
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024},     # Qwen2.5 / Qwen3's spelling
    {"type": "yarn", "factor": 8.0, "original_max_position_embeddings": 512, "beta_fast": 16, "beta_slow": 2},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024, "attention_factor": 1.25},
    {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 100, "mscale": 1.0,
     "mscale_all_dim": 0.8, "truncate": False},
]


def transformers_rope(model_type: str, scaling: dict) -> tuple[torch.Tensor, float]:
    config = transformers.AutoConfig.for_model(model_type, **SHAPE, rope_scaling=dict(scaling))
    kind = scaling.get("rope_type") or scaling.get("type")
    return ROPE_INIT_FUNCTIONS[kind](config, "cpu")


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3", "llama"])
@pytest.mark.parametrize("scaling", YARN, ids=["qwen", "betas", "attention-factor", "mscales"])
def test_yarn_frequencies_and_attention_factor_are_transformers(model_type: str, scaling: dict) -> None:
    config = parse_config({"model_type": model_type, **SHAPE, "rope_scaling": scaling})
    inv_freq, attention_factor = transformers_rope(model_type, scaling)
    assert torch.equal(rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling), inv_freq)
    assert rope_attention_factor(config.rope_scaling) == pytest.approx(attention_factor, rel=1e-12)
    positions = torch.arange(0, 4 * config.rope_scaling["original_max_position_embeddings"], 97)   # well past it
    cos, sin = rope_cos_sin(rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling), positions,
                            torch.float32, rope_attention_factor(config.rope_scaling))
    angles = positions[:, None].float() * inv_freq[None, :]
    torch.testing.assert_close(cos[:, :inv_freq.numel()], angles.cos() * attention_factor, atol=1e-6, rtol=0)
    torch.testing.assert_close(sin[:, inv_freq.numel():], angles.sin() * attention_factor, atol=1e-6, rtol=0)


def test_yarn_changes_the_rotation_past_the_original_context() -> None:
    """Guards the test above: the scaled frequencies and factor are not the plain ones."""
    config = parse_config({"model_type": "qwen3", **SHAPE, "rope_scaling": YARN[0]})
    assert not torch.equal(rope_inv_freq(128, 1e6, config.rope_scaling), rope_inv_freq(128, 1e6, None))
    assert rope_attention_factor(config.rope_scaling) > 1.1


@pytest.mark.parametrize("arch", ["qwen3", "qwen2"])
def test_a_yarn_checkpoint_over_three_stages_matches_transformers(tiny_model, arch: str) -> None:
    """Prompts past the original context of 16 positions: the scaled frequencies are the ones used."""
    model_dir = tiny_model(arch, rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                               "original_max_position_embeddings": 16})
    ids = torch.randint(3, 700, (40,), generator=torch.Generator().manual_seed(8))
    stages = load_stages(model_dir, SPLIT)
    logits = run_pipeline(stages, [s.new_cache() for s in stages], ids, 0)
    torch.testing.assert_close(logits, hf_logits(model_dir, ids), atol=LOGITS_ATOL, rtol=0)
    assert (logits - hf_logits(tiny_model(arch), ids)).abs().max() > 1e-2     # it is not the unscaled model
    assert greedy_decode(load_stages(model_dir, SPLIT), ids, 16) == hf_greedy(model_dir, ids, 16)


# LongRoPE as Phi-3.5 and Phi-4-mini spell it (a factor per rotated frequency: 3/4 of a 128-wide head, 48 of them)
PHI3 = {**SHAPE, "partial_rotary_factor": 0.75, "original_max_position_embeddings": 1024}
LONGROPE = {"type": "longrope", "short_factor": [1.0 + i / 100 for i in range(48)],
            "long_factor": [1.0 + i / 4 for i in range(48)]}


def transformers_rope_at(model_type: str, shape: dict, scaling: dict, seq_len: int) -> tuple[torch.Tensor, float]:
    """transformers' frequencies and attention factor for a forward over seq_len positions."""
    config = transformers.AutoConfig.for_model(model_type, **shape, rope_scaling=dict(scaling))
    return ROPE_INIT_FUNCTIONS[scaling["type"]](config, "cpu", seq_len=seq_len)


@pytest.mark.parametrize("max_pos", [4096, 1024], ids=["served-past-the-original", "served-within-it"])
def test_longrope_frequencies_are_transformers_for_the_context_served(max_pos: int) -> None:
    """Past its original context a model is served with the long factors: transformers' frequencies for a sequence
    that long; within it with the short ones, transformers' for any sequence that fits."""
    shape = {**PHI3, "max_position_embeddings": max_pos}
    config = parse_config({"model_type": "phi3", **shape, "rope_scaling": LONGROPE})
    assert config.rotary_dim == 96 and config.rope_scaling["long"] == (max_pos > 1024)
    seq_len = 3000 if max_pos > 1024 else 700
    inv_freq, attention_factor = transformers_rope_at("phi3", shape, LONGROPE, seq_len)
    assert inv_freq.shape == (48,)
    assert torch.equal(rope_inv_freq(config.rotary_dim, config.rope_theta, config.rope_scaling), inv_freq)
    assert rope_attention_factor(config.rope_scaling) == pytest.approx(attention_factor, rel=1e-12)
    other, _ = transformers_rope_at("phi3", shape, LONGROPE, 4000 if seq_len < 1024 else 10)
    assert not torch.equal(other, inv_freq)     # the other set of factors: the choice was made


def test_dynamic_ntk_frequencies_are_transformers_at_the_scaled_context() -> None:
    """Dynamic NTK's base is raised for the context it is served at, max_position_embeddings times factor."""
    scaling = {"type": "dynamic", "factor": 4.0}
    raw = {"model_type": "llama", **SHAPE, "max_position_embeddings": 1024, "rope_scaling": scaling}
    config = parse_config(raw)
    assert config.max_position_embeddings == 4096
    inv_freq, attention_factor = transformers_rope_at("llama", {**SHAPE, "max_position_embeddings": 1024}, scaling,
                                                      4096)
    ours = rope_inv_freq(config.rotary_dim, config.rope_theta, config.rope_scaling)
    assert torch.equal(ours, inv_freq) and attention_factor == rope_attention_factor(config.rope_scaling) == 1.0
    assert not torch.equal(ours, rope_inv_freq(128, 1e6, None))
    positions = torch.arange(1024, 4096, 101)        # past the original context
    cos, sin = rope_cos_sin(ours, positions, torch.float32)
    angles = positions[:, None].float() * inv_freq[None, :]
    torch.testing.assert_close(cos[:, :64], angles.cos(), atol=1e-6, rtol=0)
    torch.testing.assert_close(sin[:, 64:], angles.sin(), atol=1e-6, rtol=0)


@pytest.mark.parametrize("spelling", ["classic", "parameters"])
def test_a_longrope_phi3_checkpoint_over_three_stages_matches_transformers(tiny_model, spelling: str) -> None:
    """A Phi-4-mini-like checkpoint (partial rotary, LongRoPE, a window) with a 16-position original context:
    a 40-token prompt is past it, where transformers uses the long factors for the prompt and every decode step."""
    scaling = {"rope_type": "longrope", "original_max_position_embeddings": 16,
               "short_factor": [1.0 + i / 10 for i in range(24)], "long_factor": [1.5 + i / 3 for i in range(24)]}
    model_dir = tiny_model("phi3", rope_scaling=scaling, rope_spelling=spelling)
    ids = torch.randint(3, 700, (40,), generator=torch.Generator().manual_seed(9))
    stages = load_stages(model_dir, SPLIT)
    logits = run_pipeline(stages, [s.new_cache() for s in stages], ids, 0)
    torch.testing.assert_close(logits, hf_logits(model_dir, ids), atol=LOGITS_ATOL, rtol=0)
    assert (logits - hf_logits(tiny_model("phi3"), ids)).abs().max() > 1e-2     # it is not the unscaled model
    assert greedy_decode(load_stages(model_dir, SPLIT), ids, 16) == hf_greedy(model_dir, ids, 16)


def test_a_dynamic_ntk_checkpoint_over_three_stages_matches_transformers(tiny_model) -> None:
    """max_position_embeddings 32, factor 2: served to 64 positions. transformers raises the base for a forward
    of 64, and keeps it for shorter sequences past 32 once it has (its rotary state): so a prompt of 64 gives the
    same logits, and generate after it the same tokens."""
    model_dir = tiny_model("llama", max_position_embeddings=32, rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    full = torch.randint(3, 700, (64,), generator=torch.Generator().manual_seed(10))
    stages = load_stages(model_dir, SPLIT)
    logits = run_pipeline(stages, [s.new_cache() for s in stages], full, 0)
    torch.testing.assert_close(logits, hf_logits(model_dir, full), atol=LOGITS_ATOL, rtol=0)
    assert (logits - hf_logits(tiny_model("llama", max_position_embeddings=32), full)).abs().max() > 1e-3
    ids = full[:40]
    assert greedy_decode(load_stages(model_dir, SPLIT), ids, 24) == hf_greedy(model_dir, ids, 24)
