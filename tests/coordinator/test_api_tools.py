"""Tool calls on /v1/chat/completions over a fake serving whose model writes a scripted answer: tools reach the
template, calls come back as tool_calls (whole and streamed, through the openai client), required and named
choices become a grammar of the format, and bad tool requests are 400s naming the field."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from stratamesh.coordinator.api.openai import create_app
from stratamesh.coordinator.text import Tokenizer
from stratamesh.kernels.tiny_model import CHAT_TEMPLATE
from tests.coordinator import test_api
from tests.coordinator.test_api import CHAT, FakeServing, error_of

chat_tokenizers, gen, client = test_api.chat_tokenizers, test_api.gen, test_api.client

CALLS_TEXT = ('I will check.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
              '<tool_call>\n{"name": "time", "arguments": {"zone": "UTC"}}\n</tool_call>')
TOOLS = [{"type": "function", "function": {"name": "weather", "description": "the weather of a city", "parameters": {
             "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
         {"type": "function", "function": {"name": "time", "parameters": {
             "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}]


class CallingServing(FakeServing):
    """test_api's fake serving with a model "caller" that writes CALLS_TEXT, then EOS; its chat template is the tiny
    models' (Hermes' tool calls, as Qwen 2.5's)."""

    def __init__(self, tokenizer: Tokenizer, strict_tokenizer: Tokenizer, caller_tokenizer: Tokenizer) -> None:
        super().__init__(tokenizer, strict_tokenizer)
        self.caller_tokenizer = caller_tokenizer
        self.cards["caller"] = dataclasses.replace(self.cards["tiny"], id="caller", max_context=4096)

    def text(self, model_id: str) -> Tokenizer:
        return self.caller_tokenizer if model_id == "caller" else super().text(model_id)

    def script(self, model_id: str) -> Iterator[int]:
        if model_id != "caller":
            return super().script(model_id)
        return iter([*self.tokenizer.encode(CALLS_TEXT, add_special_tokens=False), min(self.tokenizer.eos_token_ids)])


@pytest.fixture(scope="module")
def caller_tokenizer(chatml_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    folder = tmp_path_factory.mktemp("caller")
    shutil.copytree(chatml_dir, folder, dirs_exist_ok=True)
    (folder / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return Tokenizer.from_dir(folder)


@pytest.fixture
def calling(chat_tokenizers: tuple[Tokenizer, Tokenizer], caller_tokenizer: Tokenizer) -> CallingServing:
    return CallingServing(*chat_tokenizers, caller_tokenizer)


@contextlib.asynccontextmanager
async def app_client(serving: FakeServing, tool_call_parser: str | None = None) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=create_app(serving, tool_call_parser=tool_call_parser))
    async with httpx.AsyncClient(transport=transport, base_url="http://mesh") as c:
        yield c


@pytest.fixture
async def hermes_client(calling: CallingServing) -> AsyncIterator[httpx.AsyncClient]:
    """The app over calling, each model's tool calls in the format its template shows."""
    async with app_client(calling) as c:
        yield c


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": "caller", "messages": CHAT, "tools": TOOLS, "max_tokens": 400, **extra}


async def test_calls_come_back_as_tool_calls_whole_and_streamed(hermes_client: httpx.AsyncClient) -> None:
    openai = pytest.importorskip("openai")
    oai = openai.AsyncOpenAI(base_url="http://mesh/v1", api_key="unused", http_client=hermes_client,
                             max_retries=0)
    whole = (await oai.chat.completions.create(**chat())).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content == "I will check.\n"
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls]
    assert calls == [("weather", {"city": "Paris"}), ("time", {"zone": "UTC"})]
    assert all(c.type == "function" and c.id.startswith("call_") for c in whole.message.tool_calls)
    chunks = [c async for c in await oai.chat.completions.create(**chat(stream=True))]
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    deltas = [d for c in chunks for d in c.choices[0].delta.tool_calls or ()]
    assert content == "I will check.\n"
    assert [(d.index, d.function.name, json.loads(d.function.arguments)) for d in deltas] == [
        (0, "weather", {"city": "Paris"}), (1, "time", {"zone": "UTC"})]
    assert [c.choices[0].finish_reason for c in chunks][-1] == "tool_calls"


