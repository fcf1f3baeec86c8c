"""A model's stages: what an agent is asked to load (StageSpec in an Assignment) and how it reports on one, the
kinds of stage the mesh computes (dtypes, runtimes, quantization) and their limits; what a model's config says of
them."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from stratamesh.fleet.errors import CheckpointError, InvalidInput
from stratamesh.fleet.states import Runtime, StageState

DTYPES = ("float32", "float16", "bfloat16")


RUNTIMES = (Runtime.TORCH, Runtime.ONNXRUNTIME)   # what computes a stage's layers (on its device)


AUTO_RUNTIME = Runtime.AUTO           # an agent's runtime when the planner picks one of RUNTIMES per stage


AGENT_RUNTIMES = tuple(Runtime)       # what an agent's operator may choose (--runtime)


MAX_REPLICAS = 64               # pipelines one model may run side by side


QUANTIZATIONS = ("int8", "int4")     # weight-only quantization of a stage (kernels.ops.quant); "" is none
# bytes a quantized weight takes, its scales counted: int8 one a row (negligible), int4 a float32 per 32 weights
QUANTIZED_BYTES = {"int8": 1.0, "int4": 0.5 + 4 / 32}


ORT_DTYPES = ("float32",)             # what ONNX Runtime stages compute in (its CPU kernels, here)


MAX_TP_DEGREE = 8               # ranks of one tensor-parallel group, at most


MAX_KV_BLOCK_SIZE = 1024        # tokens of one KV block, at most


_REVISION = re.compile(r"[A-Za-z0-9._-]{0,64}")
MAX_KV_CACHE_BYTES = 1 << 46    # a stage's KV cache per rank, at most (64 TiB: no box holds more)


# The model families a stage computes (config.json's model_type; each has its layer in kernels.models.families),
# the rope scalings it applies, and the families whose layers ONNX Runtime stages run.
MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3", "mixtral", "qwen2_moe",
               "qwen3_moe")
MOE_MODEL_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe")     # mixtures of experts (MoeShape)
# Mixtures of experts people ask for that no stage computes yet, and what it lacks for each
NOT_YET_MODEL_TYPES = {
    "gpt_oss": "its attention sinks, alternating sliding windows and MXFP4 expert weights are not computed yet",
    "deepseek_v2": "its multi-head latent attention and grouped expert routing are not computed yet",
    "deepseek_v3": "its multi-head latent attention and grouped expert routing are not computed yet",
}
ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope", "dynamic")
ONNX_MODEL_TYPES = ("llama", "mistral", "qwen2")

# Hugging Face base-model classes: no LM head, so served as embedding models (last token, L2-normalized)
EMBEDDING_ARCHITECTURES = ("LlamaModel", "Qwen2Model", "MistralModel", "Qwen3Model", "Gemma2Model", "Gemma3TextModel",
                           "Phi3Model", "MixtralModel", "Qwen2MoeModel", "Qwen3MoeModel")
# Gemma without layer_types: every 2nd (Gemma 2) or 6th (Gemma 3) layer full attention, the others sliding
GEMMA_SLIDING_PATTERN = {"gemma2": 2, "gemma3_text": 6}
GEMMA_MODEL_TYPES = tuple(GEMMA_SLIDING_PATTERN)
PER_LAYER_TYPE_ROPE = ("gemma3_text",)      # a rope per layer type (rope_parameters nested by it)
# Multimodal models whose text model a mesh serves (the vision tower is not): config.json's model_type -> its text
# model's, whose config sits under text_config as saved by transformers: what differs from these defaults of its
# config class (Gemma3TextConfig's: the released Gemma 3 4B-27B folders name only the sizes that differ)
TEXT_MODELS = {"gemma3": "gemma3_text"}
_TEXT_DEFAULTS = {"gemma3_text": {
    "vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-6, "query_pre_attn_scalar": 256, "sliding_window": 4096,
    "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True, "bos_token_id": 2, "eos_token_id": 1,
    "pad_token_id": 0}}
_TEXT_ARCHITECTURES = {"gemma3_text": "Gemma3ForCausalLM"}
# Older names of a family's rope type, as transformers reads them: Phi-3's "su" and "yarn" are LongRoPE
ROPE_ALIASES = {"phi3": {"su": "longrope", "yarn": "longrope"}}
# A layer's RMSNorm weights, beyond the two [hidden] ones of Llama's: (how many [hidden], how many [head_dim]):
# Gemma's sandwich norms around attention and MLP, and Qwen3's and Gemma 3's per-head q and k norms
_LAYER_NORMS = {"qwen3": (2, 2), "qwen3_moe": (2, 2), "gemma2": (4, 0), "gemma3_text": (4, 2)}


@dataclass(frozen=True, slots=True)
class MoeShape:
    """A mixture of experts' MLPs, as its config.json says: in each sparse layer a router picks top_k of num_experts
    SwiGLU experts (of expert_intermediate units each) per token, weighing them by their softmax probabilities,
    renormalised over the top_k where renormalize; a shared expert of shared_intermediate units (0: none) beside
    them; the other layers have a dense MLP of the config's intermediate_size."""

    num_experts: int
    top_k: int
    expert_intermediate: int
    renormalize: bool
    sparse_layers: tuple[bool, ...]
    shared_intermediate: int = 0

    def is_sparse(self, layer_idx: int) -> bool:
        return self.sparse_layers[layer_idx]


