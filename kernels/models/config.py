"""A decoder's shape, parsed from a Hugging Face config.json: pure values, I/O only in read_config."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stratamesh.fleet.errors import CheckpointError
from stratamesh.fleet.gguf_files import GgufModel, is_gguf
from stratamesh.fleet.stages import (GEMMA_MODEL_TYPES, MODEL_TYPES, PER_LAYER_TYPE_ROPE, ROPE_ALIASES, ROPE_TYPES,
                                     MoeShape, attention_windows, layer_norms, mlp_params, model_task, moe_shape,
                                     qkv_bias, served_context, text_model_config)

ARCHS = MODEL_TYPES      # config.json's model_type; each has its layer in kernels.models.families
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """What a stage needs to know about a decoder of one of the families (ARCHS)."""

    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None   # {"rope_type": "linear"|"llama3"|..., "factor", ...}
    max_position_embeddings: int = 2048          # the context it is served at (fleet.stages.served_context)
    partial_rotary_factor: float = 1.0           # the share of each head's dimensions rope rotates (Phi-3's)
    tie_word_embeddings: bool = False
    attention_bias: bool = False                 # q/k/v projections carry a bias (Qwen2)
    o_proj_bias: bool = False                    # Llama's attention_bias also puts one on o_proj
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()            # per layer "full_attention"|"sliding_attention"; () = all alike
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str = "float32"
    task: str = "generate"                       # "embed": a base model without an LM head (fleet.stages.model_task)
    # Gemma's: the sliding layers' own rope, queries scaled by query_pre_attn_scalar ** -0.5 (not head_dim's), the
    # embedding times sqrt(hidden), the logits soft-capped (tanh(x / cap) * cap)
    local_rope_theta: float | None = None
    local_rope_scaling: dict[str, Any] | None = None
    query_pre_attn_scalar: float | None = None
    embed_scale: float | None = None
    final_logit_softcap: float | None = None
    attn_logit_softcap: float | None = None      # Gemma 2's: the attention scores soft-capped too
    moe: MoeShape | None = None                  # a mixture of experts' MLPs (Mixtral, Qwen2-MoE, Qwen3-MoE)

    @property
    def rotary_dim(self) -> int:
        """The dimensions of each head rope rotates: the first rotary_dim, as transformers rounds them."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def has_lm_head(self) -> bool:
        """Whether the last stage ends in an LM head and a sampler (else it pools: an embedding model)."""
        return self.task == "generate"

    def window_for_layer(self, layer_idx: int) -> int | None:
        """The sliding window (tokens a query sees, itself included) of a layer, or None for full attention."""
        if self.sliding_window is None:
            return None
        if self.layer_types and self.layer_types[layer_idx] != "sliding_attention":
            return None
        return self.sliding_window

    @property
    def kv_bytes_per_token_per_layer(self) -> int:
        return 2 * self.num_kv_heads * self.head_dim * DTYPE_BYTES.get(self.torch_dtype, 4)

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V bytes one token costs across all layers, in torch_dtype."""
        return self.num_layers * self.kv_bytes_per_token_per_layer

    @property
    def num_params_per_layer(self) -> int:
        """A layer's parameters, where every layer has as many (a dense model's; num_layer_params otherwise)."""
        return self.num_layer_params(0)

    def num_layer_params(self, layer_idx: int) -> int:
        """The parameters of a layer as a stage loads them: attention, norms, and its MLP (every expert of a sparse
        layer, its router and shared expert)."""
        q_dim, kv_dim = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attn = self.hidden_size * (q_dim + 2 * kv_dim) + q_dim * self.hidden_size
        if self.attention_bias:
            attn += q_dim + 2 * kv_dim
        if self.o_proj_bias:
            attn += self.hidden_size
        norms, head_norms = layer_norms(self.arch)
        mlp = mlp_params(self.moe, self.hidden_size, self.intermediate_size, layer_idx)
        return attn + mlp + norms * self.hidden_size + head_norms * self.head_dim

    @property
    def num_embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size


def parse_config(raw: dict[str, Any]) -> ModelConfig:
    """A ModelConfig from the dict of a config.json; CheckpointError on a model or RoPE we do not run."""
    arch = raw.get("model_type")
    if arch not in ARCHS:
        raise CheckpointError(f"config.json model_type {arch!r} is not supported; supported: {', '.join(ARCHS)}")
    _reject_unsupported(raw)
    try:
        return _check_sizes(_build(raw, arch))
    except KeyError as e:
        raise CheckpointError(f"config.json lacks required field {e.args[0]!r}") from None
    except (TypeError, ValueError, AttributeError, ArithmeticError) as e:   # a field of the wrong type or value
        raise CheckpointError(f"config.json has a malformed field: {e}") from None


def _build(raw: dict[str, Any], arch: str) -> ModelConfig:
    """The ModelConfig a config.json describes, before its sizes are checked."""
    hidden, heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
    num_layers = int(raw["num_hidden_layers"])
    (rope_theta, rope_scaling), local_rope = _parse_ropes(raw)
    sliding_window, layer_types = attention_windows(raw, arch, num_layers)
    gemma = arch in GEMMA_MODEL_TYPES
    return ModelConfig(
        arch=arch,
        vocab_size=int(raw["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(raw.get("head_dim") or hidden // heads),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=served_context({"max_position_embeddings": 2048, **raw}),
        partial_rotary_factor=_partial_rotary(raw),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=qkv_bias(raw),
        o_proj_bias=arch == "llama" and bool(raw.get("attention_bias", False)),
        sliding_window=sliding_window,
        layer_types=layer_types,
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=_as_ids(raw.get("eos_token_id")),
        torch_dtype=str(raw.get("dtype") or raw.get("torch_dtype") or "float32"),
        task=model_task(raw),
        local_rope_theta=local_rope[0] if local_rope else None,
        local_rope_scaling=local_rope[1] if local_rope else None,
        query_pre_attn_scalar=float(raw.get("query_pre_attn_scalar", 256)) if gemma else None,
        embed_scale=hidden ** 0.5 if gemma else None,
        final_logit_softcap=float(raw["final_logit_softcapping"]) if raw.get("final_logit_softcapping") else None,
        attn_logit_softcap=float(raw["attn_logit_softcapping"]) if raw.get("attn_logit_softcapping") else None,
        moe=moe_shape(raw, num_layers),
    )


def _partial_rotary(raw: dict[str, Any]) -> float:
    """The share of each head rope rotates: Phi-3's partial_rotary_factor (in its rope parameters, or beside them),
    1 for the families whose transformers code rotates all of it."""
    if raw.get("model_type") != "phi3":
        return 1.0
    params = raw.get("rope_parameters") or {}
    return float(params.get("partial_rotary_factor") or raw.get("partial_rotary_factor") or 1.0)


def _check_sizes(config: ModelConfig) -> ModelConfig:
    """Sizes a model can have: positive, heads that group, finite epsilon and theta."""
    sizes = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
             "max_position_embeddings")
    for name in sizes:
        if getattr(config, name) < 1:
            raise CheckpointError(f"config.json {name} must be positive, got {getattr(config, name)}")
    if config.num_heads % config.num_kv_heads:
        raise CheckpointError(f"config.json num_attention_heads {config.num_heads} is not a multiple of "
                              f"num_key_value_heads {config.num_kv_heads}")
    if not (0 < config.rms_norm_eps < 1 and 0 < config.rope_theta < math.inf):
        raise CheckpointError("config.json rms_norm_eps must lie in (0, 1) and rope_theta be positive and finite")
    if config.sliding_window is not None and config.sliding_window < 1:
        raise CheckpointError(f"config.json sliding_window must be positive, got {config.sliding_window}")
    if not (0 < config.partial_rotary_factor <= 1 and config.rotary_dim % 2 == 0):
        raise CheckpointError(f"config.json partial_rotary_factor {config.partial_rotary_factor} must lie in (0, 1] "
                              f"and rotate an even number of each head's {config.head_dim} dimensions")
    scaling = config.rope_scaling or {}
    for name in ("short_factor", "long_factor"):
        if name in scaling and len(scaling[name]) != config.rotary_dim // 2:
            raise CheckpointError(f"config.json longrope {name} has {len(scaling[name])} entries; the "
                                  f"{config.rotary_dim} rotated dimensions of a head need {config.rotary_dim // 2}")
    return config


def read_config(model_dir: str | Path) -> ModelConfig:
    """parse_config of model_dir/config.json, with eos ids merged from generation_config.json if present; or of
    what a GGUF file says of its model, where model_dir names one (fleet.gguf_files)."""
    if is_gguf(model_dir):
        return parse_config(GgufModel(model_dir).config())
    model_dir = Path(model_dir)
    raw = text_model_config(_read_json(model_dir / "config.json"))     # a multimodal model's: its text model's
    gen_path = model_dir / "generation_config.json"
    if gen_path.exists():
        gen_eos = _as_ids(_read_json(gen_path).get("eos_token_id"))
        merged = list(_as_ids(raw.get("eos_token_id")))
        merged += [i for i in gen_eos if i not in merged]
        raw = {**raw, "eos_token_id": merged}
    return parse_config(raw)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"model folder has no {path.name} ({path})") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from None


ACTIVATIONS = dict.fromkeys(GEMMA_MODEL_TYPES, "gelu_pytorch_tanh")   # the MLP's gate activation, if not SiLU


def _reject_unsupported(raw: dict[str, Any]) -> None:
    want = ACTIVATIONS.get(raw.get("model_type"), "silu")
    act = raw.get("hidden_activation") or raw.get("hidden_act") or want
    if act != want:
        raise CheckpointError(f"config.json hidden_act {act!r} is not supported for {raw.get('model_type')}; "
                              f"only {want!r}")
    if raw.get("use_bidirectional_attention"):
        raise CheckpointError("config.json use_bidirectional_attention=true is not supported")
    if raw.get("mlp_bias"):
        raise CheckpointError("config.json mlp_bias=true is not supported")
    if raw.get("is_causal") is False:   # some embedding models attend both ways; our attention is causal
        raise CheckpointError("config.json is_causal=false (bidirectional attention) is not supported")


Rope = tuple[float, dict[str, Any] | None]     # (theta, normalized scaling or None)
_ORIGINAL_CONTEXT = {"phi3": 4096}             # a family's original context where its config.json names none
LOCAL_THETA = 10000.0                          # Gemma 3's sliding layers' rope base where the config names none


def _parse_ropes(raw: dict[str, Any]) -> tuple[Rope, Rope | None]:
    """(the rope of every layer, or of the full-attention ones, the sliding layers' own rope or None) from
    transformers 4 or transformers 5 spelling; Gemma 3's sliding layers have a rope of their own (rope_parameters
    nested per layer type, or rope_local_base_freq)."""
    params = raw.get("rope_parameters")
    nested = isinstance(params, dict) and any(isinstance(v, dict) for v in params.values())
    if raw.get("model_type") not in PER_LAYER_TYPE_ROPE:
        if nested:
            raise CheckpointError("config.json rope_parameters nested per layer type are not supported")
        return _parse_rope(raw, params or raw.get("rope_scaling") or {}), None
    if nested:
        return (_parse_rope(raw, params.get("full_attention") or {}, 1_000_000.0),
                _parse_rope(raw, params.get("sliding_attention") or {}, LOCAL_THETA, local=True))
    local = {"rope_theta": raw.get("rope_local_base_freq") or LOCAL_THETA}
    return _parse_rope(raw, params or raw.get("rope_scaling") or {}, 1_000_000.0), _parse_rope(raw, local, local=True)


def _parse_rope(raw: dict[str, Any], params: dict[str, Any], default_theta: float = 10000.0,
                local: bool = False) -> Rope:
    """(theta, normalized scaling or None) of one rope's parameters (local: the sliding layers', whose theta is
    their own)."""
    params = dict(params)
    theta = params.pop("rope_theta", None) or (None if local else raw.get("rope_theta")) or default_theta
    theta = float(theta)
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    rope_type = ROPE_ALIASES.get(raw.get("model_type"), {}).get(rope_type, rope_type)
    if rope_type not in ROPE_TYPES:
        raise CheckpointError(f"config.json rope type {rope_type!r} is not supported; supported: "
                              f"{', '.join(ROPE_TYPES)}")
    if rope_type == "default":
        return theta, None
    if rope_type == "linear":
        return theta, {"rope_type": "linear", "factor": float(params["factor"])}
    max_pos = int(raw.get("max_position_embeddings", 2048))
    if rope_type == "dynamic":
        factor = float(params["factor"])
        return theta, {"rope_type": "dynamic", "factor": factor, "original_max_position_embeddings": max_pos,
                       "context": served_context({**raw, "max_position_embeddings": max_pos})}
    # transformers prefers an original context beside the rope parameters to one inside them (Phi-3's place)
    beside = raw.get("original_max_position_embeddings") or _ORIGINAL_CONTEXT.get(raw.get("model_type"))
    params["original_max_position_embeddings"] = beside or params.get("original_max_position_embeddings") or max_pos
    if rope_type == "yarn":
        return theta, _yarn(params, max_pos)
    if rope_type == "longrope":
        return theta, _longrope(params, max_pos)
    missing = [k for k in _LLAMA3_KEYS if k not in params]
    if missing:
        raise CheckpointError(f"config.json llama3 rope scaling lacks {missing}")
    scaling = {k: float(params[k]) for k in _LLAMA3_KEYS}
    scaling["original_max_position_embeddings"] = int(params["original_max_position_embeddings"])
    return theta, {"rope_type": "llama3", **scaling}


def _yarn(params: dict[str, Any], max_pos: int) -> dict[str, Any]:
    """YaRN's scaling, its defaults filled in as transformers fills them: factor from the contexts' ratio, the
    attention factor from the factor (and mscale / mscale_all_dim where both are given), beta_fast 32, beta_slow 1."""
    old_len = int(params["original_max_position_embeddings"])
    factor = float(params.get("factor") or max_pos / old_len)
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        attention_factor = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
                            if mscale and mscale_all_dim else _yarn_mscale(factor))
    return {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": old_len,
            "attention_factor": float(attention_factor), "beta_fast": float(params.get("beta_fast") or 32),
            "beta_slow": float(params.get("beta_slow") or 1), "truncate": bool(params.get("truncate", True))}


def _longrope(params: dict[str, Any], max_pos: int) -> dict[str, Any]:
    """LongRoPE's scaling (Phi-3): a factor per frequency, short ones within the original context and long ones
    past it; the long ones apply where the model is served past its original context (kernels.ops.rope says why
    once for all), and the attention factor defaults as transformers' does, from the contexts' ratio."""
    old_len = int(params["original_max_position_embeddings"])
    factor = float(params.get("factor") or max_pos / old_len)
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(old_len))
    return {"rope_type": "longrope", "short_factor": tuple(float(f) for f in params["short_factor"]),
            "long_factor": tuple(float(f) for f in params["long_factor"]), "original_max_position_embeddings": old_len,
            "attention_factor": float(attention_factor), "long": max_pos > old_len}


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's softmax temperature for a context factor times longer (its eq. 21): 0.1 mscale ln(factor) + 1."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _as_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)
