"""`stratamesh up`'s mesh folder: made once, found again by the next `up`, moved aside by --fresh."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from stratamesh.coordinator.access import AccessStore
from stratamesh.coordinator.registry import StageRecord, Registry
from stratamesh.fleet.stages import StageSpec
from stratamesh.up_state import forget_last_run, open_up_state

NOW = 1_800_000_000.0


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_the_first_up_makes_a_mesh_and_the_next_finds_it(tmp_path: Path) -> None:
    old_umask = os.umask(0)
    try:
        first = open_up_state(tmp_path / "home" / "up", fresh=False, now=NOW)
    finally:
        os.umask(old_umask)
    assert not first.reused and first.mesh.startswith("local-")
    assert (mode(tmp_path / "home"), mode(first.folder), mode(first.folder / "mesh.json")) == (0o700, 0o700, 0o600)
    assert "a new one, kept in" in first.describe()
    again = open_up_state(tmp_path / "home" / "up", fresh=False, now=NOW + 60)
    assert (again.reused, again.mesh, again.registry) == (True, first.mesh, tmp_path / "home" / "up" / "registry.db")
    assert "--fresh starts a new one" in again.describe()


def test_fresh_moves_the_old_mesh_aside_and_starts_a_new_one(tmp_path: Path) -> None:
    folder = tmp_path / "up"
    old = open_up_state(folder, fresh=False, now=NOW)
    (folder / "registry.db").write_text("the old mesh's")
    new = open_up_state(folder, fresh=True, now=NOW)
    assert not new.reused and new.mesh != old.mesh and not (folder / "registry.db").exists()
    assert new.moved_aside is not None and (new.moved_aside / "registry.db").read_text() == "the old mesh's"
    assert str(new.moved_aside) in new.describe()
    newer = open_up_state(folder, fresh=True, now=NOW)        # the same second: another name, nothing lost
    assert newer.moved_aside not in (None, new.moved_aside) and new.moved_aside.exists()


def test_fresh_without_an_old_mesh_moves_nothing(tmp_path: Path) -> None:
    state = open_up_state(tmp_path / "up", fresh=True, now=NOW)
    assert state.moved_aside is None and list(tmp_path.iterdir()) == [tmp_path / "up"]


def test_the_next_up_forgets_the_last_runs_models_and_plans_but_keeps_its_keys(tmp_path: Path) -> None:
    state = open_up_state(tmp_path / "up", fresh=False, now=NOW)
    forget_last_run(state)
    assert not state.registry.exists(), "no registry is made before the coordinator makes one"
    registry = Registry(str(state.registry))
    key, _ = AccessStore(registry).create_key("operator", "bootstrap", NOW)
    registry.add_model("old", "/models/old", 8, {}, now=NOW)
    stages = [StageRecord(f"p-{i}", i, f"a{i}", StageSpec("old", "/models/old", 4 * i, 4 * i + 4, 8))
              for i in range(2)]
    registry.save_plan("p", "old", stages, "two agents", now=NOW)
    registry.close()
    forget_last_run(open_up_state(tmp_path / "up", fresh=False, now=NOW))
    registry = Registry(str(state.registry))
    try:
        assert registry.models() == [] and registry.active_plan("old") is None
        assert AccessStore(registry).check_key(key, NOW) is not None
    finally:
        registry.close()
