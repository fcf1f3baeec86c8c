"""A smoke run of each example in examples/: a real subprocess, as a user runs it; its exit status and output."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
SKIP = 77   # what netns_mesh.py exits with where it cannot run


@pytest.fixture(scope="module")
def cache_home(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One XDG cache for every example: the built-in model is written once, and not into ~/.cache."""
    return str(tmp_path_factory.mktemp("xdg-cache"))


def run_example(name: str, cache_home: str, *args: str, timeout_s: float = 180) -> subprocess.CompletedProcess:
    env = {**os.environ, "XDG_CACHE_HOME": cache_home, "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, str(EXAMPLES / name), *args], capture_output=True, text=True,
                          env=env, timeout=timeout_s, cwd=EXAMPLES.parent)


def assert_ok(result: subprocess.CompletedProcess, *patterns: str) -> None:
    """Exit status 0 and every pattern (a regex) found in stdout, in this order."""
    report = f"status {result.returncode}\n--- stdout\n{result.stdout}\n--- stderr\n{result.stderr[-4000:]}"
    assert result.returncode == 0, report
    position = 0
    for pattern in patterns:
        match = re.compile(pattern, re.MULTILINE).search(result.stdout, position)
        assert match, f"{pattern!r} not found in order\n{report}"
        position = match.end()


def test_quickstart(cache_home: str) -> None:
    result = run_example("quickstart.py", cache_home, "--agents", "2")
    assert_ok(result, r"^model demo-llama: context 2048 tokens, ready=True$", r"^agent agent0 .*: connected",
              r"^agent agent1 ", r"^generate: '.+' \(", r"^chat: '.+' \(\d+ prompt \+ \d+ completion tokens\)$",
              r"^chat, turn 2: '", r"^chat stream: .+", r"^unknown model -> NotFoundError: .*no-such-model",
              r"^async: 4 completions, \d+ tokens$", r"^done$")


def test_openai_client(cache_home: str) -> None:
    result = run_example("openai_client.py", cache_home)
    assert_ok(result, r"^models: demo-llama$", r"^completion: '.+' \(\d+ tokens, finish_reason=(length|stop)\)$",
              r"^chat stream: .+\n  \(\d+ tokens\)$",
              r"^unknown model -> NotFoundError \(404\): The model `no-such-model` does not exist", r"^done$")


def test_edge_cloud_residency(cache_home: str) -> None:
    result = run_example("edge_cloud_residency.py", cache_home)
    assert_ok(result, r"^  stage 0: layers \[0, \d+\) tp_degree=1 on agent\d \(site=factory, tier=edge\)$",
              r"^  stage 1: layers \[\d+, \d+\) tp_degree=1 on agent\d \(site=cloud-eu, tier=cloud\)$",
              r"^  stage 2: layers \[\d+, 6\) tp_degree=1 on agent\d \(site=factory, tier=edge\)$",
              r"^  spares: agent\d$", r"^residency holds", r"^completion: '.+'$", r"^done$")


def test_netns_mesh(cache_home: str) -> None:
    result = run_example("netns_mesh.py", cache_home)
    if result.returncode == SKIP:
        pytest.skip(result.stderr.strip())
    assert_ok(result, r"^namespaces: sm-[0-9a-f]{6}-\*$", r"^plan: 3 stages on 3 hosts$",
              *(rf"^  stage {i}: layers \[\d+, \d+\) on h\d at 10\.77\.\d+\.1\d:\d+$" for i in range(3)),
              r"^completion: '.+'$", r"^torn down: processes stopped, namespaces deleted$")
    prefix = re.search(r"^namespaces: (sm-[0-9a-f]{6})-", result.stdout, re.MULTILINE).group(1)
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert prefix not in namespaces
    assert not [pid for pid in _pids() if prefix in _cmdline(pid)], f"processes of {prefix} left running"


def _pids() -> list[int]:
    return [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()]


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return ""
