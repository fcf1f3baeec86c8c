"""A coordinator and 3 agents found through zeroconf serve a 6-layer model split 3 ways."""

from __future__ import annotations

import asyncio
import json
import re
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from stratamesh.coordinator.registry import Registry
from stratamesh.launcher import LocalMesh
from stratamesh.fleet.wire import mesh_pb2 as pb
from stratamesh.fleet.wire import mesh_pb2_grpc as pb_grpc
from stratamesh.fleet.sessions import SamplingParams
from stratamesh.fleet.stages import moe_shape
from stratamesh.kernels.tiny_model import TINY_ARCHS

from tests.patience import wait_until

from .conftest import NUM_LAYERS, start_mesh
from .reference import encode, greedy_processed_tokens, greedy_tokens, log_softmax_of

pytestmark = pytest.mark.slow

PROMPT = "The mesh carries every layer of the model from the edge to the cloud and back"


def complete_ids(mesh: LocalMesh, model_dir: Path, prompt_ids: list[int], max_tokens: int) -> list[int]:
    """The greedy completion's token ids, asked through the openai client (vLLM's return_token_ids)."""
    client = openai.OpenAI(base_url=f"{mesh.url}/v1", api_key=mesh.api_key, timeout=120)
    completion = client.completions.create(model=model_dir.name, prompt=prompt_ids, max_tokens=max_tokens,
                                           temperature=0, extra_body={"ignore_eos": True, "return_token_ids": True})
    (choice,) = completion.choices
    assert choice.finish_reason == "length"
    return choice.token_ids


@pytest.fixture(scope="module")
def families_mesh(tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalMesh]:
    """One mesh of 3 agents serving every family but Llama (llama_mesh's) side by side, each model in 3 stages over
    the 3 agents: the first started with the mesh, the others deployed through the admin API."""
    first, *others = [arch for arch in TINY_ARCHS if arch != "llama"]
    mesh = start_mesh(tiny_models[first], tmp_path_factory.mktemp("families-mesh"))
    try:
        for arch in others:
            deployed = httpx.post(f"{mesh.url}/admin/api/models", headers=mesh.headers,
                                  json={"path": str(tiny_models[arch]), "num_stages": 3})
            assert deployed.status_code == 202, deployed.text
        mesh.wait_ready(timeout_s=120)      # /health is ok once every model is
        yield mesh
    finally:
        mesh.stop()


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_greedy_generation_equals_transformers(arch: str, tiny_models: dict[str, Path],
                                               request: pytest.FixtureRequest) -> None:
    model_dir = tiny_models[arch]
    prompt_ids = encode(model_dir, PROMPT)
    expected = greedy_tokens(model_dir, prompt_ids, 32)
    assert len(expected) == 32
    mesh = request.getfixturevalue("llama_mesh" if arch == "llama" else "families_mesh")
    plan = next(p for p in httpx.get(f"{mesh.url}/admin/api/plans", headers=mesh.headers).json()["plans"]
                if p["model_id"] == model_dir.name and p["state"] == "active")
    assert len({s["agent_id"] for s in plan["stages"]}) == 3          # 3 stages, on 3 agents
    assert complete_ids(mesh, model_dir, prompt_ids, 32) == expected


