"""A mesh that outlives a dead agent: `stratamesh up` and `Mesh.local` start a killed agent again under its id,
and the streams in flight finish through the re-planned pipeline meanwhile, identical to an undisturbed run."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from stratamesh.bench.chaos import (FailoverRun, StreamJob, disturb_stage_mid_stream, kill_stage_mid_stream,
                                    make_jobs, wait_for_failover)
from stratamesh.bench.datasets import regular_token_ids
from stratamesh.bench.margins import decisive
from stratamesh.launcher import children
from stratamesh.sdk import Mesh

from .streams import held, settled_requests, which_diverged

pytestmark = pytest.mark.slow

MODEL = "tiny-llama"
START_TIMEOUT_S = 240.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Up:
    """`stratamesh up` as an operator runs it, with what it prints kept for the test."""

    def __init__(self, model_dir: Path, agents: int, stages: int, cwd: Path) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "stratamesh.cli", "up", "--model", str(model_dir), "--agents", str(agents),
             "--stages", str(stages), "--http-port", str(free_port())],
            cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
            env={**os.environ, "STRATAMESH_HOME": str(cwd / "state")})     # a mesh of its own, not the user's
        self.lines: list[str] = []
        self._changed = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()
        self.wait_for_line(r"Ctrl-C stops every process", START_TIMEOUT_S)
        self.url = self.wait_for_line(r"API\s+(http://\S+)/v1", 1).group(1)
        key = self.wait_for_line(r"API key (\S+)", 1).group(1)
        self.headers = {"Authorization": f"Bearer {key}"}

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            with self._changed:
                self.lines.append(line.rstrip("\n"))
                self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()

    def wait_for_line(self, pattern: str, timeout_s: float) -> re.Match[str]:
        """The first line printed so far or until timeout_s that matches pattern."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while True:
                for line in self.lines:
                    if match := re.search(pattern, line):
                        return match
                left = deadline - time.monotonic()
                if left <= 0 or self.process.poll() is not None:
                    raise AssertionError(f"`up` printed no line like {pattern!r}:\n" + "\n".join(self.lines))
                self._changed.wait(min(left, 1.0))

    def agents(self) -> dict[str, dict]:
        return agents(self.url, self.headers)

    def kill_agent_at(self, address: str) -> str:
        """kill -9 of the agent process serving at address; returns its agent id."""
        (agent_id,) = [a for a, record in self.agents().items() if record["address"] == address]
        (pid,) = [pid for pid in children(self.process.pid) if f"--agent-id\0{agent_id}\0" in cmdline(pid)]
        os.kill(pid, signal.SIGKILL)
        return agent_id

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
        try:
            return self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            return self.process.wait()


def agents(url: str, headers: dict[str, str]) -> dict[str, dict]:
    """Every agent the coordinator knows, by id (GET /admin/api/agents)."""
    return {a["agent_id"]: a for a in httpx.get(f"{url}/admin/api/agents", headers=headers).json()["agents"]}


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text()
    except OSError:
        return ""


def rejoined(agents: dict[str, dict], agent_id: str, since: float) -> bool:
    """Whether the agent has connected again after the time since (wall clock)."""
    record = agents.get(agent_id, {})
    return record.get("state") == "connected" and record.get("state_since", 0) > since


def wait_until(condition, timeout_s: float = 120.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not (ok := condition()) and time.monotonic() < deadline:
        time.sleep(0.2)
    return ok


def check_streams(run: FailoverRun, jobs: list[StreamJob], model_dir: Path) -> None:
    assert [o.error for o in run.reference + run.outcomes if o.error] == []
    assert [o.tokens for o in run.outcomes] == [r.tokens for r in run.reference], which_diverged(   # none repeated,
        model_dir, jobs, reference=run.reference, failover=run.outcomes)                            # none missing
    assert all(run.killed_address not in route for route in run.routes_after)


def test_up_restarts_a_killed_agent_and_every_stream_finishes_identically(tiny_models: dict[str, Path],
                                                                           tmp_path: Path) -> None:
    """`stratamesh up --agents 4 --stages 3` (a spare), 6 streams, kill -9 of the middle stage's agent."""
    model_dir = tiny_models["llama"]
    jobs = decisive(make_jobs(6, regular_token_ids(model_dir), prompt_len=20, max_tokens=64, seed=11), model_dir)
    up = Up(model_dir, agents=4, stages=3, cwd=tmp_path)
    try:
        before = time.time()
        killed: list[str] = []

        async def kill(run: FailoverRun, outcomes: list) -> None:
            killed.append(up.kill_agent_at(run.killed_address))
            await wait_for_failover(up.url, up.headers, run.killed_address)

        run = asyncio.run(disturb_stage_mid_stream(up.url, up.headers, MODEL, held(jobs), 1, 16, kill))
        (agent_id,) = killed
        back = up.wait_for_line(rf"agent\d \({re.escape(agent_id)}\) is back", 120)
        assert wait_until(lambda: rejoined(up.agents(), agent_id, before)), up.agents()[agent_id]
        health = httpx.get(f"{up.url}/health").json()
        # an agent the operator revokes is refused by the mesh: it stays down, and the mesh serves on
        victim = next(a for a in up.agents() if a != agent_id)
        assert httpx.post(f"{up.url}/admin/api/agents/{victim}/revoke", headers=up.headers).status_code == 200
        up.wait_for_line(rf"\({re.escape(victim)}\) was refused by the mesh \(revoked\?\); it stays down", 120)
        assert wait_until(lambda: httpx.get(f"{up.url}/health").json().get("status") == "ok")
        assert up.process.poll() is None
    finally:
        code = up.stop()
    check_streams(run, jobs, model_dir)
    assert up.wait_for_line(rf"\({re.escape(agent_id)}\) exited with status -9; restarting it in 1 s", 0)
    assert health["status"] == "ok" and health["num_agents"] == 4
    assert not [line for line in up.lines if re.search(rf"\({re.escape(victim)}\) (is back|exited)", line)]
    assert code == 0, "\n".join(up.lines)
    print(f"\n{back.string.strip()}; the 6 streams finished identical to an undisturbed run")


def test_mesh_local_restarts_a_killed_agent_under_its_id(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    model_dir = tiny_models["llama"]
    jobs = decisive(make_jobs(6, regular_token_ids(model_dir), prompt_len=20, max_tokens=64, seed=12), model_dir)
    with Mesh.local(model_dir, agents=4, stages=3, log_dir=str(tmp_path / "logs"),
                    db=str(tmp_path / "registry.db")) as mesh:
        processes = mesh.local_mesh
        before = time.time()
        run = asyncio.run(kill_stage_mid_stream(processes, MODEL, held(jobs), stage=1))
        index = run.killed_index     # (read at the kill: the restarted agent listens at another address)
        agent_id = processes.agent_ids[index]
        assert wait_until(lambda: processes.supervisor.restarts.get(index) == 1)
        assert wait_until(lambda: rejoined(agents(processes.url, processes.headers), agent_id, before))
        assert [a.state for a in mesh.agents()].count("connected") == 4
        records = settled_requests(processes, 6)
        assert processes.agents[index].poll() is None
    check_streams(run, jobs, model_dir)
    assert all(r["num_failovers"] >= 1 and r["state"] == "finished" for r in records)
