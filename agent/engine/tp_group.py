"""A tensor-parallel group as one stage: rank 0 (in the agent) launches, feeds and supervises the other ranks.

Each rank is a process holding its shard of the stage's weights and the KV of its own heads. Rank 0 hands
every step to the other ranks over a local pipe (pickled commands: the step's inputs and block tables), then
all ranks run the same forward; the all-reduces inside it (torch.distributed: gloo on CPU, NCCL on CUDA) keep
them in lockstep. A command waits on the pipe without a deadline, so an idle group is fine; a rank that dies
breaks the pipe or the next collective, and the whole group is failed as a unit."""

from __future__ import annotations

import datetime
import json
import logging
import pickle
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist

from stratamesh.fleet.errors import MeshError
from stratamesh.fleet.stages import StageSpec
from stratamesh.kernels.ops.paged_attention import SeqSlice

log = logging.getLogger(__name__)

COLLECTIVE_TIMEOUT_S = 120.0   # one collective; a rank stuck this long is as good as dead
START_TIMEOUT_S = 300.0        # a rank loading its shard of a large stage
WATCH_EVERY_S = 0.2


class GroupFailed(MeshError):
    """A rank of a tensor-parallel group died or fell out of step; the group is gone as a unit."""


# ------------------------------------------------------------------ commands, rank 0 -> the others
@dataclass(frozen=True, slots=True)
class Forward:
    inputs: torch.Tensor            # token ids [N] or hidden [N, hidden], on the CPU
    seqs: tuple[SeqSlice, ...]


@dataclass(frozen=True, slots=True)
class ReadKv:
    block_table: tuple[int, ...]
    num_tokens: int                 # the rank answers with its heads' KV [2, layers, num_tokens, kv heads, D]


@dataclass(frozen=True, slots=True)
class WriteKv:
    block_table: tuple[int, ...]
    kv: torch.Tensor                # every head's KV; each rank writes its own heads


@dataclass(frozen=True, slots=True)
class Stop:
    pass


# ------------------------------------------------------------------ answers, a rank -> rank 0
@dataclass(frozen=True, slots=True)
class Ready:
    pass


@dataclass(frozen=True, slots=True)
class LoadFailed:
    error: str


def send(conn: Connection, message: object) -> None:
    """Plain pickle over the pipe: Connection.send's pickler would pass tensors as shared-memory handles."""
    conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def recv(conn: Connection) -> object:
    return pickle.loads(conn.recv_bytes())


def backend_for(device: str) -> str:
    return "nccl" if device.startswith("cuda") else "gloo"


def rank_device(device: str, rank: int) -> str:
    """The device of rank: GPU base + rank on CUDA ("cuda:2" with rank 1 -> "cuda:3"), the CPU otherwise."""
    if not device.startswith("cuda"):
        return device
    base = int(device.partition(":")[2] or 0)
    return f"cuda:{base + rank}"


class Collectives:
    """A torch.distributed process group of its own (not the global one: an agent may serve several groups), and
    the time its all-reduces took."""

    def __init__(self, store: dist.Store, rank: int, world_size: int, backend: str) -> None:
        timeout = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
        if backend == "nccl":
            self.group = dist.ProcessGroupNCCL(store, rank, world_size, dist.ProcessGroupNCCL.Options())
        else:
            options = dist.ProcessGroupGloo._Options()
            options._timeout = timeout
            # a group lives on one box: its ranks talk over loopback, whatever the host's interfaces are
            options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
            self.group = dist.ProcessGroupGloo(store, rank, world_size, options)
        self.num_all_reduces = 0
        self.all_reduce_s = 0.0

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sums t over the ranks, in place; returns it. The time counted is until the sum is done on the CPU, and
        until it is queued on the device's stream on CUDA (no host sync on the hot path)."""
        start = time.perf_counter()
        self.group.allreduce([t]).wait()
        self.all_reduce_s += time.perf_counter() - start
        self.num_all_reduces += 1
        return t


def store_for(rank: int, world_size: int, port: int) -> dist.TCPStore:
    """The group's rendezvous on loopback: rank 0 serves it (port 0 picks a free one), the others dial it."""
    return dist.TCPStore("127.0.0.1", port, world_size, rank == 0, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=START_TIMEOUT_S))


@dataclass(slots=True)
class _Worker:
    rank: int
    process: subprocess.Popen
    conn: Connection


