"""write_tiny_model: deterministic Hugging Face checkpoints that transformers loads, with a ChatML tokenizer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from stratamesh.kernels.tiny_model import CHAT_TEMPLATE, TINY_ARCHS, write_tiny_model

transformers = pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

SMALL = {"num_layers": 2, "hidden_size": 64, "intermediate_size": 128}


def file_bytes(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("llama"), "llama")


@pytest.mark.parametrize("kwargs", [{}, {"arch": "qwen2", "shard_size_bytes": 100_000}])
def test_same_arguments_give_identical_bytes(tmp_path, kwargs):
    a = file_bytes(write_tiny_model(tmp_path / "a", **SMALL, **kwargs))
    b = file_bytes(write_tiny_model(tmp_path / "b", **SMALL, **kwargs))
    assert a == b
    c = file_bytes(write_tiny_model(tmp_path / "c", **SMALL, **kwargs, seed=1))
    assert c.keys() == a.keys() and c != a


def test_tokenizer_training_is_identical_in_another_process(tmp_path):
    code = "import sys; from stratamesh.kernels.tiny_model import train_tokenizer; print(train_tokenizer(1024).to_str())"
    runs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": str(seed)}).stdout for seed in (1, 2)]
    assert runs[0] == runs[1] and len(runs[0]) > 1000


def test_tokenizer_roundtrips_text_and_renders_chatml(llama_dir):
    tok = transformers.AutoTokenizer.from_pretrained(llama_dir)
    text = "The ferryman said: nothing goes in that cannot come out again! Übermäßig 123."
    ids = tok(text)["input_ids"]
    assert tok.decode(ids) == text and "Ġ" not in tok.decode(ids)
    assert len(ids) < len(text.encode()) / 2   # merges were learned
    assert tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [0, 1, 2]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n"
                        "<|im_start|>assistant\n")
    assert tok(rendered)["input_ids"][0] == 1
    config = json.loads((llama_dir / "tokenizer_config.json").read_text())
    assert config["chat_template"] == CHAT_TEMPLATE


def test_config_and_generation_config(llama_dir):
    config = json.loads((llama_dir / "config.json").read_text())
    gen = json.loads((llama_dir / "generation_config.json").read_text())
    tok_size = len(transformers.AutoTokenizer.from_pretrained(llama_dir))
    assert config["vocab_size"] == 1024 >= tok_size
    assert (config["bos_token_id"], gen["eos_token_id"], config["dtype"]) == (0, [0, 2], "float32")


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_transformers_loads_each_arch_and_argmax_is_clear(tmp_path, arch):
    model_dir = write_tiny_model(tmp_path, arch, **SMALL)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    num_text_tokens = len(transformers.AutoTokenizer.from_pretrained(model_dir))
    assert type(model).__name__ == json.loads((model_dir / "config.json").read_text())["architectures"][0]
    ids = torch.randint(3, 700, (1, 64), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        logits = model(ids).logits[0]
    top2 = logits.topk(2, dim=-1).values
    gaps = top2[:, 0] - top2[:, 1]
    assert float(gaps.median()) > 1e-1 and float((gaps > 1e-3).float().mean()) > 0.95
    argmax = logits.argmax(dim=-1)   # special tokens and vocab padding are never the argmax
    assert int(argmax.min()) >= 3 and int(argmax.max()) < num_text_tokens


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_an_embedding_checkpoint_is_the_base_model_as_transformers_saves_it(tmp_path, arch):
    model_dir = write_tiny_model(tmp_path, arch, **SMALL, embedding=True)
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == [{"llama": "LlamaModel", "qwen2": "Qwen2Model", "mistral": "MistralModel",
                                        "qwen3": "Qwen3Model", "gemma2": "Gemma2Model",
                                        "gemma3_text": "Gemma3TextModel", "phi3": "Phi3Model", "mixtral": "MixtralModel",
                                        "qwen2_moe": "Qwen2MoeModel", "qwen3_moe": "Qwen3MoeModel"}[arch]]
    assert not (model_dir / "generation_config.json").exists()
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    o = "layers.1.self_attn.o_proj.weight"
    assert "embed_tokens.weight" in names and "norm.weight" in names and o in names
    assert not any(n.startswith("model.") or n.startswith("lm_head") for n in names)
    model, info = transformers.AutoModel.from_pretrained(model_dir, output_loading_info=True)
    assert type(model).__name__ == config["architectures"][0]
    assert not any(info.values())     # no missing, unexpected or mismatched tensors
    causal = write_tiny_model(tmp_path / "causal", arch, **SMALL)
    with safe_open(str(causal / "model.safetensors"), "pt") as f:   # the same weights, but for the head
        assert torch.equal(f.get_tensor("model." + o), model.layers[1].self_attn.o_proj.weight)


def test_an_embedding_model_cannot_tie_a_head_it_lacks(tmp_path):
    with pytest.raises(ValueError, match="no LM head"):
        write_tiny_model(tmp_path, embedding=True, tie_word_embeddings=True)
