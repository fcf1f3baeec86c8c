"""Structured output at the API: response_format (json_object, json_schema) and vLLM's guided_json, guided_choice,
guided_regex and guided_grammar (a Lark grammar), compiled by llguidance into the grammar the last stage keeps the
output to (SamplingParams.grammar: agent/engine/grammars.py). One constraint a request; one that does not compile
is a 400 naming it.

llguidance (Microsoft's, Rust) rather than xgrammar or outlines-core: it computes a step's mask in tens of
microseconds with no grammar compilation ahead (so a request's schema costs nothing before its first token), it
takes JSON schemas, regexes and Lark grammars in one format, its wheel has no dependencies, and vLLM and SGLang ship
it as a backend."""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

from stratamesh.coordinator.api.errors import ApiError
from stratamesh.coordinator.api.schemas import GenerationRequest
from stratamesh.coordinator.api.tool_parsers import COMPACT_JSON
from stratamesh.coordinator.text import Tokenizer


def grammar_of(req: GenerationRequest, tokenizer: Tokenizer, tool_grammar: str = "") -> str:
    """The llguidance grammar of the request's constraint, "" without one; a 400 naming the field where it has
    several or one that does not compile against the model's tokenizer. tool_grammar: the Lark grammar of the tool
    calls tool_choice requires (coordinator/api/tools.py), one constraint more."""
    import llguidance

    asked = [(name, value) for name, value in (
        ("response_format", req.response_format if (req.response_format or {}).get("type") != "text" else None),
        ("guided_json", req.guided_json), ("guided_choice", req.guided_choice), ("guided_regex", req.guided_regex),
        ("guided_grammar", req.guided_grammar), ("tool_choice", tool_grammar)) if value]
    if not asked:
        return ""
    if len(asked) > 1:
        raise ApiError(400, f"one constraint a request: {' and '.join(n for n, _ in asked)} were both given",
                       param=asked[1][0])
    param, value = asked[0]
    match param:
        case "response_format":
            grammar = llguidance.LLMatcher.grammar_from_json_schema(_schema(value), defaults=COMPACT_JSON)
        case "guided_json":
            grammar = llguidance.LLMatcher.grammar_from_json_schema(_json_schema(value), defaults=COMPACT_JSON)
        case "guided_choice":
            grammar = llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in value))
        case "guided_regex":
            grammar = llguidance.LLMatcher.grammar_from_regex(value)
        case _:     # guided_grammar, tool_choice
            grammar = llguidance.LLMatcher.grammar_from_lark(value)
    error = llguidance.LLMatcher.validate_grammar(grammar, _ll_tokenizer(tokenizer.tokenizer_json,
                                                                         tokenizer.vocab_size))
    if error:
        raise ApiError(400, f"{param} does not compile: {error}", param=param)
    return grammar


def _json_schema(value: dict[str, Any] | str) -> Any:
    """guided_json's schema: an object, or one as a JSON string (a 400 where the string is not JSON)."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except ValueError as e:
        raise ApiError(400, f"guided_json is not a JSON schema: {e}", param="guided_json") from e


def _schema(response_format: dict[str, Any]) -> Any:
    """The JSON schema a response_format asks for: any object for json_object, json_schema.schema for json_schema."""
    kind = response_format.get("type")
    if kind == "json_object":
        return {"type": "object"}
    if kind != "json_schema":
        raise ApiError(400, f"response_format type {kind!r} is not one of text, json_object, json_schema",
                       param="response_format")
    schema = (response_format.get("json_schema") or {}).get("schema")
    if not isinstance(schema, dict):
        raise ApiError(400, "response_format json_schema needs a schema object (json_schema.schema)",
                       param="response_format")
    return schema


@lru_cache(maxsize=16)
def _ll_tokenizer(tokenizer_json: str, vocab_size: int):  # noqa: ANN202 - llguidance's type, imported lazily
    """llguidance's view of a model's tokenizer (built once per model: ~1 s for a 150k vocabulary)."""
    import llguidance

    return llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size)