def mlp_params(moe: MoeShape | None, hidden: int, intermediate: int, layer_idx: int, active: bool = False) -> int:
    """The parameters of a layer's MLP: a dense one's SwiGLU (intermediate units), or a sparse layer's every expert
    (active: only the top_k a token runs), its router and its shared expert (with the shared expert's gate)."""
    if moe is None or not moe.is_sparse(layer_idx):
        return 3 * hidden * intermediate
    shared = 3 * hidden * moe.shared_intermediate + hidden if moe.shared_intermediate else 0
    experts = moe.top_k if active else moe.num_experts
    return experts * 3 * hidden * moe.expert_intermediate + moe.num_experts * hidden + shared


def moe_shape(config: Mapping[str, Any], num_layers: int) -> MoeShape | None:
    """The MoeShape of a config.json dict of a MOE_MODEL_TYPES family (None for a dense one): Mixtral's
    num_local_experts over every layer, its top-k always renormalised; Qwen2- and Qwen3-MoE's num_experts in the
    layers decoder_sparse_step and mlp_only_layers leave sparse, norm_topk_prob, and Qwen2-MoE's shared expert.
    CheckpointError where the sizes cannot be."""
    model_type = config.get("model_type")
    if model_type not in MOE_MODEL_TYPES:
        return None
    if model_type == "mixtral":
        shape = MoeShape(int(config.get("num_local_experts", 8)), int(config.get("num_experts_per_tok", 2)),
                         int(config["intermediate_size"]), True, (True,) * num_layers)
    else:
        num_experts, step = int(config.get("num_experts", 60)), int(config.get("decoder_sparse_step", 1))
        dense = set(config.get("mlp_only_layers") or ())
        sparse = tuple(num_experts > 0 and i not in dense and step > 0 and (i + 1) % step == 0
                       for i in range(num_layers))
        shared = int(config.get("shared_expert_intermediate_size", 0)) if model_type == "qwen2_moe" else 0
        shape = MoeShape(num_experts, int(config.get("num_experts_per_tok", 4)),
                         int(config.get("moe_intermediate_size", 1408)), bool(config.get("norm_topk_prob", False)),
                         sparse, shared)
    if any(shape.sparse_layers) and not 0 < shape.top_k <= shape.num_experts or min(
            shape.expert_intermediate, shape.shared_intermediate + 1) < 1:
        raise CheckpointError(f"config.json of a {model_type} model: num_experts_per_tok {shape.top_k} must lie in "
                              f"[1, {shape.num_experts}] experts, and the experts' sizes be positive")
    return shape


def qkv_bias(config: Mapping[str, Any]) -> bool:
    """Whether a config.json dict's q, k and v projections carry biases: Qwen2's always, Qwen2-MoE's by qkv_bias
    (default true), others' by attention_bias."""
    model_type = config.get("model_type")
    if model_type == "qwen2":
        return True
    if model_type == "qwen2_moe":
        return bool(config.get("qkv_bias", True))
    return bool(config.get("attention_bias", False))


def text_model_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """A config.json dict as the mesh reads it: a multimodal model's (TEXT_MODELS) becomes its text model's, its
    text_config over its config class's defaults, with the dtype, tied head and special tokens the whole model's
    config names; any other is itself. CheckpointError where a multimodal config has no text_config."""
    text_type = TEXT_MODELS.get(config.get("model_type"))
    if text_type is None:
        return dict(config)
    text = config.get("text_config")
    if not isinstance(text, Mapping):
        raise CheckpointError(f"config.json of a {config['model_type']} model has no text_config object")
    whole = {key: config[key] for key in ("dtype", "torch_dtype", "tie_word_embeddings", "bos_token_id",
                                          "eos_token_id") if config.get(key) is not None}
    return {**_TEXT_DEFAULTS[text_type], **text, **whole, "model_type": text_type,
            "architectures": [_TEXT_ARCHITECTURES[text_type]]}


