"""Checkpoint folders holding a real byte-level BPE tokenizer, for the text and API tests."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

os.environ.setdefault("HF_HUB_OFFLINE", "1")

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<s>"]

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Exercises what transformers' environment offers: bos_token, raise_exception, tojson, loop controls,
# trim_blocks / lstrip_blocks.
BOS_TEMPLATE = """{{ bos_token }}
{% for message in messages %}
    {% if message['role'] not in ['system', 'user', 'assistant'] %}
        {{ raise_exception('unknown role ' + message['role']) }}
    {% endif %}
    {% if message.get('name') %}
[{{ message['name'] | tojson }}]
    {% endif %}
<|im_start|>{{ message['role'] }}
{{ message['content'] | trim }}<|im_end|>
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}"""

CORPUS = [
    "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.",
    "Pipeline stages stream hidden states from edge boxes to cloud nodes and back again.",
    "Café, naïve, résumé, über, Straße, façade — déjà vu. ¿Qué tal? Ça va très bien.",
    "中文分词测试：模型被切分为流水线阶段。日本語のテキストも少し。한국어 문장도 있습니다.",
    "Emoji: 🙂🚀🔥 and symbols ∑ ∫ √ ≈ ≠ € £ ¥ ©. def f(x):\n    return x ** 2\n",
    "User: hello there!\nAssistant: Hi, how can I help you today?\nUser: tell me a story.",
] * 20


def train_tokenizer(vocab_size: int = 420) -> Tokenizer:
    """A small byte-level BPE, so multi-byte characters often span several tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer=trainer)
    return tok


def write_checkpoint(out_dir: Path, tok: Tokenizer, variant: str) -> Path:
    """Write tokenizer.json + config files; variant "chatml" (no BOS) or "bos" (BOS added, in the template too)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    if variant == "bos":  # as Llama checkpoints do: tokenizer.json's post-processor prepends BOS
        tok = Tokenizer.from_str(tok.to_str())
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    tok.save(str(out_dir / "tokenizer.json"))
    im_end, eot = tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")
    tok_cfg: dict = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>",
                     "pad_token": "<|endoftext|>", "model_max_length": 4096}
    if variant == "chatml":
        tok_cfg["chat_template"] = CHATML_TEMPLATE
    else:
        tok_cfg.update(bos_token="<s>", add_bos_token=True, chat_template=BOS_TEMPLATE)
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    (out_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [im_end, eot]}))
    (out_dir / "config.json").write_text(json.dumps({"model_type": "llama", "eos_token_id": im_end}))
    return out_dir


@pytest.fixture(scope="session")
def trained_tokenizer() -> Tokenizer:
    return train_tokenizer()


@pytest.fixture(scope="session")
def chatml_dir(tmp_path_factory: pytest.TempPathFactory, trained_tokenizer: Tokenizer) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("chatml"), trained_tokenizer, "chatml")


@pytest.fixture(scope="session")
def bos_dir(tmp_path_factory: pytest.TempPathFactory, trained_tokenizer: Tokenizer) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("bos"), trained_tokenizer, "bos")
