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
