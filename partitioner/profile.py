"""What a model costs per layer (bytes, KV, FLOPs, activations), read from a Hugging Face config dict."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from stratamesh.fleet.errors import CheckpointError
from stratamesh.fleet.stages import (QUANTIZED_BYTES, layer_norms, layer_windows, mlp_params, model_task, moe_shape,
                                     qkv_bias)

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
    # A mixture of experts: one expert's parameters in each layer (0 in a dense layer), of experts_per_layer, and how
    # many a token runs; a stage holds every expert (in layer_params) and a step reads those its tokens pick
    layer_expert_params: tuple[int, ...] = ()
    experts_per_layer: int = 0
    experts_per_token: int = 0
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

    def layer_read_params(self, step_tokens: int) -> tuple[int, ...]:
        """The parameters a step of step_tokens tokens reads in each layer: all of a dense layer's; of a sparse
        layer's experts, as many as its tokens pick in expectation (each token top-k of them, uniformly: E x (1 -
        (1 - k / E)^tokens))."""
        if not self.layer_expert_params:
            return self.layer_params
        e, k = self.experts_per_layer, self.experts_per_token
        unread = e - e * (1 - (1 - k / e) ** max(step_tokens, 1))
        return tuple(round(p - unread * x) for p, x in zip(self.layer_params, self.layer_expert_params, strict=True))

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
    bias = q_dim + 2 * kv_dim if qkv_bias(raw) else 0
    attn = hidden * (q_dim + 2 * kv_dim) + q_dim * hidden
    norms, head_norms = layer_norms(str(raw.get("model_type")))
    moe = moe_shape(raw, num_layers)        # a mixture of experts holds every expert, and runs top_k a token
    layers = [attn + bias + mlp_params(moe, hidden, inter, i) + norms * hidden + head_norms * head_dim
              for i in range(num_layers)]   # + the RMSNorm weights
    matmuls = [attn + mlp_params(moe, hidden, inter, i, active=True) for i in range(num_layers)]
    # An embedding model has no LM head: its last stage holds the final norm and pools (a few FLOPs per prompt).
    head = vocab * hidden if model_task(raw) == "generate" else 0
    tied = bool(head) and bool(raw.get("tie_word_embeddings", False))
    return ModelProfile(
        name=name or str(raw.get("_name_or_path") or raw.get("model_type") or "model"),
        num_layers=num_layers, hidden_size=hidden, num_heads=heads, num_kv_heads=kv_heads, vocab_size=vocab,
        dtype=dtype,
        layer_params=tuple(layers),
        layer_kv_bytes_per_token=(2 * kv_dim * DTYPE_BYTES[dtype],) * num_layers,
        layer_flops_per_token=tuple(2 * matmul for matmul in matmuls),
        layer_attn_flops_per_ctx=(4 * q_dim,) * num_layers,             # q.k and p.v, 2 FLOPs per multiply-add
        layer_windows=layer_windows(raw),
        embed_params=vocab * hidden,
        head_params=head + hidden,
        head_flops_per_token=2 * head,
        tied_embeddings=tied,
        layer_expert_params=tuple(3 * hidden * moe.expert_intermediate * moe.is_sparse(i) for i in range(num_layers))
        if moe else (),
        experts_per_layer=moe.num_experts if moe else 0,
        experts_per_token=moe.top_k if moe else 0,
    )


def _check_dtype(dtype: str) -> None:
    if dtype not in DTYPE_BYTES:
        raise CheckpointError(f"dtype {dtype!r} is not one of {sorted(DTYPE_BYTES)}")
