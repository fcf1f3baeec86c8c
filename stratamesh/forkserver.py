"""A fork server for a local mesh's processes: one process imports torch (and the coordinator's libraries) once, then
forks each agent and coordinator, which runs `stratamesh agent ...` or `stratamesh coordinator ...` as a fresh
interpreter would, without importing them again.

Importing torch is most of what an agent's start costs a box: ~1.8 of its ~3 CPU seconds on this project's 2-core
VM (benchmarks/mesh_start.py), paid again by every agent of every mesh a launcher starts; a coordinator's HTTP stack,
SQLite and cryptography cost it ~0.6 s more. The server imports only
what does no I/O and starts no thread that matters at import (PRELOAD: not gRPC, which must see its environment
first; see fleet/wire/polling.py), so a fork of it is as clean as a new process.

    python -m stratamesh.forkserver FD

FD is one end of an AF_UNIX SOCK_SEQPACKET pair (stratamesh.forked holds the other). Each message on it is a
JSON request {"argv": [...], "env": {...}, "cwd": "..."} with three file descriptors: the child's stdout, its stderr
and a status socket, on which the server writes "pid N" once it forked and "exit CODE" once the child ended (CODE
as subprocess's returncode: -N for a signal). The server ends when the other end of FD closes; its children go on.
"""

from __future__ import annotations

import atexit
import importlib
import json
import logging
import os
import selectors
import signal
import socket
import sys
import threading
import traceback

# what agents import (torch, numpy, the checkpoints' readers) and what the coordinator does (its HTTP stack, SQLite,
# the CA's cryptography): ~1.8 and ~0.6 s of CPU of a start, paid once here
PRELOAD = ("numpy", "torch", "safetensors", "tokenizers", "fastapi", "uvicorn", "sqlite_utils", "cryptography.x509",
           "zeroconf", "prometheus_client")
MAX_REQUEST_BYTES = 1 << 20


def main() -> None:
    for name in PRELOAD:
        importlib.import_module(name)
    control = socket.socket(fileno=int(sys.argv[1]))
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)     # (its wake-up byte is what the loop waits for)
    children: dict[int, socket.socket] = {}
    selector = selectors.DefaultSelector()
    selector.register(control, selectors.EVENT_READ)
    selector.register(wake_r, selectors.EVENT_READ)
    while True:
        for key, _ in selector.select():
            if key.fileobj is control:
                message, fds, _, _ = socket.recv_fds(control, MAX_REQUEST_BYTES, 3)
                if not message:
                    return
                _spawn(json.loads(message), fds, children, [control.fileno(), wake_r, wake_w, selector.fileno()])
            else:
                os.read(wake_r, 4096)
            _reap(children)


def _spawn(request: dict, fds: list[int], children: dict[int, socket.socket], own: list[int]) -> None:
    stdout, stderr, status_fd = fds
    status = socket.socket(fileno=status_fd)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        _child(request, stdout, stderr, [*own, *(s.fileno() for s in children.values()), status_fd])
    os.close(stdout)
    os.close(stderr)
    children[pid] = status
    status.sendall(f"pid {pid}\n".encode())


def _reap(children: dict[int, socket.socket]) -> None:
    """Tells each child's status socket how its child ended, for every child that did."""
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        sock = children.pop(pid, None)
        if sock is not None:
            try:
                sock.sendall(f"exit {os.waitstatus_to_exitcode(status)}\n".encode())
            except OSError:
                pass        # nobody listens any more
            sock.close()


def _child(request: dict, stdout: int, stderr: int, inherited: list[int]) -> None:
    """In the forked child: becomes the process `python -m stratamesh.cli ARGV` would be, runs it, exits."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for fd in inherited:
            os.close(fd)
        os.setsid()
        devnull = os.open(os.devnull, os.O_RDONLY)
        for source, target in ((devnull, 0), (stdout, 1), (stderr, 2)):
            os.dup2(source, target)
            os.close(source)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        sys.argv = [sys.argv[0], *request["argv"]]
        code = _run(request["argv"])
    except BaseException:       # noqa: BLE001  (whatever happens, the child never returns into the server's loop)
        traceback.print_exc()
    finally:
        os._exit(code)


def _run(argv: list[str]) -> int:
    """stratamesh.cli.main(argv), ended as the interpreter ends a program: its exit code."""
    code = 0
    try:
        from stratamesh.cli import main as cli_main

        cli_main(argv)
    except SystemExit as exc:
        if isinstance(exc.code, int) or exc.code is None:
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except BaseException:       # noqa: BLE001
        traceback.print_exc()
        code = 1
    threading._shutdown()       # as at an interpreter's exit: its threads joined, then its atexit functions
    atexit._run_exitfuncs()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    return code


if __name__ == "__main__":
    main()
