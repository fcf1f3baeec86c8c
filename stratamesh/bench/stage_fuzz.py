"""A fuzzer of the Stage service: random bytes, and well-formed data-plane messages with one thing broken.

It plays an enrolled but broken (or hostile) peer: it holds a mesh certificate, so it gets past mTLS, and
every message it sends must be refused or fail only the fuzzer's own sessions. Each case is one Push call.
"""

from __future__ import annotations

import asyncio
import math
import random
import struct
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import grpc

from stratamesh.fleet.wire import mesh_pb2 as pb

PUSH = "/stratamesh.v1.Stage/Push"
# grpc/grpc#36066: when a server ends a client-streaming call (here: INVALID_ARGUMENT for a message that does not
# parse) before the client has sent all its messages, grpcio's asyncio client may report this instead of the
# server's status. It is the client's write failing after the answer, not the stage: counted apart.
CLIENT_SIDE_INTERNAL = "Internal error from Core"
ENDED_EARLY = "ENDED_EARLY"


@dataclass(frozen=True, slots=True)
class FuzzCase:
    """One Push call's messages, already serialized (random bytes need not parse)."""

    name: str
    messages: tuple[bytes, ...]


@dataclass(slots=True)
class FuzzReport:
    """How the stage answered each case: its gRPC status code, counted per case name and per code."""

    statuses: Counter[str] = field(default_factory=Counter)
    by_case: Counter[str] = field(default_factory=Counter)
    by_case_status: Counter[tuple[str, str]] = field(default_factory=Counter)
    details: dict[tuple[str, str], str] = field(default_factory=dict)   # the first answer's text of each pair

    @property
    def num_cases(self) -> int:
        return sum(self.by_case.values())


@dataclass(frozen=True, slots=True)
class Target:
    """What the fuzzer knows of a stage: its assignment, hidden size and vocabulary, and an origin address."""

    assignment_id: str
    hidden_size: int
    vocab_size: int
    origin: str


def stage_cases(rng: random.Random, target: Target) -> Iterator[FuzzCase]:
    """Endless cases: 15% random bytes, 15% bit flips, the rest a valid session broken in one named way."""
    mutations = _mutations(target)
    while True:
        roll = rng.random()
        if roll < 0.15:
            sizes = [rng.randrange(0, 4096) for _ in range(rng.randint(1, 3))]
            yield FuzzCase("random bytes", tuple(rng.randbytes(n) for n in sizes))
        elif roll < 0.3:
            session_id = _session_id()
            valid = (_open(target, session_id), _batch(rng, target, session_id, 3))
            yield FuzzCase("bit flips", tuple(_flip(rng, m.SerializeToString()) for m in valid))
        else:
            name, mutate = rng.choice(mutations)
            session_id = _session_id()
            yield FuzzCase(name, tuple(m.SerializeToString() for m in mutate(rng, session_id)))


async def fuzz_stage(channel: grpc.aio.Channel, cases: Iterator[FuzzCase], num_cases: int,
                     report: FuzzReport, timeout_s: float = 10.0) -> None:
    """Sends num_cases cases, one Push call each, and records how each call ended."""
    push = channel.stream_unary(PUSH, request_serializer=None, response_deserializer=pb.PushSummary.FromString)
    for case in (next(cases) for _ in range(num_cases)):
        try:
            await push(iter(case.messages), timeout=timeout_s)
            code, details = "OK", ""
        except grpc.aio.AioRpcError as exc:
            code, details = exc.code().name, exc.details() or ""
            if code == "INTERNAL" and details == CLIENT_SIDE_INTERNAL:
                code = ENDED_EARLY
        report.details.setdefault((case.name, code), details)
        report.statuses[code] += 1
        report.by_case[case.name] += 1
        report.by_case_status[case.name, code] += 1


def _session_id() -> str:
    return f"fuzz-{uuid.uuid4().hex}"


def _open(target: Target, session_id: str, prompt: tuple[int, ...] = (1, 2, 3)) -> pb.StageMessage:
    return pb.StageMessage(open=pb.SessionOpen(
        session_id=session_id, assignment_id=target.assignment_id, origin=target.origin,
        sampling=pb.SamplingParams(temperature=0.0, top_p=1.0), prompt_token_ids=list(prompt)))


def _tensor(rng: random.Random, rows: int, width: int, dtype: str = "float32") -> pb.Tensor:
    size = {"float32": 4, "float16": 2, "bfloat16": 2}[dtype]
    return pb.Tensor(dtype=dtype, shape=[rows, width], data=rng.randbytes(rows * width * size), codec="raw")


