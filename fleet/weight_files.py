"""A model folder's weights as byte ranges: which chunks hold some tensors (with their sha256), reading a chunk only
as hashed, and a sparse copy of the folder that holds just the chunks fetched into it.

A fetched copy keeps each file's name, size and layout, so the loader reads it as it reads the original; only the
ranges a stage needs hold bytes (the rest are holes, which the file system does not store)."""

from __future__ import annotations

import errno
import functools
import hashlib
import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

from stratamesh.fleet.errors import CheckpointError, InvalidInput
from stratamesh.fleet.gguf_files import GgufModel, is_gguf
from stratamesh.fleet.weights import (MAX_CHUNK_BYTES, WeightChunk, WeightFile, WeightManifest, canonical_name,
                                      check_file_name)

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILE = "tokenizer.json"
SINGLE_FILE = "model.safetensors"
MAX_HEADER_BYTES = 100 * 1024 * 1024     # safetensors' own limit on a header
Range = tuple[int, int]                  # [start, end) bytes of a file


def read_header(path: Path) -> tuple[int, dict[str, Range]]:
    """(bytes of a safetensors file's header, stored tensor name -> its [start, end) bytes in the file)."""
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        if size > MAX_HEADER_BYTES:
            raise CheckpointError(f"{path} has a header of {size} bytes: not a safetensors file")
        try:
            header = json.loads(f.read(size))
            head = 8 + size
            return head, {name: (head + int(entry["data_offsets"][0]), head + int(entry["data_offsets"][1]))
                          for name, entry in header.items() if name != "__metadata__"}
        except (ValueError, KeyError, TypeError, IndexError) as e:
            raise CheckpointError(f"{path} has no valid safetensors header: {e}") from None


