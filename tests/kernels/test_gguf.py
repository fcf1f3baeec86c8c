"""GGUF files loaded as they are: a random checkpoint written as GGUF (tests/gguf_writer.py, as llama.cpp's converter
writes one) gives the checkpoint's config, tokenizer and chat template, and over three stages the checkpoint's
logits within its tensor type's tolerance; Q4_0 matrices of an int4 stage are repacked exactly."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

from stratamesh.fleet.errors import CheckpointError
from stratamesh.fleet.gguf_files import GgufModel, permutation_of_rows
from stratamesh.fleet.stages import StageSpec
from stratamesh.kernels.models.config import read_config
from stratamesh.kernels.models.decoder import StageModel, load_stage, one_sequence
from stratamesh.kernels.models.gguf import GgufCheckpoint
from stratamesh.kernels.ops.quant import SCALE_SUFFIX, Int4Weight

from ..gguf_writer import _permuted, write_gguf

STAGES = ((0, 2), (2, 4), (4, 6))
IDS = torch.randint(3, 500, (20,), generator=torch.Generator().manual_seed(0))
# the largest logit error over the logits' range each type allows: float32 as stored; the others as rounded
SAME_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
               "rope_theta", "tie_word_embeddings", "attention_bias", "bos_token_id", "eos_token_ids")
TOLERANCE = {"F32": 1e-5, "F16": 2e-3, "BF16": 2e-2, "Q8_0": 2e-2, "Q4_0": 0.25}


def logits_over_stages(path: Path, quantize: str = "", stages=STAGES) -> torch.Tensor:
    """The prompt's logits through the model's stages one after the other, as a mesh computes them."""
    n = read_config(path).num_layers
    models = [load_stage(StageSpec("m", str(path), a, b, n, quantize=quantize)) for a, b in stages]
    hidden = IDS
    for model in models:
        hidden = one_sequence(model, len(IDS))(hidden, 0)
    return models[-1].logits(hidden)


@pytest.fixture(scope="module")
def checkpoints(tiny_model) -> dict[str, Path]:
    return {arch: tiny_model(arch, num_layers=6) for arch in ("llama", "qwen2", "qwen3", "mistral")}


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_a_gguf_file_says_what_the_checkpoint_says(checkpoints, tmp_path: Path, arch: str) -> None:
    model_dir = checkpoints[arch]
    # (llama.cpp's converter writes Mistral as a Llama, without its sliding window)
    gguf = write_gguf(model_dir, tmp_path / "m.gguf", "Q8_0", arch="llama" if arch == "mistral" else arch)
    theirs_config, ours_config = read_config(gguf), read_config(model_dir)
    assert theirs_config.arch == ("llama" if arch == "mistral" else arch)
    for field in SAME_FIELDS:
        assert getattr(theirs_config, field) == getattr(ours_config, field), field
    model = GgufModel(gguf)
    theirs, ours = Tokenizer.from_str(model.tokenizer_json()), Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    for text in ("Hello there, world!  It's 2026.", "<|im_start|>user\nhi<|im_end|>\n", "naïve café ✓"):
        assert theirs.encode(text).ids == ours.encode(text).ids
        assert theirs.decode(ours.encode(text).ids) == ours.decode(ours.encode(text).ids)
    template = json.loads((model_dir / "tokenizer_config.json").read_text())["chat_template"]
    assert model.chat_template() == template


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("kind", ["F32", "F16", "BF16", "Q8_0", "Q4_0"])
def test_three_stages_of_a_gguf_file_give_the_checkpoints_logits(checkpoints, tmp_path: Path, arch: str,
                                                                 kind: str) -> None:
    model_dir = checkpoints[arch]
    want = logits_over_stages(model_dir, stages=((0, 6),))
    got = logits_over_stages(write_gguf(model_dir, tmp_path / "m.gguf", kind))
    scale = float(want.max() - want.min())
    assert float((got - want).abs().max()) <= TOLERANCE[kind] * scale
    if kind in ("F32", "F16"):
        assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_q4_0_matrices_of_an_int4_stage_are_repacked_exactly(checkpoints, tmp_path: Path) -> None:
    gguf = write_gguf(checkpoints["llama"], tmp_path / "m.gguf", "Q4_0")
    names = ["model.layers.1.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight"]
    dequantized = GgufCheckpoint(gguf).load(names)
    repacked = GgufCheckpoint(gguf, quantize="int4").load(names)
    for name in names:      # the same values: Q4_0's blocks are the int4 format's groups (rows back in HF order)
        assert repacked[name].dtype == torch.uint8
        w = Int4Weight(repacked[name], repacked[name + SCALE_SUFFIX])
        assert torch.equal(w.dequantize(), dequantized[name])
    # and the stage computes with them in the int4 kernels: its logits are the dequantized stage's
    n = read_config(gguf).num_layers
    int4 = load_stage(StageSpec("m", str(gguf), 0, n, n, quantize="int4"))
    assert int4.tensors["model.layers.1.mlp.down_proj.weight" + SCALE_SUFFIX].device.type == "meta"   # repacked
    as_float = load_stage(StageSpec("m", str(gguf), 0, n, n))
    want = as_float.logits(one_sequence(as_float, len(IDS))(IDS, 0))
    got = int4.logits(one_sequence(int4, len(IDS))(IDS, 0))
    assert float((got - want).abs().max()) <= 5e-2 * float(want.max() - want.min())   # bfloat16 activations


LLAMA_CPP = os.environ.get("STRATAMESH_LLAMA_CPP")     # a llama.cpp build (stratamesh.bench.llama_cpp)


@pytest.mark.skipif(not LLAMA_CPP, reason="set STRATAMESH_LLAMA_CPP to a llama.cpp build to convert with its tools")
@pytest.mark.parametrize(("kind", "tolerance"), [("f32", 1e-5), ("q8_0", 2e-2), ("q4_0", 0.25), ("Q4_K_M", 0.25)])
def test_llama_cpps_own_conversion_gives_the_checkpoints_logits(checkpoints, tmp_path: Path, kind: str,
                                                                tolerance: float) -> None:
    """Its converter's file (f32), and llama-quantize's of it (Q4_K_M: Q4_K and Q6_K tensors, dequantized)."""
    from stratamesh.bench.llama_cpp import convert, quantize

    model_dir, llama_dir = checkpoints["llama"], Path(LLAMA_CPP)
    f32 = tmp_path / "f32.gguf"
    convert(llama_dir, model_dir, f32, "f32")
    gguf = f32 if kind == "f32" else tmp_path / f"{kind}.gguf"
    if kind != "f32":
        quantize(llama_dir, f32, gguf, kind)
    types = {GgufCheckpoint(gguf).tensor_type(name) for name in GgufCheckpoint(gguf).tensor_names()}
    assert kind != "Q4_K_M" or {"Q4_K", "Q6_K"} <= types, types
    want = logits_over_stages(model_dir, stages=((0, 6),))
    got = logits_over_stages(gguf)
    assert float((got - want).abs().max()) <= tolerance * float(want.max() - want.min())


@pytest.mark.parametrize(("kind", "stored"), [("F16", ""), ("Q8_0", "int8"), ("Q4_0", "int4")])
def test_a_gguf_file_is_served_in_the_format_nearest_its_own(checkpoints, tmp_path: Path, kind: str,
                                                             stored: str) -> None:
    from stratamesh.fleet.model_folder import stored_quantize

    assert stored_quantize(write_gguf(checkpoints["llama"], tmp_path / "m.gguf", kind)) == stored
    assert stored_quantize(checkpoints["llama"]) == ""


def test_a_stage_reads_only_its_own_tensors(checkpoints, tmp_path: Path) -> None:
    gguf = write_gguf(checkpoints["qwen3"], tmp_path / "m.gguf", "Q8_0")
    middle: StageModel = load_stage(StageSpec("m", str(gguf), 2, 4, 6))
    layers = {int(name.split(".")[2]) for name in middle.tensor_names if name.startswith("model.layers.")}
    assert layers == {2, 3} and not any(name.startswith(("model.embed", "lm_head")) for name in middle.tensor_names)


def test_llamas_q_and_k_rows_come_back_in_hugging_faces_order() -> None:
    w = torch.arange(8 * 3).reshape(8, 3).numpy()
    for heads in (1, 2, 4):
        assert (_permuted(w, heads)[permutation_of_rows(8, heads)] == w).all()


def test_a_file_that_is_not_a_model_stages_compute_is_refused_by_name(tmp_path: Path) -> None:
    from gguf import GGUFWriter

    writer = GGUFWriter(str(tmp_path / "bert.gguf"), "bert")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(CheckpointError, match="architecture 'bert'"):
        read_config(tmp_path / "bert.gguf")
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(CheckpointError, match="not a GGUF file"):
        read_config(tmp_path / "junk.gguf")
