"""Text in and out of a model: tokenizer, chat template, incremental detokenizer with stop strings."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
import tokenizers

from stratamesh.fleet.gguf_files import GgufModel, is_gguf
from stratamesh.fleet.errors import CheckpointError, InvalidInput

log = logging.getLogger(__name__)

REPLACEMENT_CHAR = "\ufffd"
# Names transformers hands a chat template from its special_tokens_map.
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                       "mask_token")
# Prompt tokens decoded together with the first output tokens, so a leading space comes out right.
NUM_CONTEXT_TOKENS = 5


@dataclass(frozen=True, slots=True)
class TokenizerConfig:
    """What tokenizer_config.json, generation_config.json and config.json say about text."""

    chat_template: str | None = None
    special_tokens: Mapping[str, str] = field(default_factory=dict)  # e.g. {"bos_token": "<s>"}
    eos_token_ids: frozenset[int] = frozenset()


class Tokenizer:
    """A model's tokenizer, special tokens and chat template."""

    def __init__(self, tokenizer: tokenizers.Tokenizer, config: TokenizerConfig) -> None:
        self._tokenizer = tokenizer
        self.config = config

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer:
        """Load tokenizer.json and the config files of a checkpoint folder (or what a GGUF file says of them)."""
        if is_gguf(model_dir):
            return cls.from_gguf(GgufModel(model_dir))
        model_dir = Path(model_dir)
        if not (model_dir / "tokenizer.json").is_file():
            raise CheckpointError(f"{model_dir} has no tokenizer.json")
        tokenizer = tokenizers.Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        template_file = model_dir / "chat_template.jinja"
        config = parse_tokenizer_config(
            tokenizer,
            tokenizer_config=_read_json(model_dir / "tokenizer_config.json"),
            generation_config=_read_json(model_dir / "generation_config.json"),
            model_config=_read_json(model_dir / "config.json"),
            chat_template_file=template_file.read_text() if template_file.is_file() else None)
        return cls(tokenizer, config)

    @classmethod
    def from_gguf(cls, model: GgufModel) -> Tokenizer:
        """A GGUF file's tokenizer, chat template and special tokens (its BOS and EOS by id)."""
        tokenizer = tokenizers.Tokenizer.from_str(model.tokenizer_json())
        config = model.config()
        named = {"bos_token": config.get("bos_token_id"), "eos_token": (config.get("eos_token_id") or [None])[0]}
        tokenizer_config = {name: tokenizer.id_to_token(i) for name, i in named.items() if i is not None}
        return cls(tokenizer, parse_tokenizer_config(tokenizer, {**tokenizer_config,
                                                                 "chat_template": model.chat_template()},
                                                     generation_config={}, model_config=config))

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self.config.eos_token_ids

    @cached_property
    def tokenizer_json(self) -> str:
        """The tokenizer as tokenizer.json holds it (what llguidance builds its token trie of)."""
        return self._tokenizer.to_str()

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._tokenizer.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of text; BOS/EOS only where tokenizer.json's post-processor adds them (as transformers 5)."""
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of token ids."""
        return self._tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                            template_kwargs: Mapping[str, Any] | None = None,
                            tools: Sequence[Mapping[str, Any]] | None = None) -> str:
        """Render messages with the model's chat template as transformers does; template_kwargs add variables,
        tools are the functions the model may call (OpenAI's definitions)."""
        if self._template is None:
            raise InvalidInput("this model has no chat template; use /v1/completions")
        # transformers drops None values: templates handle a missing key better than a None one.
        chat = [{k: v for k, v in m.items() if v is not None} for m in messages]
        context = {"tools": tools or None, "documents": None, **self.config.special_tokens, **(template_kwargs or {}),
                   "messages": chat, "add_generation_prompt": add_generation_prompt}
        try:
            return self._template.render(context)
        except Exception as e:  # the template rejected these messages (raise_exception, a missing key, ...)
            raise InvalidInput(f"chat template failed: {e}") from e

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                    template_kwargs: Mapping[str, Any] | None = None,
                    tools: Sequence[Mapping[str, Any]] | None = None) -> list[int]:
        """Prompt ids of a chat; the template places BOS itself, so none is added (as transformers)."""
        text = self.apply_chat_template(messages, add_generation_prompt, template_kwargs, tools)
        return self.encode(text, add_special_tokens=False)

    @cached_property
    def _template(self) -> jinja2.Template | None:
        if not self.config.chat_template:
            return None
        try:
            return _jinja_env().from_string(self.config.chat_template)
        except jinja2.TemplateSyntaxError as e:
            raise CheckpointError(f"chat template does not parse: {e}") from e


