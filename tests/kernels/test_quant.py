"""Weight-only int8 and int4: each format's error bound and layout, its products against a float64 reference
(in the CPU kernels and dequantized), and a quantized stage against the same stage with its weights dequantized."""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import replace

import pytest
import torch

from stratamesh.fleet.errors import InvalidInput
from stratamesh.fleet.stages import StageSpec
from stratamesh.kernels.models.config import read_config
from stratamesh.kernels.models.checkpoint import Checkpoint
from stratamesh.kernels.models.decoder import StageModel, checked_tensor_names, load_stage, quantize_tensors
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
@pytest.mark.parametrize("width", [64, 72, 259])     # 72, 259: no multiple of the kernel's 16 (they dequantize)
def test_a_product_matches_float64_with_the_dequantized_weight(num_tokens: int, kernel: bool, width: int) -> None:
    w = quantize_int8(torch.randn(96, width, generator=G) * 0.05)
    x, bias = torch.randn(num_tokens, width, generator=G), torch.randn(96, generator=G)
    want = x.double() @ w.dequantize(torch.float64).T + bias.double()
    with nullcontext() if kernel else quant.exact_products():
        got, in_kernel = linear(x, w, bias), quant._uses_cpu_kernel(x)
    assert in_kernel == (kernel and width % 16 == 0)
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


def test_each_4_bit_group_is_within_half_a_step_of_its_scale() -> None:
    w = torch.randn(32, 96, generator=G) * torch.rand(32, 1, generator=G)
    w[3, 32:64] = 0                                                           # a group of zeros
    q = quant.quantize_int4(w)
    assert q.packed.dtype == torch.uint8 and q.packed.shape == (32, 48) and q.scale.shape == (32, 3)
    assert q.shape == (32, 96) and q.group == quant.INT4_GROUP
    values = q.unpacked()
    assert int(values.max()) <= 15 and not (values[3, 32:64] - quant.INT4_ZERO).any()
    # two weights a byte, the even one in the low nibble (MatMulNBits' layout)
    assert torch.equal(q.packed, values[:, 0::2] | (values[:, 1::2] << 4))
    step = q.scale.repeat_interleave(quant.INT4_GROUP, dim=1)
    assert bool(((q.dequantize() - w).abs() <= step / 2 + 1e-7).all())


def test_rows_of_a_width_4_bits_do_not_take_are_refused() -> None:
    with pytest.raises(InvalidInput, match="multiple of 32"):
        quant.quantize_int4(torch.randn(16, 40, generator=G))
    assert not quant.takes_int4(torch.randn(16, 40)) and not quant.takes_int4(torch.randn(24, 64))
    assert quant.takes_int4(torch.randn(32, 64))


@pytest.mark.parametrize("num_tokens", [1, 7, 32])
def test_a_4_bit_product_matches_float64_in_the_kernel_and_dequantized(num_tokens: int) -> None:
    w = quant.quantize_int4(torch.randn(48, 128, generator=G) * 0.05)
    x, bias = torch.randn(num_tokens, 128, generator=G), torch.randn(48, generator=G)
    want = x.double() @ w.dequantize(torch.float64).T + bias.double()
    packed = quant.for_cpu_kernel(w)
    assert isinstance(packed, quant.PackedInt4Weight) and packed.shape == (48, 128)
    # the kernel takes bfloat16 activations; dequantized, the product is float32's
    for weight, tolerance in ((packed, 2e-2), (w, 1e-5)):
        got = linear(x, weight, bias)
        assert got.dtype == torch.float32 and got.shape == (num_tokens, 48)
        torch.testing.assert_close(got.double(), want, atol=tolerance * float(want.abs().max()), rtol=0)


@pytest.mark.parametrize("quantize", ["int8", "int4"])
def test_an_embedding_lookup_reads_the_dequantized_rows(quantize: str) -> None:
    w = torch.randn(64, 32, generator=G)
    q = quant.quantize_int8(w) if quantize == "int8" else quant.quantize_int4(w)
    ids = torch.tensor([5, 0, 63, 5])
    torch.testing.assert_close(quant.embedding(ids, q, torch.float32), q.dequantize()[ids], atol=1e-6, rtol=0)


