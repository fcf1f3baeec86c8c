"""ModelProfile from Hugging Face configs: parameter counts of known models, KV bytes, dtypes, bad configs."""

from __future__ import annotations

import pytest

from stratamesh.fleet.errors import CheckpointError
from stratamesh.partitioner.profile import profile_from_hf_config

LLAMA_31_8B = {
    "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "_name_or_path": "meta-llama/Llama-3.1-8B",
}
LLAMA_32_1B = {
    "model_type": "llama", "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 128256,
    "tie_word_embeddings": True, "torch_dtype": "bfloat16",
}
QWEN25_05B = {   # q/k/v carry biases
    "model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
    "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936, "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
}
PHI4_MINI = {    # q/k/v and gate/up stored fused: the same parameters
    "model_type": "phi3", "hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 32,
    "num_attention_heads": 24, "num_key_value_heads": 8, "vocab_size": 200064, "tie_word_embeddings": True,
    "partial_rotary_factor": 0.75, "sliding_window": 262144, "torch_dtype": "bfloat16",
}
QWEN3_06B = {    # head_dim (128) is not hidden / heads (64)
    "model_type": "qwen3", "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
    "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
    "tie_word_embeddings": True, "torch_dtype": "bfloat16",
}


# published parameter counts; kv: K + V bytes per token per layer in bf16 = 2 * kv_heads * head_dim * 2
@pytest.mark.parametrize("config, params, kv_bytes, layer_params", [
    (LLAMA_31_8B, 8_030_261_248, 2 * 8 * 128 * 2, 218_112_000),
    (LLAMA_32_1B, 1_235_814_400, 2 * 8 * 64 * 2, 60_821_504),
    (QWEN25_05B, 494_032_768, 2 * 2 * 64 * 2, 14_912_384),
    (PHI4_MINI, 3_836_021_760, 2 * 8 * 128 * 2, 100_669_440),
])
def test_known_models(config, params, kv_bytes, layer_params) -> None:
    profile = profile_from_hf_config(config)
    assert profile.dtype == "bfloat16" and profile.bytes_per_param == 2
    assert profile.total_bytes / 2 == pytest.approx(params, rel=1e-9)
    assert profile.layer_kv_bytes_per_token == (kv_bytes,) * config["num_hidden_layers"]
    assert profile.layer_params == (layer_params,) * config["num_hidden_layers"]
    assert profile.activation_bytes_per_token == config["hidden_size"] * 2
    assert profile.embed_params == config["vocab_size"] * config["hidden_size"]
    assert profile.head_params == profile.embed_params + config["hidden_size"]     # + the final norm
    assert profile.head_flops_per_token == 2 * profile.embed_params


def test_llama_31_8b_in_detail() -> None:
    profile = profile_from_hf_config(LLAMA_31_8B)
    assert profile.name == "meta-llama/Llama-3.1-8B"
    assert profile.num_layers == 32 and profile.num_heads == 32 and profile.num_kv_heads == 8
    assert profile.total_bytes / 2 == pytest.approx(8.03e9, rel=0.01)
    assert profile.layer_param_bytes(5) == 2 * 218_112_000
    assert profile.embed_bytes == 2 * 128256 * 4096
    matmul = 4096 * (4096 + 2 * 1024) + 4096 * 4096 + 3 * 4096 * 14336
    assert profile.layer_flops_per_token == (2 * matmul,) * 32
    assert profile.layer_attn_flops_per_ctx == (4 * 4096,) * 32
    assert not profile.tied_embeddings


def test_head_dim_from_config() -> None:
    profile = profile_from_hf_config(QWEN3_06B)
    q_dim, kv_dim = 16 * 128, 8 * 128
    assert profile.layer_kv_bytes_per_token[0] == 2 * kv_dim * 2
    assert profile.layer_attn_flops_per_ctx[0] == 4 * q_dim
    assert profile.layer_params[0] == (1024 * (q_dim + 2 * kv_dim) + q_dim * 1024 + 3 * 1024 * 3072 + 2 * 1024
                                       + 2 * 128)     # its per-head q and k RMSNorms


def test_tied_embeddings_counted_once() -> None:
    tied = profile_from_hf_config(LLAMA_32_1B)
    untied = profile_from_hf_config({**LLAMA_32_1B, "tie_word_embeddings": False})
    assert tied.tied_embeddings and not untied.tied_embeddings
    assert untied.total_bytes - tied.total_bytes == tied.embed_bytes
    assert tied.head_bytes == untied.head_bytes        # a last stage without the first still holds the head


