"""An embedded mesh: a coordinator and agents started as processes here, with a client connected to it."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from importlib import resources
from typing import Any

from stratamesh.launcher import LocalMesh
from stratamesh.sdk.async_client import AsyncMesh
from stratamesh.sdk.client import Mesh

__all__ = ["async_local_mesh", "builtin_model_dir", "local_mesh"]


def builtin_model_dir() -> str:
    """The built-in demo model (a small Llama trained on a public-domain novel, kernels/demo_model.py), as shipped
    with the package: read where it is installed, never written."""
    return str(resources.files("stratamesh.kernels") / "data" / "demo-llama")


def builtin_draft_dir() -> str:
    """The built-in demo model's draft (speculative decoding's draft_model), as shipped beside it."""
    return str(resources.files("stratamesh.kernels") / "data" / "demo-llama-draft")


def launcher(model: str | os.PathLike[str] | None, agents: int, stages: int | None, **kwargs: Any) -> LocalMesh:
    """The LocalMesh that serves model (default: the built-in demo model) over agents processes."""
    model_dir = str(model) if model is not None else builtin_model_dir()
    kwargs.setdefault("keep_logs", False)     # an embedded mesh leaves nothing behind unless asked to
    return LocalMesh(model_dir, num_agents=agents, num_stages=stages, **kwargs)


@contextmanager
def local_mesh(model: str | os.PathLike[str] | None = None, agents: int = 3, stages: int | None = None,
               **kwargs: Any) -> Iterator[Mesh]:
    """A Mesh connected to a mesh started here, whose dead processes are started again (stratamesh/supervisor.py);
    every process is stopped on exit, also on an exception."""
    processes = launcher(model, agents, stages, **kwargs)
    try:
        processes.start().supervise()
        with Mesh(processes.url, api_key=processes.api_key or None) as mesh:
            mesh.local_mesh = processes
            yield mesh
    finally:
        processes.stop()


@asynccontextmanager
async def async_local_mesh(model: str | os.PathLike[str] | None = None, agents: int = 3, stages: int | None = None,
                           **kwargs: Any) -> AsyncIterator[AsyncMesh]:
    """An AsyncMesh connected to a mesh started here (in a thread); every process is stopped on exit."""
    processes = launcher(model, agents, stages, **kwargs)
    start = asyncio.ensure_future(asyncio.to_thread(lambda: processes.start().supervise()))
    try:
        await asyncio.shield(start)
        async with AsyncMesh(processes.url, api_key=processes.api_key or None) as mesh:
            mesh.local_mesh = processes
            yield mesh
    finally:
        # if we were cancelled while starting, the thread still spawns processes: let it finish, then stop them all
        await asyncio.wait({start})
        if not start.cancelled():
            start.exception()   # retrieved, so asyncio does not log it a second time
        await asyncio.to_thread(processes.stop)
