"""What a model costs per layer (bytes, KV, FLOPs, activations), read from a Hugging Face config dict."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from stratamesh.fleet.errors import CheckpointError
from stratamesh.fleet.stages import QUANTIZED_BYTES, layer_norms, layer_windows, model_task

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "int8": 1}
WEIGHT_BYTES: dict[str, float] = {**DTYPE_BYTES, **QUANTIZED_BYTES}   # a weight's bytes in a dtype or quantized
TOKEN_ID_BYTES = 8        # what the origin sends the first stage and the last stage returns, per token


@dataclass(frozen=True, slots=True)
class ModelProfile:
    """Per-layer costs of a decoder at one dtype; the embedding sits on the first stage, norm + head on the last.

    Costs are per token: a step of B tokens at an average context of C tokens reads every parameter once,
    reads B * C * kv_bytes of KV and does B * (flops + C * attn_flops_per_ctx) FLOPs per layer, C at most the
    layer's sliding window (it reads no key before it). Its KV is held for the whole context all the same (a stage
    frees no block behind a window: docs/models.md)."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int
    dtype: str
    layer_params: tuple[int, ...]                 # parameters of each layer
    layer_kv_bytes_per_token: tuple[int, ...]     # K + V bytes one token costs in each layer
    layer_flops_per_token: tuple[int, ...]        # matmul FLOPs per token (2 per multiply-add)
    layer_attn_flops_per_ctx: tuple[int, ...]     # attention FLOPs per token per context token
    layer_windows: tuple[int, ...]                # the context tokens each layer reads at most; 0: all of them
    embed_params: int                             # on the first stage
    head_params: int                              # final norm + LM head on the last stage (an embedding model: norm)
    head_flops_per_token: int
    tied_embeddings: bool = False                 # one matrix: a single stage holding both counts it once
    # what the layers' matrices, the LM head and the embedding are stored in where a device measured it, if not
    # dtype: "int8" or "int4"
    # (the operator's choice for the model; cost.single_unit)
    weights: str = ""

    @property
    def bytes_per_param(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def activation_bytes_per_token(self) -> int:
        """The hidden state one token carries from a stage to the next."""
        return self.hidden_size * self.bytes_per_param

    def layer_param_bytes(self, layer: int) -> int:
        return self.layer_params[layer] * self.bytes_per_param

    @property
    def embed_bytes(self) -> int:
        return self.embed_params * self.bytes_per_param

    @property
    def head_bytes(self) -> int:
        return self.head_params * self.bytes_per_param

    @property
    def total_bytes(self) -> int:
        """Every parameter once (a tied head is the embedding)."""
        head = self.head_params - (self.embed_params if self.tied_embeddings else 0)
        return (sum(self.layer_params) + self.embed_params + head) * self.bytes_per_param

    def at_dtype(self, dtype: str) -> ModelProfile:
        """The same model stored and run in another dtype."""
        _check_dtype(dtype)
        kv = tuple(b // self.bytes_per_param * DTYPE_BYTES[dtype] for b in self.layer_kv_bytes_per_token)
        return replace(self, dtype=dtype, layer_kv_bytes_per_token=kv)


def profile_from_hf_config(raw: Mapping[str, Any], dtype: str | None = None, name: str = "") -> ModelProfile:
    """The profile of a config.json dict of a family stages compute (fleet.stages.MODEL_TYPES): its layers as
    loaded (head_dim, norms, biases, windows), a tied head once; CheckpointError if malformed."""
    try:
        hidden, heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
        num_layers, inter, vocab = int(raw["num_hidden_layers"]), int(raw["intermediate_size"]), int(raw["vocab_size"])
        kv_heads = int(raw.get("num_key_value_heads") or heads)
        head_dim = int(raw.get("head_dim") or 0)
    except KeyError as e:
        raise CheckpointError(f"config lacks required field {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"config has a malformed field: {e}") from None
    dtype = dtype or str(raw.get("dtype") or raw.get("torch_dtype") or "float32")
    _check_dtype(dtype)
    if min(hidden, heads, num_layers, inter, vocab, kv_heads) < 1 or head_dim < 0 or heads % kv_heads:
        raise CheckpointError(f"config sizes must be positive and heads ({heads}) a multiple of kv heads "
                              f"({kv_heads})")
    head_dim = head_dim or hidden // heads
    if head_dim < 1:
        raise CheckpointError(f"head_dim must be positive (hidden_size {hidden} over {heads} heads)")
    q_dim, kv_dim = heads * head_dim, kv_heads * head_dim
    bias = q_dim + 2 * kv_dim if raw.get("model_type") == "qwen2" or raw.get("attention_bias") else 0
    matmul = hidden * (q_dim + 2 * kv_dim) + q_dim * hidden + 3 * hidden * inter
    norms, head_norms = layer_norms(str(raw.get("model_type")))
    layer = matmul + bias + norms * hidden + head_norms * head_dim      # + the RMSNorm weights
    # An embedding model has no LM head: its last stage holds the final norm and pools (a few FLOPs per prompt).
    head = vocab * hidden if model_task(raw) == "generate" else 0
    tied = bool(head) and bool(raw.get("tie_word_embeddings", False))
    return ModelProfile(
        name=name or str(raw.get("_name_or_path") or raw.get("model_type") or "model"),
        num_layers=num_layers, hidden_size=hidden, num_heads=heads, num_kv_heads=kv_heads, vocab_size=vocab,
        dtype=dtype,
        layer_params=(layer,) * num_layers,
        layer_kv_bytes_per_token=(2 * kv_dim * DTYPE_BYTES[dtype],) * num_layers,
        layer_flops_per_token=(2 * matmul,) * num_layers,
        layer_attn_flops_per_ctx=(4 * q_dim,) * num_layers,             # q.k and p.v, 2 FLOPs per multiply-add
        layer_windows=layer_windows(raw),
        embed_params=vocab * hidden,
        head_params=head + hidden,
        head_flops_per_token=2 * head,
        tied_embeddings=tied,
    )


def _check_dtype(dtype: str) -> None:
    if dtype not in DTYPE_BYTES:
        raise CheckpointError(f"dtype {dtype!r} is not one of {sorted(DTYPE_BYTES)}")