E5_MISTRAL_7B = {   # intfloat/e5-mistral-7b-instruct: Mistral-7B's base model, an embedding model without an LM head
    "architectures": ["MistralModel"], "model_type": "mistral", "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 32000,
    "tie_word_embeddings": False, "torch_dtype": "float16",
}


def test_an_embedding_model_counts_no_lm_head() -> None:
    embedder = profile_from_hf_config(E5_MISTRAL_7B)
    generator = profile_from_hf_config({**E5_MISTRAL_7B, "architectures": ["MistralForCausalLM"]})
    assert embedder.total_bytes / 2 == 7_110_660_096 and generator.total_bytes / 2 == 7_241_732_096
    assert embedder.head_params == 4096 and embedder.head_flops_per_token == 0     # the final norm alone
    assert not profile_from_hf_config({**E5_MISTRAL_7B, "tie_word_embeddings": True}).tied_embeddings


@pytest.mark.parametrize("extra, expected", [
    ({}, "bfloat16"),                                            # torch_dtype
    ({"dtype": "float16"}, "float16"),                            # newer configs say dtype
    ({"torch_dtype": None}, "float32"),                           # nothing said: float32
])
def test_dtype_from_config(extra, expected) -> None:
    assert profile_from_hf_config({**LLAMA_32_1B, **extra}).dtype == expected


def test_dtype_argument_wins() -> None:
    profile = profile_from_hf_config(LLAMA_32_1B, dtype="float32", name="mine")
    assert profile.dtype == "float32" and profile.name == "mine"
    assert profile.layer_kv_bytes_per_token[0] == 2 * 8 * 64 * 4


def test_missing_kv_heads_means_multi_head() -> None:
    config = {k: v for k, v in LLAMA_31_8B.items() if k != "num_key_value_heads"}
    profile = profile_from_hf_config(config)
    assert profile.num_kv_heads == 32
    assert profile.layer_kv_bytes_per_token[0] == 2 * 4096 * 2


def test_attention_bias_adds_qkv_biases() -> None:
    plain = profile_from_hf_config(LLAMA_31_8B)
    biased = profile_from_hf_config({**LLAMA_31_8B, "attention_bias": True})
    assert biased.layer_params[0] - plain.layer_params[0] == 4096 + 2 * 1024


@pytest.mark.parametrize("dtype, bytes_per_param", [("float32", 4), ("float16", 2), ("bfloat16", 2), ("int8", 1)])
def test_at_dtype(dtype, bytes_per_param) -> None:
    profile = profile_from_hf_config(LLAMA_31_8B)
    other = profile.at_dtype(dtype)
    assert other.dtype == dtype and other.bytes_per_param == bytes_per_param
    assert other.layer_params == profile.layer_params                    # parameters do not change
    assert other.total_bytes == profile.total_bytes // 2 * bytes_per_param
    assert other.layer_kv_bytes_per_token == (2 * 8 * 128 * bytes_per_param,) * 32
    assert other.activation_bytes_per_token == 4096 * bytes_per_param
    assert other.at_dtype("bfloat16") == profile
    assert other == profile_from_hf_config(LLAMA_31_8B, dtype=dtype)


def test_at_unknown_dtype() -> None:
    with pytest.raises(CheckpointError, match="float8"):
        profile_from_hf_config(LLAMA_31_8B).at_dtype("float8")


@pytest.mark.parametrize("change, match", [
    ({"hidden_size": None}, "hidden_size"),                       # None stands for "remove the field"
    ({"num_attention_heads": None}, "num_attention_heads"),
    ({"num_hidden_layers": None}, "num_hidden_layers"),
    ({"intermediate_size": None}, "intermediate_size"),
    ({"vocab_size": None}, "vocab_size"),
    ({"hidden_size": "big"}, "malformed"),
    ({"num_hidden_layers": [32]}, "malformed"),
    ({"num_hidden_layers": 0}, "positive"),
    ({"vocab_size": -1}, "positive"),
    ({"intermediate_size": 0}, "positive"),
    ({"num_key_value_heads": 5}, "multiple of kv heads"),
    ({"num_key_value_heads": -8}, "positive"),
    ({"head_dim": -1}, "positive"),
    ({"torch_dtype": "float8_e4m3"}, "float8_e4m3"),
    ({"num_attention_heads": 0}, "positive"),
    ({"num_attention_heads": 8192, "num_key_value_heads": 8, "head_dim": 0}, "head_dim"),
])
def test_bad_configs(change, match) -> None:
    config = {**LLAMA_31_8B, **{k: v for k, v in change.items() if v is not None}}
    for key in (k for k, v in change.items() if v is None):
        del config[key]
    with pytest.raises(CheckpointError, match=match):
        profile_from_hf_config(config)