def parse_tokenizer_config(tokenizer: tokenizers.Tokenizer, tokenizer_config: Mapping[str, Any],
                       generation_config: Mapping[str, Any], model_config: Mapping[str, Any],
                       chat_template_file: str | None = None) -> TokenizerConfig:
    """TokenizerConfig from the parsed JSON files of a checkpoint (pure: no I/O)."""
    special = {name: text for name in SPECIAL_TOKEN_NAMES
               if (text := _token_text(tokenizer_config.get(name))) is not None}
    eos_ids = set(_as_ids(generation_config.get("eos_token_id")) or _as_ids(model_config.get("eos_token_id")))
    if "eos_token" in special and (eos_id := tokenizer.token_to_id(special["eos_token"])) is not None:
        eos_ids.add(eos_id)
    if not eos_ids:
        log.warning("no EOS token id in tokenizer_config, generation_config or config")
    return TokenizerConfig(
        chat_template=chat_template_file or _pick_template(tokenizer_config.get("chat_template")),
        special_tokens=special,
        eos_token_ids=frozenset(eos_ids))


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} does not hold a JSON object")
    return data


def _token_text(value: Any) -> str | None:
    # tokenizer_config stores a token as its text or as a serialized AddedToken {"content": ...}.
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _as_ids(value: Any) -> list[int]:
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def _pick_template(value: Any) -> str | None:
    # Older configs may hold several named templates: [{"name": "default", "template": ...}, ...].
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        value = named.get("default")
    return value if isinstance(value, str) else None


class _GenerationTag(jinja2.ext.Extension):
    """Accepts transformers' {% generation %} block and renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Like transformers: no HTML escaping, unlike jinja's own tojson.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _jinja_env() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


class IncrementalDetokenizer:
    """Token ids in, finished text out: holds back partial characters and possible stop-string starts. Stop strings
    count from the min_tokens-th token on (vLLM's min_tokens: no stop before the output has that many)."""

    def __init__(self, tokenizer: Tokenizer, stop: Iterable[str] = (), prompt_ids: Sequence[int] = (),
                 skip_special_tokens: bool = True, min_tokens: int = 0) -> None:
        self._tokenizer = tokenizer
        self._stop = tuple(stop)
        self._tokens_before_stops = min_tokens
        if any(not s for s in self._stop):
            raise InvalidInput("stop strings must not be empty")
        self._skip_special = skip_special_tokens
        self._ids = list(prompt_ids[-NUM_CONTEXT_TOKENS:])
        self._prefix_offset = 0  # decode from here, so the text keeps its context ...
        self._read_offset = len(self._ids)  # ... and emit what the ids from here on add
        self._pending = ""  # decoded, not yet returned: it may be the start of a stop string
        self.stopped = False
        self.stop_string: str | None = None     # the stop string that ended it

    def push(self, token_id: int) -> str:
        """Add one token; return the text it finishes (often "")."""
        if self.stopped:
            return ""
        self._ids.append(token_id)
        self._tokens_before_stops -= 1
        self._pending += self._decode_new(final=False)
        return self._release(final=False)

    def flush(self) -> str:
        """The generation ended: return all text still held back."""
        if self.stopped:
            return ""
        self._pending += self._decode_new(final=True)
        return self._release(final=True)

    def _decode_new(self, final: bool) -> str:
        if self._read_offset == len(self._ids):
            return ""
        window = self._ids[self._prefix_offset:]
        full = self._tokenizer.decode(window, self._skip_special)
        if full.endswith(REPLACEMENT_CHAR) and not final:
            return ""  # an incomplete UTF-8 sequence: the next token may complete it
        prefix = self._tokenizer.decode(window[:self._read_offset - self._prefix_offset], self._skip_special)
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return full[_common_prefix_len(prefix, full):]

    def _release(self, final: bool) -> str:
        stops = self._stop if self._tokens_before_stops <= 0 else ()
        found = _find_stop(self._pending, stops)
        if found is not None:
            cut, self.stop_string = found
            self.stopped = True
            out, self._pending = self._pending[:cut], ""
            return out
        keep = 0 if final else stop_prefix_len(self._pending, stops)
        out = self._pending[:len(self._pending) - keep]
        self._pending = self._pending[len(out):]
        return out


def _common_prefix_len(a: str, b: str) -> int:
    if b.startswith(a):
        return len(a)
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _find_stop(text: str, stop: Sequence[str]) -> tuple[int, str] | None:
    """(index, string) of the earliest stop string in text (the first given, of those there), or None."""
    hits = [(i, s) for s in stop if (i := text.find(s)) >= 0]
    return min(hits, key=lambda hit: hit[0]) if hits else None


def stop_prefix_len(text: str, stop: Sequence[str]) -> int:
    """Length of the longest tail of text that some stop string starts with."""
    longest = max((len(s) for s in stop), default=0)
    for k in range(min(len(text), longest - 1), 0, -1):
        tail = text[-k:]
        if any(s.startswith(tail) for s in stop):
            return k
    return 0
