"""A GGUF file (llama.cpp's format, as Ollama and LM Studio keep models) as a model: what it says of the model in
Hugging Face's words (a config.json dict, a tokenizer.json, the chat template) and its tensors by their Hugging Face
names. Read with the `gguf` package, llama.cpp's own reader (a memory map: nothing is read until asked for); the
tensors' bytes become torch tensors in kernels.models.gguf.

Architectures: llama (Llama, and Mistral as llama.cpp's converter writes it), mistral, qwen2 and qwen3. llama.cpp's
converter reorders the rows of a Llama's q and k matrices for its rope (each head's halves interleaved); they are
put back in Hugging Face's order as they are read (unpermuted_rows). Tokenizers: byte-level BPE ("gpt2", as Llama
3, Qwen and Mistral's newer models have); SentencePiece's ("llama": Llama 2, Mistral 7B v0.1) is refused by name."""

from __future__ import annotations

import json
from collections.abc import Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from stratamesh.fleet.errors import CheckpointError

SUFFIX = ".gguf"
MODEL_TYPES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3"}   # GGUF arch -> HF's
PERMUTED_QK = ("llama", "mistral")         # whose q and k rows llama.cpp's converter reorders
TOP_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
             "output.weight": "lm_head.weight"}
LAYER_NAMES = {       # a block's tensor (after "blk.{i}.") -> its Hugging Face name (after "model.layers.{i}.")
    "attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias", "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight", "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight", "ffn_down.weight": "mlp.down_proj.weight",
}
# Byte-level BPE's split of text into words before merges, by tokenizer.ggml.pre (the regexes are the tokenizers'
# own, as their tokenizer.json files write them)
_GPT2_SPLIT = None        # ByteLevel's own
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                 r"\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
                r"\s+(?!\S)|\s+")
SPLITS = {"gpt-2": _GPT2_SPLIT, "default": _GPT2_SPLIT, "llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT,
          "qwen2": _QWEN2_SPLIT}
CONTROL, USER_DEFINED = 3, 4             # tokenizer.ggml.token_type values of special tokens
# The weight format (StageSpec.quantize) nearest a GGUF block type: what its matrices are served in unless the
# operator says otherwise (Q4_0 exactly; the other 2-5 bit types as int4, 6-8 bit ones as int8, requantized)
FORMAT_OF_TYPE = {**dict.fromkeys(("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K"), "int4"),
                  **dict.fromkeys(("Q6_K", "Q8_0"), "int8")}


def is_gguf(path: str | Path) -> bool:
    """Whether a model path names a GGUF file (rather than a Hugging Face folder)."""
    return str(path).endswith(SUFFIX)


