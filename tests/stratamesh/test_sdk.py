"""The SDK against a real local mesh: a coordinator and 2 agents started by Mesh.local."""

from __future__ import annotations

import asyncio
import json
import os
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from tokenizers import Tokenizer

from stratamesh import (
    AsyncMesh,
    BadRequestError,
    ChatChunk,
    EmbeddingsNotSupportedError,
    Mesh,
    MeshConnectionError,
    Message,
    NotFoundError,
)

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "Where do the layers of the model live?"}]
PROMPT = "The mesh carries every layer of the model from the edge to the cloud"


@pytest.fixture(scope="module")
def model_dir(tiny_model: Callable[..., Path]) -> Path:
    return tiny_model()


@pytest.fixture(scope="module")
def mesh(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    with Mesh.local(model_dir, agents=2, log_dir=str(tmp_path_factory.mktemp("sdk-mesh"))) as mesh:
        yield mesh


def api_key(mesh: Mesh) -> str:
    """The operator key of the mesh Mesh.local started, for a second client of it."""
    assert mesh.local_mesh is not None
    return mesh.local_mesh.api_key


def num_running(mesh: Mesh) -> float:
    """The coordinator's vllm:num_requests_running gauge."""
    text = httpx.get(f"{mesh.url}/metrics", timeout=10).text
    return sum(float(v) for v in re.findall(r"^vllm:num_requests_running(?:\{[^}]*\})? (\S+)$", text, re.M))


def wait_idle(mesh: Mesh, within_s: float) -> float:
    """Seconds until the coordinator runs no generation; fails after within_s."""
    start = time.monotonic()
    while num_running(mesh) > 0:
        assert time.monotonic() - start < within_s, "a generation kept running after its stream was closed"
        time.sleep(0.1)
    return time.monotonic() - start


def test_streamed_chat_equals_the_whole_answer(mesh: Mesh) -> None:
    whole = mesh.chat(QUESTION, max_tokens=24)
    with mesh.chat(QUESTION, max_tokens=24, stream=True) as stream:
        chunks = list(stream)
    assert stream.closed
    assert whole.content and whole.message == Message("assistant", whole.content)
    assert "".join(c.content for c in chunks) == whole.content
    assert whole.finish_reason == "length" and [c.finish_reason for c in chunks if c.finish_reason] == ["length"]
    assert whole.usage is not None and whole.usage.completion_tokens == 24
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 24
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens > 0


def test_streamed_generate_equals_the_whole_completion(mesh: Mesh, model_dir: Path) -> None:
    whole = mesh.generate(PROMPT, max_tokens=16)
    chunks = list(mesh.generate(PROMPT, max_tokens=16, stream=True))
    assert whole.text and "".join(c.text for c in chunks) == whole.text
    assert whole.model == model_dir.name and whole.id.startswith("cmpl-")
    num_prompt_tokens = len(Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode(PROMPT).ids)
    assert whole.usage is not None
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (num_prompt_tokens, 16)
    assert whole.usage.total_tokens == num_prompt_tokens + 16
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 16


def test_a_repeated_prompt_reports_cached_tokens(mesh: Mesh) -> None:
    prompt = "cached " * 40  # several KV blocks
    first = mesh.generate(prompt, max_tokens=2)
    second = mesh.generate(prompt, max_tokens=2)
    assert first.usage is not None and second.usage is not None
    assert 0 < second.usage.cached_tokens < second.usage.prompt_tokens
    assert second.text == first.text


def test_sampling_options_reach_the_server(mesh: Mesh) -> None:
    seeded = [mesh.generate(PROMPT, max_tokens=12, temperature=1.0, top_k=20, top_p=0.9, seed=7).text
              for _ in range(2)]
    assert seeded[0] == seeded[1] != mesh.generate(PROMPT, max_tokens=12).text
    greedy = mesh.generate(PROMPT, max_tokens=12).text
    stop = next(word for word in greedy.split()[1:] if word.isascii() and word.isalpha())
    cut = mesh.generate(PROMPT, max_tokens=12, stop=[stop])
    assert cut.finish_reason == "stop" and greedy.startswith(cut.text) and stop not in cut.text


def test_penalties_bias_and_logprobs_reach_the_server_and_come_back_typed(mesh: Mesh) -> None:
    greedy = mesh.generate(PROMPT, max_tokens=6, logprobs=2)
    assert greedy.logprobs is not None and len(greedy.logprobs) == 6
    assert "".join(t.token for t in greedy.logprobs) == greedy.text
    assert all(t.logprob is not None and t.logprob <= 0 and len(t.top) >= 2 for t in greedy.logprobs)
    first = max(greedy.logprobs[0].top, key=greedy.logprobs[0].top.get)
    assert first == greedy.logprobs[0].token                     # greedy: the likeliest, as its logprobs say
    penalized = mesh.generate(PROMPT, max_tokens=6, frequency_penalty=2.0, presence_penalty=1.0,
                              repetition_penalty=1.5, min_p=0.05, min_tokens=2, logit_bias={5: -100})
    assert penalized.usage is not None and penalized.usage.completion_tokens == 6
    chat = mesh.chat(QUESTION, max_tokens=4, logprobs=3)
    assert chat.logprobs is not None and len(chat.logprobs) == 4 and all(len(t.top) == 3 for t in chat.logprobs)
    streamed = [t for c in mesh.chat(QUESTION, max_tokens=4, logprobs=3, stream=True) for t in c.logprobs or ()]
    assert [t.logprob for t in streamed] == [t.logprob for t in chat.logprobs]
    with pytest.raises(TypeError, match="'top_q'"):
        mesh.generate(PROMPT, top_q=0.5)


def test_choices_structured_output_and_tool_calls_come_back_typed(mesh: Mesh) -> None:
    both = mesh.generate(PROMPT, max_tokens=6, n=2, temperature=1.0, seed=3)
    assert len(both.choices) == 2 and both.text == both.choices[0].text and both.usage.completion_tokens == 12
    streamed = {c.index for c in mesh.generate(PROMPT, max_tokens=4, n=2, stream=True) if c.text}
    assert streamed == {0, 1}
    picked = mesh.generate(PROMPT, max_tokens=8, guided_choice=["edge", "cloud"], temperature=1.0, seed=1)
    assert picked.text in ("edge", "cloud")
    as_json = mesh.chat(QUESTION, max_tokens=60, temperature=1.0, seed=1, response_format={
        "type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "object", "properties": {
            "layers": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["layers"],
            "additionalProperties": False}}})
    assert 0 <= json.loads(as_json.content)["layers"] <= 99
    tool = {"type": "function", "function": {"name": "where", "parameters": {"type": "object", "properties": {
        "site": {"enum": ["edge", "cloud"]}}, "required": ["site"], "additionalProperties": False}}}
    called = mesh.chat(QUESTION, max_tokens=60, tools=[tool], tool_choice="required", parallel_tool_calls=False)
    (call,) = called.tool_calls
    assert called.finish_reason == "tool_calls" and call.name == "where" and call.args["site"] in ("edge", "cloud")
    chunks = list(mesh.chat(QUESTION, max_tokens=60, tools=[tool], tool_choice="required", parallel_tool_calls=False,
                            stream=True))
    assert [(c.name, c.arguments) for chunk in chunks for c in chunk.tool_calls] == [(call.name, call.arguments)]
    answered = [*QUESTION, called.message, {"role": "tool", "tool_call_id": call.id, "content": "edge"}]
    followed = mesh.chat(answered, max_tokens=4, tools=[tool])      # the call and its result in the prompt
    assert followed.usage.prompt_tokens > called.usage.prompt_tokens + len(call.arguments) // 4


