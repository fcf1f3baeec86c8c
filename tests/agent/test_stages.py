"""The stage host: loading once per assignment, and reusing a just-released stage's weights."""

from __future__ import annotations

from pathlib import Path

import pytest

from stratamesh.agent.engine.stage_engine import EngineConfig
from stratamesh.agent.stages import StageHost
from stratamesh.fleet.stages import Assignment, StageSpec
from stratamesh.kernels.tiny_model import write_tiny_model


@pytest.fixture
def host() -> StageHost:
    return StageHost(EngineConfig(kv_cache_bytes=4 << 20))


async def test_a_released_stage_assigned_again_under_a_new_id_reuses_its_runner(host: StageHost,
                                                                                tmp_path: Path) -> None:
    model = write_tiny_model(tmp_path / "tiny", arch="llama", num_layers=4)
    first, other = StageSpec("m", str(model), 0, 2, 4), StageSpec("m", str(model), 2, 4, 4)
    await host.load(Assignment("p1-0", first))
    runner = host.engines["p1-0"].runner
    host.release("p1-0")
    assert host.assignments() == []
    await host.load(Assignment("p2-0", first))                 # the re-plan kept this stage here
    assert host.engines["p2-0"].runner is runner and host.engines["p2-0"].scheduler.num_sessions == 0
    host.release("p2-0")
    await host.load(Assignment("p3-0", other))                 # a different stage: loaded afresh
    assert host.engines["p3-0"].runner is not runner
    await host.load(Assignment("p4-0", first))                 # the kept runner was dropped by then
    assert host.engines["p4-0"].runner is not runner
