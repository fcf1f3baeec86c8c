"""A stage's decoder layers as an ONNX graph that ONNX Runtime runs, in place of the torch layers of StageModel.

The graph computes layers [start, end) of a Llama-family decoder over a step's N tokens, hidden states in and
hidden states out, with attention over the stage's paged KV cache:
- Paged, not contiguous. A stage keeps one PagedKVCache whatever computes its layers, so the block manager, prefix
  caching and KV moves between agents work as they do for torch stages. Each layer's pool [slots, KV, D] is an
  input the graph reads in place (bound without a copy); it gathers the slots of each sequence's cached prefix.
- The step's own K and V are outputs [layers, N, KV, D] that the engine writes into their slots after the run:
  ONNX has no in-place scatter, and a ScatterND would copy the whole pool every step.
A last stage's final norm and LM head are a graph and a session of their own (export_head: the head reads as many
bytes as two or three layers, and MLAS reads weights faster than torch's float32 matmul: benchmarks/edge_cpu.py's
table of products); the embedding's lookup stays in torch. The exporter traces one layer, its weights inputs
(layer_template: seconds, once per model shapes and weights), and a stage's graph is copies of it chained, each bound
to its own layer's weights (onnx_compose). Exports are cached per (checkpoint, layer range, dtype, weights, opset,
code) in a cache directory; a changed checkpoint or code is exported again, and the export it replaces (a copy of
the stage's weights) is deleted.

int8 weights (StageSpec.quantize) are torch's own (kernels.ops.quant: per-output-channel scales) computed by ONNX
Runtime's MatMulNBits (com.microsoft) at accuracy_level 4: it quantizes each block of INT8_BLOCK activations of a
token to int8 too and multiplies in integers, 2-3x faster than a float32 MatMul on this CPU; accuracy_level 0
(float activations) dequantizes the weight for every product and is 10-50x slower than float32. Each row's one scale
is repeated over its blocks, so the weights are exactly torch's; the activations' rounding is the difference.
"""

from __future__ import annotations

import hashlib
import inspect
import logging
import math
import multiprocessing
import os
import re
import tempfile
import warnings
from collections.abc import Generator, Iterator, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from stratamesh.fleet.errors import InvalidInput
from stratamesh.fleet.states import Runtime
from stratamesh.fleet.stages import ONNX_MODEL_TYPES, ORT_DTYPES, StageSpec
from stratamesh.kernels.models.checkpoint import EMBED, FINAL_NORM
from stratamesh.kernels.models.config import ModelConfig
from stratamesh.kernels.models.decoder import StageModel, load_stage
from stratamesh.kernels.models.families.llama import LlamaLayer
from stratamesh.kernels.ops.attention import Attention
from stratamesh.kernels.ops.mlp import swiglu
from stratamesh.kernels.ops.quant import SCALE_SUFFIX, Int4Weight, Int8Weight, unpack_int4
from stratamesh.kernels.ops.kv_cache import KVCache
from stratamesh.kernels.ops.paged_attention import PagedBatch, PagedKVCache, SeqSlice
from stratamesh.kernels.ops.rope import apply_rope, rope_cos_sin

log = logging.getLogger(__name__)

OPSET = 18
EXPORT_KEY_LEN = 12                     # hex digits of an export's key in its name
_NUMPY = {torch.float32: np.float32, torch.int64: np.int64, torch.bool: np.bool_}
_INPUTS = ("hidden", "cos", "sin", "past_slots", "rows", "unpad", "past_mask", "new_mask")
INT8_BLOCK = 128      # activations per int8 scale in MatMulNBits' integer products (1.8e-2 of a product's largest
                      # value vs 3.5e-2 with one scale per row, at the same speed here; 32 is 30% slower)
MATMUL_NBITS_ZERO = 128                 # MatMulNBits' 8-bit weights are unsigned, their zero point 2^(bits - 1)


