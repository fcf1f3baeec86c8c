"""The data plane's vocabulary: how a session samples, the hops of its route, and the messages its stages and its
origin exchange (StageMessage between stages, TokenEvent back to the origin)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from stratamesh.fleet.errors import InvalidInput
from stratamesh.fleet.stages import DTYPES

HOP_CODECS = ("", *DTYPES, "int8")


def wire_dtype(sender: str, receiver: str) -> str:
    """The dtype activations travel in from a stage computing in sender to one computing in receiver: the
    receiver's, so it converts nothing, except that a float32 receiver gets the sender's narrower dtype (the
    upcast it does then is exact, and the link carries half the bytes). "" (unknown) on either side: sender's."""
    if not receiver or not sender or receiver == "float32":
        return sender or receiver or "float32"
    return receiver


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How the last stage picks a token; temperature 0 is greedy."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise InvalidInput(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise InvalidInput(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise InvalidInput(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


@dataclass(frozen=True, slots=True)
class TensorBlob:
    """A tensor as bytes: what the wire carries and kernels' codecs produce and consume."""

    dtype: str
    shape: tuple[int, ...]
    data: bytes
    codec: str = "raw"
    scales: TensorBlob | None = field(default=None)


@dataclass(frozen=True, slots=True)
class Hop:
    """One stage of a route: where it listens, which assignment serves it there, the dtype it computes in
    (activations for it travel in that dtype; "" when unknown: the sender's own), and the codec of the link into it
    (HOP_CODECS: "" raw in that dtype; a dtype: raw in that one; "int8": int8 with per-token scales); the agent
    serving it ("" when unknown), and, when that agent sits behind NAT, the address its connections come from (a
    sender outside that NAT cannot dial it, and reaches it over WebRTC instead: fleet/wire/rtc.py)."""

    address: str
    assignment_id: str
    dtype: str = ""
    codec: str = ""
    agent_id: str = ""
    nat: str = ""


@dataclass(frozen=True, slots=True)
class SessionOpen:
    """Opens a session on a stage; `route` holds the hops after the receiving stage."""

    session_id: str
    assignment_id: str
    route: tuple[Hop, ...]
    origin: str
    sampling: SamplingParams
    traceparent: str = ""       # W3C trace context of the request; "" when it is not traced
    prompt_token_ids: tuple[int, ...] = ()
    max_cached_tokens: int = 0   # the fewest prompt tokens any stage so far holds in its prefix cache
    resume_from: str = ""        # a moving session: stages that hold it under this id keep its KV
    # The decode loop: the last stage feeds each sampled token to this first stage (None: to nobody) until
    # max_new_tokens are sampled (0: no limit) or one of stop_token_ids is.
    feed: Hop | None = None
    max_new_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()

    def forwarded(self, cached_tokens: int) -> SessionOpen:
        """The open as the next hop must receive it, carrying this stage's cached-token count."""
        head, *rest = self.route
        return replace(self, assignment_id=head.assignment_id, route=tuple(rest),
                       max_cached_tokens=min(cached_tokens, self.max_cached_tokens))


@dataclass(frozen=True, slots=True)
class StepChunk:
    """One step of a session: its token ids at positions start_pos.. (every stage gets them)."""

    session_id: str
    step: int
    start_pos: int
    token_ids: tuple[int, ...] = ()
    sample: bool = False
    trace_id: str = ""          # 32 hex digits; "" when the request is not traced
    sent_unix_ns: int = 0       # when the origin sent it (0 on chunks inside a StepBatch)


@dataclass(frozen=True, slots=True)
class StepBatch:
    """A stage's step for the next one: chunks, and their hidden states as rows in chunk order."""

    chunks: tuple[StepChunk, ...]
    hidden: TensorBlob
    sent_unix_ns: int = 0       # when the sending stage finished computing it


@dataclass(frozen=True, slots=True)
class StepChunks:
    """The next decode step of several sessions, token ids only, fed by the last stage to the first in one message."""

    chunks: tuple[StepChunk, ...]


@dataclass(frozen=True, slots=True)
class SessionClose:
    session_id: str


@dataclass(frozen=True, slots=True)
class SessionHold:
    """Stops a session's decode loop after the token the pipeline is on (to move it while it is quiet)."""

    session_id: str


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """What the last stage returns to the origin: a sampled token (or an embedding model's pooled vector), or the
    error that ended the session."""

    session_id: str
    step: int
    token_id: int = -1
    error: str = ""
    error_stage: str = ""
    opened: bool = False        # the answer to an open: every stage opened the session ...
    cached_tokens: int = 0      # ... and holds this many leading prompt tokens in its cache
    preempted: bool = False     # a stage ran out of KV blocks: the origin replays the session
    sent_unix_ns: int = 0       # when the last stage finished the step that produced it
    unreachable: str = ""       # with error: the address of the hop a stage lost (the origin replays)
    embedding: tuple[float, ...] = ()   # instead of a token (embedding models): the prompt's normalized vector
    held: bool = False          # the last token before a hold: the session is quiet on every stage now


# What one stage sends another (or the origin its route's first stage) on a session's stream.
StageMessage = SessionOpen | StepChunk | StepChunks | SessionClose | SessionHold | StepBatch
