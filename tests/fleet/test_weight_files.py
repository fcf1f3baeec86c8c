"""A model folder as chunks: manifests of some tensors, verified reads, and a sparse copy a stage loads from."""

from __future__ import annotations

import hashlib
import os
import random

import pytest
import torch
from safetensors import safe_open

from stratamesh.fleet.errors import CheckpointError, InvalidInput
from stratamesh.fleet.weight_files import INDEX_FILE, Mirror, ModelFiles, chunk_ranges, read_verified
from stratamesh.fleet.weights import WeightChunk, WeightFile, WeightManifest, WeightsProgress
from stratamesh.kernels.models.checkpoint import Checkpoint, stage_tensor_names
from stratamesh.kernels.models.config import read_config

CHUNK = 64 * 1024


def stored_bytes(model_dir, names) -> int:
    """What the named tensors take in the checkpoint's files, as safetensors itself reads them."""
    checkpoint, total = Checkpoint(model_dir), 0
    for name in set(names):
        file, stored = checkpoint._stored[name]
        with safe_open(str(model_dir / file), framework="pt") as f:
            t = f.get_tensor(stored)
        total += t.numel() * t.element_size()
    return total


@pytest.mark.parametrize("seed", range(20))
def test_chunk_ranges_cover_exactly_the_ranges_asked_in_grid_aligned_pieces(seed: int) -> None:
    rng = random.Random(seed)
    ranges = [(s, s + rng.randrange(0, 500)) for s in (rng.randrange(0, 2000) for _ in range(rng.randrange(1, 8)))]
    chunks = chunk_ranges(ranges, grid=128)
    covered = {b for start, end in ranges for b in range(start, end)}
    assert {b for start, end in chunks for b in range(start, end)} == covered
    assert sum(end - start for start, end in chunks) == len(covered)      # nothing twice
    for start, end in chunks:
        assert 0 < end - start <= 128 and start // 128 == (end - 1) // 128   # never across a grid line


@pytest.mark.parametrize("shard_size_bytes", [None, 1_500_000])
def test_a_manifest_names_the_stage_tensors_bytes_plus_headers_and_config(tiny_model, shard_size_bytes) -> None:
    model_dir = tiny_model("llama", shard_size_bytes=shard_size_bytes)
    names = stage_tensor_names(read_config(model_dir), 2, 4)
    manifest = ModelFiles(model_dir, CHUNK).manifest("m", names)
    assert manifest.tensor_bytes == stored_bytes(model_dir, names)
    assert manifest.tensor_bytes < manifest.total_bytes < manifest.tensor_bytes + 64 * 1024   # headers + config
    assert "config.json" in {f.name for f in manifest.files}
    assert (INDEX_FILE in {f.name for f in manifest.files}) == (shard_size_bytes is not None)
    for chunk in manifest.chunks:
        assert chunk.length <= CHUNK
        assert hashlib.sha256((model_dir / chunk.file).read_bytes()[chunk.offset:chunk.end]).digest() == chunk.sha256
    whole = ModelFiles(model_dir, CHUNK).manifest("m", stage_tensor_names(read_config(model_dir), 0, 6))
    assert whole.tensor_bytes == stored_bytes(model_dir, Checkpoint(model_dir).tensor_names())
    assert whole.revision == manifest.revision       # one checkpoint, whichever tensors


def test_a_manifest_refuses_a_tensor_the_checkpoint_lacks(tiny_model) -> None:
    with pytest.raises(InvalidInput, match="model.layers.99.mlp.up_proj.weight"):
        ModelFiles(tiny_model("llama")).manifest("m", ["model.layers.99.mlp.up_proj.weight"])


def test_the_revision_changes_with_the_checkpoint(tiny_model, tmp_path) -> None:
    a = ModelFiles(tiny_model("llama", seed=1)).revision
    assert a == ModelFiles(tiny_model("llama", seed=1)).revision
    assert a != ModelFiles(tiny_model("llama", num_layers=4)).revision


def test_a_folder_without_config_or_with_a_short_file_is_refused(tiny_model, tmp_path) -> None:
    with pytest.raises(CheckpointError, match="config.json"):
        ModelFiles(tmp_path)
    source = tiny_model("llama")
    for name in ("config.json", "model.safetensors"):
        (tmp_path / name).write_bytes((source / name).read_bytes())
    with open(tmp_path / "model.safetensors", "r+b") as f:
        f.truncate(f.seek(0, os.SEEK_END) - 1000)
    names = stage_tensor_names(read_config(source), 4, 6)
    with pytest.raises(CheckpointError, match="shorter"):
        ModelFiles(tmp_path).manifest("m", names)


