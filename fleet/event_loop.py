"""The event loop a daemon runs on: uvloop's (libuv), or asyncio's own.

A stage's hop crosses the event loop of the process on each side (grpc.aio wakes it for each message, and the step's
results leave from it); uvloop runs a loop's iteration and its socket wake-ups in C. On this project's 2-core VM the
hop into a stage took 50-60 us less with it (benchmarks/decode_latency.py --asyncio-too). asyncio's own loop is what
runs where uvloop is not installed (it builds for Linux and macOS), or where STRATAMESH_EVENT_LOOP=asyncio says so.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Coroutine, Mapping
from typing import Any, TypeVar

from stratamesh.fleet.errors import InvalidInput

EVENT_LOOPS = ("uvloop", "asyncio")
T = TypeVar("T")


def event_loop_name(environ: Mapping[str, str] = os.environ) -> str:
    """The loop STRATAMESH_EVENT_LOOP asks for (default uvloop), where it can run; InvalidInput for an unknown one."""
    name = environ.get("STRATAMESH_EVENT_LOOP", "") or "uvloop"
    if name not in EVENT_LOOPS:
        raise InvalidInput(f"STRATAMESH_EVENT_LOOP must be one of {', '.join(EVENT_LOOPS)}, not {name!r}")
    if name == "uvloop":
        try:
            import uvloop  # noqa: F401
        except ImportError:
            return "asyncio"
    return name


def new_event_loop(environ: Mapping[str, str] = os.environ) -> asyncio.AbstractEventLoop:
    """A new loop of the kind event_loop_name() names."""
    if event_loop_name(environ) == "uvloop":
        import uvloop
        return uvloop.new_event_loop()
    return asyncio.new_event_loop()


def run(main: Coroutine[Any, Any, T]) -> T:
    """asyncio.run(main), on a loop of the kind event_loop_name() names."""
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        return runner.run(main)
