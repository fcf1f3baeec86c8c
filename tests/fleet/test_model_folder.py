"""A model folder is checked before any agent loads it, and what is wrong is said in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stratamesh.fleet.errors import CheckpointError
from stratamesh.fleet.model_folder import check_model_folder, revision_of
from stratamesh.fleet.stages import MODEL_TYPES, ROPE_TYPES, check_model_config, rope_types

CONFIG = {"model_type": "qwen3", "num_hidden_layers": 2, "dtype": "bfloat16",
          "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}


def folder(tmp_path: Path, config: object = CONFIG, files: tuple[str, ...] = ("model.safetensors",
                                                                              "tokenizer.json")) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(config))
    for name in files:
        (tmp_path / name).write_bytes(b"")
    return tmp_path


def test_a_servable_folder_gives_its_config(tmp_path: Path) -> None:
    assert check_model_folder(folder(tmp_path)) == CONFIG
    (tmp_path / "s").mkdir()
    sharded = folder(tmp_path / "s", files=("model.safetensors.index.json", "tokenizer.json"))
    assert check_model_folder(sharded)["model_type"] == "qwen3"


@pytest.mark.parametrize(("config", "files", "says"), [
    (CONFIG, ("tokenizer.json",), "has neither model.safetensors nor model.safetensors.index.json"),
    (CONFIG, ("model.safetensors",), "has no tokenizer.json"),
    ([1, 2], ("model.safetensors", "tokenizer.json"), "is not a JSON object"),
    ({**CONFIG, "model_type": "gpt_oss"}, (), "model_type 'gpt_oss' is not supported (its attention sinks, "
     "alternating sliding windows and MXFP4 expert weights are not computed yet); supported: "
     + ", ".join(MODEL_TYPES)),
    ({**CONFIG, "model_type": "falcon"}, (), "model_type 'falcon' is not supported; supported: " +
     ", ".join(MODEL_TYPES)),
    ({**CONFIG, "rope_scaling": {"type": "su"}}, (), "rope type 'su' is not supported"),
    ({**CONFIG, "rope_parameters": {"full_attention": {"rope_type": "default"}}}, (), "nested per layer type"),
    ({**CONFIG, "torch_dtype": None, "dtype": "int4"}, (), "dtype 'int4' is not supported"),
])
def test_a_folder_no_stage_can_serve_is_refused_by_name(tmp_path: Path, config: object, files: tuple[str, ...],
                                                        says: str) -> None:
    with pytest.raises(CheckpointError) as refused:
        check_model_folder(folder(tmp_path, config, files))
    assert says in str(refused.value) and "\n" not in str(refused.value)


def test_no_folder_or_no_config_is_said_so(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        check_model_folder(tmp_path / "nowhere")
    with pytest.raises(CheckpointError, match="has no config.json"):
        check_model_folder(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not readable JSON"):
        check_model_folder(tmp_path)


@pytest.mark.parametrize(("config", "rope"), [
    ({}, "default"), ({"rope_scaling": None}, "default"), ({"rope_scaling": {"type": "linear"}}, "linear"),
    ({"rope_scaling": {"rope_type": "llama3"}}, "llama3"), ({"rope_parameters": {"rope_type": "linear"}}, "linear"),
    ({"rope_parameters": {"rope_theta": 1e6}}, "default"), ({"rope_scaling": {"type": "dynamic"}}, "dynamic"),
    ({"model_type": "phi3", "rope_scaling": {"type": "su"}}, "longrope"),    # Phi-3's older names for LongRoPE
    ({"model_type": "phi3", "rope_scaling": {"type": "yarn"}}, "longrope"),
])
def test_the_rope_type_is_read_in_either_spelling(config: dict, rope: str) -> None:
    assert rope_types(config) == (rope,) and rope in ROPE_TYPES
    check_model_config({"model_type": "llama", **config})


def test_gemma_3_names_a_rope_per_layer_type_and_each_is_checked() -> None:
    nested = {"model_type": "gemma3_text", "rope_parameters": {
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}
    assert rope_types(nested) == ("linear", "default")
    check_model_config(nested)
    nested["rope_parameters"]["sliding_attention"]["rope_type"] = "proportional"
    with pytest.raises(CheckpointError, match="rope type 'proportional'"):
        check_model_config(nested)


def test_a_dynamic_ntk_model_is_served_to_its_scaled_context() -> None:
    """What /v1/models shows and the scheduler admits: max_position_embeddings times the factor (as vLLM)."""
    from stratamesh.fleet.stages import served_context

    assert served_context({"max_position_embeddings": 4096}) == 4096
    assert served_context({"max_position_embeddings": 4096, "rope_scaling": {"type": "dynamic", "factor": 2.0}}) == 8192
    assert served_context({"max_position_embeddings": 4096,
                           "rope_parameters": {"rope_type": "yarn", "factor": 4.0}}) == 4096


def test_a_folders_revision_changes_with_its_config_or_a_weight_file_and_only_then(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    model = folder(tmp_path / "a")
    first = revision_of(model)
    assert len(first) == 12 and revision_of(model) == first                    # read again: the same
    (model / "README.md").write_text("notes")                                  # not a file the model is made of
    assert revision_of(model) == first
    (model / "model.safetensors").write_bytes(b"\0" * 8)                       # new weights
    second = revision_of(model)
    assert second != first
    (model / "config.json").write_text(json.dumps({**CONFIG, "num_hidden_layers": 3}))
    assert revision_of(model) not in (first, second)
    assert revision_of(folder(tmp_path / "b")) != revision_of(model)          # another folder
