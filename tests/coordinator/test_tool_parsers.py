"""Tool calls out of a model's text: each family's format, whole and streamed in any pieces, and the grammar that
makes a model write them (a matcher accepts what the parser reads back)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from stratamesh.coordinator.api.tool_parsers import FORMATS, CallSplitter, format_of_template, split_calls
from stratamesh.coordinator.text import Tokenizer

WEATHER = {"city": "Paris", "days": 3}
TIME = {"zone": "UTC"}

# (format, output, expected text, expected calls as (name, arguments))
CASES = [
    ("hermes", 'Let me look.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Paris", "days": 3}}\n'
               '</tool_call>', "Let me look.\n", [("weather", WEATHER)]),
    ("hermes", '<tool_call>\n{"name": "weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>\n'
               '<tool_call>\n{"name": "time", "arguments": {"zone": "UTC"}}\n</tool_call>', "",
     [("weather", WEATHER), ("time", TIME)]),
    ("hermes", "No tools needed: 4 < 5 and <tool is not a call.", "No tools needed: 4 < 5 and <tool is not a call.",
     []),
    ("hermes", '<tool_call>\n{"name": "weather", "argum', '<tool_call>\n{"name": "weather", "argum', []),
    ("hermes", '<tool_call>\n{"name": "weather", "arguments": {"city": "Paris", "days": 3}}', "",
     [("weather", WEATHER)]),            # the model stopped before the closing tag: still a call
    ("hermes", '<tool_call>\nnot json\n</tool_call> then text', "<tool_call>\nnot json\n</tool_call> then text", []),
    ("llama3_json", ' {"name": "weather", "parameters": {"city": "Paris", "days": 3}}', "", [("weather", WEATHER)]),
    ("llama3_json", '<|python_tag|>{"name": "weather", "parameters": {"city": "Paris", "days": 3}}; '
                    '{"name": "time", "parameters": {"zone": "UTC"}}', "", [("weather", WEATHER), ("time", TIME)]),
    ("llama3_json", 'The answer is {"name": "x"}', 'The answer is {"name": "x"}', []),
    ("llama3_json", '{"no": "name"}', '{"no": "name"}', []),
    ("mistral", 'Sure. [TOOL_CALLS][{"name": "weather", "arguments": {"city": "Paris", "days": 3}}, '
                '{"name": "time", "arguments": {"zone": "UTC"}}]', "Sure. ", [("weather", WEATHER), ("time", TIME)]),
    ("mistral", "Paris is sunny.", "Paris is sunny.", []),
]


def as_pairs(calls: list) -> list[tuple[str, dict]]:
    return [(call.name, json.loads(call.arguments)) for call in calls]


@pytest.mark.parametrize(("fmt", "output", "text", "calls"), CASES)
def test_a_whole_output_splits_into_its_text_and_calls(fmt: str, output: str, text: str, calls: list) -> None:
    got_text, got_calls = split_calls(FORMATS[fmt], output)
    assert (got_text, as_pairs(got_calls)) == (text, calls)
    assert len({call.id for call in got_calls}) == len(got_calls)


@pytest.mark.parametrize(("fmt", "output", "text", "calls"), CASES)
def test_streamed_in_any_pieces_the_split_is_the_same(fmt: str, output: str, text: str, calls: list) -> None:
    rng = random.Random(len(output))
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(output)), min(len(output) - 1, rng.randint(1, 12))))
        splitter, texts, got = CallSplitter(FORMATS[fmt]), [], []
        for piece in (output[a:b] for a, b in zip([0, *cuts], [*cuts, len(output)], strict=True)):
            piece_text, piece_calls = splitter.push(piece)
            texts.append(piece_text)
            got += piece_calls
        end_text, end_calls = splitter.finish()
        assert ("".join(texts) + end_text, as_pairs(got + end_calls)) == (text, calls)


def test_text_before_a_call_streams_before_the_call_ends() -> None:
    splitter = CallSplitter(FORMATS["hermes"])
    assert splitter.push("Checking the weather <tool") == ("Checking the weather ", [])
    assert splitter.push('_call>\n{"name": "weather", "arguments": {}}') == ("", [])
    text, calls = splitter.push("\n</tool_call>")
    assert text == "" and as_pairs(calls) == [("weather", {})]


def test_the_format_is_the_one_the_template_shows() -> None:
    assert format_of_template("... <tool_call>\\n{{ tool }}</tool_call> ...").name == "hermes"
    assert format_of_template("{{ '<|python_tag|>' }}").name == "llama3_json"
    assert format_of_template("{{ '[TOOL_CALLS]' + calls }}").name == "mistral"
    assert format_of_template("{{ messages }}") is None and format_of_template(None) is None


@pytest.mark.parametrize("fmt", ["hermes", "llama3_json"])
@pytest.mark.parametrize("parallel", [True, False])
def test_the_grammar_of_a_format_takes_its_calls_and_the_parser_reads_them_back(
        fmt: str, parallel: bool, chatml_dir: Path) -> None:
    import llguidance

    from stratamesh.coordinator.api.structured import _ll_tokenizer

    tiny_tokenizer, f = Tokenizer.from_dir(chatml_dir), FORMATS[fmt]
    params = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"]}
    grammar = llguidance.LLMatcher.grammar_from_lark(f.grammar(f.call_schema("weather", params), parallel,
                                                               json.dumps(f.start)))
    one = json.dumps({"name": "weather", f.arguments_key: {"city": "Oslo"}}, separators=(",", ":"))
    output = {"hermes": f"<tool_call>\n{one}\n</tool_call>", "llama3_json": one}[fmt]
    two = output + {"hermes": "\n", "llama3_json": "; "}[fmt] + output
    ll_tokenizer = _ll_tokenizer(tiny_tokenizer.tokenizer_json, tiny_tokenizer.vocab_size)
    for text, valid in ((output, True), (two, parallel), (output.replace("Oslo", "Rome"), False)):
        matcher = llguidance.LLMatcher(ll_tokenizer, grammar)
        assert matcher.consume_tokens(tiny_tokenizer.encode(text, add_special_tokens=False)) == valid, text
        assert (matcher.is_accepting() and not matcher.is_error()) == valid, text
    assert as_pairs(split_calls(f, two)[1]) == [("weather", {"city": "Oslo"})] * 2


def test_a_marker_that_is_a_special_token_is_named_by_id_in_the_grammar(chatml_dir: Path) -> None:
    """Mistral's [TOOL_CALLS] is one special token: the grammar asks for that token (the model's own way of opening
    calls), and the text of it, kept in tool requests' output, parses back."""
    import llguidance
    import tokenizers

    from stratamesh.coordinator.api.structured import _ll_tokenizer
    from stratamesh.coordinator.api.tools import Tool, tool_use
    from stratamesh.coordinator.text import TokenizerConfig

    raw = tokenizers.Tokenizer.from_file(str(chatml_dir / "tokenizer.json"))
    raw.add_special_tokens(["[TOOL_CALLS]"])
    tokenizer = Tokenizer(raw, TokenizerConfig(chat_template="{{ '[TOOL_CALLS]' }}", eos_token_ids=frozenset({0})))
    marker = tokenizer.token_to_id("[TOOL_CALLS]")
    tools = [Tool.model_validate({"function": {"name": "now", "parameters": {
        "type": "object", "properties": {"zone": {"enum": ["UTC"]}}, "required": ["zone"]}}})]
    use = tool_use(tools, "required", False, tokenizer, None)
    assert use.fmt.name == "mistral" and f"<[{marker}]>" in use.grammar(tokenizer)
    matcher = llguidance.LLMatcher(_ll_tokenizer(tokenizer.tokenizer_json, tokenizer.vocab_size),
                                   llguidance.LLMatcher.grammar_from_lark(use.grammar(tokenizer)))
    body = '[{"name":"now","arguments":{"zone":"UTC"}}]'
    assert matcher.consume_tokens([marker, *tokenizer.encode(body, add_special_tokens=False)])
    assert matcher.is_accepting()
    text = tokenizer.decode([marker, *tokenizer.encode(body, add_special_tokens=False)], skip_special_tokens=False)
    assert as_pairs(split_calls(use.fmt, text)[1]) == [("now", {"zone": "UTC"})]
