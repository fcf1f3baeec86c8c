"""Weight-only int8: the quantization's error bound, its products against a float64 reference, and a quantized
stage against the same stage with its weights dequantized."""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import replace

import pytest
import torch

from stratamesh.fleet.errors import InvalidInput
from stratamesh.fleet.stages import StageSpec
from stratamesh.kernels.models.config import read_config
from stratamesh.kernels.models.decoder import StageModel, load_stage
from stratamesh.kernels.ops import quant
from stratamesh.kernels.ops.quant import SCALE_SUFFIX, Int8Weight, linear, quantize_int8

G = torch.Generator().manual_seed(0)


def test_each_row_is_within_half_a_step_of_its_scale() -> None:
    w = torch.randn(48, 64, generator=G) * torch.rand(48, 1, generator=G)     # rows of different ranges
    w[5] = 0                                                                  # a row of zeros
    q = quantize_int8(w)
    assert q.q.dtype == torch.int8 and q.q.shape == w.shape and q.scale.shape == (48,)
    assert int(q.q.abs().max()) == 127 and not q.q[5].any()
    error = (q.dequantize() - w).abs()
    assert bool((error <= q.scale[:, None] / 2 + 1e-7).all())


@pytest.mark.parametrize("num_tokens", [1, 7, 32])
@pytest.mark.parametrize("kernel", [True, False])
def test_a_product_matches_float64_with_the_dequantized_weight(num_tokens: int, kernel: bool) -> None:
    w = quantize_int8(torch.randn(96, 64, generator=G) * 0.05)
    x, bias = torch.randn(num_tokens, 64, generator=G), torch.randn(96, generator=G)
    want = x.double() @ w.dequantize(torch.float64).T + bias.double()
    with nullcontext() if kernel else quant.exact_products():
        got, in_kernel = linear(x, w, bias), quant._uses_cpu_kernel(x)
    assert got.dtype == torch.float32 and got.shape == (num_tokens, 96)
    # the CPU kernel takes bfloat16 activations: 2^-8 relative per product term
    tolerance = 2e-2 if in_kernel else 1e-5
    torch.testing.assert_close(got.double(), want, atol=tolerance * float(want.abs().max()), rtol=0)


def test_exact_products_keep_float32_activations_and_restore_the_kernel() -> None:
    w, x = quantize_int8(torch.randn(32, 16, generator=G)), torch.randn(4, 16, generator=G)
    kernel = quant._uses_cpu_kernel(x)
    with quant.exact_products():
        got = linear(x, w)
    torch.testing.assert_close(got, x @ w.dequantize().T, atol=1e-5, rtol=0)
    assert quant._uses_cpu_kernel(x) == kernel


def test_a_float_weight_is_a_plain_linear() -> None:
    w, x = torch.randn(8, 4, generator=G), torch.randn(3, 4, generator=G)
    assert torch.equal(linear(x, w), torch.nn.functional.linear(x, w))


def spec_of(model_dir, **kwargs) -> StageSpec:
    n = read_config(model_dir).num_layers
    return StageSpec("m", str(model_dir), 0, n, n, **kwargs)


@pytest.mark.parametrize("tie", [False, True])
def test_a_quantized_stage_is_the_float_stage_of_its_dequantized_weights(tiny_model, tie: bool) -> None:
    model_dir = tiny_model(num_layers=2, tie_word_embeddings=tie)
    stage = load_stage(spec_of(model_dir, quantize="int8"))
    tensors = stage.tensors
    # the projection matrices are int8 with per-row scales; norms and the embedding stay float
    q_proj = "model.layers.1.self_attn.q_proj.weight"
    assert tensors[q_proj].dtype == torch.int8 and tensors[q_proj + SCALE_SUFFIX].dtype == torch.float32
    assert tensors["model.embed_tokens.weight"].dtype == torch.float32
    assert ("lm_head.weight" + SCALE_SUFFIX in tensors) == (not tie)
    dequantized = {name: (Int8Weight(t, tensors[name + SCALE_SUFFIX]).dequantize() if t.dtype == torch.int8 else t)
                   for name, t in tensors.items() if not name.endswith(SCALE_SUFFIX)}
    reference = StageModel(stage.config, spec_of(model_dir), dequantized)
    ids = torch.randint(3, 1000, (24,), generator=G)
    got = stage.logits(stage.forward(ids, torch.arange(24), stage.new_cache()))
    want = reference.logits(reference.forward(ids, torch.arange(24), reference.new_cache()))
    tolerance = 5e-2 if quant._cpu_int8_kernel() else 1e-4       # bfloat16 activations in the CPU kernel
    torch.testing.assert_close(got, want, atol=tolerance * float(want.abs().max()), rtol=0)


def test_int8_weights_take_about_a_quarter_of_the_bytes(tiny_model) -> None:
    model_dir = tiny_model(num_layers=2)
    full, int8 = load_stage(spec_of(model_dir)), load_stage(spec_of(model_dir, quantize="int8"))
    embedding = int8.tensors["model.embed_tokens.weight"].numel() * 4
    assert int8.param_bytes - embedding < 0.27 * (full.param_bytes - embedding)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"quantize": "int4"}, "not one of"), ({"quantize": "int8", "tp_degree": 2}, "single-process stages")])
def test_a_stage_spec_refuses_what_int8_does_not_serve(kwargs: dict, message: str) -> None:
    with pytest.raises(InvalidInput, match=message):
        replace(StageSpec("m", "/m", 0, 2, 2), **kwargs)


def test_int8_weights_serve_in_torch_and_in_onnx_runtime() -> None:
    for runtime in ("torch", "onnxruntime"):
        assert StageSpec("m", "/m", 0, 2, 2, runtime=runtime, quantize="int8").quantize == "int8"
