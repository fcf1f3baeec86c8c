"""Embedding models on the data plane: stages over real gRPC return the pooled vector instead of a token, to a
real origin; sessions batch, prefill in chunks, end after their prompt, and give their KV blocks back."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Collection, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from stratamesh.agent.dataplane import StageService
from stratamesh.agent.engine.stage_engine import EngineConfig
from stratamesh.agent.stages import StageHost
from stratamesh.coordinator.serving.attempt import Run, chunk_tokens
from stratamesh.coordinator.serving.generation import Embedding, RouteSource
from stratamesh.coordinator.serving.records import RequestLog
from stratamesh.coordinator.serving.servicer import OriginService
from stratamesh.coordinator.serving.sessions import SessionTable
from stratamesh.fleet.errors import StageFailed
from stratamesh.fleet.sessions import Hop, SamplingParams, SessionClose, SessionOpen, StepChunk
from stratamesh.fleet.stages import Assignment, StageSpec
from stratamesh.fleet.wire import mesh_pb2_grpc as pb_grpc
from stratamesh.fleet.wire.channels import bind, make_server
from tests.agent.test_dataplane import send, serving
from tests.kernels.test_embedding_model import POOLED_ATOL, hf_pooled

NUM_LAYERS = 6
BLOCK_SIZE = 4
BLOCK_BYTES = 3 * 2 * BLOCK_SIZE * 2 * 64 * 4   # a stage of 3 layers: K and V of 4 tokens, 2 KV heads of 64, fp32


@dataclass
class TwoStages:
    """Layers [0, 3) and [3, 6) on two Stage services, and an origin (the coordinator's) they deliver to."""

    hosts: list[StageHost]
    route: list[Hop]
    origin: str             # where the last stage delivers: the session table's Origin service
    sessions: SessionTable
    log: RequestLog

    async def routes(self, avoid: Collection[str], token_ids: Sequence[int]) -> tuple[list[Hop], int]:
        return self.route, BLOCK_SIZE

    async def embed(self, prompt: list[int], request_id: str, routes: RouteSource | None = None) -> tuple[float, ...]:
        run = Run(self.sessions, self.log, self.origin, self.log.begin(request_id, len(prompt)), SamplingParams(),
                  chunk_tokens(256))
        return await Embedding(run, routes or self.routes, prompt, on_unreachable=lambda address: None).vector()

    def num_free_blocks(self) -> list[int]:
        return [e.scheduler.block_manager.num_free_blocks for h in self.hosts for e in h.engines.values()]

    def num_blocks(self) -> list[int]:
        return [e.runner.num_blocks for h in self.hosts for e in h.engines.values()]


@asynccontextmanager
async def two_stages(model_dir: Path, kv_cache_bytes: int) -> AsyncIterator[TwoStages]:
    servers, hosts, services, route = [], [], [], []
    for i, (start, end) in enumerate(((0, 3), (3, NUM_LAYERS))):
        spec = StageSpec("emb", str(model_dir), start, end, NUM_LAYERS, kv_block_size=BLOCK_SIZE)
        host = StageHost(EngineConfig(kv_cache_bytes=kv_cache_bytes, max_batch_tokens=256))
        await host.load(Assignment(f"a{i}", spec))
        service, server = StageService(host, f"agent-{i}"), make_server()
        pb_grpc.add_StageServicer_to_server(service, server)
        route.append(Hop(f"127.0.0.1:{bind(server, '127.0.0.1', 0)}", f"a{i}"))
        await server.start()
        service.start()
        servers.append(server), hosts.append(host), services.append(service)
    origin_server, sessions = make_server(), SessionTable(step_timeout_s=20)
    origin = f"127.0.0.1:{bind(origin_server, '127.0.0.1', 0)}"
    pb_grpc.add_OriginServicer_to_server(OriginService(sessions), origin_server)
    await origin_server.start()
    try:
        yield TwoStages(hosts, route, origin, sessions, RequestLog())
    finally:
        await sessions.close()
        for service in services:
            await service.close()
        for server in [*servers, origin_server]:
            await server.stop(grace=None)
        for host in hosts:
            host.close()


def prompt(seed: int, length: int) -> list[int]:
    return torch.randint(3, 700, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


async def settle(predicate, timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.02)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from stratamesh.kernels.tiny_model import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny-emb"), embedding=True)


async def test_concurrent_embeddings_over_two_stages_equal_transformers_and_free_their_blocks(model_dir) -> None:
    """Three prompts at once (one of 600 tokens: prefilled in chunks of at most 256 per step)."""
    prompts = [prompt(1, 40), prompt(2, 600), prompt(3, 7)]
    async with two_stages(model_dir, kv_cache_bytes=400 * BLOCK_BYTES) as mesh:
        vectors = await asyncio.gather(*(mesh.embed(p, f"r{i}") for i, p in enumerate(prompts)))
        for p, vector in zip(prompts, vectors, strict=True):
            assert len(vector) == 256
            torch.testing.assert_close(torch.tensor(vector), hf_pooled(model_dir, torch.tensor(p)),
                                       atol=POOLED_ATOL, rtol=0)
        await settle(lambda: sum(h.num_sessions for h in mesh.hosts) == 0)
        assert mesh.num_free_blocks() == mesh.num_blocks()     # every block back (full ones stay cached)
        records = [mesh.log.recent[f"r{i}"] for i in range(3)]
        assert [r.state for r in records] == ["finished"] * 3 and [r.num_tokens for r in records] == [0] * 3
        again = await mesh.embed(prompts[0], "r-again")          # its prefix comes from the cache: the same vector
        assert mesh.log.recent["r-again"].cached_tokens == 36
        torch.testing.assert_close(torch.tensor(again), torch.tensor(vectors[0]), atol=1e-6, rtol=0)


async def test_more_prompts_than_the_kv_cache_holds_wait_for_blocks_and_stay_exact(model_dir) -> None:
    """A cache of 24 blocks per stage holds two 40-token prompts (10 blocks each) at a time, not six."""
    prompts = [prompt(10 + i, 40) for i in range(6)]
    async with two_stages(model_dir, kv_cache_bytes=24 * BLOCK_BYTES) as mesh:
        assert mesh.num_blocks() == [24, 24]
        vectors = await asyncio.gather(*(mesh.embed(p, f"r{i}") for i, p in enumerate(prompts)))
        for p, vector in zip(prompts, vectors, strict=True):
            torch.testing.assert_close(torch.tensor(vector), hf_pooled(model_dir, torch.tensor(p)),
                                       atol=POOLED_ATOL, rtol=0)
        await settle(lambda: sum(h.num_sessions for h in mesh.hosts) == 0)
        assert mesh.num_free_blocks() == [24, 24]


async def test_a_bad_prompt_fails_at_once_and_alone(model_dir) -> None:
    async with two_stages(model_dir, kv_cache_bytes=100 * BLOCK_BYTES) as mesh:
        bad = mesh.embed([5, 99_999], "bad")        # outside the vocabulary: the first stage refuses the open
        good = mesh.embed(prompt(4, 20), "good")
        started = asyncio.get_running_loop().time()
        results = await asyncio.gather(bad, good, return_exceptions=True)
        assert asyncio.get_running_loop().time() - started < 5     # told by the stage, not by the step timeout
        assert isinstance(results[0], StageFailed) and "prompt_token_ids must lie in [0, 1024)" in str(results[0])
        assert len(results[1]) == 256 and mesh.log.recent["bad"].state == "failed"
        await settle(lambda: sum(h.num_sessions for h in mesh.hosts) == 0)


async def test_an_embedding_whose_first_stage_is_unreachable_replays_on_the_next_route(model_dir) -> None:
    async with two_stages(model_dir, kv_cache_bytes=100 * BLOCK_BYTES) as mesh:
        asked: list[frozenset[str]] = []
        dead = [Hop("127.0.0.1:1", "gone"), mesh.route[1]]

        async def routes(avoid: Collection[str], token_ids: Sequence[int]) -> tuple[list[Hop], int]:
            asked.append(frozenset(avoid))
            return (mesh.route if "127.0.0.1:1" in avoid else dead), BLOCK_SIZE

        ids = prompt(6, 30)
        vector = await mesh.embed(ids, "r", routes)
        torch.testing.assert_close(torch.tensor(vector), hf_pooled(model_dir, torch.tensor(ids)),
                                   atol=POOLED_ATOL, rtol=0)
        assert asked == [frozenset(), frozenset({"127.0.0.1:1"})]
        record = mesh.log.recent["r"]
        assert record.num_failovers == 1 and record.state == "finished" and record.route == tuple(mesh.route)


async def test_the_last_stage_answers_the_prompts_last_chunk_with_its_vector_and_waits_for_no_decode(
        model_dir) -> None:
    spec = StageSpec("emb", str(model_dir), 0, NUM_LAYERS, NUM_LAYERS, kv_block_size=BLOCK_SIZE)
    async with serving(spec, "a0", "agent-under-test") as (host, service, origin, address, stream):
        ids = prompt(5, 30)
        send(stream, SessionOpen("s", "a0", (), address, SamplingParams(), prompt_token_ids=tuple(ids)))
        send(stream, StepChunk("s", 0, 0, tuple(ids[:16]), sample=False))
        send(stream, StepChunk("s", 1, 16, tuple(ids[16:]), sample=True))
        assert (await origin.next("s")).opened
        event = await origin.next("s")
        assert not event.error and event.token_id == -1 and event.step == 1
        assert list(event.embedding.shape) == [256] and event.embedding.dtype == "float32"
        engine = host.engine("a0")
        # the scheduler alone would wait for this session's next token; the engine knows none is coming
        assert engine.scheduler.wants_more_decodes() and not engine.wants_more_decodes()
        send(stream, SessionClose("s"))
        await settle(lambda: host.num_sessions == 0)
        assert engine.scheduler.block_manager.num_free_blocks == engine.runner.num_blocks
