"""ONNX Runtime stages (kernels/models/onnx_stage.py): a pipeline torch -> ONNX Runtime -> torch over paged KV caches
against Hugging Face transformers, the export cache, and what ONNX Runtime stages refuse.

Tolerance: the ONNX Runtime stage computes in float32 like the torch stages, with its own kernels (MLAS matmuls, its
own softmax); their sums differ from torch's only in rounding, so logits stay within 1e-4 and greedy tokens are
identical. A last stage's final norm and LM head run in ONNX Runtime too (a graph of their own).

int8 weights (StageSpec.quantize) are torch's own, exactly, in ONNX Runtime's MatMulNBits, which rounds each block of
128 activations to int8 as well: its stage is held to being about as near the float32 stage as torch's int8 stage
with float32 activations is, and to the demo model's held-out perplexity. A quantized head's logits are held within
3% of their largest value of the float32 product of its weights as stored (what the int8 activations cost).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from onnx import numpy_helper
from transformers import AutoModelForCausalLM

from stratamesh.agent.engine.stage_runner import StageRunner
from stratamesh.fleet.errors import InvalidInput
from stratamesh.fleet.stages import StageSpec
from stratamesh.kernels.demo_model import DEMO_DIR, read_book, served_perplexity
from stratamesh.kernels.models.config import read_config
from stratamesh.kernels.models.decoder import load_stage
from stratamesh.kernels.models import onnx_stage
from stratamesh.kernels.models.checkpoint import EMBED
from stratamesh.kernels.models.onnx_stage import (AttentionIndex, NBitsWeight, OrtStageModel, export_head,
                                                  export_layers, export_path, export_stages, head_path, layer_tensors,
                                                  load_runtime_stage)
from stratamesh.kernels.ops.norm import rms_norm
from stratamesh.kernels.ops.paged_attention import SeqSlice
from stratamesh.kernels.ops.quant import exact_products

RANGES = ((0, 2), (2, 4), (4, 6))
PROMPTS = [list(range(40, 77)), [5, 17, 42, 99, 7, 3, 250, 12]]
NEW_TOKENS = 12
BLOCKS_PER_SEQ = 8
BLOCK = 16


@pytest.fixture(scope="module")
def model_dir(tiny_model) -> Path:
    return tiny_model("llama", num_layers=6)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One export cache for the module's tests of model_dir (an export takes seconds)."""
    return tmp_path_factory.mktemp("onnx-cache")


def runners(model_dir: Path, cache_dir: Path) -> list[StageRunner]:
    """torch, ONNX Runtime, torch: one stage runner per range, each with its own paged KV cache."""
    out = []
    for k, (start, end) in enumerate(RANGES):
        model = load_stage(StageSpec("m", str(model_dir), start, end, 6))
        if k == 1:
            model = OrtStageModel.from_model(model, cache_dir)
        out.append(StageRunner(model, BLOCKS_PER_SEQ * len(PROMPTS)))
    return out


def step(pipeline: list[StageRunner], token_ids: list[list[int]], done: list[int]) -> torch.Tensor:
    """One batched step of every sequence (its new tokens after done[i] cached ones) through the pipeline: the
    logits of each sequence's last token [len(token_ids), vocab]."""
    seqs, row = [], 0
    for i, new in enumerate(token_ids):
        table = list(range(i * BLOCKS_PER_SEQ, (i + 1) * BLOCKS_PER_SEQ))
        seqs.append(SeqSlice(row, len(new), done[i], table))
        row += len(new)
    x: torch.Tensor = torch.tensor([t for new in token_ids for t in new])
    for runner in pipeline:
        x = runner.forward(x, seqs)
    last_rows = torch.tensor([s.q_start + s.q_len - 1 for s in seqs])
    return pipeline[-1].model.logits(x[last_rows])


