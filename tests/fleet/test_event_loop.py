"""A daemon's event loop: uvloop's unless STRATAMESH_EVENT_LOOP=asyncio says otherwise."""

from __future__ import annotations

import asyncio

import pytest
import uvloop

from stratamesh.fleet.errors import InvalidInput
from stratamesh.fleet.event_loop import event_loop_name, new_event_loop, run


def test_daemons_run_on_uvloop_unless_asyncio_is_asked_for() -> None:
    for environ, kind in (({}, uvloop.Loop), ({"STRATAMESH_EVENT_LOOP": "uvloop"}, uvloop.Loop),
                          ({"STRATAMESH_EVENT_LOOP": "asyncio"}, asyncio.BaseEventLoop)):
        loop = new_event_loop(environ)
        try:
            assert isinstance(loop, kind) and isinstance(loop, uvloop.Loop) == (kind is uvloop.Loop), (environ, loop)
        finally:
            loop.close()
    with pytest.raises(InvalidInput, match="STRATAMESH_EVENT_LOOP must be one of uvloop, asyncio, not 'trio'"):
        event_loop_name({"STRATAMESH_EVENT_LOOP": "trio"})

    async def which() -> type:
        return type(asyncio.get_running_loop())

    assert issubclass(run(which()), uvloop.Loop)      # run() is asyncio.run on that loop