def _dequantized(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Stored quantized tensors (decoder.quantize_tensors) with each matrix dequantized to float32."""
    out = {}
    for name, t in tensors.items():
        scale = tensors.get(name + SCALE_SUFFIX)
        if name.endswith(SCALE_SUFFIX):
            continue
        if scale is None:
            out[name] = t
        else:
            out[name] = (quant.Int4Weight(t, scale) if t.dtype == torch.uint8 else Int8Weight(t, scale)).dequantize()
    return out


@pytest.mark.parametrize("quantize", ["int8", "int4"])
@pytest.mark.parametrize("tie, arch", [(False, "llama"), (True, "llama"), (False, "mixtral"), (False, "qwen2_moe")])
def test_a_quantized_stage_is_the_float_stage_of_its_dequantized_weights(tiny_model, tie: bool, arch: str,
                                                                         quantize: str) -> None:
    """(Mixtral and Qwen2-MoE: each expert's matrices quantized, and the shared expert's; the routers stay float)"""
    model_dir = tiny_model(arch, num_layers=2, tie_word_embeddings=tie)
    spec = spec_of(model_dir, quantize=quantize)
    config = read_config(model_dir)
    stored = quantize_tensors(Checkpoint(str(model_dir)).load(checked_tensor_names(spec, config), torch.float32,
                                                              "cpu"), config, quantize)
    # the projection matrices, the head and the embedding are quantized; the norms stay float
    q_proj, embed = "model.layers.1.self_attn.q_proj.weight", "model.embed_tokens.weight"
    stored_dtype = torch.int8 if quantize == "int8" else torch.uint8
    assert stored[q_proj].dtype == stored[embed].dtype == stored_dtype
    assert stored[q_proj + SCALE_SUFFIX].dtype == torch.float32
    assert stored["model.norm.weight"].dtype == torch.float32
    experts = [n for n in stored if ".experts." in n and not n.endswith(SCALE_SUFFIX)]
    # (int4 where a row's width is a multiple of its groups: Qwen2-MoE's experts' down rows, 259 wide, are int8)
    assert all(stored[n].dtype in (stored_dtype, torch.int8) for n in experts) and len(experts) == (
        {"mixtral": 2 * 5 * 3, "qwen2_moe": 6 * 3}.get(arch, 0))       # (Qwen2-MoE: layer 1 of 2 is sparse)
    routers = [n for n in stored if n.endswith(".gate.weight")]
    assert all(stored[n].dtype == torch.float32 for n in routers) and len(routers) == {"mixtral": 2,
                                                                                       "qwen2_moe": 1}.get(arch, 0)
    assert ("lm_head.weight" + SCALE_SUFFIX in stored) == (not tie)
    reference = StageModel(config, spec_of(model_dir), _dequantized(stored))
    stage = load_stage(spec)        # as an agent loads it: its 4-bit matrices repacked for the CPU kernel
    ids = torch.randint(3, 1000, (24,), generator=G)
    got = stage.logits(stage.forward(ids, torch.arange(24), stage.new_cache()))
    want = reference.logits(reference.forward(ids, torch.arange(24), reference.new_cache()))
    # bfloat16 activations in the CPU kernels: 2^-8 of each product's terms. A router's top-k may flip on a near-tie
    # between those and float32 ones: that token's row then differs wholly (at most 2 of the 24 here)
    close = (got - want).abs().amax(dim=-1) <= 5e-2 * float(want.abs().max())
    assert int((~close).sum()) <= (2 if config.moe else 0), (~close).nonzero().flatten().tolist()


@pytest.mark.parametrize(("quantize", "fraction"), [("int8", 0.26), ("int4", 0.16)])
def test_quantized_weights_take_their_share_of_the_bytes(tiny_model, quantize: str, fraction: float) -> None:
    """int8: a quarter of float32's bytes (and a scale a row); int4: an eighth, and a float32 scale per 32."""
    model_dir = tiny_model(num_layers=2)
    full, quantized = load_stage(spec_of(model_dir)), load_stage(spec_of(model_dir, quantize=quantize))
    assert 0.12 < quantized.param_bytes / full.param_bytes < fraction


def test_a_4_bit_head_tied_to_the_embedding_is_held_twice_and_counted_so(tiny_model) -> None:
    """The lookup reads the embedding's rows as stored, the head's product the kernel's tiles: two copies."""
    tied = load_stage(spec_of(tiny_model(num_layers=2, tie_word_embeddings=True), quantize="int4"))
    untied = load_stage(spec_of(tiny_model(num_layers=2), quantize="int4"))
    assert tied.tensors["lm_head.weight"].device.type == "meta"
    assert tied.param_bytes == untied.param_bytes


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"quantize": "int3"}, "not one of"), ({"quantize": "int4", "tp_degree": 2}, "single-process stages")])
def test_a_stage_spec_refuses_what_quantized_stages_do_not_serve(kwargs: dict, message: str) -> None:
    with pytest.raises(InvalidInput, match=message):
        replace(StageSpec("m", "/m", 0, 2, 2), **kwargs)


def test_quantized_weights_serve_in_torch_and_in_onnx_runtime() -> None:
    for runtime in ("torch", "onnxruntime"):
        for quantize in ("int8", "int4"):
            assert StageSpec("m", "/m", 0, 2, 2, runtime=runtime, quantize=quantize).quantize == quantize
