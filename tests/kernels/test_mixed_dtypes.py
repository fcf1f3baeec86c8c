"""Pipelines whose stages compute in different dtypes, against Hugging Face transformers on the same device (CPU).

Tolerance for bfloat16 stages, and why: bfloat16 keeps 8 significant bits, so every rounding is a relative error of
up to 2^-9 and a model that runs in it drifts from float32 by an amount that depends on the weights, not on who runs
it. The yardstick is therefore transformers itself in bfloat16 on the same device: the logits of a pipeline with
bfloat16 stages must lie no further from transformers' float32 logits (relative L2 distance) than 1.25x the distance
of transformers' own bfloat16 run. A pipeline that rounds fewer layers in bfloat16 lands well inside it (measured
here: one of three stages in bf16 is about half the distance, all of them about the same as transformers'), and
float32 throughout stays exact to rounding (greedy-equal, 1e-5).
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from stratamesh.fleet.sessions import wire_dtype
from stratamesh.fleet.stages import StageSpec
from stratamesh.kernels import codec
from stratamesh.kernels.models.decoder import load_stage
from stratamesh.kernels.tiny_model import TINY_ARCHS

RANGES = ((0, 2), (2, 4), (4, 6))
PROMPT = list(range(40, 104))
BF16_MARGIN = 1.25


@lru_cache(maxsize=8)
def transformers_logits(model_dir: str, dtype: torch.dtype, device: str = "cpu") -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval().to(device)
    with torch.inference_mode():
        return model(torch.tensor([PROMPT], device=device)).logits[0].float().cpu()


def pipeline_logits(model_dir: Path, dtypes: tuple[str, ...], devices: tuple[str, ...] = ("cpu",) * 3,
                    wire_codec: str = "raw") -> torch.Tensor:
    """The prompt through one stage per range, computing in dtypes on devices, each hop's activations encoded in
    the dtype they travel in (wire_dtype) with wire_codec and decoded as the next stage receives them."""
    x, positions = torch.tensor(PROMPT), torch.arange(len(PROMPT))
    for k, ((start, end), dtype, device) in enumerate(zip(RANGES, dtypes, devices, strict=True)):
        model = load_stage(StageSpec("m", str(model_dir), start, end, 6, dtype=dtype, device=device))
        hidden = model.forward(x, positions, model.new_cache())
        if k == len(RANGES) - 1:
            return model.logits(hidden).cpu()
        travels = wire_dtype(dtype, dtypes[k + 1])
        blob = codec.encode(hidden.to(codec.TORCH_DTYPES[travels]), wire_codec)
        assert blob.dtype == travels
        x = codec.decode(blob)


def relative_distance(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.fixture(scope="module")
def model_dir(tiny_model) -> Path:
    return tiny_model("llama", num_layers=6)


def test_a_float32_pipeline_equals_transformers(model_dir: Path) -> None:
    ours, reference = pipeline_logits(model_dir, ("float32",) * 3), transformers_logits(str(model_dir), torch.float32)
    torch.testing.assert_close(ours, reference, atol=1e-5, rtol=1e-5)
    assert torch.equal(ours.argmax(-1), reference.argmax(-1))


@pytest.mark.parametrize("dtypes", [("float32", "bfloat16", "float32"), ("bfloat16", "float32", "bfloat16"),
                                    ("bfloat16",) * 3], ids="-".join)
def test_bfloat16_stages_stay_as_close_to_float32_as_transformers_in_bfloat16(model_dir: Path,
                                                                             dtypes: tuple[str, ...]) -> None:
    reference = transformers_logits(str(model_dir), torch.float32)
    yardstick = relative_distance(transformers_logits(str(model_dir), torch.bfloat16), reference)
    assert 1e-3 < yardstick < 0.1                     # bfloat16 does round: the yardstick is not vacuous
    assert relative_distance(pipeline_logits(model_dir, dtypes), reference) <= BF16_MARGIN * yardstick


def test_int8_activations_on_every_hop_stay_as_close_to_float32_as_a_bfloat16_model(model_dir: Path) -> None:
    """int8 with a scale per token rounds each activation to 1/254 of its row's largest, about as coarse as
    bfloat16's 2^-9, but only at the two hops, not in every layer: its logits stay within the bfloat16 stages'
    margin of transformers in bfloat16 (measured here: 0.011 against 0.013), and it picks the float32 argmax at
    nearly every position (62 of 64 here; transformers in bfloat16: 63), as random weights leave near-ties."""
    reference = transformers_logits(str(model_dir), torch.float32)
    bf16 = transformers_logits(str(model_dir), torch.bfloat16)
    ours = pipeline_logits(model_dir, ("float32",) * 3, wire_codec="int8")
    assert 0 < relative_distance(ours, reference) <= BF16_MARGIN * relative_distance(bf16, reference)
    agree = int((ours.argmax(-1) == reference.argmax(-1)).sum())
    assert agree >= int((bf16.argmax(-1) == reference.argmax(-1)).sum()) - 2 and agree >= 0.9 * len(PROMPT)


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_a_bfloat16_checkpoint_loads_without_an_upcast(tiny_model, arch: str) -> None:
    fp32_dir, bf16_dir = tiny_model(arch, num_layers=2), tiny_model(arch, num_layers=2, dtype="bfloat16")
    spec = StageSpec("m", str(bf16_dir), 0, 2, 2, dtype="bfloat16")
    model = load_stage(spec)
    assert {t.dtype for t in model.tensors.values()} == {torch.bfloat16}
    assert 2 * model.param_bytes == load_stage(StageSpec("m", str(fp32_dir), 0, 2, 2)).param_bytes
    upcast = load_stage(StageSpec("m", str(bf16_dir), 0, 2, 2, dtype="float32"))   # what the spec says, only
    assert {t.dtype for t in upcast.tensors.values()} == {torch.float32}
    # and it computes as transformers does in bfloat16, within the margin above (from the float32 checkpoint's)
    x, positions = torch.tensor(PROMPT), torch.arange(len(PROMPT))
    ours = model.logits(model.forward(x, positions, model.new_cache()))
    reference = transformers_logits(str(fp32_dir), torch.float32)
    yardstick = relative_distance(transformers_logits(str(bf16_dir), torch.bfloat16), reference)
    assert 1e-3 < yardstick and relative_distance(ours, reference) <= BF16_MARGIN * yardstick


@pytest.mark.skipif(torch.cuda.is_available(), reason="this box has CUDA")
def test_a_gpu_stage_on_a_box_without_cuda_fails_saying_so(model_dir: Path) -> None:
    from stratamesh.fleet.errors import CheckpointError

    with pytest.raises(CheckpointError, match="no CUDA device"):
        load_stage(StageSpec("m", str(model_dir), 0, 2, 6, dtype="bfloat16", device="cuda:0"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_cpu_gpu_cpu_float32_pipeline_is_greedy_equal_to_transformers(model_dir: Path) -> None:
    ours = pipeline_logits(model_dir, ("float32",) * 3, ("cpu", "cuda:0", "cpu"))
    reference = transformers_logits(str(model_dir), torch.float32)
    assert torch.equal(ours.argmax(-1), reference.argmax(-1))
    torch.testing.assert_close(ours, reference, atol=1e-3, rtol=1e-3)    # the GPU's float32 matmuls may use TF32


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtypes, devices", [(("float32", "bfloat16", "float32"), ("cpu", "cuda:0", "cpu")),
                                             (("bfloat16",) * 3, ("cuda:0",) * 3)], ids=["cpu-gpu-cpu", "gpu"])
def test_bfloat16_stages_on_a_gpu_stay_as_close_as_transformers_in_bfloat16_on_it(model_dir: Path, dtypes,
                                                                                 devices) -> None:
    reference = transformers_logits(str(model_dir), torch.float32)
    yardstick = relative_distance(transformers_logits(str(model_dir), torch.bfloat16, "cuda:0"), reference)
    assert relative_distance(pipeline_logits(model_dir, dtypes, devices), reference) <= BF16_MARGIN * yardstick