def test_a_mixture_of_experts_stages_report_where_their_routers_sent_tokens(tiny_models: dict[str, Path],
                                                                            families_mesh: LocalMesh) -> None:
    """Through the agents' heartbeats to the admin API: after a completion, each stage of the mixture of experts
    (Qwen3-MoE's: its first layer dense) counts tokens for every expert, top_k per token through each of its
    sparse layers (so a multiple of top_k x its sparse layers), unsplit (one rank, no straggler), its last step's
    imbalance at least even; a dense model's stages have no experts."""
    arch = "qwen3_moe"
    model_dir = tiny_models[arch]
    moe = moe_shape(json.loads((model_dir / "config.json").read_text()), NUM_LAYERS)
    complete_ids(families_mesh, model_dir, encode(model_dir, f"{PROMPT} ({arch}'s experts)"), 8)

    def stages(model_id: str) -> list[dict]:
        plans = httpx.get(f"{families_mesh.url}/admin/api/plans", headers=families_mesh.headers).json()["plans"]
        return next(p for p in plans if p["model_id"] == model_id and p["state"] == "active")["stages"]

    def counted() -> bool:
        return all(s["experts"] and sum(s["experts"]["tokens"]) and s["experts"]["imbalance"] for s in stages(
            model_dir.name))
    wait_until(counted, 30)
    for stage in stages(model_dir.name):
        experts = stage["experts"]
        sparse = sum(moe.is_sparse(i) for i in range(stage["start_layer"], stage["end_layer"]))
        assert len(experts["tokens"]) == moe.num_experts
        assert sum(experts["tokens"]) % (moe.top_k * sparse) == 0
        assert experts["rank_tokens"] == [sum(experts["tokens"])] and experts["straggler_rank"] is None
        assert 1 <= experts["imbalance"] <= moe.num_experts
    assert all(s["experts"] is None for s in stages(tiny_models["qwen3"].name))


def test_openai_client_streams_the_same_chat_answer(llama_mesh: LocalMesh, tiny_models) -> None:
    client = openai.OpenAI(base_url=f"{llama_mesh.url}/v1", api_key=llama_mesh.api_key)
    model = tiny_models["llama"].name
    messages = [{"role": "user", "content": "Where do the layers of the model live?"}]
    whole = client.chat.completions.create(model=model, messages=messages, max_tokens=24, temperature=0)
    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=24,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    pieces, usage = [], None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
        usage = chunk.usage or usage
    assert whole.choices[0].message.content
    assert "".join(pieces) == whole.choices[0].message.content
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens


@pytest.mark.parametrize("fields", [
    {"frequency_penalty": 1.5, "presence_penalty": 0.5},
    {"repetition_penalty": 1.8},
    {"logit_bias": {"77": 3.0, "645": -100.0}, "presence_penalty": -0.5},     # 645: plain greedy's first
], ids=["frequency-presence", "repetition", "logit-bias"])
def test_penalties_and_logit_bias_pick_the_tokens_of_their_formulas(llama_mesh: LocalMesh, tiny_models,
                                                                     fields: dict) -> None:
    """Through 3 stages and the openai client, greedy: each step's pick is the argmax of transformers' logits as
    the formula of each parameter changes them (tests/sampling_reference.py), which differs from plain greedy."""
    model_dir = tiny_models["llama"]
    prompt_ids = encode(model_dir, PROMPT)
    params = SamplingParams(**{**fields, "logit_bias": tuple((int(t), b) for t, b in fields.get("logit_bias",
                                                                                                  {}).items())})
    expected = greedy_processed_tokens(model_dir, prompt_ids, 24, params)
    assert expected != greedy_tokens(model_dir, prompt_ids, 24)
    client = openai.OpenAI(base_url=f"{llama_mesh.url}/v1", api_key=llama_mesh.api_key, timeout=120)
    standard = {k: v for k, v in fields.items() if k in ("frequency_penalty", "presence_penalty", "logit_bias")}
    completion = client.completions.create(
        model=model_dir.name, prompt=prompt_ids, max_tokens=24, temperature=0, **standard,
        extra_body={"ignore_eos": True, "return_token_ids": True, **{k: v for k, v in fields.items()
                                                                       if k not in standard}})
    assert completion.choices[0].token_ids == expected


