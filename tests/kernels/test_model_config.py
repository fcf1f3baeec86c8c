"""parse_config / read_config: tables over the config.json spellings transformers 4 and 5 write."""

from __future__ import annotations

import json

import pytest

from stratamesh.fleet.errors import CheckpointError
from stratamesh.kernels.models.config import ModelConfig, parse_config, read_config

BASE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 100, "max_position_embeddings": 512}
LLAMA3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


@pytest.mark.parametrize("extra, theta, scaling", [
    ({}, 10000.0, None),
    ({"rope_theta": 500000.0}, 500000.0, None),
    ({"rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", **LLAMA3}}, 500000.0,
     {"rope_type": "llama3", **LLAMA3}),
    ({"rope_theta": 1e4, "rope_scaling": {"type": "linear", "factor": 2}}, 1e4, {"rope_type": "linear", "factor": 2.0}),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}, 1e6, None),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, **LLAMA3}}, 5e5, {"rope_type": "llama3", **LLAMA3}),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0}}, 5e5,
     {"rope_type": "llama3", **LLAMA3, "original_max_position_embeddings": 512}),
], ids=["none", "classic-theta", "classic-llama3", "classic-linear-type", "params-default", "params-llama3",
        "params-llama3-default-original-len"])
def test_rope_spellings(extra, theta, scaling):
    config = parse_config({"model_type": "llama", **BASE, **extra})
    assert config.rope_theta == theta
    assert config.rope_scaling == scaling


@pytest.mark.parametrize("raw, match", [
    ({"model_type": "gpt2", **BASE}, "model_type 'gpt2'"),
    ({**BASE}, "model_type None"),
    ({"model_type": "llama", **BASE, "rope_scaling": {"rope_type": "su", "factor": 4.0}}, "rope type 'su'"),
    ({"model_type": "llama", **BASE, "rope_parameters": {"rope_type": "proportional", "factor": 2.0}},
     "'proportional'"),
    ({"model_type": "phi3", **BASE, "rope_scaling": {"type": "su", "short_factor": [1.0] * 3,
                                                     "long_factor": [1.0] * 8}}, "short_factor has 3 entries"),
    ({"model_type": "phi3", **BASE, "partial_rotary_factor": 1.5}, "partial_rotary_factor 1.5"),
    ({"model_type": "llama", **BASE, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "lacks"),
    ({"model_type": "llama", **BASE, "hidden_act": "gelu"}, "hidden_act"),
    ({"model_type": "llama", **{k: v for k, v in BASE.items() if k != "vocab_size"}}, "vocab_size"),
])
def test_unsupported_configs_raise_checkpoint_error(raw, match):
    with pytest.raises(CheckpointError, match=match):
        parse_config(raw)


def test_architecture_fields():
    llama = parse_config({"model_type": "llama", **BASE, "sliding_window": 16})
    qwen = parse_config({"model_type": "qwen2", **BASE, "use_sliding_window": False, "sliding_window": 16})
    qwen_win = parse_config({"model_type": "qwen2", **BASE, "use_sliding_window": True, "sliding_window": 16,
                             "max_window_layers": 2})
    mistral = parse_config({"model_type": "mistral", **BASE, "sliding_window": 16, "head_dim": 32})
    assert (llama.head_dim, llama.num_kv_heads, llama.attention_bias, llama.sliding_window) == (16, 2, False, None)
    assert qwen.attention_bias and qwen.sliding_window is None
    assert [qwen_win.window_for_layer(i) for i in range(4)] == [None, None, 16, 16]
    assert mistral.head_dim == 32 and [mistral.window_for_layer(i) for i in range(4)] == [16] * 4


def test_kv_bytes_per_token():
    config = parse_config({"model_type": "llama", **BASE, "dtype": "bfloat16"})
    assert config.kv_bytes_per_token == 4 * 2 * 2 * 16 * 2   # layers * (K, V) * kv heads * head_dim * bytes


def test_read_config_merges_generation_eos(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2", **BASE, "eos_token_id": 5,
                                                      "bos_token_id": 4}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 7]}))
    config = read_config(tmp_path)
    assert isinstance(config, ModelConfig)
    assert (config.bos_token_id, config.eos_token_ids) == (4, (5, 7))


def test_read_config_missing_file(tmp_path):
    with pytest.raises(CheckpointError, match="config.json"):
        read_config(tmp_path)
