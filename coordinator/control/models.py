"""The models the coordinator serves: their folders' config, checked, and what the API shows of them."""

from __future__ import annotations

from dataclasses import dataclass

from stratamesh.coordinator.registry_store import PlanStore
from stratamesh.fleet.errors import CheckpointError, InvalidInput, ModelNotFound
from stratamesh.fleet.model_folder import read_config_json
from stratamesh.fleet.sessions import Speculation
from stratamesh.fleet.stages import QUANTIZATIONS, check_model_config, model_task, served_context
from stratamesh.partitioner.profile import profile_from_hf_config


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What the coordinator needs of a model without loading it."""

    model_id: str
    path: str
    num_layers: int
    hidden_size: int
    max_context: int
    created: int
    task: str = "generate"      # or "embed": fleet.stages.model_task of its config
    speculation: Speculation | None = None      # its speculative decoding (None: the coordinator's default)


def read_model_config(path: str) -> dict:
    """config.json of a Hugging Face folder, checked for a family, rope type and dtype stages compute
    (check_model_config) and the fields placement needs."""
    config = read_config_json(path)
    for key in ("num_hidden_layers", "hidden_size", "max_position_embeddings"):
        if not isinstance(config.get(key), int) or config[key] <= 0:
            raise CheckpointError(f"{path}/config.json: {key} must be a positive integer")
    profile_from_hf_config(config)     # the planner's fields: CheckpointError names a missing one
    check_model_config(config)
    return config


def check_model(path: str, num_stages: int) -> dict:
    """The config of a model to deploy in num_stages stages (InvalidInput, CheckpointError)."""
    if num_stages < 1:
        raise InvalidInput(f"num_stages must be >= 1, got {num_stages}")
    return read_model_config(path)


def check_quantize(quantize: str) -> None:
    """InvalidInput unless quantize is "" (the weights as stored) or one of QUANTIZATIONS."""
    if quantize and quantize not in QUANTIZATIONS:
        raise InvalidInput(f"quantize must be one of {', '.join(QUANTIZATIONS)} (or none), got {quantize!r}")


def model_infos(registry: PlanStore) -> list[ModelInfo]:
    """Every registered model."""
    return [ModelInfo(m.model_id, m.path, m.num_layers, m.config["hidden_size"],
                      served_context(m.config), int(m.created), model_task(m.config), m.speculation)
            for m in registry.models()]


def find_model(registry: PlanStore, model_id: str) -> ModelInfo:
    """The registered model of that id (ModelNotFound otherwise)."""
    for info in model_infos(registry):
        if info.model_id == model_id:
            return info
    raise ModelNotFound(f"the model '{model_id}' does not exist")
