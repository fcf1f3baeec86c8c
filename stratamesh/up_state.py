"""`stratamesh up`'s mesh between runs: one private folder holds its name, registry, CA, the agents' keys, the
bootstrap credentials and the logs, and the next `up` starts the same mesh from it (`--fresh`: a new one)."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from stratamesh.coordinator.registry import Registry
from stratamesh.fleet.state import UP_REGISTRY, make_private_dir, write_private

MESH_FILE = "mesh.json"


@dataclass(frozen=True, slots=True)
class UpState:
    """The folder of `up`'s mesh and what opening it did."""

    folder: Path
    mesh: str
    reused: bool                       # False: a new mesh (the first `up`, or --fresh)
    moved_aside: Path | None = None    # --fresh: where the previous mesh's folder went

    @property
    def registry(self) -> Path:
        return self.folder / UP_REGISTRY

    @property
    def log_dir(self) -> Path:
        return self.folder / "logs"

    def describe(self) -> str:
        """What a user reads at start: which mesh, kept where, and what became of an old one."""
        if self.reused:
            return f"mesh {self.mesh}: the one kept in {self.folder} (--fresh starts a new one)"
        aside = (f"\nthe previous mesh's folder was moved to {self.moved_aside} (delete it once you no longer need it)"
                 if self.moved_aside else "")
        return f"mesh {self.mesh}: a new one, kept in {self.folder} for the next `stratamesh up`{aside}"


def open_up_state(folder: Path, fresh: bool, now: float) -> UpState:
    """The mesh kept in folder, or a new one made there (folder 0700); fresh moves an existing one aside first."""
    moved = _move_aside(folder, now) if fresh and folder.exists() else None
    make_private_dir(folder)
    mesh = _stored_mesh(folder / MESH_FILE)
    if mesh:
        return UpState(folder, mesh, reused=True)
    mesh = f"local-{uuid.uuid4().hex[:8]}"
    write_private(folder / MESH_FILE, json.dumps({"mesh": mesh}).encode())
    return UpState(folder, mesh, reused=False, moved_aside=moved)


def forget_last_run(state: UpState) -> None:
    """Drops the models and plans of the previous `up` from the registry it kept: this one starts every agent
    afresh and serves the model, agents and stages asked for now. Credentials, the CA and events stay."""
    if not state.registry.exists():
        return
    registry = Registry(str(state.registry))
    try:
        registry.forget_models()
    finally:
        registry.close()


def _stored_mesh(path: Path) -> str:
    try:
        mesh = json.loads(path.read_text()).get("mesh", "")
    except (OSError, ValueError, AttributeError):
        return ""
    return mesh if isinstance(mesh, str) else ""


def _move_aside(folder: Path, now: float) -> Path:
    """Renames folder to <name>.<date-time> beside it (.2, .3, ... if that is taken); returns the new path."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    target = folder.with_name(f"{folder.name}.{stamp}")
    number = 1
    while target.exists():
        number += 1
        target = folder.with_name(f"{folder.name}.{stamp}.{number}")
    folder.rename(target)
    return target
