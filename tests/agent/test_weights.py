"""Weights delivered to an agent over real gRPC on loopback: the coordinator's manifest and Weights service, peers
asked first, corrupt chunks fetched again, an interrupted fetch resumed from the copy on disk."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import grpc
import pytest
import torch

from stratamesh.agent.weights import WeightFetcher, WeightsUnavailable
from stratamesh.coordinator.control.servicer import ControlService
from stratamesh.coordinator.weights import ModelWeights
from stratamesh.fleet.stages import StageSpec
from stratamesh.fleet.weight_service import MAX_CHUNKS_PER_FETCH, WeightsService
from stratamesh.fleet.weight_files import ModelFiles, read_verified
from stratamesh.fleet.weights import WeightChunk, WeightsProgress
from stratamesh.fleet.wire import convert
from stratamesh.fleet.wire import mesh_pb2 as pb
from stratamesh.fleet.wire import mesh_pb2_grpc as pb_grpc
from stratamesh.fleet.wire.channels import bind, make_channel, make_server
from stratamesh.kernels.models.checkpoint import stage_tensor_names
from stratamesh.kernels.models.config import read_config
from stratamesh.kernels.models.decoder import load_stage
from stratamesh.fleet.gguf_files import GgufModel
from tests.fleet.test_weight_files import stored_bytes
from tests.gguf_writer import write_gguf

CHUNK = 256 * 1024


class CountingWeights(WeightsService):
    """The Weights service, counting the chunks it sends; it can corrupt the first few full chunks of tensors, or
    drop the call after some, every call."""

    def __init__(self, roots, corrupt: int = 0, die_after: int | None = None) -> None:
        super().__init__(roots)
        self.num_sent, self.corrupt, self.die_after = 0, corrupt, die_after

    async def Fetch(self, request: pb.WeightFetch, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.WeightData]:
        num_sent = 0
        async for message in super().Fetch(request, context):
            if num_sent == self.die_after:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "the source went away")
            if not message.missing:
                num_sent += 1
                self.num_sent += 1
                if self.corrupt and request.chunks[message.index].length == CHUNK:
                    self.corrupt -= 1
                    message.data = bytes([message.data[0] ^ 0xFF]) + message.data[1:]
            yield message


async def serve(*servicers) -> tuple[str, grpc.aio.Server]:
    server = make_server()
    for servicer in servicers:
        if isinstance(servicer, ControlService):
            pb_grpc.add_ControlServicer_to_server(servicer, server)
        else:
            pb_grpc.add_WeightsServicer_to_server(servicer, server)
    address = f"127.0.0.1:{bind(server, '127.0.0.1', 0)}"
    await server.start()
    return address, server


class Mesh:
    """A coordinator serving one model's manifest and chunks, and the channel an agent's control stream uses."""

    def __init__(self, model_dir: Path, sources: list[str] | None = None, **weights_kwargs) -> None:
        self.model_dir = model_dir
        self.weights = ModelWeights(lambda model_id: str(model_dir) if model_id == "tiny" else None,
                                    lambda model_id, agent_id: sources or [], chunk_bytes=CHUNK)
        self.service = CountingWeights(self.weights.roots, **weights_kwargs)

    async def __aenter__(self) -> Mesh:
        self.address, self.server = await serve(ControlService(None, "m", weights=self.weights), self.service)
        self.channel = make_channel(self.address)
        return self

    async def __aexit__(self, *exc) -> None:
        await self.channel.close()
        await self.server.stop(grace=None)


def spec_of(model_dir: Path, start: int, end: int) -> StageSpec:
    return StageSpec("tiny", str(model_dir), start, end, read_config(model_dir).num_layers)


def same_tensors(a: StageSpec, b: StageSpec) -> bool:
    ours, theirs = load_stage(a).tensors, load_stage(b).tensors
    return ours.keys() == theirs.keys() and all(torch.equal(ours[n], theirs[n]) for n in ours)


async def test_a_stage_fetched_from_the_coordinator_is_exactly_its_own_tensors(tiny_model, tmp_path, caplog) -> None:
    model_dir = tiny_model("llama")
    spec, reports = spec_of(model_dir, 0, 2), []
    caplog.set_level(logging.INFO, "stratamesh.agent.weights")
    async with Mesh(model_dir) as mesh:
        local = await WeightFetcher(tmp_path, "a1", "always").localize("as-1", spec, mesh.channel, reports.append)
    done = reports[-1]
    assert done.done and done.assignment_id == "as-1" and done.num_corrupt == 0 and done.source == "coordinator"
    names = stage_tensor_names(read_config(model_dir), 0, 2)
    assert done.tensor_bytes == stored_bytes(model_dir, names)           # its layers' bytes, and no others
    assert done.fetched_bytes + done.reused_bytes == done.total_bytes < done.tensor_bytes + 64 * 1024
    assert Path(local.model_path).is_relative_to(tmp_path) and replace(local, model_path=spec.model_path) == spec
    assert same_tensors(local, spec)
    bars = [r.getMessage() for r in caplog.records if "[####" in r.getMessage()]
    assert bars and "100%" in bars[-1], "the log shows a progress bar up to the end"


async def test_a_stage_of_a_gguf_file_fetches_its_header_and_its_own_tensors_only(tiny_model, tmp_path) -> None:
    """A GGUF model is one file: its copy holds the header (the config and tokenizer) and the stage's tensors; the
    rest of it is holes. The stage loads from the copy exactly what it loads from the file."""
    gguf = write_gguf(tiny_model("qwen3", num_layers=6), tmp_path / "qwen3-q8.gguf", "Q8_0")
    spec, reports = StageSpec("tiny", str(gguf), 2, 4, 6), []
    async with Mesh(gguf) as mesh:
        local = await WeightFetcher(tmp_path / "agent", "a1", "always").localize("as-1", spec, mesh.channel,
                                                                              reports.append)
    assert Path(local.model_path).name == gguf.name and Path(local.model_path).is_relative_to(tmp_path / "agent")
    layout = GgufModel(gguf).layout()[1]
    names = stage_tensor_names(read_config(gguf), 2, 4)
    assert reports[-1].tensor_bytes == sum(end - start for name, (start, end) in layout.items() if name in names)
    copy = Path(local.model_path).stat()
    assert copy.st_size == gguf.stat().st_size and copy.st_blocks * 512 < gguf.stat().st_size / 2   # mostly holes
    assert same_tensors(local, spec)
    assert not WeightFetcher(tmp_path / "agent", "a1").needs_fetch(spec)     # a file here is read where it is


async def test_a_local_folder_is_used_as_it_is_unless_told_to_fetch_always(tiny_model, tmp_path) -> None:
    spec = spec_of(tiny_model("llama"), 0, 2)
    # no coordinator at all: asking one would fail
    assert await WeightFetcher(tmp_path, "a1").localize("as-1", spec, None) is spec
    gone = replace(spec, model_path=str(tmp_path / "not-on-this-box"))
    assert WeightFetcher(tmp_path, "a1").needs_fetch(gone) and not WeightFetcher(tmp_path, "a1").needs_fetch(spec)


async def test_a_corrupted_chunk_is_detected_and_fetched_again(tiny_model, tmp_path, caplog) -> None:
    model_dir = tiny_model("llama")
    spec, reports = spec_of(model_dir, 2, 4), []
    async with Mesh(model_dir, corrupt=2) as mesh:
        local = await WeightFetcher(tmp_path, "a1", "always").localize("as-1", spec, mesh.channel, reports.append)
    assert reports[-1].num_corrupt == 2
    assert sum("failed its sha256 check" in r.getMessage() for r in caplog.records) == 2
    assert same_tensors(local, spec)


async def test_a_peer_is_asked_first_and_what_it_lacks_comes_from_the_coordinator(tiny_model, tmp_path) -> None:
    model_dir = tiny_model("llama")
    async with Mesh(model_dir) as first:     # the peer fetched layers [0, 2) earlier
        peer_fetcher = WeightFetcher(tmp_path / "peer", "peer", "always")
        await peer_fetcher.localize("as-0", spec_of(model_dir, 0, 2), first.channel)
    peer = CountingWeights(lambda model_id, revision: [peer_fetcher.mirror_dir(model_id, revision)])
    peer_address, peer_server = await serve(peer)
    try:
        async with Mesh(model_dir, sources=[peer_address]) as mesh:
            reports: list[WeightsProgress] = []
            spec = spec_of(model_dir, 0, 4)
            local = await WeightFetcher(tmp_path / "me", "me", "always").localize("as-1", spec, mesh.channel,
                                                                                 reports.append)
    finally:
        await peer_server.stop(grace=None)
    assert peer.num_sent > 0 and mesh.service.num_sent > 0
    done = reports[-1]
    shared = stored_bytes(model_dir, stage_tensor_names(read_config(model_dir), 0, 2))
    only_ours = stored_bytes(model_dir, stage_tensor_names(read_config(model_dir), 2, 4))
    assert done.tensor_bytes == shared + only_ours
    # the coordinator sent only what the peer could not: layers [2, 4) (the headers' chunks may come from either)
    assert (mesh.service.num_sent - 2) * CHUNK <= only_ours + CHUNK * 2
    assert same_tensors(local, spec)


async def test_an_interrupted_fetch_resumes_from_the_chunks_on_disk(tiny_model, tmp_path) -> None:
    model_dir = tiny_model("llama")
    spec = spec_of(model_dir, 0, 6)
    fetcher = WeightFetcher(tmp_path, "a1", "always")
    async with Mesh(model_dir, die_after=2) as flaky:
        with pytest.raises(WeightsUnavailable, match="could not be fetched intact"):
            await fetcher.localize("as-1", spec, flaky.channel)
    got_before = flaky.service.num_sent
    reports: list[WeightsProgress] = []
    async with Mesh(model_dir) as mesh:
        local = await fetcher.localize("as-1", spec, mesh.channel, reports.append)
    done = reports[-1]
    assert done.reused_bytes > 0 and done.fetched_bytes + done.reused_bytes == done.total_bytes
    # every chunk the flaky source sent was kept: only the rest came again (config.json as well, and the chunks
    # that are zeros, which a new sparse copy holds already)
    chunks = read_chunks(mesh)
    zeros = sum(read_verified([mesh.model_dir], c) == bytes(c.length) for c in chunks)
    assert mesh.service.num_sent == len(chunks) - got_before - zeros
    assert same_tensors(local, spec)


def read_chunks(mesh: Mesh) -> list[WeightChunk]:
    names = stage_tensor_names(read_config(mesh.model_dir), 0, 6)
    return list(ModelFiles(mesh.model_dir, CHUNK).manifest("tiny", names).chunks)


async def test_the_coordinator_answers_bad_manifest_and_fetch_requests_clearly(tiny_model) -> None:
    async with Mesh(tiny_model("llama")) as mesh:
        control, weights = pb_grpc.ControlStub(mesh.channel), pb_grpc.WeightsStub(mesh.channel)
        for request, code, match in [
                (convert.weight_manifest_request_to_pb("nope", [], "a"), grpc.StatusCode.NOT_FOUND, "nope"),
                (convert.weight_manifest_request_to_pb("tiny", ["model.layers.9.x"], "a"),
                 grpc.StatusCode.INVALID_ARGUMENT, "model.layers.9.x"),
                (convert.weight_manifest_request_to_pb("", [], "a"), grpc.StatusCode.INVALID_ARGUMENT, "model_id")]:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await control.GetWeightManifest(request)
            assert e.value.code() == code and match in e.value.details()
        too_many = pb.WeightFetch(model_id="tiny", revision="0" * 64, chunks=[
            pb.WeightChunk(file="config.json", offset=0, length=1, sha256=bytes(32))] * (MAX_CHUNKS_PER_FETCH + 1))
        escape = pb.WeightFetch(model_id="tiny", revision="0" * 64, chunks=[
            pb.WeightChunk(file="../../etc/passwd", offset=0, length=1, sha256=bytes(32))])
        for request, match in [(too_many, "at most"), (escape, "plain file name")]:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                async for _ in weights.Fetch(request):
                    pass
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and match in e.value.details()
        # a chunk nobody holds as hashed comes back missing, not wrong
        wrong = pb.WeightFetch(model_id="tiny", revision="0" * 64, chunks=[
            pb.WeightChunk(file="config.json", offset=0, length=1, sha256=bytes(32))])
        assert [m.missing async for m in weights.Fetch(wrong)] == [True]
