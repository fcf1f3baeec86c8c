"""Agents and coordinators forked from a fork server (stratamesh/forkserver.py) instead of started as new
interpreters: what a local mesh's launcher uses where STRATAMESH_FORK_SERVER=1 (the test suite sets it); each agent's
start then costs its box ~1.8 CPU seconds less (torch is imported once, by the server), a coordinator's ~0.6 s.

ForkedProcess stands for a forked child as subprocess.Popen does for a started one (pid, args, stdout, poll, wait,
send_signal, kill, returncode): the launcher and its supervisor treat both alike."""

from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from typing import IO

FORK_SERVER_ENV = "STRATAMESH_FORK_SERVER"   # "1": a local mesh's agents on this box are forked from a fork server
# Variables that the server's imports (torch and its OpenMP, CUDA, Python itself) read as they load: a child whose
# environment differs from the server's in one of them is started as a new interpreter instead.
IMPORT_TIME_PREFIXES = ("OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS_", "CUDA_", "TORCH", "PYTORCH_", "TRITON_",
                        "PYTHON", "LD_")
# ... but for these, which nothing in the server reads: torch writes inductor's cache folder into its own process's
# environment once anything asks for it (the ONNX exporter, a compiled kernel), and the agent's probe sets
# CUDA_DEVICE_ORDER, which CUDA reads as it initializes (in the child), in whatever process calls it, a test's
# included. Either, inherited from the process that starts a mesh, kept its agents from forking: 79 of the suite's
# agents in one run, ~2 s of CPU each.
NOT_READ_BY_THE_SERVER = frozenset({"TORCHINDUCTOR_CACHE_DIR", "CUDA_DEVICE_ORDER"})


def wanted(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether this process's local meshes fork their agents (STRATAMESH_FORK_SERVER=1)."""
    return environ.get(FORK_SERVER_ENV) == "1"


class ForkedProcess:
    """A child of the fork server, as a Popen: its exit code comes over its status socket."""

    def __init__(self, args: list[str], pid: int, status: socket.socket, stdout: IO[bytes], pending: bytes) -> None:
        self.args, self.pid, self.stdout = args, pid, stdout
        self.returncode: int | None = None
        self._status, self._pending, self._orphan = status, pending, False

    def poll(self) -> int | None:
        if self.returncode is None:
            self._read(0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self._read(timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def _read(self, timeout: float | None) -> None:
        """Takes "exit CODE" if it comes within timeout (None: however long it takes)."""
        if b"\n" not in self._pending and not self._orphan:
            self._status.settimeout(timeout)
            try:
                data = self._status.recv(64)
            except (TimeoutError, BlockingIOError):
                return
            except OSError:
                data = b""
            self._pending += data
            self._orphan = not data     # the server ended before its child: the child's code ends with it
        if b"\n" in self._pending:
            self.returncode = int(self._pending.split()[1])
        elif self._orphan and not _alive(self.pid):
            self.returncode = -signal.SIGKILL


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True         # (PermissionError too: it exists, another user's)


class ForkServer:
    """The fork server of this process: started on the first fork, ended with this process."""

    def __init__(self, environ: Mapping[str, str]) -> None:
        self._environ = dict(environ)
        self._control, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.process = subprocess.Popen([sys.executable, "-m", "stratamesh.forkserver", str(theirs.fileno())],
                                        pass_fds=[theirs.fileno()], env=self._environ, start_new_session=True,
                                        stdin=subprocess.DEVNULL)
        theirs.close()
        self._lock = threading.Lock()
        atexit.register(self.close)

    def can_fork(self, environ: Mapping[str, str]) -> bool:
        """Whether a child with this environment may be forked: it agrees with the server's on what imports read."""
        return all(environ.get(name) == self._environ.get(name) for name in {*environ, *self._environ}
                   if name.startswith(IMPORT_TIME_PREFIXES) and name not in NOT_READ_BY_THE_SERVER)

    def fork(self, argv: Sequence[str], environ: Mapping[str, str], stderr: int) -> ForkedProcess:
        """A child running `stratamesh ARGV` with this environment; its stdout is a pipe, its stderr the fd given."""
        read_end, write_end = os.pipe()
        status, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        request = json.dumps({"argv": list(argv), "env": dict(environ), "cwd": os.getcwd()}).encode()
        try:
            with self._lock:
                socket.send_fds(self._control, [request], [write_end, stderr, theirs.fileno()])
        finally:
            os.close(write_end)
            theirs.close()
        received = b""
        while b"\n" not in received:
            chunk = status.recv(64)
            if not chunk:
                os.close(read_end)
                raise OSError("the fork server ended before it forked")
            received += chunk
        line, rest = received.split(b"\n", 1)      # ("pid N", and "exit CODE" if the child ended at once)
        return ForkedProcess([sys.executable, "-m", "stratamesh.cli", *argv], int(line.split()[1]), status,
                             os.fdopen(read_end, "rb"), rest)

    def close(self) -> None:
        self._control.close()       # the server ends; its children go on
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()


_server: ForkServer | None = None
_server_lock = threading.Lock()


def fork_server(environ: Mapping[str, str] | None = None) -> ForkServer:
    """This process's fork server, started on first use with the environment given (default: this process's): that
    of the first child to fork, so that the variables read as the server starts (PYTHONUNBUFFERED, ...) are the
    children's."""
    global _server
    with _server_lock:
        if _server is None or _server.process.poll() is not None:
            _server = ForkServer(os.environ if environ is None else environ)
        return _server
