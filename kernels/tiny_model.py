"""Deterministic random-weight checkpoints in Hugging Face format, small enough for tests and `stratamesh up`."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from stratamesh.fleet.stages import GEMMA_MODEL_TYPES, MOE_MODEL_TYPES, layer_norms, moe_shape, qkv_bias

if TYPE_CHECKING:       # torch is imported where weights are made: training a tokenizer alone does not need it
    import torch

TINY_ARCHS = ("llama", "qwen2", "mistral", "qwen3", "gemma2", "gemma3_text", "phi3", "mixtral", "qwen2_moe",
              "qwen3_moe")
CORPUS = Path(__file__).parent / "data" / "corpus.txt"
ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)   # ids 0, 1, 2
# ChatML; with tools, Hermes' tool calls as Qwen 2.5 renders them: the tools listed in the system turn (after the
# system message), calls in <tool_call> blocks, results in <tool_response> blocks of a user turn
_TOOLS_HEADER = (
    "{% if tools %}{{ '<|im_start|>system\n' }}"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\n\n' }}{% endif %}"
    "{{ '# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with "
    "function signatures within <tools></tools> XML tags:\n<tools>' }}"
    "{% for tool in tools %}{{ '\n' + (tool | tojson) }}{% endfor %}"
    "{{ '\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\n</tool_call><|im_end|>\n' }}{% endif %}"
)
_TOOL_TURNS = (
    "{% elif message['role'] == 'assistant' and message['tool_calls'] is defined %}"
    "{{ '<|im_start|>assistant\n' }}{% if message['content'] %}{{ message['content'] + '\n' }}{% endif %}"
    "{% for call in message['tool_calls'] %}{% set call = call['function'] if call['function'] is defined else call %}"
    "{% if not loop.first %}{{ '\n' }}{% endif %}"
    "{{ '<tool_call>\n{\"name\": \"' + call['name'] + '\", \"arguments\": ' + (call['arguments'] | tojson) "
    "+ '}\n</tool_call>' }}{% endfor %}{{ '<|im_end|>\n' }}"
    "{% elif message['role'] == 'tool' %}"
    "{{ '<|im_start|>user\n<tool_response>\n' + message['content'] + '\n</tool_response><|im_end|>\n' }}"
)
CHAT_TEMPLATE = (
    _TOOLS_HEADER
    + "{% for message in messages %}"
    + "{% if tools and loop.first and message['role'] == 'system' %}"
    + _TOOL_TURNS
    + "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_ARCH_CLASS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM",
               "qwen3": "Qwen3ForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
               "phi3": "Phi3ForCausalLM", "mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
               "qwen3_moe": "Qwen3MoeForCausalLM"}
_BASE_CLASS = {"llama": "LlamaModel", "qwen2": "Qwen2Model", "mistral": "MistralModel",   # no LM head: embeddings
               "qwen3": "Qwen3Model", "gemma2": "Gemma2Model", "gemma3_text": "Gemma3TextModel",
               "phi3": "Phi3Model", "mixtral": "MixtralModel", "qwen2_moe": "Qwen2MoeModel",
               "qwen3_moe": "Qwen3MoeModel"}
_ROPE_THETA = {"llama": 10000.0, "qwen2": 1000000.0, "mistral": 10000.0, "qwen3": 1000000.0,
               "gemma2": 10000.0, "gemma3_text": 1000000.0, "phi3": 10000.0, "mixtral": 1000000.0,
               "qwen2_moe": 1000000.0, "qwen3_moe": 1000000.0}
_GEMMA_LOCAL_THETA = 10000.0
# Gemma's full-attention layers: every 2nd (Gemma 2's own), every 3rd (Gemma 3's is 6: fewer layers here)
_GEMMA_PATTERN = {"gemma2": 2, "gemma3_text": 3}
_GEMMA2_CAPS = (5.0, 10.0)   # attention and final logit soft-caps: Gemma 2's are 50 and 30, which a tiny model's
                             # scores never come near; these bite
_MISTRAL_WINDOW = 32   # small so that tests with a few dozen tokens exercise the sliding window
_PHI3_ROTARY = 0.75    # Phi-4-mini's partial_rotary_factor: rope turns the first 3/4 of each head
_DTYPES = ("float32", "bfloat16", "float16")       # how the weights may be stored (torch's dtype names)


def write_tiny_model(out_dir: str | Path, arch: str = "llama", num_layers: int = 6, hidden_size: int = 256,
                     intermediate_size: int = 512, num_heads: int = 4, num_kv_heads: int = 2,
                     vocab_size: int = 1024, max_position_embeddings: int = 2048,
                     tie_word_embeddings: bool = False, rope_scaling: dict[str, Any] | None = None,
                     rope_spelling: str = "classic", shard_size_bytes: int | None = None,
                     seed: int = 0, sliding_window: int | None = None, embedding: bool = False,
                     dtype: str = "float32", head_dim: int | None = None, num_experts: int | None = None) -> Path:
    """Write config, generation config, safetensors weights and a ChatML BPE tokenizer to out_dir.

    rope_spelling "classic" writes rope_theta + rope_scaling (transformers 4), "parameters" writes
    rope_parameters (transformers 5). sliding_window applies to mistral and Gemma (default 32). embedding writes
    an embedding model instead: the base model (LlamaModel, ...) without an LM head nor a generation config,
    its tensors named as transformers' save_pretrained names them ("layers.0...", no "model." prefix). dtype is
    how the weights are stored (config.json says so too): "float32", "bfloat16" or "float16". head_dim: the
    attention heads' size, hidden_size / num_heads by default, but 1.5 times that for qwen3 (as in Qwen3's
    checkpoints, its heads together are wider than the hidden state). num_experts: a mixture of experts' experts per
    sparse layer (default: its family's tiny count, _moe)."""
    if arch not in TINY_ARCHS:
        raise ValueError(f"arch {arch!r} is not one of {TINY_ARCHS}")
    if embedding and tie_word_embeddings:
        raise ValueError("an embedding model has no LM head to tie to its embeddings")
    if rope_spelling not in ("classic", "parameters"):
        raise ValueError(f"rope_spelling {rope_spelling!r} is not 'classic' or 'parameters'")
    if dtype not in _DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {sorted(_DTYPES)}")
    tokenizer = train_tokenizer(vocab_size)
    head_dim = head_dim or (hidden_size // num_heads) * (3 if arch in ("qwen3", "qwen3_moe") else 2) // 2
    config = _config(arch, num_layers, hidden_size, intermediate_size, num_heads, num_kv_heads, vocab_size,
                     max_position_embeddings, tie_word_embeddings, rope_scaling, rope_spelling, sliding_window,
                     head_dim)
    config["dtype"] = dtype
    if num_experts is not None and arch in MOE_MODEL_TYPES:
        config["num_local_experts" if arch == "mixtral" else "num_experts"] = num_experts
    import torch

    weights = {name: t.to(getattr(torch, dtype)) for name, t in
               _random_weights(config, seed, num_text_tokens=tokenizer.get_vocab_size()).items()}
    if embedding:
        config["architectures"] = [_BASE_CLASS[arch]]
        del weights["lm_head.weight"]
        weights = {name.removeprefix("model."): t for name, t in weights.items()}
    return write_checkpoint(out_dir, config, weights, tokenizer, generation=not embedding,
                            shard_size_bytes=shard_size_bytes)


def write_checkpoint(out_dir: str | Path, config: dict[str, Any], weights: dict[str, torch.Tensor],
                     tokenizer: Tokenizer, generation: bool = True, shard_size_bytes: int | None = None) -> Path:
    """A Hugging Face folder: config.json, the ChatML tokenizer and its config, safetensors weights (in shards of
    at most shard_size_bytes, with their index), and a generation config (generation: a model with an LM head)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out / "tokenizer.json"))
    if generation:
        _write_json(out / "generation_config.json", {"bos_token_id": 0, "eos_token_id": [0, 2], "do_sample": False})
    _write_json(out / "config.json", config)
    _write_json(out / "tokenizer_config.json", _tokenizer_config(config["max_position_embeddings"]))
    _write_weights(out, weights, shard_size_bytes)
    return out


def train_tokenizer(vocab_size: int, texts: Iterable[str] | None = None) -> Tokenizer:
    """A byte-level BPE trained on texts (default: the bundled corpus' lines), with the ChatML special tokens at
    ids 0..2."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    if texts is None:
        texts = CORPUS.read_text().splitlines(keepends=True)
    tokenizer.train_from_iterator(texts, trainer=trainer)
    if tokenizer.get_vocab_size() > vocab_size:
        raise ValueError(f"vocab_size {vocab_size} is smaller than the tokenizer's {tokenizer.get_vocab_size()}")
    return tokenizer


def _config(arch: str, num_layers: int, hidden: int, intermediate: int, num_heads: int, num_kv_heads: int,
            vocab_size: int, max_pos: int, tie: bool, rope_scaling: dict[str, Any] | None,
            rope_spelling: str, sliding_window: int | None, head_dim: int | None = None) -> dict[str, Any]:
    theta = _ROPE_THETA[arch]
    config: dict[str, Any] = {
        "architectures": [_ARCH_CLASS[arch]], "model_type": arch, "vocab_size": vocab_size,
        "hidden_size": hidden, "intermediate_size": intermediate, "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads, "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim or hidden // num_heads,
        "hidden_act": "silu", "max_position_embeddings": max_pos,
        "rms_norm_eps": 1e-6 if arch.startswith("qwen") else 1e-5,
        "tie_word_embeddings": tie, "bos_token_id": 0, "eos_token_id": 0, "dtype": "float32",
        "initializer_range": 0.02, "use_cache": True, "attention_dropout": 0.0,
    }
    if rope_spelling == "classic":
        config["rope_theta"] = theta
        config["rope_scaling"] = dict(rope_scaling) if rope_scaling else None
    else:
        config["rope_parameters"] = {"rope_type": "default", **(rope_scaling or {}), "rope_theta": theta}
    if arch in GEMMA_MODEL_TYPES:
        return _gemma(arch, config, num_layers, num_heads, hidden, rope_spelling, sliding_window)
    if arch in MOE_MODEL_TYPES:
        return _moe(arch, config, num_layers, intermediate, max_pos)
    if arch == "llama":
        config.update(attention_bias=False, mlp_bias=False)
    elif arch in ("qwen2", "qwen3"):   # a window is declared but off, as in released Qwen2 and Qwen3 checkpoints
        config.update(use_sliding_window=False, sliding_window=max_pos, max_window_layers=num_layers)
        if arch == "qwen3":
            config.update(attention_bias=False)
    else:       # mistral, phi3
        config["sliding_window"] = sliding_window or _MISTRAL_WINDOW
    if arch == "phi3":
        original = (rope_scaling or {}).get("original_max_position_embeddings", max_pos)   # where Phi-3 keeps it
        config.update(partial_rotary_factor=_PHI3_ROTARY, original_max_position_embeddings=original, pad_token_id=0)
        if rope_spelling == "parameters":
            config["rope_parameters"]["partial_rotary_factor"] = _PHI3_ROTARY
    return config


def _moe(arch: str, config: dict[str, Any], num_layers: int, intermediate: int, max_pos: int) -> dict[str, Any]:
    """A mixture of experts' config, of odd sizes: Mixtral's 5 experts (2 a token) in every layer; Qwen3-MoE's 6
    (2 a token, renormalised) of half the MLP's units, its first layer dense (mlp_only_layers); Qwen2-MoE's 6 (3 a
    token, not renormalised) and a shared expert, every other layer sparse (decoder_sparse_step 2), q/k/v biased."""
    # transformers' reference runs its experts one by one: its default grouped_mm takes only sizes whose rows are
    # multiples of 16 bytes
    config["experts_implementation"] = "eager"
    if arch == "mixtral":
        config.update(num_local_experts=5, num_experts_per_tok=2, router_jitter_noise=0.0, sliding_window=None,
                      router_aux_loss_coef=0.0)
        return config
    config.update(num_experts=6, moe_intermediate_size=max(1, intermediate // 2 + 3), use_sliding_window=False,
                  sliding_window=max_pos, max_window_layers=num_layers, router_aux_loss_coef=0.0,
                  output_router_logits=False)
    if arch == "qwen3_moe":
        config.update(num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
                      mlp_only_layers=[0] if num_layers > 1 else [], attention_bias=False)
    else:
        config.update(num_experts_per_tok=3, norm_topk_prob=False, decoder_sparse_step=2, mlp_only_layers=[],
                      shared_expert_intermediate_size=intermediate, qkv_bias=True)
    return config


def _gemma(arch: str, config: dict[str, Any], num_layers: int, num_heads: int, hidden: int, rope_spelling: str,
           sliding_window: int | None) -> dict[str, Any]:
    """Gemma's config: sliding layers beside full ones, queries scaled by a query_pre_attn_scalar other than
    head_dim (as the 27B models'), a tanh-GELU MLP; Gemma 2's attention and final logits soft-capped (every other
    layer sliding), Gemma 3's sliding layers with their own rope base (in rope_parameters per layer type, or
    rope_local_base_freq; two of them for each full one)."""
    gemma2 = arch == "gemma2"
    config.update(hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=(hidden // num_heads) * 3 // 4,
                  sliding_window=sliding_window or _MISTRAL_WINDOW, attention_bias=False,
                  final_logit_softcapping=_GEMMA2_CAPS[1] if gemma2 else None,
                  attn_logit_softcapping=_GEMMA2_CAPS[0] if gemma2 else None,
                  layer_types=["sliding_attention" if (i + 1) % _GEMMA_PATTERN[arch] else "full_attention"
                               for i in range(num_layers)])
    del config["hidden_act"]
    if gemma2:
        return config
    config["use_bidirectional_attention"] = False
    if rope_spelling == "classic":
        config["rope_local_base_freq"] = _GEMMA_LOCAL_THETA
    else:
        config["rope_parameters"] = {"full_attention": config["rope_parameters"],
                                     "sliding_attention": {"rope_type": "default", "rope_theta": _GEMMA_LOCAL_THETA}}
    return config


def _tokenizer_config(max_pos: int) -> dict[str, Any]:
    added = {str(i): {"content": tok, "lstrip": False, "normalized": False, "rstrip": False,
                      "single_word": False, "special": True} for i, tok in enumerate(SPECIAL_TOKENS)}
    return {
        "tokenizer_class": "PreTrainedTokenizerFast", "added_tokens_decoder": added,
        "bos_token": ENDOFTEXT, "eos_token": ENDOFTEXT, "pad_token": ENDOFTEXT, "unk_token": None,
        "additional_special_tokens": [IM_START, IM_END], "model_max_length": max_pos,
        "clean_up_tokenization_spaces": False, "chat_template": CHAT_TEMPLATE,
    }


def _random_weights(config: dict[str, Any], seed: int, num_text_tokens: int) -> dict[str, torch.Tensor]:
    """Weights big enough that attention is sharp and greedy argmax has no near-ties, in HF names.

    The LM head rows of the special tokens and of the vocab padding are zero: their logit is 0 while the
    best text token's is several units, so an untied tiny model never stops early nor emits an id the
    tokenizer cannot decode. (Tied: only the padding rows are zero.)"""
    import torch

    g = torch.Generator().manual_seed(seed)
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    q_dim = config["num_attention_heads"] * config["head_dim"]
    kv_dim = config["num_key_value_heads"] * config["head_dim"]

    def normal(*shape: int, std: float, mean: float = 0.0) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std + mean

    gemma = config["model_type"] in GEMMA_MODEL_TYPES
    moe = moe_shape(config, config["num_hidden_layers"])
    norm_mean = 0.0 if gemma else 1.0        # Gemma's norms weigh by (1 + w)
    w = {"model.embed_tokens.weight": normal(config["vocab_size"], hidden, std=hidden ** -0.5 if gemma else 1.0)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = normal(hidden, std=0.1, mean=norm_mean)
        w[p + "self_attn.q_proj.weight"] = normal(q_dim, hidden, std=hidden ** -0.5)
        w[p + "self_attn.k_proj.weight"] = normal(kv_dim, hidden, std=hidden ** -0.5)
        w[p + "self_attn.v_proj.weight"] = normal(kv_dim, hidden, std=hidden ** -0.5)
        w[p + "self_attn.o_proj.weight"] = normal(hidden, q_dim, std=q_dim ** -0.5)
        if qkv_bias(config):
            for name, dim in (("q", q_dim), ("k", kv_dim), ("v", kv_dim)):
                w[p + f"self_attn.{name}_proj.bias"] = normal(dim, std=0.5)
        if layer_norms(config["model_type"])[1]:
            w[p + "self_attn.q_norm.weight"] = normal(config["head_dim"], std=0.1, mean=norm_mean)
            w[p + "self_attn.k_norm.weight"] = normal(config["head_dim"], std=0.1, mean=norm_mean)
        w[p + "post_attention_layernorm.weight"] = normal(hidden, std=0.1, mean=norm_mean)
        if gemma:
            w[p + "pre_feedforward_layernorm.weight"] = normal(hidden, std=0.1, mean=norm_mean)
            w[p + "post_feedforward_layernorm.weight"] = normal(hidden, std=0.1, mean=norm_mean)
        if moe is not None and moe.is_sparse(i):
            w.update(_experts(config["model_type"], p, moe, hidden, normal))
            continue
        w[p + "mlp.gate_proj.weight"] = normal(inter, hidden, std=hidden ** -0.5)
        w[p + "mlp.up_proj.weight"] = normal(inter, hidden, std=hidden ** -0.5)
        w[p + "mlp.down_proj.weight"] = normal(hidden, inter, std=inter ** -0.5)
    if config["model_type"] == "phi3":     # Phi-3 stores q, k, v and gate, up fused
        for i in range(config["num_hidden_layers"]):
            a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
            w[a + "qkv_proj.weight"] = torch.cat([w.pop(a + f"{n}_proj.weight") for n in "qkv"])
            w[m + "gate_up_proj.weight"] = torch.cat([w.pop(m + f"{n}_proj.weight") for n in ("gate", "up")])
    w["model.norm.weight"] = normal(hidden, std=0.1, mean=norm_mean)
    w["model.embed_tokens.weight"][num_text_tokens:] = 0
    if not config["tie_word_embeddings"]:
        w["lm_head.weight"] = normal(config["vocab_size"], hidden, std=2 * hidden ** -0.5)
        w["lm_head.weight"][:len(SPECIAL_TOKENS)] = 0
        w["lm_head.weight"][num_text_tokens:] = 0
    return w


def _experts(model_type: str, p: str, moe: Any, hidden: int, normal: Any) -> dict[str, torch.Tensor]:
    """A sparse layer's router and experts (and shared expert), named as the released checkpoints name them; the
    router's logits spread by a few units, so a token's top-k has no near-ties."""
    m, names = (p + "block_sparse_moe.", ("w1", "w3", "w2")) if model_type == "mixtral" else (
        p + "mlp.", ("gate_proj", "up_proj", "down_proj"))
    inter = moe.expert_intermediate
    w = {m + "gate.weight": normal(moe.num_experts, hidden, std=3 * hidden ** -0.5)}
    for e in range(moe.num_experts):
        w[f"{m}experts.{e}.{names[0]}.weight"] = normal(inter, hidden, std=hidden ** -0.5)
        w[f"{m}experts.{e}.{names[1]}.weight"] = normal(inter, hidden, std=hidden ** -0.5)
        w[f"{m}experts.{e}.{names[2]}.weight"] = normal(hidden, inter, std=inter ** -0.5)
    if moe.shared_intermediate:
        shared = moe.shared_intermediate
        w[m + "shared_expert.gate_proj.weight"] = normal(shared, hidden, std=hidden ** -0.5)
        w[m + "shared_expert.up_proj.weight"] = normal(shared, hidden, std=hidden ** -0.5)
        w[m + "shared_expert.down_proj.weight"] = normal(hidden, shared, std=shared ** -0.5)
        w[m + "shared_expert_gate.weight"] = normal(1, hidden, std=hidden ** -0.5)
    return w


def _write_weights(out: Path, weights: dict[str, torch.Tensor], shard_size_bytes: int | None) -> None:
    from safetensors.torch import save_file

    metadata = {"format": "pt"}
    if shard_size_bytes is None:
        save_file(weights, str(out / "model.safetensors"), metadata=metadata)
        return
    shards: list[dict[str, torch.Tensor]] = [{}]
    shard_bytes = 0
    for name, t in weights.items():   # insertion order: embed, layers, norm, head
        nbytes = t.numel() * t.element_size()
        if shards[-1] and shard_bytes + nbytes > shard_size_bytes:
            shards.append({})
            shard_bytes = 0
        shards[-1][name] = t
        shard_bytes += nbytes
    weight_map = {}
    for i, shard in enumerate(shards, start=1):
        file_name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / file_name), metadata=metadata)
        weight_map.update({name: file_name for name in shard})
    total = sum(t.numel() * t.element_size() for t in weights.values())
    _write_json(out / "model.safetensors.index.json", {"metadata": {"total_size": total}, "weight_map": weight_map})


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")
