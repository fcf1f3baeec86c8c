"""What a model's weights look like on the wire: files, chunks with their sha256, a manifest, fetch progress.

Pure values (no I/O): fleet.weight_files reads and writes them, fleet.weight_service serves them, the agent's
fetcher (agent.weights) uses them to copy exactly one stage's tensors from the coordinator or a peer."""

from __future__ import annotations

import re
from dataclasses import dataclass

from stratamesh.fleet.errors import InvalidInput

# A chunk is at most this long: the unit that is hashed, fetched, verified, and fetched again when it fails.
MAX_CHUNK_BYTES = 4 * 1024 * 1024
SHA256_BYTES = 32
# A file of a model folder, by its plain name: no folders, nothing hidden, so a name can never leave the folder.
_FILE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,199}")
# A base model (LlamaModel.save_pretrained, as embedding models ship) names its tensors without "model."
_BASE_MODEL_PREFIXES = ("embed_tokens.", "layers.", "norm.")
# A multimodal model's text model (fleet.stages.TEXT_MODELS): under language_model, as released and as transformers
# saves it, or under model.language_model (transformers 4.5x's own layout)
_TEXT_MODEL_PREFIXES = {"language_model.model.": "model.", "language_model.lm_head.": "lm_head.",
                        "model.language_model.": "model."}


def canonical_name(name: str) -> str:
    """The name a checkpoint tensor goes by in the mesh: a base model's "layers.0..." becomes "model.layers.0...",
    a multimodal model's "language_model.model.layers.0..." too (its vision tower's keep theirs)."""
    if name.startswith(_BASE_MODEL_PREFIXES):
        return "model." + name
    for prefix, canonical in _TEXT_MODEL_PREFIXES.items():
        if name.startswith(prefix):
            return canonical + name[len(prefix):]
    return name


def check_file_name(name: str) -> str:
    """name, if it is a plain file name (InvalidInput otherwise)."""
    if not _FILE_NAME.fullmatch(name) or ".." in name:
        raise InvalidInput(f"weight file name {name!r} is not a plain file name")
    return name


@dataclass(frozen=True, slots=True)
class WeightFile:
    """A file of a model's folder, at its full size (a fetched copy is sparse: it holds only the chunks asked for)."""

    name: str
    size: int

    def __post_init__(self) -> None:
        check_file_name(self.name)
        if self.size < 0:
            raise InvalidInput(f"weight file {self.name!r} has a negative size")


@dataclass(frozen=True, slots=True)
class WeightChunk:
    """A byte range of one file and the sha256 it must have."""

    file: str
    offset: int
    length: int
    sha256: bytes

    def __post_init__(self) -> None:
        check_file_name(self.file)
        if self.offset < 0 or not 0 < self.length <= MAX_CHUNK_BYTES:
            raise InvalidInput(f"weight chunk {self.offset}+{self.length} of {self.file!r} is not a range of "
                               f"1..{MAX_CHUNK_BYTES} bytes")
        if len(self.sha256) != SHA256_BYTES:
            raise InvalidInput(f"weight chunk of {self.file!r}: sha256 must be {SHA256_BYTES} bytes")

    @property
    def end(self) -> int:
        return self.offset + self.length

    def __str__(self) -> str:
        return f"{self.file}@{self.offset}+{self.length}"


@dataclass(frozen=True, slots=True)
class WeightManifest:
    """The chunks that hold some tensors of one model, and where to fetch them: sources first, then the
    coordinator. revision names the checkpoint (its config, index and headers): a fetched copy is kept under it."""

    model_id: str
    revision: str
    files: tuple[WeightFile, ...]
    chunks: tuple[WeightChunk, ...]
    tensor_bytes: int
    sources: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[0-9a-f]{64}", self.revision):
            raise InvalidInput(f"weight manifest revision {self.revision!r} is not a hex sha256")
        sizes = {f.name: f.size for f in self.files}
        if len(sizes) != len(self.files):
            raise InvalidInput("weight manifest names a file twice")
        for chunk in self.chunks:
            if chunk.file not in sizes or chunk.end > sizes[chunk.file]:
                raise InvalidInput(f"weight chunk {chunk} lies outside the manifest's files")
        if not 0 <= self.tensor_bytes <= self.total_bytes:
            raise InvalidInput(f"weight manifest tensor_bytes {self.tensor_bytes} is not within its chunks' "
                               f"{self.total_bytes} bytes")

    @property
    def total_bytes(self) -> int:
        return sum(c.length for c in self.chunks)


@dataclass(frozen=True, slots=True)
class WeightsProgress:
    """How far an agent is with fetching one stage's tensors (what its log, the admin API and the UI show)."""

    assignment_id: str
    fetched_bytes: int          # received and verified
    reused_bytes: int           # already on its disk, verified
    total_bytes: int            # everything the stage needs: tensors, file headers, config
    tensor_bytes: int           # of total_bytes, the stage's tensors
    done: bool = False
    source: str = ""            # where the latest chunk came from: a peer's address, or "coordinator"
    num_corrupt: int = 0        # chunks that failed their sha256 check and were fetched again

    def __post_init__(self) -> None:
        if min(self.fetched_bytes, self.reused_bytes, self.total_bytes, self.tensor_bytes, self.num_corrupt) < 0:
            raise InvalidInput("weights progress counts must be >= 0")
        if self.fetched_bytes + self.reused_bytes > self.total_bytes or self.tensor_bytes > self.total_bytes:
            raise InvalidInput(f"weights progress {self.fetched_bytes} + {self.reused_bytes} bytes is more than "
                               f"its total {self.total_bytes}")

    @property
    def fraction(self) -> float:
        return (self.fetched_bytes + self.reused_bytes) / self.total_bytes if self.total_bytes else 1.0