def test_a_torch_onnxruntime_torch_pipeline_equals_transformers(model_dir: Path, cache_dir: Path) -> None:
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    pipeline = runners(model_dir, cache_dir)
    # the prompts prefill in one step, then every step decodes one token of each: batches mix lengths and depths
    logits = step(pipeline, PROMPTS, [0, 0])
    generated = [[int(row.argmax())] for row in logits]
    with torch.inference_mode():
        for i, prompt in enumerate(PROMPTS):
            expected = reference(torch.tensor([prompt])).logits[0, -1]
            torch.testing.assert_close(logits[i], expected, atol=1e-4, rtol=0)
    for _ in range(NEW_TOKENS - 1):
        done = [len(p) + len(g) - 1 for p, g in zip(PROMPTS, generated, strict=True)]
        logits = step(pipeline, [g[-1:] for g in generated], done)
        for g, row in zip(generated, logits, strict=True):
            g.append(int(row.argmax()))
    with torch.inference_mode():
        for prompt, tokens in zip(PROMPTS, generated, strict=True):
            out = reference.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False)
            assert tokens == out[0, len(prompt):].tolist()


def test_a_step_of_the_onnxruntime_stage_equals_the_torch_stage_and_writes_the_same_kv(model_dir: Path,
                                                                                         cache_dir: Path) -> None:
    spec = StageSpec("m", str(model_dir), 2, 4, 6)
    torch_runner = StageRunner(load_stage(spec), 8)
    ort_runner = StageRunner(load_runtime_stage(replace(spec, runtime="onnxruntime"), cache_dir), 8)
    hidden = torch.randn(10, 256, generator=torch.Generator().manual_seed(0))
    for seqs, rows in (([SeqSlice(0, 7, 0, [0, 1]), SeqSlice(7, 3, 0, [2])], hidden),       # two prefills
                       ([SeqSlice(0, 1, 7, [0, 1]), SeqSlice(1, 1, 3, [2])], hidden[:2]),   # two decodes
                       ([SeqSlice(0, 4, 8, [0, 1]), SeqSlice(4, 1, 4, [2])], hidden[:5])):  # a chunk beside a decode
        torch.testing.assert_close(ort_runner.forward(rows, seqs), torch_runner.forward(rows, seqs),
                                   atol=2e-5, rtol=0)
    for layer in range(2):
        torch.testing.assert_close(ort_runner.cache.k[layer], torch_runner.cache.k[layer], atol=2e-5, rtol=0)
        torch.testing.assert_close(ort_runner.cache.v[layer], torch_runner.cache.v[layer], atol=2e-5, rtol=0)


@pytest.mark.parametrize("quantize", ["int8", "int4"])
def test_a_quantized_export_holds_torchs_weights_in_matmul_nbits(model_dir: Path, cache_dir: Path,
                                                                 quantize: str) -> None:
    model = load_stage(StageSpec("m", str(model_dir), 2, 4, 6, quantize=quantize, runtime="onnxruntime"))
    path = export_layers(model, cache_dir)
    assert path != export_path(load_stage(StageSpec("m", str(model_dir), 2, 4, 6)), cache_dir)   # its own export
    graph = onnx.load(str(path)).graph
    initializers = {i.name: numpy_helper.to_array(i) for i in graph.initializer}
    nodes = [n for n in graph.node if n.op_type == "MatMulNBits"]
    assert len(nodes) == 4 * 2      # every projection; the float products left are attention's
    assert not [n for n in graph.node if n.op_type in ("MatMul", "Gemm") and set(n.input) & set(initializers)]
    exported = [(initializers[n.input[1]], initializers[n.input[2]]) for n in nodes]
    assert {n.attribute[2].i if n.attribute[2].name == "bits" else None for n in nodes} <= {4, 8}
    for layer in model._layers:
        for w in (layer.qkv, layer.o, layer.gate_up, layer.down):
            packed = NBitsWeight.of(w)
            assert any(np.array_equal(b, packed.packed.numpy()) and np.array_equal(s, packed.scales.numpy())
                       for b, s in exported)
            rows = packed.packed.reshape(w.shape[0], -1)
            if quantize == "int8":      # q + MatMulNBits' zero point, 128
                assert packed.bits == 8
                assert torch.equal(rows[:, :w.q.shape[1]].to(torch.int16) - 128, w.q.to(torch.int16))
            else:                       # the stored bytes and scales as they are, each group a block
                assert packed.bits == 4 and torch.equal(rows, w.packed)
                assert torch.equal(packed.scales, w.scale.reshape(-1))