class GgufModel:
    """One GGUF file; CheckpointError if it is not one, or of an architecture stages do not compute."""

    def __init__(self, path: str | Path) -> None:
        from gguf import GGUFReader

        self.path = Path(path)
        try:
            self.reader = GGUFReader(self.path, "r")
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"{self.path} is not a GGUF file we can read: {exc}") from None
        self.arch = str(self._value("general.architecture"))
        if self.arch not in MODEL_TYPES:
            raise CheckpointError(f"{self.path}: GGUF architecture {self.arch!r} is not one stages compute "
                                  f"({', '.join(MODEL_TYPES)})")

    def _value(self, key: str, default: Any = KeyError) -> Any:
        field = self.reader.fields.get(key)
        if field is None:
            if default is KeyError:
                raise CheckpointError(f"{self.path}: GGUF metadata lacks {key}")
            return default
        return field.contents()

    def _hparam(self, key: str, default: Any = KeyError) -> Any:
        return self._value(f"{self.arch}.{key}", default)

    @cached_property
    def tensors(self) -> dict[str, Any]:
        """Each tensor's gguf ReaderTensor by its Hugging Face name (unnamed ones left out, as checkpoints' extras)."""
        out = {}
        for tensor in self.reader.tensors:
            name = hf_name(tensor.name)
            if name is not None:
                out[name] = tensor
        return out

    def layout(self) -> tuple[int, dict[str, tuple[int, int]]]:
        """(bytes of the file's header: metadata and tensor infos, each tensor's Hugging Face name -> its [start,
        end) bytes in the file): what a stage's copy of the file needs (fleet.weight_files)."""
        return int(self.reader.data_offset), {name: (int(t.data_offset), int(t.data_offset) + int(t.n_bytes))
                                              for name, t in self.tensors.items()}

    def stored_format(self) -> str:
        """The weight format nearest the type most of its layers' matrices are stored in (FORMAT_OF_TYPE; "": a
        float type)."""
        types = [t.tensor_type.name for name, t in self.tensors.items() if name.endswith("_proj.weight")]
        return FORMAT_OF_TYPE.get(max(set(types), key=types.count), "") if types else ""

    def config(self) -> dict[str, Any]:
        """The model as a config.json dict would describe it (float32: its tensors are read into a stage's dtype)."""
        return dict(self._config)

    @cached_property
    def _config(self) -> dict[str, Any]:
        heads = int(self._hparam("attention.head_count"))
        hidden = int(self._hparam("embedding_length"))
        config = {
            "model_type": MODEL_TYPES[self.arch], "hidden_size": hidden,
            "intermediate_size": int(self._hparam("feed_forward_length")),
            "num_hidden_layers": int(self._hparam("block_count")), "num_attention_heads": heads,
            "num_key_value_heads": int(self._hparam("attention.head_count_kv", heads)),
            "head_dim": int(self._hparam("attention.key_length", hidden // heads)),
            "rms_norm_eps": float(self._hparam("attention.layer_norm_rms_epsilon", 1e-6)),
            "rope_theta": float(self._hparam("rope.freq_base", 10000.0)),
            "max_position_embeddings": int(self._hparam("context_length", 2048)),
            "vocab_size": int(self._hparam("vocab_size", 0)) or len(self._value("tokenizer.ggml.tokens")),
            "tie_word_embeddings": "lm_head.weight" not in self.tensors,
            "bos_token_id": self._value("tokenizer.ggml.bos_token_id", None),
            "eos_token_id": self.end_token_ids(),
            "torch_dtype": "float32",
        }
        if self._hparam("rope.scaling.type", "none") not in ("none", ""):
            raise CheckpointError(f"{self.path}: rope scaling {self._hparam('rope.scaling.type')!r} in GGUF files "
                                  "is not read yet")
        if self.arch == "llama" and "model.layers.0.self_attn.q_proj.bias" in self.tensors:
            config["attention_bias"] = True
        window = self._hparam("attention.sliding_window", None)
        if window:
            config["sliding_window"] = int(window)
        return config

    def end_token_ids(self) -> list[int]:
        """The tokens that end a generation: end of sequence, and (as llama.cpp reads them) end of turn and of
        message where the file names them."""
        ids = [self._value(f"tokenizer.ggml.{key}_token_id", None) for key in ("eos", "eot", "eom")]
        return list(dict.fromkeys(int(i) for i in ids if i is not None))

    def tokenizer_json(self) -> str:
        """The file's tokenizer as a Hugging Face tokenizer.json (byte-level BPE)."""
        kind = self._value("tokenizer.ggml.model")
        if kind != "gpt2":
            raise CheckpointError(f"{self.path}: its tokenizer is {kind!r}; GGUF files are read with byte-level BPE "
                                  "tokenizers (\"gpt2\": Llama 3, Qwen, Mistral's newer models) only yet")
        pre = str(self._value("tokenizer.ggml.pre", "default"))
        if pre not in SPLITS:
            raise CheckpointError(f"{self.path}: its tokenizer's pre-tokenizer {pre!r} is not one we know "
                                  f"({', '.join(SPLITS)})")
        tokens = list(self._value("tokenizer.ggml.tokens"))
        types = list(self._value("tokenizer.ggml.token_type", [1] * len(tokens)))
        merges = list(self._value("tokenizer.ggml.merges", []))
        return json.dumps(byte_level_bpe(tokens, types, merges, SPLITS[pre]))

    def chat_template(self) -> str | None:
        return self._value("tokenizer.chat_template", None)

    def unpermuted_rows(self, name: str) -> np.ndarray | None:
        """The order to read the rows of a tensor in to have Hugging Face's (None: as stored): a Llama's q and k
        matrices, each head's rows interleaved by llama.cpp's converter."""
        if self.arch not in PERMUTED_QK or not name.endswith(("self_attn.q_proj.weight", "self_attn.k_proj.weight")):
            return None
        config = self._config
        heads = config["num_attention_heads"] if "q_proj" in name else config["num_key_value_heads"]
        rows = int(self.tensors[name].shape[-1])
        return permutation_of_rows(rows, heads)


def hf_name(gguf_name: str) -> str | None:
    """A GGUF tensor's Hugging Face name (None for one stages do not read: llama.cpp's rope tables, ...)."""
    if gguf_name in TOP_NAMES:
        return TOP_NAMES[gguf_name]
    head, _, rest = gguf_name.partition(".")
    index, _, part = rest.partition(".")
    if head != "blk" or not index.isdigit() or part not in LAYER_NAMES:
        return None
    return f"model.layers.{index}.{LAYER_NAMES[part]}"


def permutation_of_rows(rows: int, heads: int) -> np.ndarray:
    """stored[permutation] is the Hugging Face order of a matrix's rows that llama.cpp's converter permuted: each
    head's rows [first half, second half] went out as pairs (first[j], second[j])."""
    half = rows // heads // 2
    stored = np.arange(rows).reshape(heads, half, 2)          # stored row of head h, pair j, element e
    return stored.transpose(0, 2, 1).reshape(rows)            # HF row (h, e, j) <- stored (h, j, e)


def byte_level_bpe(tokens: Sequence[str], types: Sequence[int], merges: Sequence[str],
                   split: str | None) -> dict[str, Any]:
    """A tokenizer.json of a byte-level BPE vocabulary (its merges "a b"), its control and user-defined tokens
    special, words split as `split` says (None: ByteLevel's own GPT-2 split)."""
    pre: dict[str, Any] = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                           "use_regex": split is None}
    if split is not None:
        pre = {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": split}, "behavior": "Isolated", "invert": False}, pre]}
    added = [{"id": i, "content": token, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": True}
             for i, (token, kind) in enumerate(zip(tokens, types)) if kind in (CONTROL, USER_DEFINED)]
    return {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
            "pre_tokenizer": pre, "post_processor": None,
            "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": True},
            "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                      "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                      "ignore_merges": False, "vocab": {token: i for i, token in enumerate(tokens)},
                      "merges": [m.split(" ", 1) for m in merges]}}