class RankGroup:
    """Rank 0's view of its group: the worker processes of ranks 1..N-1, their pipes, and the collectives."""

    def __init__(self, spec: StageSpec, num_blocks: int, num_threads: int,
                 on_failure: Callable[[str], None] | None = None) -> None:
        self.spec, self.world_size = spec, spec.tp_degree
        self._on_failure = on_failure
        self._store = store_for(0, self.world_size, 0)
        self._workers = [self._launch(rank, num_blocks, num_threads) for rank in range(1, self.world_size)]
        self.collectives: Collectives | None = None
        self.failure = ""
        self._closed = False
        self._lock = threading.Lock()

    def _launch(self, rank: int, num_blocks: int, num_threads: int) -> _Worker:
        ours, theirs = socket.socketpair()
        args = [sys.executable, "-m", "stratamesh.agent.engine.tp_worker", "--rank", str(rank),
                "--store-port", str(self._store.port), "--num-blocks", str(num_blocks),
                "--threads", str(num_threads), "--fd", str(theirs.fileno()), "--spec", _spec_arg(self.spec)]
        process = subprocess.Popen(args, pass_fds=(theirs.fileno(),))   # gloo's device is set: loopback
        theirs.close()
        return _Worker(rank, process, Connection(ours.detach()))

    def start(self) -> Collectives:
        """Waits for every rank to load its shard, then joins them in the process group (GroupFailed if one cannot)."""
        deadline = time.monotonic() + START_TIMEOUT_S
        for worker in self._workers:
            while not worker.conn.poll(0.1):
                if worker.process.poll() is not None or time.monotonic() > deadline:
                    self.close()
                    raise GroupFailed(f"rank {worker.rank} of {self.spec.model_id} "
                                      f"[{self.spec.start_layer}, {self.spec.end_layer}) did not start "
                                      f"(exit status {worker.process.poll()})")
            answer = recv(worker.conn)
            if isinstance(answer, LoadFailed):
                self.close()
                raise GroupFailed(f"rank {worker.rank} could not load its shard: {answer.error}")
        self.collectives = Collectives(self._store, 0, self.world_size, backend_for(self.spec.device))
        threading.Thread(target=self._watch, name="tp-group-watch", daemon=True).start()
        return self.collectives

    # ------------------------------------------------------------ commands
    def forward(self, inputs: torch.Tensor, seqs: tuple[SeqSlice, ...]) -> None:
        """Hands a step to the other ranks; rank 0 then runs the same forward itself."""
        self._send(Forward(inputs.cpu(), seqs))

    def read_kv(self, block_table: tuple[int, ...], num_tokens: int) -> list[torch.Tensor]:
        """The KV of ranks 1..N-1's heads for a session, in rank order."""
        self._send(ReadKv(block_table, num_tokens))
        return [self._recv(worker) for worker in self._workers]

    def write_kv(self, block_table: tuple[int, ...], kv: torch.Tensor) -> None:
        self._send(WriteKv(block_table, kv.cpu()))

    def _send(self, command: object) -> None:
        if self.failure:
            raise GroupFailed(self.failure)
        try:
            for worker in self._workers:
                send(worker.conn, command)
        except OSError as exc:
            raise self.fail(f"a rank's pipe broke: {exc}") from exc

    def _recv(self, worker: _Worker):
        try:
            return recv(worker.conn)
        except (OSError, EOFError) as exc:
            raise self.fail(f"rank {worker.rank} stopped answering: {exc}") from exc

    # ------------------------------------------------------------ supervision
    def fail(self, reason: str) -> GroupFailed:
        """Takes the whole group down (every rank killed) and reports why, once; returns the error to raise."""
        with self._lock:
            first = not self.failure and not self._closed
            if first:
                self.failure = f"tensor-parallel group of {self.spec.model_id} [{self.spec.start_layer}, " \
                               f"{self.spec.end_layer}) failed: {reason}"
        if first:
            log.error("%s; taking its %d ranks down", self.failure, self.world_size)
            self._kill()
            if self._on_failure is not None:
                self._on_failure(self.failure)
        return GroupFailed(self.failure or reason)

    def _watch(self) -> None:
        while not self._closed and not self.failure:
            for worker in self._workers:
                code = worker.process.poll()
                if code is not None and not self._closed:
                    self.fail(f"rank {worker.rank} exited with status {code}")
                    return
            time.sleep(WATCH_EVERY_S)

    def close(self) -> None:
        """Stops the other ranks (a released stage)."""
        if self._closed:
            return
        self._closed = True
        for worker in self._workers:
            try:
                send(worker.conn, Stop())
            except OSError:
                pass
        for worker in self._workers:
            try:
                worker.process.wait(timeout=5)
            except subprocess.TimeoutExpired:     # (a rank slow to stop on a busy box): killed, and reaped
                worker.process.kill()
                worker.process.wait()
            worker.conn.close()

    def _kill(self) -> None:
        for worker in self._workers:
            if worker.process.poll() is None:
                worker.process.kill()
        for worker in self._workers:
            worker.process.wait()
            worker.conn.close()

    @property
    def pids(self) -> list[int]:
        return [worker.process.pid for worker in self._workers]


def _spec_arg(spec: StageSpec) -> str:
    return json.dumps(asdict(spec))