@pytest.mark.parametrize("quantize, tied", [("", False), ("", True), ("int8", False), ("int4", True)])
def test_a_last_onnxruntime_stage_computes_its_final_norm_and_lm_head_in_onnxruntime(
        tiny_model, model_dir: Path, cache_dir: Path, quantize: str, tied: bool) -> None:
    """tied: one stage of a model whose head is its embedding, looked up in torch and multiplied in ONNX Runtime."""
    folder, start = (tiny_model("llama", num_layers=6, tie_word_embeddings=True), 0) if tied else (model_dir, 4)
    spec = StageSpec("m", str(folder), start, 6, 6, quantize=quantize, runtime="onnxruntime")
    stored = load_stage(spec)           # (for the ONNX Runtime runtime: quantized matrices as stored, not repacked)
    stage = load_runtime_stage(spec, cache_dir)
    head_graph = onnx.load(str(head_path(export_path(stored, cache_dir))), load_external_data=False).graph
    assert [n.op_type for n in head_graph.node] == ["SimplifiedLayerNormalization",
                                                    "MatMulNBits" if quantize else "MatMul"]
    assert set(stage.tensors) == ({EMBED, f"{EMBED}_scale"} if tied and quantize else {EMBED} if tied else set()) | {
        "model.norm.weight"}                        # torch keeps what it looks up, and the norm (for pooling)
    hidden = torch.randn(5, 256, generator=torch.Generator().manual_seed(0)) * 3
    head = stored._lm_head
    expected = F.linear(rms_norm(hidden, stored._final_norm, stored.config.rms_norm_eps),
                        head if not quantize else head.dequantize())
    logits = stage.logits(hidden)
    assert logits.dtype == torch.float32 and logits.shape == expected.shape
    if not quantize:
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-5)      # (a tied head's logits are large)
        torch.testing.assert_close(logits, load_stage(replace(spec, runtime="torch")).logits(hidden), atol=1e-4,
                                   rtol=1e-5)
    else:
        assert 0 < (logits - expected).abs().max() < 0.03 * expected.abs().max()
    # a step reads the layers, the head (in ONNX Runtime) and the norm once, and no embedding (a lookup)
    assert stage.step_read_bytes == stage._ort.weight_bytes + stage._head.weight_bytes + 256 * 4


@pytest.mark.parametrize("quantize", ["int8", "int4"])
def test_a_quantized_onnxruntime_stage_is_about_as_near_float32_as_the_torch_one(model_dir: Path, cache_dir: Path,
                                                                               quantize: str) -> None:
    full = StageRunner(load_stage(StageSpec("m", str(model_dir), 2, 4, 6)), 8)
    quantized = StageSpec("m", str(model_dir), 2, 4, 6, quantize=quantize)
    torch_int8 = StageRunner(load_stage(quantized), 8)
    ort_int8 = StageRunner(load_runtime_stage(replace(quantized, runtime="onnxruntime"), cache_dir), 8)
    hidden = torch.randn(10, 256, generator=torch.Generator().manual_seed(0))
    for seqs, rows in (([SeqSlice(0, 7, 0, [0, 1]), SeqSlice(7, 3, 0, [2])], hidden),
                       ([SeqSlice(0, 1, 7, [0, 1]), SeqSlice(1, 1, 3, [2])], hidden[:2])):
        expected = full.forward(rows, seqs)
        with exact_products():
            torch_error = (torch_int8.forward(rows, seqs) - expected).abs().max()
        ort_error = (ort_int8.forward(rows, seqs) - expected).abs().max()
        # the layers' change to the hidden states is of order 1 here: int8 moves it by a few percent, int4 by more
        assert 0 < ort_error < 2 * torch_error < (0.1 if quantize == "int8" else 0.5) * (expected - rows).abs().max()


