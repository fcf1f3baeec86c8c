"""Tokenizer against transformers' tokenizer; IncrementalDetokenizer properties and stop strings."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from stratamesh.coordinator.text import TokenizerConfig, IncrementalDetokenizer, Tokenizer, parse_tokenizer_config
from stratamesh.fleet.errors import CheckpointError, InvalidInput

TEXTS = ["", "hello", " leading space", "Hello wörld 中文 🙂🚀", "Café déjà vu\n\n  tabs\tand  spaces ",
         "<|im_start|>user\nspecial tokens inside text<|im_end|>", "def f(x):\n    return x ** 2\n"]
CHATS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Qué tal? 🙂 <b>\"q\"</b>"}],
    [{"role": "user", "content": "one"}, {"role": "assistant", "content": "two"},
     {"role": "user", "content": " three ", "name": "bob"}],
    [{"role": "user", "content": "tool said", "name": None}],
]


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tiny_model = pytest.importorskip("stratamesh.kernels.tiny_model")
    return tiny_model.write_tiny_model(tmp_path_factory.mktemp("tiny"), arch="llama", num_layers=1,
                                       hidden_size=64, intermediate_size=64)


@pytest.fixture(params=["chatml_dir", "bos_dir", "tiny_dir"])
def model_dir(request: pytest.FixtureRequest) -> Path:
    return request.getfixturevalue(request.param)


@pytest.fixture
def hf_tokenizer(model_dir: Path):  # noqa: ANN201 - transformers' type
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(model_dir))


@pytest.fixture(scope="session")
def tokenizer(chatml_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(chatml_dir)


def test_encode_matches_transformers(model_dir: Path, hf_tokenizer) -> None:  # noqa: ANN001
    tokenizer = Tokenizer.from_dir(model_dir)
    for text in TEXTS:
        assert tokenizer.encode(text) == hf_tokenizer.encode(text), text
        assert tokenizer.decode(tokenizer.encode(text)) == hf_tokenizer.decode(hf_tokenizer.encode(text),
                                                                       skip_special_tokens=True)


def test_bos_added_once(bos_dir: Path) -> None:
    tokenizer = Tokenizer.from_dir(bos_dir)
    bos = tokenizer.token_to_id("<s>")
    assert tokenizer.encode("hi")[0] == bos
    ids = tokenizer.encode_chat([{"role": "user", "content": "hi"}])
    assert ids[0] == bos and ids[1] != bos


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(model_dir: Path, hf_tokenizer,  # noqa: ANN001
                                            add_generation_prompt: bool) -> None:
    tokenizer = Tokenizer.from_dir(model_dir)
    for chat in CHATS:
        expected_text = hf_tokenizer.apply_chat_template(chat, tokenize=False,
                                                         add_generation_prompt=add_generation_prompt)
        assert tokenizer.apply_chat_template(chat, add_generation_prompt) == expected_text
        expected_ids = hf_tokenizer.apply_chat_template(chat, tokenize=True,
                                                        add_generation_prompt=add_generation_prompt)
        expected_ids = expected_ids["input_ids"] if hasattr(expected_ids, "keys") else expected_ids
        assert tokenizer.encode_chat(chat, add_generation_prompt) == list(expected_ids)


TOOLS = [{"type": "function", "function": {"name": "weather", "description": "the weather of a city",
                                          "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                         "required": ["city"]}}},
         {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}]
TOOL_CHATS = [
    [{"role": "user", "content": "Weather in Paris?"}],
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Weather in Paris, and the time?"},
     {"role": "assistant", "tool_calls": [
         {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": {"city": "Paris"}}},
         {"id": "c2", "type": "function", "function": {"name": "now", "arguments": {}}}]},
     {"role": "tool", "tool_call_id": "c1", "content": "sunny"}, {"role": "tool", "tool_call_id": "c2",
                                                                  "content": "noon"}],
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Let me see.", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "now", "arguments": {}}}]}],
]


def test_tools_render_as_transformers_renders_them(tiny_dir: Path) -> None:
    transformers = pytest.importorskip("transformers")
    hf, tokenizer = transformers.AutoTokenizer.from_pretrained(str(tiny_dir)), Tokenizer.from_dir(tiny_dir)
    for chat in TOOL_CHATS:
        expected = hf.apply_chat_template(chat, tools=TOOLS, tokenize=False, add_generation_prompt=True)
        assert tokenizer.apply_chat_template(chat, True, None, TOOLS) == expected
        assert '"name": "weather"' in expected and "<tools>" in expected      # the template shows them
    assert tokenizer.apply_chat_template(CHATS[1], True, None, []) == hf.apply_chat_template(
        CHATS[1], tools=None, tokenize=False, add_generation_prompt=True)      # no tools: the plain ChatML


def test_template_raise_exception_is_invalid_input(bos_dir: Path) -> None:
    tokenizer = Tokenizer.from_dir(bos_dir)
    with pytest.raises(InvalidInput, match="unknown role robot"):
        tokenizer.apply_chat_template([{"role": "robot", "content": "beep"}])


def test_no_template_is_invalid_input(trained_tokenizer: tokenizers.Tokenizer) -> None:
    tokenizer = Tokenizer(trained_tokenizer, TokenizerConfig())
    with pytest.raises(InvalidInput, match="no chat template"):
        tokenizer.encode_chat([{"role": "user", "content": "hi"}])


def test_template_is_sandboxed(trained_tokenizer: tokenizers.Tokenizer) -> None:
    evil = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    tokenizer = Tokenizer(trained_tokenizer, TokenizerConfig(chat_template=evil))
    with pytest.raises(InvalidInput):
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])


def test_eos_ids_from_every_file(tokenizer: Tokenizer, trained_tokenizer: tokenizers.Tokenizer) -> None:
    ids = {trained_tokenizer.token_to_id(t) for t in ("<|im_end|>", "<|endoftext|>")}
    assert tokenizer.eos_token_ids == ids


@pytest.mark.parametrize(("tok_cfg", "gen_cfg", "model_cfg", "eos"), [
    ({"eos_token": "<|im_end|>"}, {}, {}, {"<|im_end|>"}),
    ({"eos_token": {"content": "<|im_end|>", "special": True}}, {}, {}, {"<|im_end|>"}),
    ({}, {"eos_token_id": 0}, {"eos_token_id": 2}, {"<|endoftext|>"}),
    ({}, {}, {"eos_token_id": [0, 2]}, {"<|endoftext|>", "<|im_end|>"}),
    ({}, {}, {}, set()),
])
def test_parse_eos(trained_tokenizer: tokenizers.Tokenizer, tok_cfg: dict, gen_cfg: dict, model_cfg: dict,
                   eos: set[str]) -> None:
    config = parse_tokenizer_config(trained_tokenizer, tok_cfg, gen_cfg, model_cfg)
    assert config.eos_token_ids == {trained_tokenizer.token_to_id(t) for t in eos}


@pytest.mark.parametrize(("tok_cfg", "template_file", "expected"), [
    ({"chat_template": "A"}, None, "A"),
    ({"chat_template": "A"}, "B", "B"),
    ({"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]}, None, "D"),
    ({}, None, None),
])
def test_parse_template(trained_tokenizer: tokenizers.Tokenizer, tok_cfg: dict, template_file: str | None,
                        expected: str | None) -> None:
    assert parse_tokenizer_config(trained_tokenizer, tok_cfg, {}, {}, template_file).chat_template == expected


def test_from_dir_errors(tmp_path: Path, chatml_dir: Path) -> None:
    with pytest.raises(CheckpointError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text((chatml_dir / "tokenizer.json").read_text())
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="config.json"):
        Tokenizer.from_dir(tmp_path)


def stream(detok: IncrementalDetokenizer, ids: list[int]) -> tuple[list[str], str]:
    """Push every id (until stopped); return the pieces and the flushed tail."""
    pieces = []
    for i in ids:
        pieces.append(detok.push(i))
        if detok.stopped:
            break
    return pieces, detok.flush()


def truncate_at_stop(text: str, stop: list[str]) -> str:
    hits = [i for s in stop if (i := text.find(s)) >= 0]
    return text[:min(hits)] if hits else text


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_stream_equals_decode_on_random_ids(tokenizer: Tokenizer, skip_special_tokens: bool) -> None:
    rng = random.Random(0)
    for _ in range(300):
        ids = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randrange(1, 40))]
        pieces, tail = stream(IncrementalDetokenizer(tokenizer, skip_special_tokens=skip_special_tokens), ids)
        assert "".join(pieces) + tail == tokenizer.decode(ids, skip_special_tokens), ids


def test_stream_with_prompt_context(tokenizer: Tokenizer) -> None:
    rng = random.Random(1)
    for _ in range(100):
        prompt = tokenizer.encode(rng.choice(TEXTS[1:]))
        ids = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randrange(1, 30))]
        pieces, tail = stream(IncrementalDetokenizer(tokenizer, prompt_ids=prompt), ids)
        prompt_text = tokenizer.decode(prompt)
        assert "".join(pieces) + tail == tokenizer.decode(prompt + ids)[len(prompt_text):]


def test_prompt_context_keeps_leading_space() -> None:
    # A Metaspace decoder drops the space before the first token of a text, so a first output token
    # "_world" must be decoded after its prompt to come out as " world".
    tok = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator(["Hello world, hello there world"] * 5,
                            trainers.BpeTrainer(vocab_size=60, special_tokens=["<unk>"]))
    tokenizer = Tokenizer(tok, TokenizerConfig())
    prompt, out = tokenizer.encode("Hello"), tokenizer.encode(" world")
    assert tokenizer.decode(out) == "world"
    pieces, tail = stream(IncrementalDetokenizer(tokenizer, prompt_ids=prompt), out)
    assert "".join(pieces) + tail == " world"


def test_random_ids_with_stop_strings(tokenizer: Tokenizer) -> None:
    rng = random.Random(2)
    for _ in range(300):
        ids = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randrange(1, 40))]
        text = tokenizer.decode(ids)
        # stop strings taken from the text itself, so they really occur, often across tokens
        start = rng.randrange(len(text)) if text else 0
        stop = [text[start:start + rng.randrange(1, 6)] or "zz", "never-there"]
        detok = IncrementalDetokenizer(tokenizer, stop=stop)
        pieces, tail = stream(detok, ids)
        assert "".join(pieces) + tail == truncate_at_stop(text, stop), (ids, stop)
        assert detok.stopped == (truncate_at_stop(text, stop) != text)


def test_incomplete_utf8_is_held_back(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("🙂")
    assert len(ids) > 1, "the test needs a character that spans tokens"
    detok = IncrementalDetokenizer(tokenizer)
    assert [detok.push(i) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.push(ids[-1]) == "🙂"


def test_stop_string_split_across_tokens(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("Hello there, STOP here and more")
    detok = IncrementalDetokenizer(tokenizer, stop=["STOP", "xyz"])
    pieces, tail = stream(detok, ids)
    assert detok.stopped and "".join(pieces) + tail == "Hello there, "
    assert tail == "" and detok.push(ids[0]) == "" and detok.flush() == ""
    assert not any("S" in p for p in pieces)  # "S", "ST", "STO" were held back, never released


def test_held_back_prefix_is_released(tokenizer: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tokenizer, stop=["lazy cat"])
    pieces, tail = stream(detok, tokenizer.encode("the lazy dog is lazy"))
    assert not detok.stopped
    assert "".join(pieces) + tail == "the lazy dog is lazy"
    assert tail == "lazy"  # could have become "lazy cat" until the end


@pytest.mark.parametrize("stop", [["dog", "lazy dog"], ["lazy dog", "dog"], ["quick brown", "dog"]])
def test_earliest_stop_wins(tokenizer: Tokenizer, stop: list[str]) -> None:
    text = "The quick brown fox jumps over the lazy dog."
    pieces, tail = stream(IncrementalDetokenizer(tokenizer, stop=stop), tokenizer.encode(text))
    assert "".join(pieces) + tail == truncate_at_stop(text, stop)


def test_empty_stop_string_rejected(tokenizer: Tokenizer) -> None:
    with pytest.raises(InvalidInput):
        IncrementalDetokenizer(tokenizer, stop=["ok", ""])


def test_stop_strings_count_from_the_min_tokens_th_token(tokenizer: Tokenizer) -> None:
    """vLLM's min_tokens: no stop before the output has that many tokens; a stop string after it still stops."""
    ids = tokenizer.encode("the dog ran, the dog sat, and the cat")
    dog_at = next(n for n in range(1, len(ids)) if "dog" in tokenizer.decode(ids[:n]))    # the first "dog" ends here
    pieces, tail = stream(IncrementalDetokenizer(tokenizer, stop=["dog"], min_tokens=dog_at + 1), ids)
    assert "".join(pieces) + tail == "the dog ran, the "
    pieces, tail = stream(IncrementalDetokenizer(tokenizer, stop=["dog"]), ids)
    assert "".join(pieces) + tail == "the "
