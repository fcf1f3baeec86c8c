"""Model families, one module each: the layer a family's checkpoint describes, on the shared ops (kernels/ops).

A stage (kernels.models.decoder.StageModel) embeds, rotates positions, runs its slice of layers and ends in the
head the same way for every family; what differs is the layer: its tensors (names, shapes, how they fuse) and its
forward. docs/models.md says how to add one."""

from __future__ import annotations

from stratamesh.kernels.models.config import ModelConfig
from stratamesh.kernels.models.families.gemma import Gemma3Layer, GemmaLayer
from stratamesh.kernels.models.families.llama import LlamaLayer
from stratamesh.kernels.models.families.moe import MoeLayer, Qwen2MoeLayer, Qwen3MoeLayer
from stratamesh.kernels.models.families.phi3 import Phi3Layer
from stratamesh.kernels.models.families.qwen3 import Qwen3Layer

LAYERS: dict[str, type[LlamaLayer]] = {"llama": LlamaLayer, "mistral": LlamaLayer, "qwen2": LlamaLayer,
                                       "qwen3": Qwen3Layer, "gemma2": GemmaLayer, "gemma3_text": Gemma3Layer,
                                       "phi3": Phi3Layer, "mixtral": MoeLayer, "qwen2_moe": Qwen2MoeLayer,
                                       "qwen3_moe": Qwen3MoeLayer}


def layer_class(config: ModelConfig) -> type[LlamaLayer]:
    """The layer class of config's family (config.arch is one that parse_config accepts)."""
    return LAYERS[config.arch]