@dataclass(frozen=True, slots=True)
class AttentionIndex:
    """Where a step's queries and keys are, for the graph: B sequences of at most T new tokens after at most P
    cached ones (P >= 1: a step with no cached prefix gets one masked-out slot, so no dimension is empty)."""

    past_slots: torch.Tensor    # [B, P] int64: the cache slots of each sequence's cached positions (0: padding)
    rows: torch.Tensor          # [B, T] int64: the batch row of each sequence's t-th new token (0: padding)
    unpad: torch.Tensor         # [N] int64: where each batch row sits in B x T
    past_mask: torch.Tensor     # [B, T, P] bool: which cached keys each query sees
    new_mask: torch.Tensor      # [B, T, T] bool: which of the step's own keys each query sees

    @classmethod
    def of(cls, seqs: Sequence[SeqSlice], block_size: int) -> AttentionIndex:
        """The index of a batch's sequences (causal attention, no window)."""
        num_seqs, most_new = len(seqs), max(s.q_len for s in seqs)
        most_past = max(1, max(s.start_pos for s in seqs))
        past = torch.zeros(num_seqs, most_past, dtype=torch.long)
        rows = torch.zeros(num_seqs, most_new, dtype=torch.long)
        unpad = torch.empty(sum(s.q_len for s in seqs), dtype=torch.long)
        past_mask = torch.zeros(num_seqs, most_new, most_past, dtype=torch.bool)
        new_mask = torch.zeros(num_seqs, most_new, most_new, dtype=torch.bool)
        causal = torch.ones(most_new, most_new, dtype=torch.bool).tril()
        for b, s in enumerate(seqs):
            table = torch.tensor(s.block_table, dtype=torch.long)
            positions = torch.arange(s.start_pos)
            past[b, :s.start_pos] = table[positions // block_size] * block_size + positions % block_size
            rows[b, :s.q_len] = torch.arange(s.q_start, s.q_start + s.q_len)
            unpad[s.q_start:s.q_start + s.q_len] = torch.arange(b * most_new, b * most_new + s.q_len)
            past_mask[b, :s.q_len, :s.start_pos] = True
            new_mask[b, :s.q_len, :s.q_len] = causal[:s.q_len, :s.q_len]
            past_mask[b, s.q_len:, 0] = True       # padding queries see one key: no row of -inf, no NaN
        return cls(past, rows, unpad, past_mask, new_mask)


@dataclass(frozen=True, slots=True)
class NBitsWeight:
    """A quantized matrix [out, in] as MatMulNBits takes it: packed [out, blocks, block * bits / 8] uint8 (unsigned,
    its zero point 2^(bits - 1)), scales [out * blocks] float32. From an Int8Weight: q + 128 in blocks of
    _int8_block (the last padded with zero weights), each row's scale once per block; from an Int4Weight: its bytes
    and scales as they are (the same layout), its groups the blocks."""

    packed: torch.Tensor
    scales: torch.Tensor
    in_features: int
    bits: int

    @classmethod
    def of(cls, w: Int8Weight | Int4Weight) -> NBitsWeight:
        if isinstance(w, Int4Weight):
            (out_features, in_features), group = w.shape, w.group
            packed = w.packed.reshape(out_features, in_features // group, group // 2)
            return cls(packed.contiguous(), w.scale.reshape(-1).float().contiguous(), in_features, w.BITS)
        out_features, in_features = w.q.shape
        block = _int8_block(in_features)
        blocks = -(-in_features // block)
        packed = torch.full((out_features, blocks * block), MATMUL_NBITS_ZERO, dtype=torch.int16)
        packed[:, :in_features] = w.q.to(torch.int16) + MATMUL_NBITS_ZERO
        return cls(packed.to(torch.uint8).view(out_features, blocks, block).contiguous(),
                   w.scale.float().repeat_interleave(blocks).contiguous(), in_features, w.BITS)


def _int8_block(in_features: int) -> int:
    """MatMulNBits' block: INT8_BLOCK, or the power of two (at least 16) that holds a narrower row whole."""
    return min(INT8_BLOCK, max(16, 1 << (in_features - 1).bit_length()))


@torch.library.custom_op("stratamesh::nbits_linear", mutates_args=())
def nbits_linear(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, in_features: int,
                 bits: int) -> torch.Tensor:
    """x [N, in] times an NBitsWeight's matrix, transposed -> [N, out]: what MatMulNBits computes (exported as that
    node by _translate_nbits_linear), here with the weight dequantized and float activations."""
    out_features, blocks, _ = packed.shape
    q = packed.reshape(out_features, -1)
    if bits == 4:
        q = unpack_int4(q)
    q = q.reshape(out_features, blocks, -1).to(x.dtype) - 2 ** (bits - 1)
    w = (q * scales.view(out_features, blocks, 1).to(x.dtype)).reshape(out_features, -1)[:, :in_features]
    return x @ w.T


@nbits_linear.register_fake
def _(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, in_features: int, bits: int) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], packed.shape[0])


def _translate_nbits_linear(x, packed, scales, in_features: int, bits: int):   # (the exporter's symbolic values)
    """nbits_linear as ONNX Runtime's MatMulNBits node."""
    out_features, _, block_bytes = packed.shape
    return _matmul_nbits()(x, packed, scales, K=in_features, N=out_features, bits=bits,
                           block_size=block_bytes * 8 // bits, accuracy_level=4)


@cache
def _matmul_nbits():
    """MatMulNBits (com.microsoft) as an onnxscript op: the exporter needs the schema ONNX itself does not know."""
    from onnx.defs import OpSchema
    from onnxscript.values import Op, Opset

    floats = ("T1", ["tensor(float)"], "activations and scales")
    schema = OpSchema("MatMulNBits", "com.microsoft", 1,
                      inputs=[OpSchema.FormalParameter(name, kind) for name, kind in
                              (("A", "T1"), ("B", "T2"), ("scales", "T1"))],
                      outputs=[OpSchema.FormalParameter("Y", "T1")],
                      type_constraints=[floats, ("T2", ["tensor(uint8)"], "packed weights")],
                      attributes=[OpSchema.Attribute(name, OpSchema.AttrType.INT, "") for name in
                                  ("K", "N", "bits", "block_size", "accuracy_level")])
    return Op(Opset("com.microsoft", 1), "MatMulNBits", schema)


def _linear(x: torch.Tensor, w: torch.Tensor | NBitsWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, for a float weight or an NBitsWeight."""
    if isinstance(w, torch.Tensor):
        return F.linear(x, w, bias)
    out = nbits_linear(x, w.packed, w.scales, w.in_features, w.bits)
    return out if bias is None else out + bias


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """kernels.ops.norm.rms_norm of float32 x, written as the pattern ONNX Runtime fuses into one
    SimplifiedLayerNormalization node: a division by the root (the exporter writes torch's rsqrt as a Sqrt and a
    Reciprocal, which it does not fuse: seven nodes a norm, a fifth of a layer's)."""
    return weight * (x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps))


_WEIGHTS = ("input_norm", "post_attn_norm", "qkv", "o", "gate_up", "down", "qkv_bias", "o_bias")


def layer_tensors(layer: LlamaLayer) -> dict[str, torch.Tensor]:
    """A layer's weights as the exported graph takes them, by name: a quantized one as its NBitsWeight's packed and
    scales tensors ("qkv_packed", "qkv_scales")."""
    out = {}
    for name in _WEIGHTS:
        tensor = getattr(layer, name)
        if isinstance(tensor, Int8Weight | Int4Weight):
            w = NBitsWeight.of(tensor)
            out[f"{name}_packed"], out[f"{name}_scales"] = w.packed, w.scales
        elif tensor is not None:
            out[name] = tensor.detach().contiguous()
    return out


class _Layer(torch.nn.Module):
    """The graph traced: one decoder layer as a function of a step's hidden states, RoPE tables, attention index,
    the layer's KV pools and its weights (layer_tensors, in the order of `names`). Its weights are inputs, so that
    one trace serves every layer of a model of these shapes (onnx_compose.compose_layers)."""

    def __init__(self, model: StageModel, names: Sequence[str], in_features: Mapping[str, tuple[int, int]]) -> None:
        super().__init__()
        c = model.config
        self.eps, self.heads, self.kv_heads, self.head_dim = c.rms_norm_eps, model.num_heads, model.num_kv_heads, \
            c.head_dim
        self.names, self.in_features = tuple(names), dict(in_features)    # quantized weights' (row length, bits)

    def weights(self, tensors: Sequence[torch.Tensor]) -> LlamaLayer:
        """The layer's LlamaLayer from the graph's weight inputs."""
        given = dict(zip(self.names, tensors, strict=True))
        own = {}
        for name in _WEIGHTS:
            if f"{name}_packed" in given:
                own[name] = NBitsWeight(given[f"{name}_packed"], given[f"{name}_scales"], *self.in_features[name])
            elif name in given:
                own[name] = given[name]
        return LlamaLayer(**own)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, past_slots: torch.Tensor,
                rows: torch.Tensor, unpad: torch.Tensor, past_mask: torch.Tensor, new_mask: torch.Tensor,
                k_pool: torch.Tensor, v_pool: torch.Tensor,
                *tensors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        heads, kv_heads, dim = self.heads, self.kv_heads, self.head_dim
        layer = self.weights(tensors)
        num_seqs, most_new = rows.shape
        blocked = ~torch.cat([past_mask, new_mask], dim=-1)[:, None, None]     # [B, 1, 1, T, P + T]
        cos, sin = cos[:, None], sin[:, None]
        x = hidden
        h = _rms_norm(x, layer.input_norm, self.eps)
        qkv = _linear(h, layer.qkv, layer.qkv_bias).view(-1, heads + 2 * kv_heads, dim)
        qk = apply_rope(qkv[:, :heads + kv_heads], cos, sin)
        q, k, v = qk[:, :heads], qk[:, heads:], qkv[:, heads + kv_heads:]
        keys = torch.cat([k_pool[past_slots], k[rows]], dim=1)              # [B, P + T, KV, D]
        values = torch.cat([v_pool[past_slots], v[rows]], dim=1)
        # [B, KV, G, T, D] against keys [B, KV, 1, D, S]: each group of G query heads shares its KV head
        queries = q[rows].view(num_seqs, most_new, kv_heads, heads // kv_heads, dim).permute(0, 2, 3, 1, 4)
        scores = queries @ keys.permute(0, 2, 3, 1)[:, :, None] * dim ** -0.5          # [B, KV, G, T, S]
        weights = scores.masked_fill(blocked, float("-inf")).softmax(dim=-1)
        out = weights @ values.permute(0, 2, 1, 3)[:, :, None]                        # [B, KV, G, T, D]
        out = out.permute(0, 3, 1, 2, 4).reshape(-1, heads * dim)[unpad]
        x = x + _linear(out, layer.o, layer.o_bias)
        x = x + swiglu(_rms_norm(x, layer.post_attn_norm, self.eps), layer.gate_up, layer.down, _linear)
        return x, k[None], v[None]                 # new K and V: [1, N, KV, D], concatenated over the layers


def _input_names(num_layers: int) -> list[str]:
    """The stage graph's inputs: the step's, then each layer's K and V pool."""
    return [*_INPUTS, *(f"{kind}{i}" for i in range(num_layers) for kind in ("k", "v"))]


def export_path(model: StageModel, cache_dir: str | Path) -> Path:
    """Where the export of the model's layers lives: named by checkpoint folder, layer range, dtype, weights and
    opset, keyed by the checkpoint files' sizes and times, torch's version and the code (any change exports again)."""
    return _export_path_of(model.spec, cache_dir)


def _export_path_of(spec: StageSpec, cache_dir: str | Path) -> Path:
    """export_path of the stage spec names: <stage name>-<key>.onnx (_stage_name)."""
    files = sorted(Path(spec.model_path).glob("*.safetensors")) + [Path(spec.model_path, "config.json")]
    key = hashlib.sha256(repr([(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files]
                              + [torch.__version__, _code_key()]).encode()).hexdigest()
    return Path(cache_dir, "onnx", f"{_stage_name(spec)}-{key[:EXPORT_KEY_LEN]}.onnx")


def _stage_name(spec: StageSpec) -> str:
    """What an export is an export of: the checkpoint folder (its name, and a digest of where it is), the layer range,
    dtype, weights and opset."""
    folder = Path(spec.model_path).resolve()
    where = hashlib.sha256(str(folder).encode()).hexdigest()[:8]
    weights = f"-{spec.quantize}" if spec.quantize else ""
    return f"{folder.name}-{where}-{spec.start_layer}-{spec.end_layer}-{spec.dtype}{weights}-opset{OPSET}"


def _delete_replaced(path: Path, spec: StageSpec) -> None:
    """Deletes the exports the one at path replaces: of the same stage of the same checkpoint folder, with another
    key (older checkpoint files, another torch, older code). Each holds a copy of the stage's weights."""
    export = re.compile(re.escape(_stage_name(spec)) + rf"-[0-9a-f]{{{EXPORT_KEY_LEN}}}(\.head)?\.onnx(\.data)?")
    current = {name for export_of in (path, head_path(path)) for name in (export_of.name, f"{export_of.name}.data")}
    for old in path.parent.iterdir():
        if export.fullmatch(old.name) and old.name not in current:
            old.unlink(missing_ok=True)
            log.info("deleted %s: replaced by %s", old, path.name)


@cache
def _code_key() -> str:
    """A digest of the code a graph is traced and composed from: an upgrade that changes it exports again."""
    files = [Path(__file__), Path(__file__).with_name("onnx_compose.py"),
             *(Path(inspect.getsourcefile(op)) for op in (apply_rope, swiglu))]
    return hashlib.sha256(b"".join(f.read_bytes() for f in files)).hexdigest()[:16]


def export_layers(model: StageModel, cache_dir: str | Path) -> Path:
    """The model's layers as an ONNX file (weights beside it, as external data), made once and cached: copies of
    the layer template (layer_template) chained, each with its layer's weights."""
    path = export_path(model, cache_dir)
    if path.exists():
        return path
    import onnx     # (here: an agent serving torch stages only never loads onnx)

    from stratamesh.kernels.models.onnx_compose import compose_layers

    check_exportable(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    layers = [{name: t.numpy() for name, t in layer_tensors(layer).items()} for layer in model._layers]
    if len({tuple((name, t.shape, t.dtype) for name, t in layer.items()) for layer in layers}) > 1:
        raise InvalidInput("ONNX Runtime stages serve layers of one shape: this stage's layers differ")
    template = onnx.load(str(layer_template(model, cache_dir)))
    with _written(path) as draft:
        compose_layers(template, _INPUTS[1:], layers, draft)
    log.info("exported layers [%d, %d) of %s to %s", model.spec.start_layer, model.spec.end_layer,
             model.spec.model_id, path)
    _delete_replaced(path, model.spec)
    return path


def head_path(layers_path: Path) -> Path:
    """Where the export of a last stage's final norm and LM head lives: beside its layers' (export_path)."""
    return layers_path.with_name(layers_path.name.removesuffix(".onnx") + ".head.onnx")


def export_head(model: StageModel, cache_dir: str | Path) -> Path:
    """The model's final norm and LM head as an ONNX file (weights beside it), made once and cached beside its
    layers' export: hidden [T, hidden] -> logits [T, vocab] float32, the norm one SimplifiedLayerNormalization, the
    head a MatMul (float32, stored transposed) or a MatMulNBits (quantized, as the layers' products). Built node by
    node (nothing to trace): milliseconds but for writing the weights."""
    path = head_path(export_path(model, cache_dir))
    if path.exists():
        return path
    import onnx
    from onnx import TensorProto, helper

    from stratamesh.kernels.models.onnx_compose import external_tensor

    check_exportable(model)
    c, head = model.config, model._lm_head
    if head is None:
        raise InvalidInput(f"stage [{model.spec.start_layer}, {model.spec.end_layer}) has no LM head")
    weights = {"final_norm": model._final_norm.float().numpy()}
    nodes = [helper.make_node("SimplifiedLayerNormalization", ["hidden", "final_norm"], ["normed"], axis=-1,
                              epsilon=c.rms_norm_eps)]
    if isinstance(head, torch.Tensor):
        weights["head"] = head.float().T.contiguous().numpy()                   # [hidden, vocab]: MatMul's B
        nodes.append(helper.make_node("MatMul", ["normed", "head"], ["logits"]))
    else:
        w = NBitsWeight.of(head)
        weights["head_packed"], weights["head_scales"] = w.packed.numpy(), w.scales.numpy()
        nodes.append(helper.make_node("MatMulNBits", ["normed", "head_packed", "head_scales"], ["logits"],
                                      domain="com.microsoft", K=w.in_features, N=c.vocab_size, bits=w.bits,
                                      block_size=w.packed.shape[2] * 8 // w.bits, accuracy_level=4))
    path.parent.mkdir(parents=True, exist_ok=True)
    with _written(path) as draft:
        with open(f"{draft}.data", "wb") as data:
            initializers = [external_tensor(name, array, data, f"{path.name}.data") for name, array in weights.items()]
        graph = helper.make_graph(
            nodes, "head", [helper.make_tensor_value_info("hidden", TensorProto.FLOAT, ["tokens", c.hidden_size])],
            [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["tokens", c.vocab_size])], initializers)
        onnx.save_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET),
                                                                 helper.make_opsetid("com.microsoft", 1)]), str(draft))
    return path


@contextmanager
def _written(path: Path) -> Iterator[Path]:
    """Where to write an export (its .onnx, and its weights in .data beside it under the same name), in a temporary
    folder beside path; both are moved into place as the block ends, the .onnx last: an export whose .onnx exists
    is whole."""
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        draft = Path(tmp, path.name)
        yield draft
        Path(f"{draft}.data").replace(f"{path}.data")
        draft.replace(path)


def layer_template(model: StageModel, cache_dir: str | Path) -> Path:
    """The ONNX graph of one of the model's layers with its weights as inputs (WEIGHT_PREFIX + name), traced once
    per layer shapes, dtype, weights, opset, torch's version and code, and cached."""
    tensors = layer_tensors(model._layers[0])
    c = model.config
    key = hashlib.sha256(repr([(n, tuple(t.shape), str(t.dtype)) for n, t in tensors.items()]
                              + [model.num_heads, model.num_kv_heads, c.head_dim, c.rms_norm_eps, _in_features(model),
                                 torch.__version__, _code_key()]).encode()).hexdigest()
    path = Path(cache_dir, "onnx", f"layer-opset{OPSET}-{key[:16]}.onnx")
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    program = trace_layers(model, 1)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        program.save(str(Path(tmp, path.name)))
        Path(tmp, path.name).replace(path)
    return path


def trace_layers(model: StageModel, num_layers: int) -> torch.onnx.ONNXProgram:
    """The exporter's program of num_layers copies of the model's first layer in one graph, weights as inputs: one
    is layer_template's; more is what tracing a whole stage costs (benchmarks/onnx_export.py's baseline: the exporter
    traces every layer again)."""
    from stratamesh.kernels.models.onnx_compose import OUTPUTS, WEIGHT_PREFIX

    logging.getLogger("torch.onnx").setLevel(logging.ERROR)    # (its notes on torchvision ops it skips)
    tensors, c = layer_tensors(model._layers[0]), model.config
    # sizes of 2 or more, all different: the exporter keeps a dimension of 0 or 1 (or equal to another) fixed
    index = AttentionIndex.of([SeqSlice(0, 3, 4, [0, 1]), SeqSlice(3, 2, 2, [2])], block_size=4)
    num_tokens, pool = 5, torch.zeros(12, model.num_kv_heads, c.head_dim, dtype=model.dtype)
    hidden = torch.zeros(num_tokens, c.hidden_size, dtype=model.dtype)
    cos = torch.ones(num_tokens, c.head_dim, dtype=model.dtype)
    example = (hidden, cos, cos.clone(), index.past_slots, index.rows, index.unpad, index.past_mask, index.new_mask,
               *(pool.clone() for _ in range(2 * num_layers)), *(list(tensors.values()) * num_layers))
    n, b, t, p, s = (torch.export.Dim(name, min=1) for name in ("tokens", "seqs", "new", "past", "slots"))
    shapes = ({0: n}, {0: n}, {0: n}, {0: b, 1: p}, {0: b, 1: t}, {0: n}, {0: b, 1: t, 2: p}, {0: b, 1: t, 2: t},
              (*({0: s} for _ in range(2 * num_layers)), *({} for _ in range(len(tensors) * num_layers))))
    if num_layers == 1:
        names = [*_INPUTS, "k", "v", *(WEIGHT_PREFIX + name for name in tensors)]
    else:
        names = [*_input_names(num_layers), *(f"l{i}.{name}" for i in range(num_layers) for name in tensors)]
    layers = _Layers(_Layer(model, list(tensors), _in_features(model)), num_layers)
    with warnings.catch_warnings():     # (the exporter's notes on how it named the dynamic axes)
        warnings.simplefilter("ignore", UserWarning)
        warnings.simplefilter("ignore", FutureWarning)    # (torch.export's own use of a deprecated pytree API)
        return torch.onnx.export(layers.eval(), example, dynamic_shapes=shapes, input_names=names,
                                 output_names=list(OUTPUTS), opset_version=OPSET, dynamo=True, optimize=True,
                                 verbose=False, custom_translation_table={
                                     torch.ops.stratamesh.nbits_linear.default: _translate_nbits_linear})


class _Layers(torch.nn.Module):
    """num_layers copies of a _Layer, one after the other: the step's inputs, then each copy's K and V pools, then
    each copy's weights."""

    def __init__(self, layer: _Layer, num_layers: int) -> None:
        super().__init__()
        self.layer, self.num_layers = layer, num_layers

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, past_slots: torch.Tensor,
                rows: torch.Tensor, unpad: torch.Tensor, past_mask: torch.Tensor, new_mask: torch.Tensor,
                *rest: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        step = (cos, sin, past_slots, rows, unpad, past_mask, new_mask)
        pools, weights = rest[:2 * self.num_layers], rest[2 * self.num_layers:]
        per_layer = len(weights) // self.num_layers
        x, new_k, new_v = hidden, [], []
        for i in range(self.num_layers):
            x, k, v = self.layer(x, *step, pools[2 * i], pools[2 * i + 1], *weights[i * per_layer:(i + 1) * per_layer])
            new_k.append(k)
            new_v.append(v)
        return x, torch.cat(new_k), torch.cat(new_v)


def _in_features(model: StageModel) -> dict[str, tuple[int, int]]:
    """The row length and bits of each of the first layer's quantized weights, by name."""
    first = model._layers[0]
    return {name: (w.shape[1], w.BITS) for name in _WEIGHTS
            if isinstance(w := getattr(first, name), Int8Weight | Int4Weight)}


def export_stages(specs: Sequence[StageSpec], cache_dir: str | Path) -> list[Path]:
    """export_layers of each spec's stage. The stages of one model and weights share their traced layer, the most of
    an export's time: the first stage of each such group not cached yet is exported in parallel processes (one a
    core), then the rest here, each a chain of copies of its group's layer."""
    paths = [_export_path_of(spec, cache_dir) for spec in specs]
    pending = list({path: spec for path, spec in zip(paths, specs) if not path.exists()}.values())
    firsts: dict[tuple[str, str, str], StageSpec] = {}
    for spec in pending:
        firsts.setdefault((spec.model_path, spec.dtype, spec.quantize), spec)
    workers = min(len(firsts), os.cpu_count() or 1)
    if workers > 1:
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
            list(pool.map(_export_stage, firsts.values(), [cache_dir] * len(firsts)))
    for spec in pending:
        if workers <= 1 or spec not in firsts.values():
            _export_stage(spec, cache_dir)
    return paths


def _export_stage(spec: StageSpec, cache_dir: str | Path) -> Path:
    model = load_stage(spec)
    if model._lm_head is not None:
        export_head(model, cache_dir)
    return export_layers(model, cache_dir)


def check_exportable(model: StageModel) -> None:
    """InvalidInput unless ONNX Runtime stages can serve the model's stage here."""
    spec, c = model.spec, model.config
    if spec.dtype not in ORT_DTYPES:
        raise InvalidInput(f"ONNX Runtime stages compute in {', '.join(ORT_DTYPES)} here, not {spec.dtype}")
    if spec.tp_degree > 1 or not spec.device == "cpu":
        raise InvalidInput("ONNX Runtime stages run on one CPU rank here")
    if c.arch not in ONNX_MODEL_TYPES:
        raise InvalidInput(f"ONNX Runtime stages run the Llama layer ({', '.join(ONNX_MODEL_TYPES)}), not {c.arch}'s: "
                           "its differences are not in the exported graph yet; serve it with --runtime torch")
    if any(c.window_for_layer(i) is not None for i in range(spec.start_layer, spec.end_layer)):
        raise InvalidInput("ONNX Runtime stages do not serve sliding-window attention yet")


def load_runtime_stage(spec: StageSpec, onnx_cache: str | Path, config: ModelConfig | None = None,
                       threads: int = 0) -> StageModel:
    """The stage spec names as its runtime computes it: load_stage's, with its layers and head in ONNX Runtime (from
    exports kept in onnx_cache, on `threads` threads, 0: torch's) where spec.runtime is onnxruntime."""
    model = load_stage(spec, config)
    return OrtStageModel.from_model(model, onnx_cache, threads) if spec.runtime == Runtime.ONNXRUNTIME else model


class OrtLayers:
    """An InferenceSession of an exported stage, run over torch tensors bound in place (inputs and outputs)."""

    def __init__(self, path: Path, num_layers: int, threads: int = 0) -> None:
        self.session = _session(path, threads)
        self.num_layers = num_layers
        self.weight_bytes = _initializer_bytes(path)
        self._names = _input_names(num_layers)

    def run(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, index: AttentionIndex,
            pools: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The layers over hidden [N, hidden]: (hidden out, new K, new V [layers, N, KV, D])."""
        binding = self.session.io_binding()
        inputs = (hidden, cos, sin, index.past_slots, index.rows, index.unpad, index.past_mask, index.new_mask,
                  *pools)
        kept = [t.contiguous() for t in inputs]        # (held until the run ends: the session reads them in place)
        for name, tensor in zip(self._names, kept, strict=True):
            _bind(binding.bind_input, name, tensor)
        kv_shape = (self.num_layers, hidden.shape[0], *pools[0].shape[1:])
        outputs = (torch.empty_like(hidden), torch.empty(kv_shape, dtype=pools[0].dtype),
                   torch.empty(kv_shape, dtype=pools[0].dtype))
        for name, tensor in zip(("hidden_out", "new_k", "new_v"), outputs, strict=True):
            _bind(binding.bind_output, name, tensor)
        self.session.run_with_iobinding(binding)
        return outputs


class OrtHead:
    """An InferenceSession of a last stage's final norm and LM head (export_head)."""

    def __init__(self, path: Path, threads: int = 0) -> None:
        self.session = _session(path, threads)
        self.weight_bytes = _initializer_bytes(path)
        self.vocab_size = self.session.get_outputs()[0].shape[1]

    def run(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [T, hidden] float32 -> logits [T, vocab] float32."""
        binding = self.session.io_binding()
        hidden = hidden.contiguous()
        logits = torch.empty(hidden.shape[0], self.vocab_size, dtype=torch.float32)
        _bind(binding.bind_input, "hidden", hidden)
        _bind(binding.bind_output, "logits", logits)
        self.session.run_with_iobinding(binding)
        return logits


def _session(path: Path, threads: int = 0):
    """An ONNX Runtime CPU session of the graph at path. threads > 0: the threads its process gave ONNX Runtime,
    torch computing on one (an agent whose stages all run in ONNX Runtime: agent.daemon); they spin through a run,
    waiting for its next node's work, and stop at its end (sleeping, they wake for each node).
    0: torch's threads, which torch's OpenMP workers share: the session's sleep whenever idle (spinning threads of
    both stretched steps tenfold on 2 cores)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads or torch.get_num_threads()
    options.inter_op_num_threads = 1
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.add_session_config_entry("session.intra_op.allow_spinning", "1" if threads else "0")
    options.add_session_config_entry("session.force_spinning_stop", "1")
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def _initializer_bytes(path: Path) -> int:
    """The bytes of the export's initializers (its weights, the most of them stored beside it as external data)."""
    import onnx

    graph = onnx.load(str(path), load_external_data=False).graph
    return sum(math.prod(t.dims) * onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
               for t in graph.initializer)


def _bind(bind, name: str, tensor: torch.Tensor) -> None:
    bind(name, "cpu", 0, _NUMPY[tensor.dtype], tuple(tensor.shape), tensor.data_ptr())


class OrtStageModel(StageModel):
    """A StageModel whose layers and LM head ONNX Runtime computes (the embedding's lookup stays in torch); it serves
    the paged attention of a stage runner (PagedBatch) only."""

    paged_only = True

    @property
    def param_bytes(self) -> int:
        """The torch tensors' (embedding, final norm) and ONNX Runtime's weights (layers, LM head)."""
        return super().param_bytes + self._ort.weight_bytes + (self._head.weight_bytes if self._head else 0)

    @classmethod
    def from_model(cls, model: StageModel, cache_dir: str | Path, threads: int = 0) -> OrtStageModel:
        """Exports (or finds the exports of) model's layers and LM head and takes its other tensors; the torch
        weights of its layers and head are let go (ONNX Runtime holds its own)."""
        layers = OrtLayers(export_layers(model, cache_dir), model.spec.end_layer - model.spec.start_layer, threads)
        head = None if model._lm_head is None else OrtHead(export_head(model, cache_dir), threads)
        kept = {name: t for name, t in model.tensors.items() if name == FINAL_NORM
                or (model.spec.is_first and name.removesuffix(SCALE_SUFFIX) == EMBED)}
        ort_model = cls.__new__(cls)
        ort_model.__dict__.update(model.__dict__)
        ort_model._tensors, ort_model._layers, ort_model._ort, ort_model._head = kept, [], layers, head
        ort_model._lm_head = None
        return ort_model

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """StageModel.logits, in ONNX Runtime."""
        if self._head is None:
            return super().logits(hidden)       # (InvalidInput: no head)
        return self._head.run(hidden.to(self.dtype))

    def new_paged_cache(self, num_blocks: int, block_size: int) -> PagedKVCache:
        c = self.config
        return PagedKVCache(self._ort.num_layers, num_blocks, block_size, self.num_kv_heads, c.head_dim, self.dtype,
                            self.spec.device)

    def new_cache(self, chunk_tokens: int = 256) -> KVCache:
        raise InvalidInput("an ONNX Runtime stage attends over a paged KV cache only")

    def forward_layers(self, inputs: torch.Tensor, positions: torch.Tensor, attn: Attention,
                       checked: bool = False) -> Generator[None, None, torch.Tensor]:
        """StageModel.forward_layers, every layer in one run of the session (it yields once, after it)."""
        if not isinstance(attn, PagedBatch):
            raise InvalidInput("an ONNX Runtime stage attends over a paged KV cache only")
        if not checked:
            self.check_inputs(inputs, positions, attn)
        x = self._embed_inputs(inputs)
        cos, sin = rope_cos_sin(self._inv_freq, positions.to(torch.long), self.dtype, self._rope_factor)
        cache = attn.cache
        pools = [t for i in range(self._ort.num_layers) for t in cache.flat(i)]
        x, new_k, new_v = self._ort.run(x, cos, sin, AttentionIndex.of(attn.seqs, cache.block_size), pools)
        for i in range(self._ort.num_layers):
            attn.write_kv(i, new_k[i], new_v[i])
        yield
        return x
