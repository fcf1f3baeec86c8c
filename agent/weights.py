"""Weights delivered to the agent: a stage whose model folder is not on this box gets exactly its own tensors,
fetched in sha256-checked chunks from peers that hold them, else from the coordinator, into a sparse copy of the
folder in the cache (fleet.weight_files.Mirror) that a later fetch resumes from."""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import grpc

from stratamesh.fleet.errors import MeshError
from stratamesh.fleet.stages import StageSpec
from stratamesh.fleet.weight_files import Mirror, config_path, model_path_in
from stratamesh.fleet.weight_service import fetch_chunks
from stratamesh.fleet.weights import WeightChunk, WeightManifest, WeightsProgress
from stratamesh.fleet.wire import convert
from stratamesh.fleet.wire import mesh_pb2_grpc as pb_grpc
from stratamesh.fleet.wire.channels import describe_error, make_channel
from stratamesh.kernels.models.checkpoint import stage_tensor_names
from stratamesh.kernels.models.config import read_config

log = logging.getLogger(__name__)

FETCH_MODES = ("missing", "always")   # fetch a stage's tensors when its folder is not on this box, or always
COORDINATOR = "coordinator"           # the source the control channel reaches
MAX_ROUNDS = 3                        # passes over every source before a chunk no source could give fails the load
REPORT_EVERY_S = 0.25                 # progress goes to the coordinator at most this often (and once done)
BAR_WIDTH = 20


class WeightsUnavailable(MeshError):
    """A stage's tensors could not be fetched from any source."""


@dataclass(slots=True)
class _Progress:
    """One stage's fetch as it goes: counts, the log's progress bar (every tenth), reports to the coordinator."""

    label: str
    assignment_id: str
    total_bytes: int
    tensor_bytes: int
    report: Callable[[WeightsProgress], None]
    fetched_bytes: int = 0
    reused_bytes: int = 0
    num_corrupt: int = 0
    source: str = ""
    started: float = 0.0
    log_bar: bool = True
    _tenths: int = -1
    _reported: float = 0.0

    def snapshot(self, done: bool = False) -> WeightsProgress:
        return WeightsProgress(self.assignment_id, self.fetched_bytes, self.reused_bytes, self.total_bytes,
                               self.tensor_bytes, done, self.source, self.num_corrupt)

    def advance(self, num_bytes: int, source: str) -> None:
        self.fetched_bytes += num_bytes
        self.source = source
        now = time.monotonic()
        fraction = self.snapshot().fraction
        if self.log_bar and int(fraction * 10) > self._tenths:
            self._tenths = int(fraction * 10)
            rate = self.fetched_bytes / max(now - self.started, 1e-9) / 1e6
            filled = round(fraction * BAR_WIDTH)
            log.info("weights of %s: [%s%s] %3.0f%% %.1f/%.1f MB from %s, %.1f MB/s", self.label, "#" * filled,
                     "." * (BAR_WIDTH - filled), fraction * 100, (self.fetched_bytes + self.reused_bytes) / 1e6,
                     self.total_bytes / 1e6, source, rate)
        if now - self._reported >= REPORT_EVERY_S:
            self._reported = now
            self.report(self.snapshot())


