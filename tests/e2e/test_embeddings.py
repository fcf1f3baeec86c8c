"""An embedding model served by a 2-stage mesh: /v1/embeddings, the SDK and the openai client give transformers'
vectors; the text endpoints refuse it; bad inputs get a 400 and the mesh serves on; the stages keep nothing."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModel, AutoTokenizer

from stratamesh import Mesh
from stratamesh.launcher import LocalMesh
from stratamesh.fleet.wire import mesh_pb2 as pb
from stratamesh.fleet.wire import mesh_pb2_grpc as pb_grpc

from .conftest import start_mesh

pytestmark = pytest.mark.slow

MIN_COSINE = 0.99999
MAX_ABS_DIFF = 1e-4
TEXTS = ["The mesh carries every layer of the model from the edge to the cloud and back",
         "Embeddings",
         " ".join(["a long input, prefilled in chunks of at most 512 tokens by the origin"] * 60)]


@pytest.fixture(scope="module")
def mesh(tiny_embedding_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalMesh]:
    with start_mesh(tiny_embedding_model, tmp_path_factory.mktemp("embed-mesh"), num_agents=2) as mesh:
        yield mesh


def reference(model_dir: Path, texts: list[str]) -> tuple[torch.Tensor, list[int]]:
    """transformers' AutoModel: the last token's last_hidden_state (after the final norm), L2-normalized, of each
    text on its own; and the texts' token counts."""
    model, tokenizer = AutoModel.from_pretrained(model_dir).eval(), AutoTokenizer.from_pretrained(model_dir)
    vectors, counts = [], []
    with torch.inference_mode():
        for text in texts:
            ids = tokenizer(text, return_tensors="pt")["input_ids"]
            vectors.append(F.normalize(model(ids).last_hidden_state[0, -1], dim=-1))
            counts.append(ids.shape[1])
    return torch.stack(vectors), counts


def assert_close_to(got: list[list[float]], expected: torch.Tensor) -> None:
    got_t = torch.tensor(got, dtype=torch.float32)
    assert got_t.shape == expected.shape
    cosine = F.cosine_similarity(got_t, expected, dim=-1)
    max_diff = float((got_t - expected).abs().max())
    print(f"\nvs transformers: min cosine {float(cosine.min()):.8f}, max |diff| {max_diff:.2e}")
    assert float(cosine.min()) > MIN_COSINE and max_diff < MAX_ABS_DIFF


def stage_infos(mesh: LocalMesh) -> list[pb.StageInfo]:
    async def info(address: str) -> pb.StageInfo:
        async with mesh.channel(address) as channel:
            return await pb_grpc.StageStub(channel).Info(pb.StageInfoRequest(), timeout=10)

    return [asyncio.run(info(a)) for a in mesh.agent_addresses]


def test_embeddings_over_two_stages_equal_transformers(mesh: LocalMesh, tiny_embedding_model: Path) -> None:
    expected, counts = reference(tiny_embedding_model, TEXTS)
    assert counts[2] > 512     # the long one is prefilled in two chunks
    model = tiny_embedding_model.name
    response = httpx.post(f"{mesh.url}/v1/embeddings", json={"model": model, "input": TEXTS}, timeout=120,
                          headers=mesh.headers)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "list" and body["model"] == model
    assert [(d["object"], d["index"]) for d in body["data"]] == [("embedding", i) for i in range(3)]
    assert body["usage"] == {"prompt_tokens": sum(counts), "total_tokens": sum(counts)}
    assert_close_to([d["embedding"] for d in body["data"]], expected)
    assert float(expected[0] @ expected[1]) < 0.9     # the texts' vectors differ: a mix-up would show

    with Mesh(mesh.url, api_key=mesh.api_key) as sdk:      # the mesh serves one model: model= may be left out
        assert [m.task for m in sdk.models()] == ["embed"]
        assert_close_to(sdk.embed(TEXTS), expected)
    client = openai.OpenAI(base_url=f"{mesh.url}/v1", api_key=mesh.api_key)    # it asks for base64
    assert_close_to([d.embedding for d in client.embeddings.create(model=model, input=TEXTS).data], expected)
    models = httpx.get(f"{mesh.url}/v1/models", timeout=30, headers=mesh.headers).json()["data"]
    assert [(m["id"], m["task"]) for m in models] == [(model, "embed")]
    infos = stage_infos(mesh)
    ranges = sorted((i.assignments[0].stage.start_layer, i.assignments[0].stage.end_layer) for i in infos)
    assert len(ranges) == 2 and ranges[0][0] == 0 and ranges[0][1] == ranges[1][0] and ranges[1][1] == 6
    assert [i.num_sessions for i in infos] == [0, 0]      # every session ended on both stages
    assert not any("lm_head" in name for i in infos for name in i.tensor_names)


def test_bad_input_gets_a_400_and_the_mesh_serves_on(mesh: LocalMesh, tiny_embedding_model: Path) -> None:
    model, url = tiny_embedding_model.name, mesh.url
    cases = [
        ("/v1/embeddings", {"model": model, "input": ""}, "input", None),
        ("/v1/embeddings", {"model": model, "input": [5, 1_000_000]}, "input", None),
        ("/v1/embeddings", {"model": model, "input": [[5, 6], []]}, "input", None),
        ("/v1/embeddings", {"model": model, "input": list(range(3, 700)) * 4}, "input", "context_length_exceeded"),
        ("/v1/completions", {"model": model, "prompt": "hello", "max_tokens": 4}, "model", "model_not_generative"),
        ("/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": "hi"}]}, "model",
         "model_not_generative"),
    ]
    for path, body, param, code in cases:
        response = httpx.post(f"{url}{path}", json=body, timeout=30, headers=mesh.headers)
        assert response.status_code == 400, (body, response.text)
        error = response.json()["error"]
        assert (error["param"], error["code"]) == (param, code), error
    expected, _ = reference(tiny_embedding_model, TEXTS[:1])
    with Mesh(url, api_key=mesh.api_key) as sdk:
        assert_close_to(sdk.embed(TEXTS[0], model=model), expected)