def _batch(rng: random.Random, target: Target, session_id: str, num_tokens: int, start_pos: int = 0,
           hidden: pb.Tensor | None = None) -> pb.StageMessage:
    chunk = pb.StepChunk(session_id=session_id, step=0, start_pos=start_pos,
                         token_ids=[rng.randrange(target.vocab_size) for _ in range(num_tokens)], sample=True)
    hidden = hidden if hidden is not None else _floats(num_tokens, target.hidden_size, 0.5)
    return pb.StageMessage(batch=pb.StepBatch(chunks=[chunk], hidden=hidden))


def _floats(rows: int, width: int, value: float) -> pb.Tensor:
    data = struct.pack(f"{rows * width}f", *[value] * (rows * width))
    return pb.Tensor(dtype="float32", shape=[rows, width], data=data, codec="raw")


def _flip(rng: random.Random, data: bytes) -> bytes:
    flipped = bytearray(data)
    for _ in range(rng.randint(1, 8)):
        if flipped:
            flipped[rng.randrange(len(flipped))] ^= 1 << rng.randrange(8)
    return bytes(flipped)


Mutation = Callable[[random.Random, str], list[pb.StageMessage]]


def _mutations(t: Target) -> list[tuple[str, Mutation]]:
    """Named ways to break a session that opens validly: each returns the messages to send in order."""
    h = t.hidden_size

    def opened(*rest: Callable[[random.Random, str], pb.StageMessage]) -> Mutation:
        return lambda rng, sid: [_open(t, sid), *(make(rng, sid) for make in rest)]

    def tensor(make: Callable[[random.Random], pb.Tensor], rows: int = 3) -> Callable:
        return lambda rng, sid: _batch(rng, t, sid, rows, hidden=make(rng))

    def int8(scales: Callable[[random.Random], pb.Tensor | None]) -> Callable:
        def make(rng: random.Random) -> pb.Tensor:
            blob = pb.Tensor(dtype="float32", shape=[3, h], data=rng.randbytes(3 * h), codec="int8")
            if (s := scales(rng)) is not None:
                blob.scales.CopyFrom(s)
            return blob
        return make

    nan, inf = math.nan, math.inf
    return [
        ("truncated tensor", opened(tensor(lambda rng: _truncate(_tensor(rng, 3, h))))),
        ("extra tensor bytes", opened(tensor(lambda rng: _pad(_tensor(rng, 3, h))))),
        ("unknown dtype", opened(tensor(lambda rng: _retype(_tensor(rng, 3, h), "float64")))),
        ("unknown codec", opened(tensor(lambda rng: _recodec(_tensor(rng, 3, h), "zstd")))),
        ("wrong hidden width", opened(tensor(lambda rng: _tensor(rng, 3, h + 1)))),
        ("rows are not the tokens", opened(tensor(lambda rng: _tensor(rng, 5, h)))),
        ("a third dimension", opened(tensor(lambda rng: pb.Tensor(dtype="float32", shape=[3, h, 1],
                                                                  data=rng.randbytes(12 * h), codec="raw")))),
        ("negative dimension", opened(tensor(lambda rng: pb.Tensor(dtype="float32", shape=[3, -h], codec="raw")))),
        ("huge declared shape", opened(tensor(lambda rng: pb.Tensor(dtype="float32", shape=[3, 1 << 40],
                                                                    data=b"\0" * 64, codec="raw")))),
        ("NaN activations", opened(tensor(lambda rng: _floats(3, h, nan)))),
        ("infinite activations", opened(tensor(lambda rng: _floats(3, h, inf)))),
        ("huge activations", opened(tensor(lambda rng: _floats(3, h, 3e38)))),
        ("float16 noise", opened(tensor(lambda rng: _tensor(rng, 3, h, "float16")))),
        ("bfloat16 noise", opened(tensor(lambda rng: _tensor(rng, 3, h, "bfloat16")))),
        ("int8 without scales", opened(tensor(int8(lambda rng: None)))),
        ("int8 scales too short", opened(tensor(int8(lambda rng: _floats(1, 2, 0.1))))),
        ("int8 NaN scales", opened(tensor(int8(lambda rng: pb.Tensor(
            dtype="float32", shape=[3], data=struct.pack("3f", nan, nan, nan), codec="raw"))))),
        ("token id past the vocabulary", opened(lambda rng, sid: _token_batch(rng, t, sid, [t.vocab_size + 7]))),
        ("negative token id", opened(lambda rng, sid: _token_batch(rng, t, sid, [-3]))),
        ("position far past the prompt", opened(lambda rng, sid: _batch(rng, t, sid, 3, start_pos=1 << 30))),
        ("negative position", opened(lambda rng, sid: _batch(rng, t, sid, 3, start_pos=-5))),
        ("empty chunk list", opened(lambda rng, sid: pb.StageMessage(batch=pb.StepBatch(hidden=_floats(1, h, 0.))))),
        ("batch without hidden", opened(lambda rng, sid: pb.StageMessage(batch=pb.StepBatch(
            chunks=[pb.StepChunk(session_id=sid, token_ids=[1])])))),
        ("chunk of an unknown session", lambda rng, sid: [_batch(rng, t, sid, 3)]),
        ("decode before any prefill", opened(lambda rng, sid: _batch(rng, t, sid, 1, start_pos=3))),
        ("prefill twice", opened(lambda rng, sid: _batch(rng, t, sid, 3), lambda rng, sid: _batch(rng, t, sid, 3))),
        ("close twice", opened(lambda rng, sid: pb.StageMessage(close=pb.SessionClose(session_id=sid)),
                               lambda rng, sid: pb.StageMessage(close=pb.SessionClose(session_id=sid)))),
        ("open twice", opened(lambda rng, sid: _open(t, sid))),
        ("empty session id", lambda rng, sid: [_open(t, "")]),
        ("overlong session id", lambda rng, sid: [_open(t, "s" * 100_000)]),
        ("another stage's assignment", lambda rng, sid: [pb.StageMessage(open=pb.SessionOpen(
            session_id=sid, assignment_id="not-here", origin=t.origin, prompt_token_ids=[1]))]),
        ("origin that does not answer", lambda rng, sid: [pb.StageMessage(open=pb.SessionOpen(
            session_id=sid, assignment_id=t.assignment_id, origin="127.0.0.1:9", prompt_token_ids=[1, 2, 3])),
            _batch(rng, t, sid, 3)]),
        ("origin that is not an address", lambda rng, sid: [pb.StageMessage(open=pb.SessionOpen(
            session_id=sid, assignment_id=t.assignment_id, origin="\x00::/nowhere", prompt_token_ids=[1]))]),
        ("route longer than its assignments", lambda rng, sid: [pb.StageMessage(open=pb.SessionOpen(
            session_id=sid, assignment_id=t.assignment_id, origin=t.origin, route=["127.0.0.1:9"]))]),
        ("route to a dead stage", lambda rng, sid: [pb.StageMessage(open=pb.SessionOpen(
            session_id=sid, assignment_id=t.assignment_id, origin=t.origin, route=["127.0.0.1:9"],
            route_assignments=["x"], prompt_token_ids=[1, 2, 3])), _batch(rng, t, sid, 3)]),
        ("cached tokens beyond the prompt", lambda rng, sid: [pb.StageMessage(open=pb.SessionOpen(
            session_id=sid, assignment_id=t.assignment_id, origin=t.origin, prompt_token_ids=[1],
            max_cached_tokens=50))]),
        ("a prompt of 100,000 tokens", lambda rng, sid: [_open(t, sid, tuple(rng.randrange(t.vocab_size)
                                                                            for _ in range(100_000)))]),
        ("bad sampling", lambda rng, sid: [pb.StageMessage(open=pb.SessionOpen(
            session_id=sid, assignment_id=t.assignment_id, origin=t.origin, prompt_token_ids=[1],
            sampling=pb.SamplingParams(temperature=-1.0, top_k=-5, top_p=7.0)))]),
        ("bad traceparent", lambda rng, sid: [pb.StageMessage(open=pb.SessionOpen(
            session_id=sid, assignment_id=t.assignment_id, origin=t.origin, prompt_token_ids=[1],
            traceparent="00-zz"))]),
        ("no kind set", lambda rng, sid: [pb.StageMessage()]),
    ]


