"""Several coordinators of one mesh on one PostgreSQL registry (docs/registry.md): one leads while it holds the
mesh's lease; a standby serves the API from its own origin, over the routes the leader writes, and its streams
outlive the leader; it takes a dead leader's lease over, and the mesh serves on from it."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from stratamesh.bench.chaos import StreamJob, StreamOutcome, make_jobs, run_streams, wait_for_tokens
from stratamesh.bench.datasets import regular_token_ids
from stratamesh.bench.margins import decisive, whole_model
from stratamesh.kernels.models.decoder import greedy_tokens
from stratamesh.launcher import LocalMesh
from stratamesh.sdk import Mesh, MeshConnectionError, Stream
from tests.patience import patient, wait_until
from .streams import held, which_diverged

pytestmark = pytest.mark.slow
psycopg = pytest.importorskip("psycopg")

LEASE_TTL_S = 3.0
MODEL = "tiny-llama"


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _lease(url: str, mesh: str) -> tuple[str, int]:
    with psycopg.connect(url) as conn:
        return conn.execute("SELECT holder, epoch FROM coordinator_lease WHERE mesh = %s", (mesh,)).fetchone()


def test_streams_through_a_standby_outlive_the_leader_and_it_takes_over_and_serves_on(
        tiny_models: dict[str, Path], tmp_path: Path, postgres_database: str) -> None:
    """The acceptance of issue 53: 2 coordinators on one PostgreSQL, 4 agents, 8 streams through the standby, kill -9
    of the leader mid-way: the standby takes the lease over, the streams finish as they did undisturbed, the agents
    move to it, a model deployed after the failover serves, and an SDK stream broken on the leader is resumed on
    the standby with the same tokens."""
    model_dir, other_dir = tiny_models["llama"], tiny_models["qwen2"]
    jobs = decisive(make_jobs(8, regular_token_ids(model_dir), prompt_len=16, max_tokens=24, seed=11), model_dir)
    http_a, grpc_a, enroll_a, http_b, grpc_b = _free_ports(5)
    # agents 0 and 2 find the leader on zeroconf (only a leader advertises), 1 and 3 are given both addresses;
    # two serve the model's 2 stages, two are spares
    listed = ["--coordinator", f"127.0.0.1:{grpc_a},127.0.0.1:{grpc_b}", "--enroll", f"127.0.0.1:{enroll_a}"]
    with LocalMesh(str(model_dir), num_agents=4, num_stages=2, db=postgres_database, http_port=http_a,
                   grpc_port=grpc_a, enroll_port=enroll_a, log_dir=str(tmp_path / "logs"),
                   coordinator_args=["--lease-ttl", str(LEASE_TTL_S)],
                   agent_args_by_index={1: listed, 3: listed}) as mesh:
        standby, standby_url = mesh.start_standby(http_b, grpc_b)
        assert _lease(postgres_database, mesh.mesh) == (f"{socket.gethostname()}:{http_a}", 1)
        wait_until(lambda: httpx.get(f"{standby_url}/health").json()["models"].get(MODEL) == "ready")
        undisturbed = asyncio.run(run_streams(standby_url, MODEL, jobs, headers=mesh.headers))
        assert all(not o.error for o in undisturbed)
        plan = _plan_ids(mesh)
        _check_the_standbys_admin_api(mesh, standby_url, http_a, http_b)
        assert _gauges(standby_url, mesh.headers) == {"stratamesh:coordinator_leader": 0.0}
        assert _gauges(mesh.url, mesh.headers) == {"stratamesh:coordinator_leader": 1.0,
                                                   "stratamesh:coordinator_lease_epoch": 1.0}

        resume = SdkResume(jobs[1].prompt_ids, seed=5)      # seeded sampling: drawn by (seed, position)
        resume.reference = resume.undisturbed(standby_url, mesh.api_key)

        async def fail_over(outcomes: list[StreamOutcome]) -> None:
            await wait_for_tokens(outcomes, 4)
            await asyncio.to_thread(resume.start, mesh.url, mesh.api_key)    # an SDK stream on the leader
            mesh.kill_coordinator()                 # kill -9: no release, its lease runs out
            await asyncio.to_thread(resume.finish, standby_url, mesh.api_key)    # ... resumed on the standby
            await asyncio.to_thread(mesh.take_over, standby, patient(60))
            taken_over_at = [len(o.arrivals) for o in outcomes]     # (held: none of them has ended)
            await asyncio.wait_for(_more_tokens(outcomes, taken_over_at), patient(60))
            release.set()

        release = asyncio.Event()
        through = asyncio.run(run_streams(standby_url, MODEL, held(jobs), during=fail_over, headers=mesh.headers,
                                          release=release))
        assert [o.error for o in through] == [""] * len(jobs)
        assert resume.broke_after >= 4 and resume.tokens == resume.reference, "the SDK's resume elsewhere"
        assert [o.tokens for o in through] == [o.tokens for o in undisturbed], \
            which_diverged(model_dir, jobs, undisturbed=undisturbed, failed_over=through)
        assert mesh.url == standby_url and _lease(postgres_database, mesh.mesh) == (
            f"{socket.gethostname()}:{http_b}", 2)
        mesh.wait_connected(4, patient(60))     # the agents moved to it: found on zeroconf, or given its address
        mesh.wait_ready(patient(60))
        assert _plan_ids(mesh) == plan, "the same boxes: the plan is kept, its stages re-adopted as they are"
        assert _gauges(mesh.url, mesh.headers) == {"stratamesh:coordinator_leader": 1.0,
                                                   "stratamesh:coordinator_lease_epoch": 2.0}

        # a model deployed on the new leader loads and serves
        deployed = httpx.post(f"{mesh.url}/admin/api/models", headers=mesh.headers,
                              json={"path": str(other_dir), "num_stages": 1})
        assert deployed.status_code == 202, deployed.text
        wait_until(lambda: httpx.get(f"{mesh.url}/health").json()["models"].get("tiny-qwen2") == "ready",
                   timeout_s=60)
        prompt = jobs[0].prompt_ids
        (answer,) = asyncio.run(run_streams(mesh.url, "tiny-qwen2", [StreamJob(prompt, 8)], headers=mesh.headers))
        assert answer.tokens == greedy_tokens(whole_model(other_dir), list(prompt), 8)


class SdkResume:
    """An SDK stream on the coordinator that dies, resumed on another (Mesh.resume): its tokens against the same
    request's undisturbed ones."""

    NUM_TOKENS = 24     # compared
    ASKED = 1900        # asked for: a stream far from its end when its coordinator dies (as StreamJob.hold_tokens)

    def __init__(self, prompt_ids: tuple[int, ...], seed: int) -> None:
        self.prompt, self.seed = list(prompt_ids), seed
        self.reference: list[int] = []
        self.tokens: list[int] = []
        self.broke_after = 0
        self._stream: Stream | None = None

    def _open(self, client: Mesh) -> Stream:
        return client.generate(self.prompt, model=MODEL, stream=True, max_tokens=self.ASKED, temperature=0.8,
                               seed=self.seed, ignore_eos=True)

    def undisturbed(self, url: str, api_key: str) -> list[int]:
        with Mesh(url, api_key) as client, self._open(client) as stream:
            return self._read(stream, stream.resumable.token_ids)

    def start(self, url: str, api_key: str) -> None:
        """Opens the stream and reads its first tokens."""
        self._client = Mesh(url, api_key)
        self._stream = self._open(self._client)
        self._read(self._stream, self._stream.resumable.token_ids, 4)

    def finish(self, url: str, api_key: str) -> None:
        """Reads until the stream breaks, then resumes it on the coordinator at url."""
        with pytest.raises(MeshConnectionError):
            for _ in self._stream:
                pass
        self.broke_after = len(self._stream.resumable.token_ids)
        self._client.close()
        with Mesh(url, api_key) as client, client.resume(self._stream) as resumed:
            self.tokens = self._stream.resumable.token_ids + self._read(
                resumed, resumed.resumable.token_ids, self.NUM_TOKENS - self.broke_after)

    def _read(self, stream: Stream, token_ids: list[int], count: int = NUM_TOKENS) -> list[int]:
        for _ in stream:
            if len(token_ids) >= count:
                break
        return token_ids[:count]