def test_logprobs_and_echo_are_transformers_log_softmax(llama_mesh: LocalMesh, tiny_models) -> None:
    """Through 3 stages and the openai client (lm-eval's call: echo with logprobs): the prompt's tokens (the first
    null) and the generated ones with their 3 likeliest, and chat's logprobs and top_logprobs, streamed and not,
    within 1e-4 of transformers' log_softmax."""
    model_dir = tiny_models["llama"]
    prompt_ids = encode(model_dir, PROMPT)
    client = openai.OpenAI(base_url=f"{llama_mesh.url}/v1", api_key=llama_mesh.api_key, timeout=120)
    completion = client.completions.create(model=model_dir.name, prompt=prompt_ids, max_tokens=8, temperature=0,
                                           logprobs=3, echo=True,
                                           extra_body={"ignore_eos": True, "return_token_ids": True})
    (choice,) = completion.choices
    ids = prompt_ids + choice.token_ids
    expected = log_softmax_of(model_dir, ids)
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx([float(expected[i - 1, ids[i]]) for i in range(1, len(ids))],
                                                  abs=1e-4)
    for i in range(1, len(ids)):
        top = expected[i - 1].topk(3).values.tolist()
        assert sorted(lp.top_logprobs[i].values(), reverse=True)[:3] == pytest.approx(top, abs=1e-4)
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    assert choice.text.startswith(PROMPT)      # echo: the prompt, then the completion
    alone = client.completions.create(model=model_dir.name, prompt=PROMPT, max_tokens=0, logprobs=1, echo=True)
    assert alone.choices[0].text == PROMPT and alone.usage.completion_tokens == 0    # the legacy API's max_tokens 0
    assert alone.choices[0].logprobs.token_logprobs == lp.token_logprobs[:len(prompt_ids)]

    messages = [{"role": "user", "content": "Where do the layers live?"}]
    asked = dict(model=model_dir.name, messages=messages, max_tokens=6, temperature=0, logprobs=True,
                 top_logprobs=2, extra_body={"ignore_eos": True, "return_token_ids": True})
    chat = client.chat.completions.create(**asked).choices[0]
    chat_ids = chat.token_ids
    streamed = [c.choices[0].logprobs for c in client.chat.completions.create(**asked, stream=True)
                if c.choices and c.choices[0].logprobs]
    assert [e.logprob for s in streamed for e in s.content] == [e.logprob for e in chat.logprobs.content]
    template_ids = _chat_prompt_ids(model_dir, messages)
    chat_expected = log_softmax_of(model_dir, template_ids + chat_ids)
    start = len(template_ids) - 1
    assert [e.logprob for e in chat.logprobs.content] == pytest.approx(
        [float(chat_expected[start + i, t]) for i, t in enumerate(chat_ids)], abs=1e-4)
    assert all(len(e.top_logprobs) == 2 for e in chat.logprobs.content)


def test_n_choices_share_the_prompt_and_best_of_returns_the_likeliest(llama_mesh: LocalMesh, tiny_models) -> None:
    """n=3 greedy: three equal choices, the prompt prefilled once (the others' prompts are prefix-cache hits), usage
    counting each; sampled with a seed: choices of their own, the same again; streamed: every index's chunks,
    the same texts; best_of=4, n=2: the two of the four candidates whose tokens are likeliest."""
    model_dir = tiny_models["llama"]
    prompt_ids = encode(model_dir, PROMPT) * 3        # several full KV blocks to share
    client = openai.OpenAI(base_url=f"{llama_mesh.url}/v1", api_key=llama_mesh.api_key, timeout=120)
    asked = dict(model=model_dir.name, prompt=prompt_ids, max_tokens=10, extra_body={"ignore_eos": True})
    hits_before = _prefix_cache_hits(llama_mesh)
    greedy = client.completions.create(**asked, n=3, temperature=0)
    assert [c.index for c in greedy.choices] == [0, 1, 2] and len({c.text for c in greedy.choices}) == 1
    assert greedy.usage.completion_tokens == 30 and greedy.usage.prompt_tokens == len(prompt_ids)
    # the second and third choices found all but the prompt's last partial block (of at most 16) in the cache
    assert _prefix_cache_hits(llama_mesh) - hits_before >= 2 * (len(prompt_ids) - 16)
    sampled = client.completions.create(**asked, n=3, temperature=1.0, seed=11)
    assert len({c.text for c in sampled.choices}) > 1
    assert [c.text for c in client.completions.create(**asked, n=3, temperature=1.0, seed=11).choices] == [
        c.text for c in sampled.choices]
    texts: dict[int, str] = {}
    for chunk in client.completions.create(**asked, n=3, temperature=1.0, seed=11, stream=True):
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    assert [texts[i] for i in range(3)] == [c.text for c in sampled.choices]
    candidates = client.completions.create(**asked, n=4, temperature=1.0, seed=5, logprobs=0).choices
    scores = [sum(c.logprobs.token_logprobs) for c in candidates]
    best = client.completions.create(**asked, n=2, best_of=4, temperature=1.0, seed=5)
    ranked = sorted(range(4), key=lambda i: -scores[i])[:2]
    assert [c.text for c in best.choices] == [candidates[i].text for i in ranked]
    assert best.usage.completion_tokens == 40 and all(c.logprobs is None for c in best.choices)