def layer_norms(model_type: str) -> tuple[int, int]:
    """(norm weights of [hidden], norm weights of [head_dim]) in one layer of the family: what the planner counts
    and a stage loads (kernels.models.families: a layer class's NORMS and HEAD_NORMS)."""
    return _LAYER_NORMS.get(model_type, (2, 0))


def rope_types(config: Mapping[str, Any]) -> tuple[str, ...]:
    """The rope scalings a config.json dict asks for, in transformers 4's spelling (rope_scaling: {"type" or
    "rope_type"}) or 5's (rope_parameters: {"rope_type"}, or one such per layer type, as Gemma 3's); "default"
    where it asks for none."""
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if not isinstance(params, Mapping):
        raise CheckpointError(f"config.json rope scaling must be an object, got {params!r}")
    nested = [v for v in params.values() if isinstance(v, Mapping)]
    if nested and config.get("model_type") not in PER_LAYER_TYPE_ROPE:
        raise CheckpointError("config.json rope_parameters nested per layer type are not supported")
    aliases = ROPE_ALIASES.get(config.get("model_type"), {})
    kinds = (str(p.get("rope_type") or p.get("type") or "default") for p in (nested or [params]))
    return tuple(aliases.get(kind, kind) for kind in kinds)


def served_context(config: Mapping[str, Any]) -> int:
    """The longest sequence the mesh serves of a config.json dict's model: its max_position_embeddings, times the
    factor of a dynamic (NTK) rope scaling, which is for contexts longer than that (as vLLM serves it)."""
    context = int(config["max_position_embeddings"])
    if rope_types(config) == ("dynamic",):
        params = config.get("rope_parameters") or config.get("rope_scaling")
        return int(context * float(params["factor"]))
    return context


def check_model_config(config: Mapping[str, Any]) -> None:
    """CheckpointError, in one line naming the problem, unless a stage computes the model of a config.json dict:
    a family of MODEL_TYPES, a rope type of ROPE_TYPES, a dtype of DTYPES (the full check of its sizes is the
    loader's: kernels.models.config)."""
    model_type = config.get("model_type")
    if model_type not in MODEL_TYPES:
        why = f" ({NOT_YET_MODEL_TYPES[model_type]})" if model_type in NOT_YET_MODEL_TYPES else ""
        raise CheckpointError(f"config.json model_type {model_type!r} is not supported{why}; supported: "
                              f"{', '.join(MODEL_TYPES)}")
    for rope in rope_types(config):
        if rope not in ROPE_TYPES:
            raise CheckpointError(f"config.json rope type {rope!r} is not supported; supported: "
                                  f"{', '.join(ROPE_TYPES)}")
    dtype = config.get("dtype") or config.get("torch_dtype") or "float32"
    if dtype not in DTYPES:
        raise CheckpointError(f"config.json dtype {dtype!r} is not supported; supported: {', '.join(DTYPES)}")


def model_task(config: Mapping[str, Any]) -> str:
    """"embed" for a config.json dict whose architectures[0] is a base model without an LM head, else "generate"."""
    architectures = config.get("architectures")
    first = architectures[0] if isinstance(architectures, list) and architectures else None
    return "embed" if first in EMBEDDING_ARCHITECTURES else "generate"


def attention_windows(config: Mapping[str, Any], arch: str, num_layers: int) -> tuple[int | None, tuple[str, ...]]:
    """(sliding window, layer types) of a config.json dict: Mistral and Phi-3 window every layer; Qwen2 only with
    use_sliding_window, from max_window_layers on (its layer_types name which); Gemma 2 and 3 the layers their
    layer_types (or sliding_window_pattern) say are sliding; (None, ()) is full attention.
    CheckpointError where layer_types does not name every layer."""
    window = config.get("sliding_window")
    if arch == "llama" or window is None:
        return None, ()
    if arch in ("mistral", "phi3", "mixtral"):
        return int(window), ()
    if arch in GEMMA_SLIDING_PATTERN and config.get("layer_types") is None:
        pattern = int(config.get("sliding_window_pattern") or GEMMA_SLIDING_PATTERN[arch])
        return int(window), tuple("sliding_attention" if (i + 1) % pattern else "full_attention"
                                  for i in range(num_layers))
    if arch in GEMMA_SLIDING_PATTERN:
        layer_types = config["layer_types"]
        if len(layer_types) != num_layers:
            raise CheckpointError(f"config.json layer_types has {len(layer_types)} entries for {num_layers} layers")
        return int(window), tuple(layer_types)
    if not config.get("use_sliding_window", False):
        return None, ()
    layer_types = config.get("layer_types")
    if layer_types is None:
        first = int(config.get("max_window_layers", 28))
        layer_types = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
    if len(layer_types) != num_layers:
        raise CheckpointError(f"config.json layer_types has {len(layer_types)} entries for {num_layers} layers")
    return int(window), tuple(layer_types)