def test_an_agent_loads_an_int8_onnxruntime_stage_in_about_a_quarter_of_the_bytes(model_dir: Path,
                                                                                   cache_dir: Path) -> None:
    specs = [StageSpec("m", str(model_dir), 2, 4, 6, runtime="onnxruntime", quantize=q) for q in ("", "int8")]
    full, int8 = (StageRunner.load(s, 1 << 20, onnx_cache=cache_dir).model for s in specs)
    assert isinstance(int8, OrtStageModel) and int8.tensors == {}       # a middle stage: every weight is ORT's
    assert 0 < int8.param_bytes < 0.27 * full.param_bytes                # a byte a weight, a scale per 128


@pytest.mark.slow
def test_int4_in_onnx_runtime_keeps_the_demo_models_held_out_perplexity() -> None:
    """int4, over the held-out chapter's first 2,000 of its ~9,900 tokens (benchmarks/edge_cpu.py measures every
    format over all of them; float32 in ONNX Runtime is torch's: test_a_torch_onnxruntime_torch_pipeline_equals_
    transformers; int8 is as near float32 as torch's int8: test_a_quantized_onnxruntime_stage_is_about_as_near_...).
    One export, in this process: a pool's processes beside a busy suite's took most of a minute."""
    # the session's cache folder (tests/conftest.py), where the edge benchmark's smoke test exports the same stages;
    # what is not there yet is exported first, at once
    cache, n = os.environ["STRATAMESH_CACHE_DIR"], read_config(DEMO_DIR).num_layers
    export_stages([StageSpec("demo", str(DEMO_DIR), 0, n, n, quantize="int4", runtime="onnxruntime")], cache)
    held_out = read_book().held_out

    def perplexity(**kwargs) -> float:
        return served_perplexity(DEMO_DIR, held_out, max_tokens=2000, **kwargs)

    float32 = perplexity()
    assert perplexity(quantize="int4", onnx_cache=cache) == pytest.approx(float32, rel=0.05)


def test_the_attention_index_places_each_query_and_key() -> None:
    # a 3-token chunk after 5 cached tokens (blocks 4 and 6 of 4 slots), and a decode after 1 cached token (block 9)
    index = AttentionIndex.of([SeqSlice(0, 3, 5, [4, 6]), SeqSlice(3, 1, 1, [9])], block_size=4)
    assert index.past_slots.tolist() == [[16, 17, 18, 19, 24], [36, 0, 0, 0, 0]]
    assert index.rows.tolist() == [[0, 1, 2], [3, 0, 0]] and index.unpad.tolist() == [0, 1, 2, 3]
    assert index.past_mask[0].all() and index.past_mask[1].tolist() == [[True, False, False, False, False]] * 3
    assert index.new_mask[0].tolist() == [[True, False, False], [True, True, False], [True, True, True]]
    assert index.new_mask[1].tolist() == [[True, False, False], [False] * 3, [False] * 3]   # padding sees a past key


