"""The docs stand on their own: every relative link in the README and docs/ names a file of the repo, and nothing in
the repo points outside it (a clone holds the repo alone)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def relative_links(text: str) -> list[str]:
    """The targets of a page's markdown links that are paths (not URLs, not anchors), without their #fragment."""
    targets = (m.split("#", 1)[0] for m in LINK.findall(text))
    return [t for t in targets if t and not re.match(r"[a-z][a-z0-9+.-]*:", t)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_names_a_file_of_the_repo(page: Path) -> None:
    links = relative_links(page.read_text())
    missing = [t for t in links if not (page.parent / t).resolve().is_relative_to(ROOT)
               or not (page.parent / t).exists()]
    assert missing == []


def test_the_readme_links_to_the_architecture_page() -> None:
    assert "docs/architecture.md" in relative_links((ROOT / "README.md").read_text())


def test_the_link_check_catches_a_missing_file_and_a_way_out() -> None:
    assert relative_links("see [a](docs/a.md#x), [b](https://x.org/b) and [c](#here)") == ["docs/a.md"]
    page = ROOT / "README.md"
    for target in ("docs/no-such-page.md", "../outside/page.md"):
        assert not ((page.parent / target).resolve().is_relative_to(ROOT) and (page.parent / target).exists())


def test_nothing_in_the_repo_points_outside_it() -> None:
    found = subprocess.run(["git", "grep", "-n", "-I", "-E", r"\.\./shared|\b(DESIGN|ENVIRONMENT|STYLE)\.md", "--",
                            ".", ":!tests/test_docs.py"], cwd=ROOT, capture_output=True, text=True)
    if found.returncode not in (0, 1):
        pytest.skip(f"not a git checkout: {found.stderr.strip()}")
    assert found.stdout == ""
