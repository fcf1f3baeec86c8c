"""Checkpoint: lazy per-stage loading from single-file and sharded safetensors."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from stratamesh.fleet.errors import CheckpointError
from stratamesh.kernels.models.checkpoint import Checkpoint, stage_tensor_names
from stratamesh.kernels.models.config import read_config


def test_stage_tensor_names_cover_the_model_once(tiny_model):
    model_dir = tiny_model("qwen2")
    config = read_config(model_dir)
    parts = [stage_tensor_names(config, s, e) for s, e in ((0, 1), (1, 4), (4, 6))]
    flat = [n for part in parts for n in part]
    assert len(flat) == len(set(flat))
    assert sorted(flat) == Checkpoint(model_dir).tensor_names()
    assert parts[0][0] == "model.embed_tokens.weight" and parts[2][-1] == "lm_head.weight"
    assert not any("embed" in n or "lm_head" in n or "model.norm" in n for n in parts[1])


def test_tied_head_is_the_embedding(tiny_model):
    config = read_config(tiny_model("llama", tie_word_embeddings=True))
    assert stage_tensor_names(config, 3, 6)[-1] == "model.embed_tokens.weight"
    assert stage_tensor_names(config, 0, 6).count("model.embed_tokens.weight") == 1


def test_sharded_equals_single_file(tiny_model):
    single, sharded = tiny_model("llama"), tiny_model("llama", shard_size_bytes=1_500_000)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    names = stage_tensor_names(read_config(single), 2, 6)
    a, b = Checkpoint(single).load(names), Checkpoint(sharded).load(names)
    assert list(a) == names and a.keys() == b.keys()
    for name in names:
        assert torch.equal(a[name], b[name])
    assert torch.equal(a["lm_head.weight"], load_file(single / "model.safetensors")["lm_head.weight"])


def test_load_casts_and_reads_only_what_was_asked(tiny_model):
    out = Checkpoint(tiny_model("llama")).load(["model.norm.weight"], torch.bfloat16)
    assert list(out) == ["model.norm.weight"] and out["model.norm.weight"].dtype == torch.bfloat16


def test_missing_tensor_is_named(tiny_model):
    with pytest.raises(CheckpointError, match="model.layers.99.mlp.up_proj.weight"):
        Checkpoint(tiny_model("llama")).load(["model.layers.99.mlp.up_proj.weight"])


def test_missing_shard_and_empty_folder(tiny_model, tmp_path):
    with pytest.raises(CheckpointError, match="neither"):
        Checkpoint(tmp_path)
    index = {"weight_map": {"model.norm.weight": "model-00009-of-00009.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="shard"):
        Checkpoint(tmp_path).load(["model.norm.weight"])