def chunk_ranges(ranges: Iterable[Range], grid: int = MAX_CHUNK_BYTES) -> list[Range]:
    """The ranges merged where they touch, then cut where they cross a multiple of grid: the same bytes, in chunks
    of at most grid bytes whose bounds do not depend on which other ranges were asked for."""
    merged: list[list[int]] = []
    for start, end in sorted(r for r in ranges if r[1] > r[0]):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    out = []
    for start, end in merged:
        while start < end:
            cut = min(end, (start // grid + 1) * grid)
            out.append((start, cut))
            start = cut
    return out


def sha256_of(path: Path, start: int, end: int) -> bytes | None:
    """The sha256 of bytes [start, end) of a file; None if the file is not that long."""
    data = read_range(path, start, end)
    return None if data is None else hashlib.sha256(data).digest()


def read_range(path: Path, start: int, end: int) -> bytes | None:
    """Bytes [start, end) of a regular file; None if there is no such file or it is shorter."""
    if not os.path.isfile(path):    # not a folder, and never a FIFO (opening one would block)
        return None
    try:
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size < end:
                return None
            return os.pread(f.fileno(), end - start, start)
    except OSError:
        return None


def read_verified(roots: Sequence[Path], chunk: WeightChunk) -> bytes | None:
    """The chunk's bytes from the first folder of roots that holds them as hashed; None if none does."""
    for root in roots:
        data = read_range(root / chunk.file, chunk.offset, chunk.end)
        if data is not None and hashlib.sha256(data).digest() == chunk.sha256:
            return data
    return None


def files_root(model_path: str | Path) -> Path:
    """The folder a model's files are in, chunks naming them relative to it: the model's folder, or its GGUF
    file's."""
    return Path(model_path).parent if is_gguf(model_path) else Path(model_path)


def model_path_in(root: str | Path, model_path: str | Path) -> Path:
    """files_root's inverse: the model's path in a folder holding its files (a copy of them)."""
    return Path(root) / Path(model_path).name if is_gguf(model_path) else Path(root)


def config_path(model_path: str | Path) -> Path:
    """The file whose presence says a model is on this disk: its folder's config.json, or its GGUF file."""
    return Path(model_path) if is_gguf(model_path) else Path(model_path) / CONFIG_FILE


class ModelFiles:
    """One model folder's layout: which file and byte range holds each tensor, read from its index and headers. Or
    one GGUF file's: its header (the model's config and tokenizer) and its tensors' bytes (fleet.gguf_files).

    Chunk hashes are computed when first asked for and kept while the files stay as they were."""

    def __init__(self, model_dir: str | Path, chunk_bytes: int = MAX_CHUNK_BYTES) -> None:
        """chunk_bytes: the grid chunks are cut at (at most MAX_CHUNK_BYTES)."""
        assert 0 < chunk_bytes <= MAX_CHUNK_BYTES, chunk_bytes
        self.chunk_bytes = chunk_bytes
        self._heads: dict[str, int] = {}                 # weight file -> bytes of its header
        self._tensors: dict[str, tuple[str, Range]] = {}     # canonical name -> (file, its bytes there)
        self._headed: list[str] = []     # files whose header every manifest carries (a GGUF file's: the config)
        self.model_dir = files_root(model_dir)
        if is_gguf(model_dir):
            self._small = []
            file = Path(model_dir).name
            check_file_name(file)
            self._heads[file], ranges = GgufModel(model_dir).layout()
            self._tensors = {name: (file, r) for name, r in ranges.items()}
            self._headed = [file]
        else:
            # delivered whole: the config, the index, and the tokenizer (a last stage's grammars are over its tokens)
            self._small = [name for name in (CONFIG_FILE, INDEX_FILE, TOKENIZER_FILE)
                           if (self.model_dir / name).is_file()]
            if CONFIG_FILE not in self._small:
                raise CheckpointError(f"{self.model_dir} has no {CONFIG_FILE}")
            for file in self._weight_files():
                self._heads[file], ranges = read_header(self.model_dir / file)
                self._tensors.update({canonical_name(name): (file, r) for name, r in ranges.items()})
        self._stats = self._stat()
        self._hashes: dict[tuple[str, int, int], bytes] = {}
        self.revision = self._revision()

    def _weight_files(self) -> list[str]:
        if INDEX_FILE in self._small:
            try:
                weight_map = json.loads((self.model_dir / INDEX_FILE).read_text())["weight_map"]
                files = sorted({str(f) for f in weight_map.values()})
            except (ValueError, KeyError, AttributeError) as e:
                raise CheckpointError(f"{self.model_dir / INDEX_FILE} is not a safetensors index: {e}") from None
        else:
            files = [SINGLE_FILE]
        for file in files:
            try:
                check_file_name(file)
            except InvalidInput as e:
                raise CheckpointError(f"{self.model_dir}: {e}") from None
            if not (self.model_dir / file).is_file():
                raise CheckpointError(f"checkpoint shard {self.model_dir / file} is missing")
        return files

    def _stat(self) -> dict[str, tuple[int, int]]:
        out = {}
        for name in [*self._small, *self._heads]:
            st = (self.model_dir / name).stat()
            out[name] = (st.st_size, st.st_mtime_ns)
        return out

    def is_current(self) -> bool:
        """Whether the folder's files are still the ones read (same sizes and modification times)."""
        try:
            return self._stat() == self._stats
        except OSError:
            return False

    def _revision(self) -> str:
        digest = hashlib.sha256()
        for name in [*self._small, *sorted(self._heads)]:
            size = self._stats[name][0]
            head = size if name in self._small else self._heads[name]
            digest.update(f"{name}\0{size}\0".encode())
            digest.update(read_range(self.model_dir / name, 0, head) or b"")
        return digest.hexdigest()

    def manifest(self, model_id: str, tensor_names: Iterable[str], sources: Sequence[str] = ()) -> WeightManifest:
        """The chunks holding config.json, the index, tokenizer.json, and the named tensors with their files' headers
        (InvalidInput naming a tensor the checkpoint lacks). A GGUF file's header, its config, is in every manifest,
        in chunks of its own: those of the first manifest (of no tensor), whatever tensors a later one names."""
        whole = {name: [(0, self._stats[name][0])] for name in self._small}
        whole.update({file: [(0, self._heads[file])] for file in self._headed})
        wanted: dict[str, list[Range]] = {}
        tensor_ranges = set()
        for name in dict.fromkeys(tensor_names):
            if name not in self._tensors:
                raise InvalidInput(f"model {model_id} has no tensor {name!r}")
            file, r = self._tensors[name]
            wanted.setdefault(file, [] if file in self._headed else [(0, self._heads[file])]).append(r)
            tensor_ranges.add((file, r))
        chunks = [WeightChunk(file, start, end - start, self._hash(file, start, end))
                  for group in (whole, wanted) for file, ranges in group.items()
                  for start, end in chunk_ranges(ranges, self.chunk_bytes)]
        files = tuple(WeightFile(name, self._stats[name][0]) for name in dict.fromkeys([*whole, *wanted]))
        return WeightManifest(model_id, self.revision, files, tuple(chunks),
                              sum(end - start for _, (start, end) in tensor_ranges), tuple(sources))

    def _hash(self, file: str, start: int, end: int) -> bytes:
        key = (file, start, end)
        if key not in self._hashes:
            digest = sha256_of(self.model_dir / file, start, end)
            if digest is None:
                raise CheckpointError(f"{self.model_dir / file} is shorter than its header says")
            self._hashes[key] = digest
        return self._hashes[key]


class Mirror:
    """A sparse copy of a model folder under root: its files at full size, holding only the chunks written."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    def prepare(self, files: Iterable[WeightFile]) -> None:
        """Creates each file missing (as a hole of its size), keeping whatever an earlier fetch wrote."""
        self.root.mkdir(parents=True, exist_ok=True)
        for file in files:
            path = self.root / file.name
            with open(path, "ab") as f:
                if os.fstat(f.fileno()).st_size != file.size:
                    f.truncate(file.size)

    def missing(self, chunks: Iterable[WeightChunk]) -> list[WeightChunk]:
        """The chunks this copy does not hold as hashed. A chunk that lies in a hole (never written) is zeros: it is
        held only if zeros are what it must hash to, and it is not read (a new copy of a large stage is all holes)."""
        return [c for c in chunks if not self._holds(c)]

    def _holds(self, chunk: WeightChunk) -> bool:
        path = self.root / chunk.file
        if not path.is_file():
            return False
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size < chunk.end:
                return False
            if _in_hole(f.fileno(), chunk.offset, chunk.end):
                return chunk.sha256 == _zeros_sha256(chunk.length)
            return hashlib.sha256(os.pread(f.fileno(), chunk.length, chunk.offset)).digest() == chunk.sha256

    def write(self, chunk: WeightChunk, data: bytes) -> bool:
        """Writes the chunk if data hashes as it should; False (nothing written) if it does not."""
        if len(data) != chunk.length or hashlib.sha256(data).digest() != chunk.sha256:
            return False
        fd = os.open(self.root / chunk.file, os.O_WRONLY)
        try:
            os.pwrite(fd, data, chunk.offset)
        finally:
            os.close(fd)
        return True


def _in_hole(fd: int, start: int, end: int) -> bool:
    """Whether bytes [start, end) of the file lie in a hole; False where the file system cannot say."""
    try:
        return os.lseek(fd, start, os.SEEK_DATA) >= end
    except OSError as e:        # ENXIO: no data from start to the end of the file
        return e.errno == errno.ENXIO


@functools.lru_cache(maxsize=8)
def _zeros_sha256(length: int) -> bytes:
    return hashlib.sha256(bytes(length)).digest()
