"""What a model family is to the rest of the mesh: the tensors its layers hold (the planner counts them as loaded),
and the runtimes that compute it (ONNX Runtime stages refuse by name the families whose layer they lack)."""

from __future__ import annotations

import json

import pytest

from stratamesh.coordinator.placement import onnx_servable
from stratamesh.fleet.errors import InvalidInput
from stratamesh.fleet.stages import MODEL_TYPES, ONNX_MODEL_TYPES, StageSpec
from stratamesh.kernels.models.checkpoint import Checkpoint
from stratamesh.kernels.models.config import read_config
from stratamesh.kernels.models.decoder import load_stage
from stratamesh.kernels.models.families import LAYERS
from stratamesh.kernels.models.onnx_stage import check_exportable
from stratamesh.kernels.tiny_model import TINY_ARCHS
from stratamesh.partitioner.profile import profile_from_hf_config


def test_every_family_has_a_layer_and_a_tiny_checkpoint() -> None:
    assert set(LAYERS) == set(MODEL_TYPES) == set(TINY_ARCHS)


@pytest.mark.parametrize("arch", TINY_ARCHS)
@pytest.mark.parametrize("tied", [False, True])
def test_the_planner_counts_the_parameters_a_stage_loads(tiny_model, arch: str, tied: bool) -> None:
    model_dir = tiny_model(arch, num_layers=2, tie_word_embeddings=tied)
    raw, config = json.loads((model_dir / "config.json").read_text()), read_config(model_dir)
    first, last = (load_stage(StageSpec("m", str(model_dir), s, e, 2)) for s, e in ((0, 1), (1, 2)))
    profile = profile_from_hf_config(raw)
    per_layer = [sum(t.numel() for name, t in stage.tensors.items() if name.startswith("model.layers."))
                 for stage in (first, last)]
    assert per_layer == list(profile.layer_params) == [config.num_layer_params(i) for i in range(2)]
    assert sum(t.numel() for t in Checkpoint(model_dir).load(Checkpoint(model_dir).tensor_names()).values()) == (
        sum(profile.layer_params) + profile.embed_params + profile.head_params - (profile.embed_params if tied else 0))


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_onnx_runtime_stages_take_the_llama_layer_and_refuse_the_rest_by_name(tiny_model, arch: str) -> None:
    model_dir = tiny_model(arch, num_layers=2)
    raw = json.loads((model_dir / "config.json").read_text())
    stage = load_stage(StageSpec("m", str(model_dir), 0, 2, 2, runtime="onnxruntime"))
    windowed = arch == "mistral"
    assert onnx_servable(raw) == (arch in ONNX_MODEL_TYPES and not windowed)
    if onnx_servable(raw):
        check_exportable(stage)
        return
    with pytest.raises(InvalidInput, match="sliding-window" if windowed else f"not {arch}'s: .*--runtime torch"):
        check_exportable(stage)


def test_a_mixture_of_experts_stage_holds_each_expert_once(tiny_model) -> None:
    """A stage stacks a sparse layer's experts: the checkpoint's tensors become views of the stacks (no second copy),
    and the stage's parameters are the checkpoint's."""
    model_dir = tiny_model("qwen2_moe", num_layers=2)
    stage = load_stage(StageSpec("m", str(model_dir), 0, 2, 2))
    layer = stage._layers[1]                                   # decoder_sparse_step 2: layer 1 is sparse
    assert layer.gate_up is None and layer.experts_gate_up.shape[0] == read_config(model_dir).moe.num_experts
    expert = stage.tensors["model.layers.1.mlp.experts.3.up_proj.weight"]
    assert expert.untyped_storage().data_ptr() == layer.experts_gate_up.untyped_storage().data_ptr()
    assert stage._layers[0].router is None and stage._layers[0].gate_up is not None     # layer 0 is dense