class WeightFetcher:
    """Makes a stage's tensors local before it loads; mode "missing" fetches only for a folder this box lacks."""

    def __init__(self, root: str | Path, agent_id: str, mode: str = "missing") -> None:
        """root: the folder fetched copies are kept in, one per checkpoint."""
        if mode not in FETCH_MODES:
            raise ValueError(f"fetch mode {mode!r} is not one of {FETCH_MODES}")
        self.root = Path(root)
        self.agent_id = agent_id
        self.mode = mode

    def mirror_dir(self, model_id: str, revision: str) -> Path:
        """Where the fetched copy of one checkpoint lives: a model id (a peer's request names it) becomes one plain
        folder name, never "." or ".."."""
        return self.root / re.sub(r"[^A-Za-z0-9_-]", "_", model_id)[:100] / revision[:16]

    def needs_fetch(self, spec: StageSpec) -> bool:
        return self.mode == "always" or not config_path(spec.model_path).is_file()

    async def localize(self, assignment_id: str, spec: StageSpec, coordinator: grpc.aio.Channel,
                       report: Callable[[WeightsProgress], None] = lambda p: None) -> StageSpec:
        """spec, reading from a local copy of its tensors (fetched now unless needs_fetch says the folder is here).

        The coordinator's manifest first names config.json (whose layer count says which tensors the stage
        needs), then those tensors' chunks; report hears the progress."""
        if not self.needs_fetch(spec):
            return spec
        control = pb_grpc.ControlStub(coordinator)
        head = await self._manifest(control, spec.model_id, ())
        mirror = Mirror(self.mirror_dir(spec.model_id, head.revision))
        label = f"{spec.model_id} [{spec.start_layer}, {spec.end_layer})"
        head_progress = _Progress(label, assignment_id, head.total_bytes, 0, lambda p: None, log_bar=False)
        await self._fetch(head, mirror, coordinator, head_progress)
        local = model_path_in(mirror.root, spec.model_path)
        config = await asyncio.to_thread(read_config, local)
        manifest = await self._manifest(control, spec.model_id,
                                        stage_tensor_names(config, spec.start_layer, spec.end_layer))
        if manifest.revision != head.revision:
            raise WeightsUnavailable(f"the checkpoint of {spec.model_id} changed on the coordinator while fetching")
        # what the first manifest's fetch got (config.json, the index) counts as fetched, not found on disk
        progress = _Progress(label, assignment_id, manifest.total_bytes, manifest.tensor_bytes, report,
                             fetched_bytes=head_progress.fetched_bytes, num_corrupt=head_progress.num_corrupt)
        await self._fetch(manifest, mirror, coordinator, progress)
        done = progress.snapshot(done=True)
        report(done)
        log.info("weights of %s ready in %s: fetched %.2f MB (its tensors: %.2f MB of %.2f MB needed), %.2f MB "
                 "already on disk, %d corrupt chunk(s) fetched again, %.1f s", label, mirror.root,
                 done.fetched_bytes / 1e6, done.tensor_bytes / 1e6, done.total_bytes / 1e6, done.reused_bytes / 1e6,
                 done.num_corrupt, time.monotonic() - progress.started)
        return replace(spec, model_path=str(local))

    async def _manifest(self, control: pb_grpc.ControlStub, model_id: str, names: Sequence[str]) -> WeightManifest:
        reply = await control.GetWeightManifest(
            convert.weight_manifest_request_to_pb(model_id, names, self.agent_id))
        return convert.weight_manifest_from_pb(reply)

    async def _fetch(self, manifest: WeightManifest, mirror: Mirror, coordinator: grpc.aio.Channel,
                     progress: _Progress) -> None:
        """Fills mirror with the manifest's chunks: what it holds already is kept; the rest comes from each source
        in turn (peers first), a chunk that is missing or fails its hash going to the next; MAX_ROUNDS passes."""
        await asyncio.to_thread(mirror.prepare, manifest.files)
        pending = await asyncio.to_thread(mirror.missing, manifest.chunks)
        progress.reused_bytes = manifest.total_bytes - sum(c.length for c in pending) - progress.fetched_bytes
        progress.started = time.monotonic()
        for _ in range(MAX_ROUNDS):
            for source in (*manifest.sources, COORDINATOR):
                if not pending:
                    return
                pending = await self._from_source(source, coordinator, manifest, pending, mirror, progress)
        if pending:
            raise WeightsUnavailable(f"{len(pending)} chunk(s) of {manifest.model_id}, {pending[0]} first, could not "
                                     f"be fetched intact from {', '.join((*manifest.sources, COORDINATOR))}")

    async def _from_source(self, source: str, coordinator: grpc.aio.Channel, manifest: WeightManifest,
                           pending: list[WeightChunk], mirror: Mirror, progress: _Progress) -> list[WeightChunk]:
        """The chunks of pending still missing after asking source for them all."""
        channel = coordinator if source == COORDINATOR else make_channel(source)
        left = {chunk: None for chunk in pending}
        try:
            async for chunk, data in fetch_chunks(channel, manifest.model_id, manifest.revision, pending):
                if data is None:
                    continue
                if not await asyncio.to_thread(mirror.write, chunk, data):
                    progress.num_corrupt += 1
                    log.warning("weights of %s: chunk %s from %s failed its sha256 check; fetching it again",
                                progress.label, chunk, source)
                    continue
                left.pop(chunk, None)
                progress.advance(chunk.length, source)
        except (grpc.aio.AioRpcError, MeshError) as exc:
            log.warning("weights of %s: source %s failed (%s); trying the next", progress.label, source,
                        describe_error(exc) if isinstance(exc, grpc.aio.AioRpcError) else exc)
        finally:
            if channel is not coordinator:
                await channel.close(grace=None)
        return list(left)
