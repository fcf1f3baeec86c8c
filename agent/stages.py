"""The stages this agent serves: one engine per assignment, loaded off the event loop."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable
import threading
from pathlib import Path
from typing import TypeVar

from stratamesh.agent.engine.stage_engine import EngineConfig, StageEngine
from stratamesh.agent.engine.stage_runner import StageRunner
from stratamesh.fleet.errors import InvalidInput
from stratamesh.fleet.kv import KvEvents
from stratamesh.fleet.stages import Assignment, StageSpec

log = logging.getLogger(__name__)

RELEASED_KEEP_S = 10.0
T = TypeVar("T")


async def in_own_thread(fn: Callable[[], T]) -> T:
    """fn's result, computed on a new thread that ends when fn returns."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[T] = loop.create_future()

    def settle(result: T | None, exc: BaseException | None) -> None:
        if not done.done():     # nobody waits any more if the caller was cancelled
            done.set_exception(exc) if exc is not None else done.set_result(result)

    def work() -> None:
        try:
            result = fn()
        except BaseException as exc:  # noqa: BLE001  handed to the awaiting caller
            loop.call_soon_threadsafe(settle, None, exc)
        else:
            loop.call_soon_threadsafe(settle, result, None)

    threading.Thread(target=work, name="stage-loader", daemon=True).start()
    return await done


class StageHost:
    """Loaded stages by assignment id, and which stage each open session lives on.

    Stages compute on the event loop's thread (agent.dataplane); a load runs on a thread of its own that ends with
    it, because a thread that ran torch's CPU kernels keeps an OpenMP pool that slows the loop's kernels after."""

    def __init__(self, config: EngineConfig, on_group_failure: Callable[[str], None] | None = None):
        self.config = config
        # told (from any thread) when a tensor-parallel stage's group went down: the agent cannot serve it again
        self.on_group_failure = on_group_failure
        self.engines: dict[str, StageEngine] = {}
        self.num_computed_tokens = 0        # tokens all stages have run through their layers, ever
        self.num_step_tokens = 0            # tokens of steps, a prefill chunk counting one, ever (the serving
                                            # path's work is per sequence of a step, whatever the chunk's length)
        self.layers_cpu_s = 0.0             # process CPU seconds spent inside the layers of steps, ever
        self._loading: dict[str, asyncio.Future[StageEngine]] = {}
        # The runner of the stage released last, kept briefly: a re-plan after a death releases every stage
        # and assigns the survivors theirs again under new ids; reusing it skips reading weights again.
        self._released: StageRunner | None = None

    async def load(self, assignment: Assignment, spec: StageSpec | None = None) -> int:
        """Loads a stage (once per assignment id, however often asked) as spec says (default: the assignment's
        own; agent.weights may point it at a fetched copy of its folder); returns its parameter bytes."""
        engine = self.engines.get(assignment.assignment_id)
        if engine is None:
            pending = self._loading.get(assignment.assignment_id)
            if pending is None:
                pending = asyncio.ensure_future(self._load(assignment, spec or assignment.stage))
                self._loading[assignment.assignment_id] = pending
            try:
                engine = await asyncio.shield(pending)
            finally:
                self._loading.pop(assignment.assignment_id, None)
        return engine.runner.model.param_bytes

    async def _load(self, assignment: Assignment, spec: StageSpec) -> StageEngine:
        runner, self._released = self._released, None     # dropped either way: its memory may be needed
        if runner is not None and runner.model.spec != spec:
            runner.close()
            runner = None
        if runner is None:
            config = self.config
            runner = await in_own_thread(functools.partial(
                StageRunner.load, spec, config.kv_cache_bytes, self._group_failed,
                config.gpu_memory_utilization, config.max_batch_tokens,
                config.max_batch_seqs if config.cuda_graphs else 0, onnx_threads=config.onnx_threads))
        engine = self.engines[assignment.assignment_id] = StageEngine(assignment, runner, self.config)
        return engine

    def release(self, assignment_id: str) -> None:
        """Drops a stage and every session on it (its runner is kept for RELEASED_KEEP_S, in case the same
        stage comes back under a new assignment id)."""
        engine = self.engines.pop(assignment_id, None)
        if engine is not None:
            if self._released is not None:
                self._released.close()
            runner = self._released = engine.runner
            asyncio.get_running_loop().call_later(RELEASED_KEEP_S, self._forget_released, runner)

    def _group_failed(self, reason: str) -> None:
        if self.on_group_failure is not None:
            self.on_group_failure(reason)

    def _forget_released(self, runner: StageRunner) -> None:
        if self._released is runner:
            self._released = None
            runner.close()

    def close(self) -> None:
        """Stops the other ranks of every tensor-parallel stage (the agent is going away)."""
        for runner in [e.runner for e in self.engines.values()] + [self._released]:
            if runner is not None:
                runner.close()

    def engine(self, assignment_id: str) -> StageEngine:
        engine = self.engines.get(assignment_id)
        if engine is None:
            raise InvalidInput(f"assignment_id {assignment_id!r} is not served here")
        return engine

    def engine_of(self, session_id: str, assignment_id: str = "") -> StageEngine | None:
        """The engine a session is open on, if any: that of the assignment named, when it is served here (an agent
        may serve two stages of one pipeline, on two of its GPUs, and both hold the session), else any."""
        named = self.engines.get(assignment_id)
        if named is not None:
            return named if session_id in named.sessions else None
        for engine in self.engines.values():
            if session_id in engine.sessions:
                return engine
        return None

    def assignments(self) -> list[Assignment]:
        return [engine.assignment for engine in self.engines.values()]

    def kv_events(self, resend_all: bool = False) -> list[KvEvents]:
        """Each loaded stage's prefix-cache changes since the last call; resend_all: everything each holds, for a
        coordinator that knows nothing yet (a new control stream)."""
        reports = []
        for assignment_id, engine in self.engines.items():
            blocks = engine.scheduler.block_manager
            if resend_all:
                blocks.resend_all_kv()
            if (events := blocks.take_kv_events(assignment_id)) is not None:
                reports.append(events)
        return reports

    def model_paths(self, model_id: str) -> list[Path]:
        """The folders the loaded stages of a model read their tensors from."""
        return list(dict.fromkeys(Path(e.runner.model.spec.model_path) for e in self.engines.values()
                                  if e.runner.model.spec.model_id == model_id))

    def tensor_names(self) -> list[str]:
        return sorted({n for e in self.engines.values() for n in e.runner.model.tensor_names})

    def param_bytes(self) -> int:
        return sum(engine.runner.model.param_bytes for engine in self.engines.values())

    @property
    def num_sessions(self) -> int:
        return sum(len(engine.sessions) for engine in self.engines.values())