async def test_tools_reach_the_template_and_earlier_calls_render_with_object_arguments(
        hermes_client: httpx.AsyncClient, calling: CallingServing) -> None:
    earlier = [*CHAT, {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function", "function": {"name": "time", "arguments": '{"zone": "UTC"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}]
    resp = await hermes_client.post("/v1/chat/completions", json=chat(messages=earlier))
    assert resp.status_code == 200, resp.text
    prompt = calling.tokenizer.decode(calling.calls[-1][1], skip_special_tokens=False)
    assert json.dumps(TOOLS[0]["function"]["parameters"]) in prompt         # the tools, as the template has them
    assert '"arguments": {"zone": "UTC"}' in prompt       # the earlier call's arguments an object, not a string


@pytest.mark.parametrize(("choice", "parallel", "names", "many"), [
    ("required", None, {"weather", "time"}, True), ("required", False, {"weather", "time"}, False),
    ({"type": "function", "function": {"name": "time"}}, None, {"time"}, False)])
async def test_required_and_named_choices_constrain_the_output_to_calls_of_the_format(
        hermes_client: httpx.AsyncClient, calling: CallingServing, choice: Any, parallel: bool | None,
        names: set[str], many: bool) -> None:
    import llguidance

    body = chat(tool_choice=choice) | ({} if parallel is None else {"parallel_tool_calls": parallel})
    resp = await hermes_client.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    grammar = calling.calls[-1][2].grammar
    assert grammar and not llguidance.LLMatcher.validate_grammar(grammar)
    assert ("call (" in grammar) == many and {n for n in ("weather", "time") if f'"const": "{n}"' in grammar} == names


async def test_auto_and_none_leave_the_model_free_and_none_parses_nothing(hermes_client: httpx.AsyncClient,
                                                                          calling: CallingServing) -> None:
    resp = await hermes_client.post("/v1/chat/completions", json=chat(tool_choice="none"))
    choice = resp.json()["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": CALLS_TEXT} and choice["finish_reason"] == "stop"
    assert calling.calls[-1][2].grammar == ""
    await hermes_client.post("/v1/chat/completions", json=chat(tool_choice="auto"))
    assert calling.calls[-1][2].grammar == ""


@pytest.mark.parametrize(("body", "param"), [
    (chat(tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
    (chat(tool_choice="sometimes"), "tool_choice"),
    ({"model": "caller", "messages": CHAT, "tool_choice": "required"}, "tool_choice"),
    (chat(tools=[{"type": "function", "function": {"name": "has space"}}]), "tools[0].function.name"),
    (chat(tools=[{"type": "retrieval"}]), "tools[0].type"),
    (chat(tool_choice="required", response_format={"type": "json_object"}), "tool_choice"),
])
async def test_bad_tool_requests_are_400s_naming_the_field(hermes_client: httpx.AsyncClient, body: dict,
                                                           param: str) -> None:
    resp = await hermes_client.post("/v1/chat/completions", json=body)
    assert error_of(resp, 400)["param"] == param


async def test_a_model_whose_template_shows_no_tool_format_refuses_tools_by_name(client: httpx.AsyncClient,
                                                                                 gen: FakeServing) -> None:
    resp = await client.post("/v1/chat/completions", json=chat(model="tiny"))
    err = error_of(resp, 400)
    assert err["param"] == "tools" and "--tool-call-parser" in err["message"] and not gen.calls
    none = await client.post("/v1/chat/completions", json=chat(model="tiny", tool_choice="none", max_tokens=4))
    assert none.status_code == 200 and none.json()["choices"][0]["finish_reason"] == "length"   # nothing to parse


async def test_a_parser_given_at_start_serves_tools_of_a_model_whose_template_shows_none(
        calling: CallingServing) -> None:
    async with app_client(calling, tool_call_parser="hermes") as c:
        resp = await c.post("/v1/chat/completions", json=chat(model="tiny", tool_choice="required"))
        assert resp.status_code == 200, resp.text
        assert "<tool_call>" in calling.calls[-1][2].grammar


ANTHROPIC_TOOLS = [{"name": t["function"]["name"], "description": t["function"].get("description", ""),
                    "input_schema": t["function"]["parameters"]} for t in TOOLS]


async def test_anthropic_clients_get_tool_use_blocks_created_and_streamed(calling: CallingServing) -> None:
    anthropic = pytest.importorskip("anthropic")
    httpx2 = pytest.importorskip("httpx2")      # the anthropic client's own httpx
    app = httpx2.ASGITransport(app=create_app(calling))
    async with httpx2.AsyncClient(transport=app, base_url="http://mesh") as http:
        client = anthropic.AsyncAnthropic(base_url="http://mesh", api_key="unused", http_client=http, max_retries=0)
        asked = {"model": "caller", "max_tokens": 400, "tools": ANTHROPIC_TOOLS,
                 "messages": [{"role": "user", "content": "Weather in Paris, and the time?"}]}
        message = await client.messages.create(**asked)
        assert message.stop_reason == "tool_use" and [b.type for b in message.content] == ["text", "tool_use",
                                                                                           "tool_use"]
        assert [(b.name, b.input) for b in message.content[1:]] == [("weather", {"city": "Paris"}),
                                                                    ("time", {"zone": "UTC"})]
        async with client.messages.stream(**asked) as stream:
            final = await stream.get_final_message()
        assert final.stop_reason == "tool_use" and final.content[0].text == message.content[0].text
        assert [(b.name, b.input) for b in final.content[1:]] == [(b.name, b.input) for b in message.content[1:]]
        answered = [*asked["messages"], {"role": "assistant", "content": [
            {"type": "tool_use", "id": "toolu_1", "name": "time", "input": {"zone": "UTC"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "12:00"},
                                         {"type": "text", "text": "And so?"}]}]
        await client.messages.create(**{**asked, "messages": answered, "tool_choice": {"type": "tool", "name": "time"}})
        prompt = calling.tokenizer.decode(calling.calls[-1][1], skip_special_tokens=False)
        assert '"arguments": {"zone": "UTC"}' in prompt and "<tool_response>\n12:00\n</tool_response>" in prompt
        assert prompt.index("12:00") < prompt.index("And so?")
        assert '"const": "time"' in calling.calls[-1][2].grammar


async def test_responses_clients_get_function_call_items_created_and_streamed(hermes_client: httpx.AsyncClient,
                                                                             calling: CallingServing) -> None:
    openai = pytest.importorskip("openai")
    oai = openai.AsyncOpenAI(base_url="http://mesh/v1", api_key="unused", http_client=hermes_client,
                             max_retries=0)
    flat = [{"type": "function", **t["function"]} for t in TOOLS]
    asked = {"model": "caller", "input": "Weather in Paris, and the time?", "tools": flat, "max_output_tokens": 400}
    response = await oai.responses.create(**asked)
    assert [item.type for item in response.output] == ["message", "function_call", "function_call"]
    assert response.output_text == "I will check.\n" and response.status == "completed"
    calls = [(item.name, json.loads(item.arguments)) for item in response.output[1:]]
    assert calls == [("weather", {"city": "Paris"}), ("time", {"zone": "UTC"})]
    async with oai.responses.stream(**asked) as stream:
        final = await stream.get_final_response()
    assert [(item.name, json.loads(item.arguments)) for item in final.output[1:]] == calls
    answered = [{"role": "user", "content": "Time?"},
                {"type": "function_call", "call_id": "call_9", "name": "time", "arguments": '{"zone": "UTC"}'},
                {"type": "function_call_output", "call_id": "call_9", "output": "12:00"}]
    await oai.responses.create(**{**asked, "input": answered, "tool_choice": {"type": "function", "name": "time"}})
    prompt = calling.tokenizer.decode(calling.calls[-1][1], skip_special_tokens=False)
    assert '"arguments": {"zone": "UTC"}' in prompt and "<tool_response>\n12:00\n</tool_response>" in prompt
    assert '"const": "time"' in calling.calls[-1][2].grammar