def test_messages_may_be_dataclasses(mesh: Mesh) -> None:
    as_dicts = mesh.chat(QUESTION, max_tokens=8)
    as_messages = mesh.chat([Message("user", QUESTION[0]["content"])], max_tokens=8)
    assert as_messages.content == as_dicts.content


async def test_async_client_gives_the_same_answers(mesh: Mesh) -> None:
    expected = mesh.chat(QUESTION, max_tokens=20).content
    async with AsyncMesh(mesh.url, api_key=api_key(mesh)) as client:
        whole = await client.chat(QUESTION, max_tokens=20)
        stream = await client.chat(QUESTION, max_tokens=20, stream=True)
        async with stream:
            chunks: list[ChatChunk] = [chunk async for chunk in stream]
        completion = await client.generate(PROMPT, max_tokens=10)
        pieces = [c.text async for c in await client.generate(PROMPT, max_tokens=10, stream=True)]
        models = await client.models()
        agents = await client.agents()
    assert whole.content == expected == "".join(c.content for c in chunks)
    assert stream.closed and chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 20
    assert completion.text == mesh.generate(PROMPT, max_tokens=10).text == "".join(pieces)
    assert [m.id for m in models] == [m.id for m in mesh.models()] and len(agents) == 2


def test_models_and_agents(mesh: Mesh, model_dir: Path) -> None:
    (model,) = mesh.models()
    assert (model.id, model.max_context, model.ready, model.task) == (model_dir.name, 2048, True, "generate")
    assert model.created > 1_600_000_000
    agents = mesh.agents()
    assert mesh.local_mesh is not None
    assert sorted(a.address for a in agents) == sorted(mesh.local_mesh.agent_addresses)
    assert sorted(a.name for a in agents) == ["agent0", "agent1"]
    for agent in agents:
        assert agent.state == "connected" and agent.agent_id in mesh.local_mesh.agent_ids
        assert agent.num_cpus == os.cpu_count() and agent.ram_total_bytes > 2**20
        assert agent.tier == "edge" and agent.num_ranks == 1 and agent.gpus == ()
        assert agent.queue_depth is not None and agent.queue_depth >= 0 and agent.tokens_per_s is not None