def test_an_export_is_made_once_and_again_when_the_checkpoint_or_the_code_changes_replacing_the_old_one(
        tiny_model, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model_dir = tiny_model("llama", num_layers=2, seed=7)
    model = load_stage(StageSpec("m", str(model_dir), 0, 2, 2))
    path, head = export_layers(model, tmp_path), export_head(model, tmp_path)
    assert path == export_path(model, tmp_path) and path.exists() and Path(f"{path}.data").exists()
    assert head == head_path(path) and head.exists() and Path(f"{head}.data").exists()
    made = path.stat().st_mtime_ns
    assert export_layers(model, tmp_path).stat().st_mtime_ns == made       # found, not exported again
    # exports that stay: another stage of the checkpoint, and the same stage of a copy of it elsewhere
    other_stage = export_layers(load_stage(StageSpec("m", str(model_dir), 1, 2, 2)), tmp_path)
    copy = Path(shutil.copytree(model_dir, tmp_path / "elsewhere" / model_dir.name))
    of_copy = export_layers(load_stage(StageSpec("m", str(copy), 0, 2, 2)), tmp_path)
    weights = next(model_dir.glob("*.safetensors"))
    os.utime(weights, ns=(made, weights.stat().st_mtime_ns + 1_000_000_000))
    changed = export_layers(model, tmp_path)
    assert changed != path and changed.exists()                           # a changed checkpoint: a new key ...
    assert not [p for p in (path, head) for p in (p, Path(f"{p}.data")) if p.exists()]   # ... the exports it
    # replaces (layers and head) are gone
    assert all(p.exists() and Path(f"{p}.data").exists() for p in (other_stage, of_copy))
    monkeypatch.setattr(onnx_stage, "_code_key", lambda: "an upgrade")
    assert export_path(model, tmp_path) != changed                         # changed code (an upgrade): a new key


def test_the_stages_of_a_model_share_one_traced_layer_each_copy_holding_its_own_layers_weights(
        model_dir: Path, tmp_path: Path) -> None:
    def templates() -> int:
        return len(list((tmp_path / "onnx").glob("layer-*.onnx")))

    export_layers(load_stage(StageSpec("m", str(model_dir), 0, 2, 6)), tmp_path)
    model = load_stage(StageSpec("m", str(model_dir), 2, 6, 6))
    path = export_layers(model, tmp_path)
    assert templates() == 1                 # the second stage traced nothing
    initializers = {i.name: numpy_helper.to_array(i) for i in onnx.load(str(path)).graph.initializer}
    for i, layer in enumerate(model._layers):          # layers 2..5 of the checkpoint, in order
        for name, tensor in layer_tensors(layer).items():
            assert np.array_equal(initializers[f"l{i}.{name}"], tensor.numpy()), (i, name)
    assert not [name for name in initializers if name.startswith("l4.")]
    export_layers(load_stage(StageSpec("m", str(model_dir), 0, 2, 6, quantize="int8")), tmp_path)
    assert templates() == 2                 # int8 weights: a layer of other inputs and nodes


@pytest.mark.parametrize("spec, message", [
    (dict(dtype="bfloat16"), "compute in float32"),
    (dict(tp_degree=2), "one CPU rank"),
], ids=["bfloat16", "tensor-parallel"])
def test_what_an_onnxruntime_stage_refuses(tiny_model, tmp_path: Path, spec: dict, message: str) -> None:
    model_dir = tiny_model("llama", num_layers=2)
    model = load_stage(StageSpec("m", str(model_dir), 0, 2, 2, dtype=spec.get("dtype", "float32")))
    model.spec = StageSpec("m", str(model_dir), 0, 2, 2, **spec)
    with pytest.raises(InvalidInput, match=message):
        export_layers(model, tmp_path)


def test_a_stage_whose_layers_differ_in_shape_is_refused(tiny_model, tmp_path: Path) -> None:
    model = load_stage(StageSpec("m", str(tiny_model("llama", num_layers=2)), 0, 2, 2))
    first = model._layers[0]
    model._layers[1] = replace(model._layers[1], qkv_bias=torch.zeros(first.qkv.shape[0]))   # one layer biased
    with pytest.raises(InvalidInput, match="layers of one shape"):
        export_layers(model, tmp_path)


def test_a_sliding_window_model_is_refused(tiny_model, tmp_path: Path) -> None:
    model_dir = tiny_model("mistral", num_layers=2, sliding_window=8)
    with pytest.raises(InvalidInput, match="sliding-window"):
        export_layers(load_stage(StageSpec("m", str(model_dir), 0, 2, 2)), tmp_path)


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_a_mixture_of_experts_is_refused_with_the_runtime_to_use(tiny_model, tmp_path: Path, arch: str) -> None:
    """Its int8 experts are served by torch stages (tests/kernels/test_quant.py); ONNX Runtime's export has no
    experts yet."""
    model_dir = tiny_model(arch, num_layers=2)
    with pytest.raises(InvalidInput, match=f"not {arch}'s: .* serve it with --runtime torch"):
        export_layers(load_stage(StageSpec("m", str(model_dir), 0, 2, 2, quantize="int8")), tmp_path)