def _token_batch(rng: random.Random, t: Target, sid: str, token_ids: list[int]) -> pb.StageMessage:
    chunk = pb.StepChunk(session_id=sid, step=0, start_pos=0, token_ids=token_ids, sample=True)
    return pb.StageMessage(batch=pb.StepBatch(chunks=[chunk], hidden=_floats(len(token_ids), t.hidden_size, 0.1)))


def _truncate(blob: pb.Tensor) -> pb.Tensor:
    blob.data = blob.data[: len(blob.data) // 2]
    return blob


def _pad(blob: pb.Tensor) -> pb.Tensor:
    blob.data = blob.data + b"\0" * 7
    return blob


def _retype(blob: pb.Tensor, dtype: str) -> pb.Tensor:
    blob.dtype = dtype
    return blob


def _recodec(blob: pb.Tensor, codec: str) -> pb.Tensor:
    blob.codec = codec
    return blob


async def fuzz_concurrently(channels: dict[str, grpc.aio.Channel], targets: dict[str, Target], num_cases: int,
                            seed: int, timeout_s: float = 10.0) -> dict[str, FuzzReport]:
    """Fuzzes every stage at once, num_cases each, each call given timeout_s; the report per stage address."""
    reports = {address: FuzzReport() for address in channels}
    await asyncio.gather(*(fuzz_stage(channels[a], stage_cases(random.Random(f"{seed}-{a}"), targets[a]),
                                      num_cases, reports[a], timeout_s) for a in channels))
    return reports