def _check_the_standbys_admin_api(mesh: LocalMesh, standby_url: str, http_a: int, http_b: int) -> None:
    """What a standby answers itself (the coordinators), what it forwards to the leader (a read of what only the
    leader holds, and a write: an operator's login, whose session then works on both)."""
    coordinators = httpx.get(f"{standby_url}/admin/api/coordinators", headers=mesh.headers).json()
    host = socket.gethostname()
    assert [(c["name"], c["leads"]) for c in coordinators["coordinators"]] == [(f"{host}:{http_a}", True),
                                                                                (f"{host}:{http_b}", False)]
    assert (coordinators["lease"]["holder"], coordinators["lease"]["epoch"]) == (f"{host}:{http_a}", 1)
    agents = httpx.get(f"{standby_url}/admin/api/agents", headers=mesh.headers).json()["agents"]
    assert [a["state"] for a in agents] == ["connected"] * 4
    user, password = mesh.admin_login
    with httpx.Client() as browser:
        login = browser.post(f"{standby_url}/admin/api/login", json={"username": user, "password": password})
        assert login.status_code == 200, login.text
        for url in (standby_url, mesh.url):
            assert browser.get(f"{url}/admin/api/whoami").json()["user"]["name"] == user


async def _more_tokens(outcomes: list[StreamOutcome], than: list[int]) -> None:
    """Returns once every stream has had more tokens than it had (than), none of them ended."""
    while any(len(o.arrivals) <= n for o, n in zip(outcomes, than)):
        assert not any(o.end_s for o in outcomes), "a held stream ended"
        await asyncio.sleep(0.01)


def _gauges(url: str, headers: dict[str, str]) -> dict[str, float]:
    """The coordinator's leadership gauges on /metrics."""
    text = httpx.get(f"{url}/metrics", headers=headers).text
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples
            if s.name.startswith("stratamesh:coordinator_le")}


def _plan_ids(mesh: LocalMesh) -> dict[str, str]:
    plans = httpx.get(f"{mesh.url}/admin/api/plans", headers=mesh.headers).json()["plans"]
    return {p["model_id"]: p["plan_id"] for p in plans if p.get("state", "active") == "active"}


def test_a_leader_whose_lease_was_taken_over_stops_and_says_why(postgres_database: str) -> None:
    leader = subprocess.Popen([sys.executable, "-m", "stratamesh.cli", "coordinator", "--registry", postgres_database,
                               "--insecure", "--mesh", "m", "--name", "coord-a", "--lease-ttl", "2",
                               "--http-port", "0"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines = iter(leader.stdout)
        assert any(line.startswith("stratamesh coordinator: http=") for line in lines), "it never led"
        with psycopg.connect(postgres_database, autocommit=True) as conn:     # another took the lease over
            conn.execute("UPDATE coordinator_lease SET holder = 'coord-b', epoch = epoch + 1 WHERE mesh = 'm'")
        assert leader.wait(timeout=patient(30)) == 1
        assert any("coord-a lost the lease of mesh m: another took it over" in line for line in lines)
    finally:
        leader.kill()
        leader.wait()