def test_a_sparse_copy_of_one_stages_chunks_loads_that_stage_exactly(tiny_model, tmp_path) -> None:
    model_dir = tiny_model("llama", shard_size_bytes=1_500_000)
    names = stage_tensor_names(read_config(model_dir), 0, 2)
    manifest = ModelFiles(model_dir, CHUNK).manifest("m", names)
    mirror = Mirror(tmp_path / "copy")
    mirror.prepare(manifest.files)
    missing = mirror.missing(manifest.chunks)
    # a new copy is all holes: it holds only the chunks that are zeros in the checkpoint too
    assert missing and all(read_verified([model_dir], c) == bytes(c.length) for c in manifest.chunks
                           if c not in missing)
    for chunk in manifest.chunks:
        assert mirror.write(chunk, read_verified([model_dir], chunk))
    assert mirror.missing(manifest.chunks) == []
    for f in manifest.files:      # full size, but only what was written takes room on disk
        st = (mirror.root / f.name).stat()
        assert st.st_size == f.size
    shards = [f for f in manifest.files if f.name.endswith(".safetensors")]
    assert sum((mirror.root / f.name).stat().st_blocks * 512 for f in shards) < sum(f.size for f in shards)
    ours, theirs = Checkpoint(mirror.root).load(names), Checkpoint(model_dir).load(names)
    assert all(torch.equal(ours[n], theirs[n]) for n in names)


def test_a_chunk_that_does_not_hash_right_is_neither_written_nor_served(tiny_model, tmp_path) -> None:
    model_dir = tiny_model("llama")
    manifest = ModelFiles(model_dir, CHUNK).manifest("m", stage_tensor_names(read_config(model_dir), 5, 6))
    chunk = manifest.chunks[-1]
    good = read_verified([model_dir], chunk)
    mirror = Mirror(tmp_path)
    mirror.prepare(manifest.files)
    bad = bytes([good[0] ^ 1]) + good[1:]
    assert not mirror.write(chunk, bad) and not mirror.write(chunk, good[:-1])
    assert mirror.missing([chunk]) == [chunk]
    # a copy holding no bytes there (a hole) serves nothing; the next folder that holds them as hashed does
    assert read_verified([mirror.root], chunk) is None
    assert read_verified([mirror.root, tmp_path / "nowhere", model_dir], chunk) == good
    os.mkfifo(tmp_path / "fifo")        # never opened: it would block
    assert read_verified([tmp_path], WeightChunk("fifo", 0, 1, bytes(32))) is None


@pytest.mark.parametrize("name", ["../config.json", "a/b", ".hidden", "", "x" * 300, "a\0b"])
def test_a_chunk_names_only_a_plain_file(name: str) -> None:
    with pytest.raises(InvalidInput, match="plain file name"):
        WeightChunk(name, 0, 1, bytes(32))


@pytest.mark.parametrize("offset, length, sha", [(-1, 1, bytes(32)), (0, 0, bytes(32)), (0, 5 << 20, bytes(32)),
                                                 (0, 1, bytes(31))])
def test_a_chunk_is_a_bounded_range_with_a_sha256(offset: int, length: int, sha: bytes) -> None:
    with pytest.raises(InvalidInput):
        WeightChunk("model.safetensors", offset, length, sha)


def test_a_manifest_keeps_its_chunks_inside_its_files() -> None:
    rev = "ab" * 32
    files = (WeightFile("model.safetensors", 100),)
    assert WeightManifest("m", rev, files, (WeightChunk("model.safetensors", 90, 10, bytes(32)),), 10).total_bytes == 10
    for chunks, tensor_bytes, match in [((WeightChunk("model.safetensors", 95, 10, bytes(32)),), 0, "outside"),
                                        ((WeightChunk("other.safetensors", 0, 10, bytes(32)),), 0, "outside"),
                                        ((WeightChunk("model.safetensors", 0, 10, bytes(32)),), 11, "tensor_bytes")]:
        with pytest.raises(InvalidInput, match=match):
            WeightManifest("m", rev, files, chunks, tensor_bytes)
    with pytest.raises(InvalidInput, match="revision"):
        WeightManifest("m", "not-hex", files, (), 0)


def test_progress_counts_stay_within_the_total() -> None:
    assert WeightsProgress("a", 30, 10, 80, 60).fraction == 0.5
    with pytest.raises(InvalidInput):
        WeightsProgress("a", 80, 10, 80, 60)
    with pytest.raises(InvalidInput):
        WeightsProgress("a", -1, 0, 80, 60)