def windowed(config: Mapping[str, Any]) -> bool:
    """Whether any layer of a config.json dict attends over a sliding window (attention_windows)."""
    return any(layer_windows(config))


def layer_windows(config: Mapping[str, Any]) -> tuple[int, ...]:
    """Each layer's sliding window of a config.json dict (attention_windows), 0 for a layer of full attention."""
    num_layers = int(config.get("num_hidden_layers", 0))
    window, layer_types = attention_windows(config, str(config.get("model_type")), num_layers)
    if window is None:
        return (0,) * num_layers
    return tuple(window if not layer_types or layer_types[i] == "sliding_attention" else 0 for i in range(num_layers))


def check_revision(revision: str, where: str) -> None:
    """A model revision's id: up to 64 letters, digits, dots, dashes and underscores ("": none said)."""
    if not _REVISION.fullmatch(revision):
        raise InvalidInput(f"{where} {revision[:80]!r} is not a revision (up to 64 of A-Z a-z 0-9 . _ -)")


@dataclass(frozen=True, slots=True)
class StageSpec:
    """A contiguous layer range [start_layer, end_layer) of one model, as one stage serves it."""

    model_id: str
    model_path: str
    start_layer: int
    end_layer: int
    num_layers: int
    dtype: str = "float32"
    device: str = "cpu"
    kv_block_size: int = 16
    tp_degree: int = 1          # ranks of the tensor-parallel group serving it; 1 = one process
    runtime: str = "torch"      # what computes its layers: "torch", or "onnxruntime" (kernels.models.onnx_stage)
    quantize: str = ""          # "int8" / "int4": its matrices, LM head and embedding quantized (kernels.ops.quant)
    kv_cache_bytes: int = 0     # the KV cache its plan reserved for it, per rank; 0: the plan said nothing
    revision: str = ""          # which revision of the model's folder it serves (model_folder.revision_of); a
                                # stage takes sessions of its own revision only: a pipeline never mixes two

    def __post_init__(self) -> None:
        if not 1 <= self.tp_degree <= MAX_TP_DEGREE:
            raise InvalidInput(f"stage tp_degree must be in 1..{MAX_TP_DEGREE}, got {self.tp_degree}")
        if not 1 <= self.kv_block_size <= MAX_KV_BLOCK_SIZE:
            raise InvalidInput(f"stage kv_block_size must be in 1..{MAX_KV_BLOCK_SIZE}, got {self.kv_block_size}")
        if not 0 <= self.start_layer < self.end_layer <= self.num_layers:
            raise InvalidInput(
                f"stage layer range [{self.start_layer}, {self.end_layer}) is not inside "
                f"[0, {self.num_layers})")
        if self.dtype not in DTYPES:
            raise InvalidInput(f"stage dtype {self.dtype!r} is not one of {DTYPES}")
        if not re.fullmatch(r"cpu|cuda(:\d{1,2})?", self.device):
            raise InvalidInput(f"stage device {self.device!r} is not cpu, cuda or cuda:N")
        if self.runtime not in RUNTIMES:
            raise InvalidInput(f"stage runtime {self.runtime!r} is not one of {RUNTIMES}")
        if self.quantize and self.quantize not in QUANTIZATIONS:
            raise InvalidInput(f"stage quantize {self.quantize!r} is not one of {QUANTIZATIONS} (or none)")
        if self.quantize and self.tp_degree > 1:
            raise InvalidInput("quantized weights are for single-process stages (tp_degree 1)")
        if not 0 <= self.kv_cache_bytes <= MAX_KV_CACHE_BYTES:
            raise InvalidInput(f"stage kv_cache_bytes must be in 0..{MAX_KV_CACHE_BYTES}, got {self.kv_cache_bytes}")
        check_revision(self.revision, "stage revision")

    @property
    def is_first(self) -> bool:
        return self.start_layer == 0

    @property
    def is_last(self) -> bool:
        return self.end_layer == self.num_layers


@dataclass(frozen=True, slots=True)
class Assignment:
    """An order to an agent: serve this stage under this id."""

    assignment_id: str
    stage: StageSpec


STAGE_STATES = tuple(StageState)


@dataclass(frozen=True, slots=True)
class StageStatus:
    """An agent's report on one assignment: one of STAGE_STATES (less "assigned")."""

    assignment_id: str
    state: str
    error: str = ""
    param_bytes: int = 0
