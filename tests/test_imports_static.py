"""Static tools resolve every stratamesh.* import to its file (docs/architecture.md, section 1): mypy, run over the
tree from the repo root with no site-packages (no installed package, no import hook to help it), finds none
unresolved, because stratamesh/<folder> is a link to the top-level <folder>/."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("fleet", "agent", "coordinator", "partitioner", "kernels")     # each is also stratamesh/<folder>, a link
CHECKED = ("stratamesh", "tests", "benchmarks", "examples")               # the folders through stratamesh/
UNRESOLVED = re.compile(r'Cannot find implementation or library stub for module named "stratamesh(\.[\w.]+)?"'
                        r'|Module "stratamesh(\.[\w.]+)?" has no attribute "\w+"')


def unresolved_imports(root: Path, paths: Sequence[str]) -> list[str]:
    """The imports of stratamesh.* modules (or of names in them) that mypy cannot resolve in root's paths, as
    'path:line: message'. Third-party imports go unresolved too (no site-packages, which is cheaper) and are left
    out: only the project's imports must resolve from the root alone, as in an editor opened on the repo."""
    run = subprocess.run([sys.executable, "-m", "mypy", "--config-file=", "--no-site-packages", "--cache-dir=/dev/null",
                          "--output=json", *paths], cwd=root, capture_output=True, text=True, timeout=300)
    assert run.returncode in (0, 1), run.stdout + run.stderr     # 1: it found errors (third-party imports, at least)
    diagnostics = [json.loads(line) for line in run.stdout.splitlines()]
    return [f"{d['file']}:{d['line']}: {d['message']}" for d in diagnostics
            if d["code"] in ("import-not-found", "attr-defined") and UNRESOLVED.fullmatch(d["message"])]


def test_every_folder_is_linked_under_stratamesh() -> None:
    packages = {p.parent.name for p in ROOT.glob("*/__init__.py")} - {"stratamesh", "tests"}
    assert packages == set(FOLDERS)
    links = {f: ROOT / "stratamesh" / f for f in FOLDERS}
    assert [f for f, link in links.items() if not link.is_symlink() or link.readlink() != Path("..", f)] == []


def test_a_static_checker_resolves_every_project_import() -> None:
    assert unresolved_imports(ROOT, CHECKED) == []


PLANTED = """\
from stratamesh.fleet import states
from stratamesh.fleet.states import AgentState
import stratamesh.no_such_module
from stratamesh.fleet import (
    no_such_module,
)
"""


@pytest.mark.parametrize("linked, paths, unresolved", [
    (True, ["stratamesh"], ["stratamesh/agent/daemon.py:3", "stratamesh/agent/daemon.py:4"]),
    (False, ["stratamesh", "fleet", "agent"], ["agent/daemon.py:1", "agent/daemon.py:2", "agent/daemon.py:3"]),
])
def test_the_check_catches_an_import_with_no_file(tmp_path: Path, linked: bool, paths: list[str],
                                                  unresolved: list[str]) -> None:
    """A tree like the repo's, with and without the links: with them only what has no file is reported; without them
    (the folders mapped by setuptools' package-dir, an import hook) every stratamesh.<folder> import is."""
    for folder in ("fleet", "agent", "stratamesh"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "__init__.py").write_text("")
    (tmp_path / "fleet" / "states.py").write_text("class AgentState:\n    pass\n")
    (tmp_path / "agent" / "daemon.py").write_text(PLANTED)
    if linked:
        for folder in ("fleet", "agent"):
            (tmp_path / "stratamesh" / folder).symlink_to(Path("..", folder))
    assert [f.split(": ")[0] for f in unresolved_imports(tmp_path, paths)] == unresolved
