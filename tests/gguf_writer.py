"""A Hugging Face checkpoint (a tiny model's folder) written as a GGUF file with the `gguf` package, as llama.cpp's
converter writes one: its metadata, its byte-level BPE tokenizer, its tensors under GGUF's names in a type of the
caller's choosing (llama's q and k rows reordered for llama.cpp's rope), for tests that cannot build llama.cpp."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter, quants
from safetensors.torch import load_file

from stratamesh.fleet.gguf_files import LAYER_NAMES, PERMUTED_QK, TOP_NAMES

TYPES = {name: GGMLQuantizationType[name] for name in ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_K", "Q6_K")}


def write_gguf(model_dir: Path, out: Path, matrix_type: str = "F32", arch: str | None = None) -> Path:
    """model_dir's checkpoint as a GGUF file at out: its matrices in matrix_type, vectors in F32. arch: GGUF's name
    of the architecture (default: the config's model_type; llama.cpp writes Mistral as "llama")."""
    config = json.loads((model_dir / "config.json").read_text())
    arch = arch or config["model_type"]
    tokenizer = json.loads((model_dir / "tokenizer.json").read_text())
    template = json.loads((model_dir / "tokenizer_config.json").read_text()).get("chat_template")
    heads, hidden = config["num_attention_heads"], config["hidden_size"]
    writer = GGUFWriter(str(out), arch)
    writer.add_name(model_dir.name)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config.get("max_position_embeddings", 2048))
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(config.get("num_key_value_heads") or heads)
    writer.add_key_length(config.get("head_dim") or hidden // heads)
    writer.add_rope_freq_base(config.get("rope_theta", 10000.0))
    writer.add_layer_norm_rms_eps(config.get("rms_norm_eps", 1e-6))
    writer.add_vocab_size(config["vocab_size"])
    vocab = sorted(tokenizer["model"]["vocab"].items(), key=lambda item: item[1])
    tokens = [token for token, _ in vocab] + [f"[PAD{i}]" for i in range(len(vocab), config["vocab_size"])]
    special = {t["content"] for t in tokenizer["added_tokens"] if t.get("special")}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if token in special else 1 for token in tokens])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tokenizer["model"]["merges"]])
    generation = model_dir / "generation_config.json"
    ends = json.loads(generation.read_text()).get("eos_token_id") if generation.exists() else None
    ends = [e for e in [config.get("eos_token_id"), *(ends if isinstance(ends, list) else [ends])] if e is not None]
    ends = list(dict.fromkeys(ends))
    if isinstance(config.get("bos_token_id"), int):
        writer.add_bos_token_id(config["bos_token_id"])
    for end, add in zip(ends, (writer.add_eos_token_id, writer.add_eot_token_id)):
        add(end)      # end of sequence, then end of turn (as llama.cpp's converter writes a chat model's)
    if template:
        writer.add_chat_template(template)
    for name, tensor in load_file(str(model_dir / "model.safetensors")).items():
        values = tensor.float().numpy()
        if arch in PERMUTED_QK and name.endswith(("q_proj.weight", "k_proj.weight")):
            values = _permuted(values, heads if "q_proj" in name else config.get("num_key_value_heads") or heads)
        kind = TYPES[matrix_type] if values.ndim == 2 else TYPES["F32"]
        writer.add_tensor(gguf_name(name), _stored(values, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def gguf_name(hf_name: str) -> str:
    top = {hf: gguf for gguf, hf in TOP_NAMES.items()}
    if hf_name in top:
        return top[hf_name]
    _, _, index, rest = hf_name.split(".", 3)
    return f"blk.{index}." + {hf: gguf for gguf, hf in LAYER_NAMES.items()}[rest]


def _permuted(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's order of a Llama q or k matrix's rows (each head's halves interleaved)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _stored(values: np.ndarray, kind: GGMLQuantizationType) -> np.ndarray:
    if kind == GGMLQuantizationType.F32:
        return values
    if kind == GGMLQuantizationType.F16:
        return values.astype(np.float16)
    if kind == GGMLQuantizationType.BF16:
        return (torch.from_numpy(values).bfloat16().view(torch.int16).numpy()).view(np.uint16)
    return quants.quantize(values, kind)
