"""OpenAI's Responses API (POST /v1/responses) over test_api's fake serving: the chat path's answer as a Response
object or its numbered named events, as the openai client reads them."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from tests.coordinator import test_api
from tests.coordinator.test_api import CHAT, FakeServing, error_of

# test_api's fixtures: its fake serving's models, and an httpx client of the app over it
chat_tokenizers, gen, client = test_api.chat_tokenizers, test_api.gen, test_api.client

STREAM_TYPES = ["response.created", "response.in_progress", "response.output_item.added",
                "response.content_part.added"]
END_TYPES = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]


def response_events(resp: httpx.Response) -> list[dict[str, Any]]:
    """Parse a Responses SSE body strictly: `event: <type>` then `data: {json}` of that type, numbered from 0 in
    order, no [DONE]."""
    assert resp.status_code == 200, resp.text
    assert resp.headers["content-type"].startswith("text/event-stream")
    assert resp.text.endswith("\n\n") and "[DONE]" not in resp.text
    events = []
    for block in resp.text[:-2].split("\n\n"):
        head, data = block.split("\n")
        assert head.startswith("event: ") and data.startswith("data: "), block
        event = json.loads(data[len("data: "):])
        assert event["type"] == head[len("event: "):]
        events.append(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


def story(gen: FakeServing) -> str:
    """What tiny-eos answers before its EOS."""
    return gen.tokenizer.decode(gen.story_ids)


async def test_a_string_input_is_one_user_message(client: httpx.AsyncClient, gen: FakeServing) -> None:
    resp = await client.post("/v1/responses", json={"model": "tiny-eos", "input": "tell me a story"})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert gen.calls[-1][1] == gen.tokenizer.encode_chat([{"role": "user", "content": "tell me a story"}])
    assert body["id"].startswith("resp_") and body["object"] == "response" and body["model"] == "tiny-eos"
    assert body["status"] == "completed" and body["incomplete_details"] is None and body["error"] is None
    (message,) = body["output"]
    assert message["type"] == "message" and message["role"] == "assistant" and message["status"] == "completed"
    assert message["id"].startswith("msg_")
    assert message["content"] == [{"type": "output_text", "text": story(gen), "annotations": []}]
    prompt, completion = len(gen.calls[-1][1]), len(gen.story_ids) + 1      # the EOS counts
    assert body["usage"] == {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": 0},
                             "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": 0},
                             "total_tokens": prompt + completion}
    assert body["tools"] == [] and body["text"] == {"format": {"type": "text"}} and body["metadata"] == {}


async def test_items_follow_the_instructions_as_chat_messages(client: httpx.AsyncClient, gen: FakeServing) -> None:
    items = [{"type": "message", "role": "developer", "content": "no rhymes"},
             {"role": "user", "content": [{"type": "input_text", "text": "tell me"},
                                          {"type": "input_text", "text": "a story"}]},
             {"role": "assistant", "content": [{"type": "output_text", "text": "Once", "annotations": []}],
              "id": "msg_1", "status": "completed"},
             {"role": "user", "content": "go on"}]
    resp = await client.post("/v1/responses", json={"model": "tiny", "input": items, "instructions": "be brief",
                                                    "max_output_tokens": 9, "temperature": 0.5, "top_p": 0.9,
                                                    "store": True, "metadata": {"k": "v"}, "reasoning": {}})
    assert resp.status_code == 200, resp.text
    assert gen.calls[-1][1] == gen.tokenizer.encode_chat([
        {"role": "system", "content": "be brief"}, {"role": "system", "content": "no rhymes"},
        {"role": "user", "content": "tell me\na story"}, {"role": "assistant", "content": "Once"},
        {"role": "user", "content": "go on"}])
    params = gen.calls[-1][2]
    assert (params.temperature, params.top_p) == (0.5, 0.9)
    body = resp.json()
    assert (body["instructions"], body["temperature"], body["top_p"], body["metadata"]) == (
        "be brief", 0.5, 0.9, {"k": "v"})


async def test_max_output_tokens_leaves_it_incomplete(client: httpx.AsyncClient, gen: FakeServing) -> None:
    resp = await client.post("/v1/responses", json={"model": "tiny", "input": "tell me a story",
                                                    "max_output_tokens": 9})
    body = resp.json()
    assert body["status"] == "incomplete" and body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert body["max_output_tokens"] == 9 and body["usage"]["output_tokens"] == 9
    assert body["output"][0]["status"] == "incomplete"
    assert body["output"][0]["content"][0]["text"] == gen.expected_text(9)


@pytest.mark.parametrize(("model", "max_output_tokens", "last"), [("tiny-eos", None, "response.completed"),
                                                                 ("tiny", 12, "response.incomplete")])
async def test_streamed_events_come_in_order_numbered(client: httpx.AsyncClient, gen: FakeServing, model: str,
                                                      max_output_tokens: int | None, last: str) -> None:
    asked = {"model": model, "input": CHAT[1:], "max_output_tokens": max_output_tokens}
    whole = (await client.post("/v1/responses", json=asked)).json()
    events = response_events(await client.post("/v1/responses", json={**asked, "stream": True}))
    types = [e["type"] for e in events]
    deltas = types[len(STREAM_TYPES):-len(END_TYPES) - 1]
    assert types[:len(STREAM_TYPES)] == STREAM_TYPES and types[-len(END_TYPES) - 1:] == [*END_TYPES, last]
    assert deltas and set(deltas) == {"response.output_text.delta"}
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text == whole["output"][0]["content"][0]["text"]
    created, final = events[0]["response"], events[-1]["response"]
    assert created["status"] == "in_progress" and created["output"] == [] and created["usage"] is None
    item_id = events[2]["item"]["id"]
    assert all(e["item_id"] == item_id for e in events if "item_id" in e)
    assert events[-4]["text"] == events[-3]["part"]["text"] == text
    assert events[-2]["item"] == final["output"][0]
    ignored = ("id", "created_at", "output")
    assert {k: v for k, v in final.items() if k not in ignored} == {k: v for k, v in whole.items() if k not in ignored}
    assert final["output"][0]["content"] == whole["output"][0]["content"] and final["id"] == created["id"]


async def test_the_openai_client_reads_responses_created_and_streamed(client: httpx.AsyncClient,
                                                                     gen: FakeServing) -> None:
    openai = pytest.importorskip("openai")
    oai = openai.AsyncOpenAI(base_url="http://mesh/v1", api_key="unused", http_client=client, max_retries=0)
    response = await oai.responses.create(model="tiny-eos", input="tell me a story", instructions="be brief")
    assert response.output_text == story(gen) and response.status == "completed"
    assert response.usage.output_tokens == len(gen.story_ids) + 1
    cut = await oai.responses.create(model="tiny", input="tell me a story", max_output_tokens=8)
    assert cut.output_text == gen.expected_text(8) and cut.incomplete_details.reason == "max_output_tokens"
    events = [e async for e in await oai.responses.create(model="tiny-eos", input="tell me a story", stream=True)]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == story(gen)
    assert events[-1].type == "response.completed" and events[-1].response.output_text == story(gen)
    async with oai.responses.stream(model="tiny-eos", input="tell me a story") as stream:
        final = await stream.get_final_response()
    assert final.output_text == story(gen) and final.usage.output_tokens == response.usage.output_tokens
    with pytest.raises(openai.BadRequestError, match="previous_response_id"):
        await oai.responses.create(model="tiny", input="x", previous_response_id=response.id)
    failed = [e async for e in await oai.responses.create(model="flaky", input="x", stream=True)]
    assert failed[-1].type == "error" and "stage" in failed[-1].message


@pytest.mark.parametrize("text_format, response_format", [
    ({"type": "json_schema", "name": "pet", "strict": True,
      "schema": {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}},
     {"type": "json_schema", "json_schema": {"name": "pet", "strict": True, "schema": {
         "type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}}}),
    ({"type": "json_object"}, {"type": "json_object"}),
])
async def test_text_format_constrains_as_chats_response_format(client: httpx.AsyncClient, gen: FakeServing,
                                                               text_format: dict, response_format: dict) -> None:
    chat = await client.post("/v1/chat/completions", json={"model": "tiny", "messages": CHAT, "max_tokens": 2,
                                                           "response_format": response_format})
    assert chat.status_code == 200, chat.text
    resp = await client.post("/v1/responses", json={"model": "tiny", "input": CHAT[1:], "instructions": "be brief",
                                                    "max_output_tokens": 2, "text": {"format": text_format}})
    assert resp.status_code == 200, resp.text
    (_, chat_prompt, chat_params, _), (_, prompt, params, _) = gen.calls
    assert params.grammar and params.grammar == chat_params.grammar and prompt == chat_prompt
    assert resp.json()["text"] == {"format": text_format}


@pytest.mark.parametrize(("body", "param", "message"), [
    ({"model": "tiny", "input": "x", "previous_response_id": "resp_1"}, "previous_response_id", "not stored"),
    ({"model": "tiny", "input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type", ""),
    ({"model": "tiny", "input": "x", "tools": [{"type": "function", "name": "f", "parameters": {}}]}, "tools",
     "shows no way to call tools"),
    ({"model": "tiny", "input": []}, "input", "input is empty"),
    ({"model": "tiny", "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input", ""),
    ({"model": "tiny", "input": [{"role": "robot", "content": "beep"}]}, "input", ""),
    ({"model": "tiny", "input": "x", "max_output_tokens": 0}, "max_output_tokens", ""),
    ({"model": "tiny", "input": "x", "temperature": 3}, "temperature", ""),
    ({"model": "tiny", "input": "x", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format",
     "needs its schema"),
    ({"input": "x"}, "model", ""),
])
async def test_a_bad_request_is_a_400_in_openais_shape(client: httpx.AsyncClient, gen: FakeServing, body: dict,
                                                       param: str, message: str) -> None:
    err = error_of(await client.post("/v1/responses", json=body), 400)
    assert err["type"] == "invalid_request_error" and err["param"] == param and message in err["message"]
    assert gen.calls == []


async def test_an_unknown_model_is_a_404_and_a_failure_mid_stream_an_error_event(client: httpx.AsyncClient) -> None:
    assert error_of(await client.post("/v1/responses", json={"model": "nope", "input": "x"}), 404)["param"] == "model"
    events = response_events(await client.post("/v1/responses", json={"model": "flaky", "input": "x",
                                                                     "stream": True}))
    assert events[-1]["type"] == "error" and events[-1]["code"] == "stage_failed" and "stage" in events[-1]["message"]
    assert not any(e["type"] in ("response.completed", "response.incomplete") for e in events)
    assert error_of(await client.post("/v1/responses", json={"model": "broken", "input": "x", "stream": True}),
                    502)["code"] == "stage_failed"