def test_server_errors_become_exceptions(mesh: Mesh) -> None:
    with pytest.raises(NotFoundError) as unknown:
        mesh.chat(QUESTION, model="no-such-model")
    assert unknown.value.status_code == 404 and unknown.value.code == "model_not_found"
    assert unknown.value.message == "The model `no-such-model` does not exist."
    with pytest.raises(NotFoundError):
        mesh.generate(PROMPT, model="no-such-model", stream=True)  # raised by the call, before any chunk
    with pytest.raises(BadRequestError) as cold:
        mesh.generate(PROMPT, temperature=-1)
    assert cold.value.status_code == 400 and cold.value.param == "temperature"
    with pytest.raises(BadRequestError) as long:
        mesh.chat(QUESTION, max_tokens=5000, stream=True)
    assert long.value.code == "context_length_exceeded" and "2048" in long.value.message


def test_embed_raises_a_clear_error(mesh: Mesh, model_dir: Path) -> None:
    with pytest.raises(EmbeddingsNotSupportedError, match=f"'{model_dir.name}' .*serves no embeddings") as info:
        mesh.embed(["a sentence"])
    assert isinstance(info.value, BadRequestError) and info.value.status_code == 400
    assert info.value.code == "model_not_embedding"
    with pytest.raises(NotFoundError) as unknown:
        mesh.embed("a sentence", model="no-such-model")
    assert not isinstance(unknown.value, EmbeddingsNotSupportedError) and unknown.value.code == "model_not_found"


async def test_async_errors(mesh: Mesh) -> None:
    async with AsyncMesh(mesh.url, api_key=api_key(mesh)) as client:
        with pytest.raises(NotFoundError, match="does not exist"):
            await client.generate(PROMPT, model="no-such-model", stream=True)
        with pytest.raises(BadRequestError):
            await client.chat(QUESTION, top_p=0)
        with pytest.raises(EmbeddingsNotSupportedError):
            await client.embed("a sentence")


def test_leaving_a_stream_early_stops_the_generation(mesh: Mesh) -> None:
    with mesh.generate(PROMPT, max_tokens=1500, stream=True) as stream:
        first = [next(stream) for _ in range(3)]
        assert num_running(mesh) == 1
    assert stream.closed and all(c.text and c.finish_reason is None for c in first)
    wait_idle(mesh, within_s=5.0)   # all 1500 tokens take over 15 s here
    for chunk in mesh.chat(QUESTION, max_tokens=1500, stream=True):
        break                       # no with: the stream closes when it is dropped
    wait_idle(mesh, within_s=5.0)
    assert mesh.chat(QUESTION, max_tokens=4).usage.completion_tokens == 4


async def test_leaving_an_async_stream_early_stops_the_generation(mesh: Mesh) -> None:
    async with AsyncMesh(mesh.url, api_key=api_key(mesh)) as client:
        async with await client.chat(QUESTION, max_tokens=1500, stream=True) as stream:
            async for chunk in stream:
                if chunk.content:
                    break
        assert stream.closed
        await _wait_idle_async(mesh, within_s=5.0)
        assert (await client.generate(PROMPT, max_tokens=3)).usage.completion_tokens == 3


async def _wait_idle_async(mesh: Mesh, within_s: float) -> None:
    await asyncio.to_thread(wait_idle, mesh, within_s)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_local_mesh_stops_its_processes_on_an_exception(model_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="boom"), Mesh.local(model_dir, agents=1, log_dir=str(tmp_path)) as mesh:
        assert mesh.local_mesh is not None and mesh.local_mesh.coordinator is not None
        pids = [mesh.local_mesh.coordinator.pid, *(p.pid for p in mesh.local_mesh.agents)]
        url, key = mesh.url, api_key(mesh)
        assert len(pids) == 2 and all(_alive(pid) for pid in pids)
        assert mesh.generate(PROMPT, max_tokens=3).usage.completion_tokens == 3
        raise RuntimeError("boom")
    assert not any(_alive(pid) for pid in pids)
    assert (tmp_path / "coordinator.log").exists()        # a log folder the caller gave is kept
    with Mesh(url, api_key=key) as client, pytest.raises(MeshConnectionError):
        client.models()


async def test_async_local_mesh(model_dir: Path) -> None:
    async with AsyncMesh.local(model_dir, agents=1) as client:
        assert client.local_mesh is not None and client.local_mesh.coordinator is not None
        pids = [client.local_mesh.coordinator.pid, *(p.pid for p in client.local_mesh.agents)]
        logs = Path(client.local_mesh.log_dir)
        assert (logs / "coordinator.log").exists()
        reply = await client.chat(QUESTION, max_tokens=5)
        assert reply.usage is not None and reply.usage.completion_tokens == 5 and reply.content
        assert [a.state for a in await client.agents()] == ["connected"]
    assert len(pids) == 2 and not any(_alive(pid) for pid in pids)
    assert not logs.exists()                               # a folder of its own is removed
