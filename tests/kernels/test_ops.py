"""RMSNorm, RoPE (default, linear, llama3) and SwiGLU against slow float64 references on random inputs."""

from __future__ import annotations

import pytest
import torch

from stratamesh.kernels.ops.mlp import swiglu
from stratamesh.kernels.ops.norm import rms_norm
from stratamesh.kernels.ops.reference import rms_norm_reference, rope_reference, swiglu_reference
from stratamesh.kernels.ops.rope import apply_rope, rope_cos_sin, rope_inv_freq

ATOL = 1e-5   # float32 ops against float64 references on O(1) inputs

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_rms_norm():
    x, w = randn(7, 48, seed=1) * 3, randn(48, seed=2)
    torch.testing.assert_close(rms_norm(x, w, 1e-6).double(), rms_norm_reference(x, w, 1e-6), atol=ATOL, rtol=0)


def test_rms_norm_in_bfloat16_rounds_before_the_weight_as_transformers_does():
    """Hugging Face Llama normalizes in float32, casts to the activation dtype, then multiplies by the weight."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    x, w = (randn(7, 48, seed=1) * 3).bfloat16(), randn(48, seed=2).bfloat16()
    hf = LlamaRMSNorm(48, eps=1e-6)
    hf.weight.data = w
    with torch.no_grad():
        assert torch.equal(rms_norm(x, w, 1e-6), hf(x))


@pytest.mark.parametrize("scaling", [None, {"rope_type": "linear", "factor": 4.0}, LLAMA3],
                         ids=["default", "linear", "llama3"])
def test_rope(scaling):
    head_dim, theta = 32, 10000.0
    x = randn(9, 3, head_dim, seed=3)                          # [N, H, D]
    positions = torch.tensor([0, 1, 2, 5, 40, 63, 64, 200, 1000])
    cos, sin = rope_cos_sin(rope_inv_freq(head_dim, theta, scaling), positions, torch.float32)   # [N, D]
    ours = apply_rope(x, cos[:, None], sin[:, None])
    # angles up to 1000 rad in float32 lose about 1e-4 absolute
    torch.testing.assert_close(ours.double(), rope_reference(x, positions, head_dim, theta, scaling),
                               atol=2e-4, rtol=0)


def test_rope_is_bit_identical_to_transformers_rotate_half():
    """The roll with a signed sin must give exactly HF's x * cos + rotate_half(x) * sin."""
    from transformers.models.llama.modeling_llama import rotate_half

    inv_freq = rope_inv_freq(64, 10000.0, None)
    positions = torch.arange(0, 300, 7)
    x = randn(len(positions), 4, 64, seed=5)
    cos, signed_sin = rope_cos_sin(inv_freq, positions, torch.float32)
    freqs = positions[:, None].float() * inv_freq[None, :]
    sin = torch.cat((freqs, freqs), dim=-1).sin()                               # HF's sin
    expected = x * cos[:, None] + rotate_half(x) * sin[:, None]
    assert torch.equal(apply_rope(x, cos[:, None], signed_sin[:, None]), expected)


def test_llama3_scaling_changes_the_rotation():
    """Guards the rope test: the llama3 reference must differ from the unscaled one at long positions."""
    x, positions = randn(2, 1, 32, seed=4), torch.tensor([100, 1000])
    scaled, plain = rope_reference(x, positions, 32, 1e4, LLAMA3), rope_reference(x, positions, 32, 1e4, None)
    assert (scaled - plain).abs().max() > 1e-2


def test_swiglu():
    x, gate, up, down = randn(5, 32, seed=5), randn(64, 32, seed=6), randn(64, 32, seed=7), randn(32, 64, seed=8)
    expected = swiglu_reference(x, gate, up, down)
    ours = swiglu(x, torch.cat([gate, up]), down)      # the gate's rows, then up's
    torch.testing.assert_close(ours.double(), expected, atol=ATOL * expected.abs().max(), rtol=0)