SCHEMAS = [
    {"type": "object", "properties": {"mood": {"enum": ["calm", "stormy", "bright"]},
                                      "level": {"type": "integer", "minimum": -5, "maximum": 40}},
     "required": ["mood", "level"], "additionalProperties": False},
    {"type": "object", "properties": {"box": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 6}, "gpu": {"type": "boolean"}}, "required": ["name", "gpu"],
        "additionalProperties": False},
        "layers": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 31}, "minItems": 2,
                   "maxItems": 4}}, "required": ["box", "layers"], "additionalProperties": False},
    {"type": "array", "items": {"type": "object", "properties": {
        "k": {"const": "v"}, "n": {"type": "integer", "minimum": -999, "maximum": 999}},
        "required": ["k"], "additionalProperties": False}, "minItems": 1, "maxItems": 3},
]


def test_structured_output_keeps_a_random_model_to_each_schema_choice_and_regex(llama_mesh: LocalMesh,
                                                                                 tiny_models) -> None:
    """A random-weight model, sampled: only the constraint can make its output valid. Through 3 stages and the
    openai client: chat's response_format json_schema (whole and streamed) and completions' guided_* each
    validate, for several seeds."""
    jsonschema = pytest.importorskip("jsonschema")
    model_dir = tiny_models["llama"]
    client = openai.OpenAI(base_url=f"{llama_mesh.url}/v1", api_key=llama_mesh.api_key, timeout=120)
    messages = [{"role": "user", "content": "Describe the mesh as JSON."}]
    for i, schema in enumerate(SCHEMAS):
        response_format = {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema, "strict": True}}
        for seed in (1, 2):
            answer = client.chat.completions.create(model=model_dir.name, messages=messages, temperature=1.0,
                                                    seed=seed, max_tokens=120, response_format=response_format)
            assert answer.choices[0].finish_reason == "stop", answer
            jsonschema.validate(json.loads(answer.choices[0].message.content), schema)
        streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model=model_dir.name, messages=messages, temperature=1.0, seed=1, max_tokens=120,
            response_format=response_format, stream=True) if c.choices)
        jsonschema.validate(json.loads(streamed), schema)
    unconstrained = client.chat.completions.create(model=model_dir.name, messages=messages, temperature=1.0, seed=1,
                                                   max_tokens=40)
    with pytest.raises(ValueError):       # guards it: the same draws without the constraint are no JSON
        json.loads(unconstrained.choices[0].message.content)
    choice = client.completions.create(model=model_dir.name, prompt="The weather is", temperature=1.0, seed=3,
                                       max_tokens=10, extra_body={"guided_choice": ["sunny", "rainy", "foggy"]})
    assert choice.choices[0].text in ("sunny", "rainy", "foggy")
    regex = client.completions.create(model=model_dir.name, prompt="A date:", temperature=1.0, seed=3,
                                      max_tokens=20, extra_body={"guided_regex": r"20[0-9]{2}-(0[1-9]|1[0-2])"})
    assert re.fullmatch(r"20[0-9]{2}-(0[1-9]|1[0-2])", regex.choices[0].text), regex.choices[0].text