def test_a_windowed_layer_reads_at_most_its_window_and_holds_the_whole_context() -> None:
    """Mistral's every layer, Gemma 2's every other: a step reads (and attends over) at most the window's KV per
    windowed layer, while the KV reserved is the whole context's (a stage frees no block behind a window)."""
    from stratamesh.partitioner.cost import StageTables
    from stratamesh.partitioner.plan import PlanRequest

    mistral = {"model_type": "mistral", "hidden_size": 1024, "intermediate_size": 2048, "num_hidden_layers": 4,
               "num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": 1000, "sliding_window": 256}
    gemma2 = {**mistral, "model_type": "gemma2"}
    full = {**mistral, "sliding_window": None}
    assert profile_from_hf_config(mistral).layer_windows == (256,) * 4
    assert profile_from_hf_config(gemma2).layer_windows == (256, 0, 256, 0)
    request = PlanRequest(context_len=8192)
    tables = {name: StageTables(profile_from_hf_config(c), request)
              for name, c in (("mistral", mistral), ("gemma2", gemma2), ("full", full))}
    share = 256 / request.mean_context
    assert tables["mistral"].read_kv[0, 4] == pytest.approx(tables["full"].read_kv[0, 4] * share)
    assert tables["gemma2"].read_kv[0, 4] == pytest.approx(tables["full"].read_kv[0, 4] * (1 + share) / 2)
    assert tables["mistral"].flops[0, 4] < tables["gemma2"].flops[0, 4] < tables["full"].flops[0, 4]
    assert (tables["mistral"].memory_at("float32") == tables["full"].memory_at("float32")).all()
    short = StageTables(profile_from_hf_config(mistral), PlanRequest(context_len=256))   # the window not reached
    assert short.read_kv[0, 4] == StageTables(profile_from_hf_config(full), PlanRequest(context_len=256)).read_kv[0, 4]


def test_a_mixture_of_experts_is_held_whole_and_read_as_its_tokens_pick() -> None:
    """Qwen3-MoE's shape (128 experts, 8 a token): a stage holds every expert, as a dense model of as many
    parameters; a step of one token reads the attention, the router and 8 experts (the planner prices a 30B-A3B
    model as 30B in memory and about 3B in speed), and a step of many tokens reads most of the experts."""
    from stratamesh.partitioner.cost import StageTables
    from stratamesh.partitioner.plan import PlanRequest

    moe = {"model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
           "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 4, "num_attention_heads": 32,
           "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 1000, "norm_topk_prob": True}
    profile = profile_from_hf_config(moe)
    attention = 2048 * 128 * (32 + 2 * 4) + 32 * 128 * 2048 + 2 * 2048 + 2 * 128
    expert = 3 * 2048 * 768
    assert profile.layer_params == (attention + 128 * (expert + 2048),) * 4
    assert profile.layer_flops_per_token == (2 * (attention - 2 * 2048 - 2 * 128 + 8 * expert + 128 * 2048),) * 4
    assert profile.layer_read_params(1) == (attention + 128 * 2048 + 8 * expert,) * 4
    assert profile.layer_read_params(64)[0] == pytest.approx(attention + 128 * 2048 + 128 * (1 - (1 - 8 / 128) ** 64)
                                                             * expert, rel=1e-6)
    dense = {**moe, "model_type": "qwen3", "intermediate_size": 128 * 768 + 43}    # about as many parameters
    one, many = PlanRequest(concurrency=1), PlanRequest(concurrency=64)
    held = StageTables(profile, one).memory_at("bfloat16")[0, 4]
    assert held == pytest.approx(StageTables(profile_from_hf_config(dense), one).memory_at("bfloat16")[0, 4],
                                 rel=1e-3)
    assert StageTables(profile, one).read_params[0, 4] < StageTables(profile, many).read_params[0, 4] < (
        StageTables(profile_from_hf_config(dense), one).read_params[0, 4])
    assert StageTables(profile, many).held_params[0, 4] == sum(profile.layer_params)