WEATHER_TOOLS = [
    {"type": "function", "function": {"name": "weather", "description": "the weather of a city, some days ahead",
                                      "parameters": {"type": "object", "properties": {
                                          "city": {"enum": ["Paris", "Oslo", "Lima"]},
                                          "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                                          "required": ["city", "days"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "alarm", "parameters": {"type": "object", "properties": {
        "hour": {"type": "integer", "minimum": 0, "maximum": 23}, "repeat": {"type": "boolean"}},
        "required": ["hour"], "additionalProperties": False}}}]   # (strict: a random model writes keys forever)


def test_tool_calls_required_or_named_validate_against_their_functions(llama_mesh: LocalMesh, tiny_models) -> None:
    """A random-weight model, sampled, through 3 stages and the openai client: tool_choice "required" and a named
    function give calls (whole and streamed, the same) whose arguments validate against the function's parameters,
    finish_reason "tool_calls"."""
    jsonschema = pytest.importorskip("jsonschema")
    client = openai.OpenAI(base_url=f"{llama_mesh.url}/v1", api_key=llama_mesh.api_key, timeout=120)
    parameters = {t["function"]["name"]: t["function"]["parameters"] for t in WEATHER_TOOLS}
    asked = {"model": tiny_models["llama"].name, "messages": [{"role": "user", "content": "Weather in Oslo?"}],
             "tools": WEATHER_TOOLS, "temperature": 1.0, "max_tokens": 150, "parallel_tool_calls": False}
    for seed, choice in ((1, "required"), (2, "required"), (1, {"type": "function", "function": {"name": "alarm"}})):
        whole = client.chat.completions.create(**asked, seed=seed, tool_choice=choice).choices[0]
        assert whole.finish_reason == "tool_calls" and whole.message.content is None, whole
        (call,) = whole.message.tool_calls
        jsonschema.validate(json.loads(call.function.arguments), parameters[call.function.name])
        assert choice == "required" or call.function.name == "alarm"
        chunks = list(client.chat.completions.create(**asked, seed=seed, tool_choice=choice, stream=True))
        (streamed,) = [d for c in chunks for d in c.choices[0].delta.tool_calls or ()]
        assert (streamed.function.name, streamed.function.arguments) == (call.function.name, call.function.arguments)
        assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_the_anthropic_sdk_gets_the_chat_apis_answers_from_messages(llama_mesh: LocalMesh, tiny_models) -> None:
    """Anthropic's client (x-api-key) against /v1/messages: created and streamed, the chat API's answer to the same
    conversation, with Anthropic's stop reasons and usage; a stop sequence names itself; a bad request is its
    BadRequestError."""
    anthropic = pytest.importorskip("anthropic")
    model = tiny_models["llama"].name
    client = anthropic.Anthropic(base_url=llama_mesh.url, api_key=llama_mesh.api_key, timeout=120)
    asked = dict(model=model, max_tokens=16, system="Answer briefly.", extra_body={"temperature": 0},   # (older
                 messages=[{"role": "user", "content": [{"type": "text", "text": "Where do the layers live?"}]}])
    # clients name temperature; the newest take it no more: Anthropic's default, as OpenAI's, is 1)
    message = client.messages.create(**asked)
    (block,) = message.content
    assert message.type == "message" and message.role == "assistant" and block.type == "text" and block.text
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 16 and message.usage.input_tokens
    chat = openai.OpenAI(base_url=f"{llama_mesh.url}/v1", api_key=llama_mesh.api_key).chat.completions.create(
        model=model, max_tokens=16, temperature=0, messages=[{"role": "system", "content": "Answer briefly."},
                                                            {"role": "user", "content": "Where do the layers live?"}])
    assert block.text == chat.choices[0].message.content
    with client.messages.stream(**asked) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == block.text and final.stop_reason == "max_tokens" and final.usage.output_tokens == 16
    sequence = block.text[len(block.text) // 2:][:3]        # from the answer's middle
    cut = client.messages.create(**{**asked, "stop_sequences": [sequence]})
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == sequence
    assert cut.content[0].text == block.text[:block.text.index(sequence)]
    with pytest.raises(anthropic.BadRequestError, match="max_tokens"):
        client.messages.create(**{**asked, "max_tokens": 0})


def _prefix_cache_hits(mesh: LocalMesh) -> float:
    """The coordinator's count of prompt tokens the stages' prefix caches served (vllm:prefix_cache_hits)."""
    text = httpx.get(f"{mesh.url}/metrics", headers=mesh.headers).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:prefix_cache_hits_total"))


def _chat_prompt_ids(model_dir: Path, messages: list[dict]) -> list[int]:
    """The token ids the mesh's chat template makes of messages (its tokenizer, as the coordinator renders it)."""
    from stratamesh.coordinator.text import Tokenizer

    return Tokenizer.from_dir(model_dir).encode_chat(messages, True, None)


async def _stage_info(mesh: LocalMesh, address: str) -> pb.StageInfo:
    async with mesh.channel(address) as channel:
        return await pb_grpc.StageStub(channel).Info(pb.StageInfoRequest(), timeout=10)


def test_each_stage_holds_only_its_own_layers(llama_mesh: LocalMesh) -> None:
    infos = [asyncio.run(_stage_info(llama_mesh, a)) for a in llama_mesh.agent_addresses]
    ranges = []
    for info in infos:
        (assignment,) = info.assignments
        start, end = assignment.stage.start_layer, assignment.stage.end_layer
        ranges.append((start, end))
        layers = {int(name.split(".")[2]) for name in info.tensor_names if name.startswith("model.layers.")}
        assert layers == set(range(start, end))
        assert ("model.embed_tokens.weight" in info.tensor_names) == (start == 0)
        assert ("model.norm.weight" in info.tensor_names) == (end == NUM_LAYERS)
    ranges.sort()   # the planner sizes them; together they tile the model, one range per agent
    assert len(ranges) == 3 and ranges[0][0] == 0 and ranges[-1][1] == NUM_LAYERS
    assert all(a[1] == b[0] and a[0] < a[1] for a, b in zip(ranges, ranges[1:]))


def _error(response: httpx.Response) -> dict:
    body = response.json()
    assert set(body["error"]) >= {"message", "type", "param", "code"}, body
    return body["error"]


def test_bad_requests_get_4xx_while_a_generation_completes(llama_mesh: LocalMesh, tiny_models) -> None:
    model_dir = tiny_models["llama"]
    prompt_ids = encode(model_dir, PROMPT)
    expected = greedy_tokens(model_dir, prompt_ids, 96)
    result: list[list[int]] = []
    runner = threading.Thread(target=lambda: result.append(
        complete_ids(llama_mesh, model_dir, prompt_ids, 96)))
    runner.start()
    url = f"{llama_mesh.url}/v1/completions"
    good = {"model": model_dir.name, "prompt": "hello", "max_tokens": 4}
    cases = [
        ({**good, "model": "no-such-model"}, 404),
        ({**good, "max_tokens": -1}, 400),
        ({**good, "prompt": list(range(1, 10)) * 300}, 400),   # 2700 tokens > 2048 context
        ({**good, "temperature": -1}, 400),
    ]
    for body, status in cases:
        response = httpx.post(url, json=body, timeout=30, headers=llama_mesh.headers)
        assert response.status_code == status, (body, response.text)
        _error(response)
    malformed = httpx.post(url, content=b'{"model": "x", "prompt": ', timeout=30,
                           headers={"Content-Type": "application/json", **llama_mesh.headers})
    assert malformed.status_code == 400
    _error(malformed)
    runner.join(timeout=120)
    assert result == [expected]


def test_coordinator_restart_keeps_model_and_agents(tiny_models, tmp_path: Path) -> None:
    model_dir = tiny_models["llama"]
    prompt_ids = encode(model_dir, PROMPT)
    with start_mesh(model_dir, tmp_path) as mesh:
        before = complete_ids(mesh, model_dir, prompt_ids, 16)
        mesh.stop_coordinator()
        registry = Registry(str(tmp_path / "registry.db"))
        assert [m.model_id for m in registry.models()] == [model_dir.name]
        assert len(registry.agents()) == 3
        registry.close()
        mesh.start_coordinator(deploy=False)   # the model comes from the registry alone
        mesh.wait_ready(60)
        assert mesh.health()["num_agents"] == 3
        assert complete_ids(mesh, model_dir, prompt_ids, 16) == before


def test_a_long_prompt_is_prefilled_in_chunks_and_still_matches(llama_mesh: LocalMesh, tiny_models) -> None:
    model_dir = tiny_models["llama"]
    prompt_ids = encode(model_dir, " ".join([PROMPT] * 60))[:1200]
    assert len(prompt_ids) > 2 * 512           # three chunks of at most 512 tokens on every hop
    assert complete_ids(llama_mesh, model_dir, prompt_ids, 8) == greedy_tokens(model_dir, prompt_ids, 8)


def _completion(mesh: LocalMesh, body: dict) -> dict:
    response = httpx.post(f"{mesh.url}/v1/completions", json=body, timeout=120, headers=mesh.headers)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


def test_seeded_sampling_reproduces_and_stop_strings_cut(llama_mesh: LocalMesh, tiny_models) -> None:
    body = {"model": tiny_models["llama"].name, "prompt": PROMPT, "max_tokens": 24, "temperature": 0.9,
            "top_p": 0.95, "top_k": 50, "ignore_eos": True, "return_token_ids": True}
    first, again = _completion(llama_mesh, {**body, "seed": 7}), _completion(llama_mesh, {**body, "seed": 7})
    other = _completion(llama_mesh, {**body, "seed": 8})
    assert first["token_ids"] == again["token_ids"] and len(first["token_ids"]) == 24
    assert other["token_ids"] != first["token_ids"]
    text = first["text"]
    stop = text[len(text) // 2: len(text) // 2 + 3]
    cut = _completion(llama_mesh, {**body, "seed": 7, "stop": [stop]})
    assert cut["finish_reason"] == "stop" and cut["text"] == text[:text.index(stop)]


def test_agents_can_dial_a_given_coordinator_address(tiny_models, tmp_path: Path) -> None:
    model_dir = tiny_models["qwen2"]
    prompt_ids = encode(model_dir, PROMPT)
    mesh = LocalMesh(str(model_dir), num_agents=2, use_zeroconf=False, log_dir=str(tmp_path / "logs"),
                     db=str(tmp_path / "registry.db"))
    with mesh:
        assert complete_ids(mesh, model_dir, prompt_ids, 16) == greedy_tokens(model_dir, prompt_ids, 16)


def test_the_openai_clients_responses_are_the_chat_apis_answers(llama_mesh: LocalMesh, tiny_models) -> None:
    """OpenAI's client against /v1/responses: created and streamed, the chat API's greedy answer to the same
    conversation (the instructions its system message), with its usage and status."""
    model = tiny_models["llama"].name
    client = openai.OpenAI(base_url=f"{llama_mesh.url}/v1", api_key=llama_mesh.api_key, timeout=120)
    asked = dict(model=model, instructions="Answer briefly.", input="Where do the layers live?", max_output_tokens=16,
                 temperature=0)
    response = client.responses.create(**asked)
    chat = client.chat.completions.create(model=model, max_tokens=16, temperature=0, messages=[
        {"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Where do the layers live?"}])
    assert response.output_text and response.output_text == chat.choices[0].message.content
    assert (response.usage.input_tokens, response.usage.output_tokens) == (chat.usage.prompt_tokens,
                                                                           chat.usage.completion_tokens)
    assert response.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    events = list(client.responses.create(**asked, stream=True))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == response.output_text
    assert events[-1].response.output_text == response.output_text and events[-1].response.status == response.status
