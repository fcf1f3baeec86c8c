"""mTLS on a real mesh: only enrolled processes talk to a stage, bad tokens enroll nobody, revoking cuts off."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest

from stratamesh.agent.credentials import enroll, load_credentials
from stratamesh.coordinator.enrollment import default_pki_dir, open_enroller
from stratamesh.fleet import pki
from stratamesh.fleet.errors import EXIT_REFUSED
from stratamesh.fleet.versions import PROTOCOL_VERSION
from stratamesh.launcher import LocalMesh
from stratamesh.fleet.wire import mesh_pb2 as pb
from stratamesh.fleet.wire import mesh_pb2_grpc as pb_grpc
from stratamesh.fleet.wire.channels import MeshTls, make_channel
from tests.patience import patient

pytestmark = pytest.mark.slow

MODEL = "tiny-llama"


@pytest.fixture(scope="module")
def mesh(tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalMesh]:
    root = tmp_path_factory.mktemp("secure-mesh")
    with LocalMesh(str(tiny_models["llama"]), num_agents=2, num_stages=2, log_dir=str(root / "logs"),
                   db=str(root / "registry.db")) as started:
        yield started


def stage_address(mesh: LocalMesh, index: int) -> str:
    [plan] = httpx.get(f"{mesh.url}/admin/api/plans", headers=mesh.headers).json()["plans"]
    return mesh.agent_addresses[mesh.agent_ids.index(plan["stages"][index]["agent_id"])]


async def push_activation(address: str, tls: MeshTls | None) -> pb.PushSummary:
    """One StepBatch carrying a hidden-state tensor, as an upstream stage sends it."""
    hidden = pb.Tensor(dtype="float32", shape=[1, 256], data=os.urandom(1024), codec="raw")
    chunk = pb.StepChunk(session_id="s" * 16, step=0, start_pos=0, token_ids=[1])
    message = pb.StageMessage(batch=pb.StepBatch(chunks=[chunk], hidden=hidden))
    async with make_channel(address, tls=tls) as channel:
        return await pb_grpc.StageStub(channel).Push(iter([message]), timeout=5)


def completion(mesh: LocalMesh) -> str:
    response = httpx.post(f"{mesh.url}/v1/completions", timeout=60, headers=mesh.headers,
                          json={"model": MODEL, "prompt": "The mesh", "max_tokens": 8, "temperature": 0})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def test_only_a_process_holding_a_mesh_certificate_can_send_activations(mesh: LocalMesh, tmp_path: Path) -> None:
    before = completion(mesh)
    address = stage_address(mesh, 1)
    client = asyncio.run(enroll(mesh.enroll_address, mesh.join_token, mesh.mesh, "test-client"))
    ca = client.ca_pem
    foreign_ca = pki.create_ca("impostor", time.time())
    foreign_key = pki.new_key()
    foreign = MeshTls(ca, pki.issue(*foreign_ca, pki.make_csr(foreign_key, "test-client"), 7, time.time(), 60),
                      foreign_key)
    refused = {"plaintext": None, "a certificate of another CA": foreign}
    for what, tls in refused.items():
        with pytest.raises(grpc.aio.AioRpcError) as err:
            asyncio.run(push_activation(address, tls))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE, what    # the TLS handshake fails: no call at all
    # Trusting the CA but presenting no certificate of its own fails the handshake too.
    no_cert = grpc.ssl_channel_credentials(ca)
    with pytest.raises(grpc.RpcError) as err:
        options = [("grpc.ssl_target_name_override", pki.MESH_TLS_NAME)]
        with grpc.secure_channel(address, no_cert, options=options) as ch:
            pb_grpc.StageStub(ch).Info(pb.StageInfoRequest(), timeout=5)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    # The control: the same message with an enrolled certificate reaches the stage.
    assert asyncio.run(push_activation(address, client)).num_messages == 1
    assert completion(mesh) == before, "the mesh serves on, unchanged"


def test_a_certificate_cannot_register_as_another_agent(mesh: LocalMesh) -> None:
    client = asyncio.run(enroll(mesh.enroll_address, mesh.join_token, mesh.mesh, "test-impostor"))

    async def register_as(agent_id: str) -> grpc.StatusCode:
        register = pb.AgentMessage(register=pb.Register(agent_id=agent_id, name="x", stage_address="127.0.0.1:1",
                                                        mesh=mesh.mesh, protocol_version=PROTOCOL_VERSION))
        async with make_channel(mesh.grpc_address, tls=client) as channel:
            call = pb_grpc.ControlStub(channel).Connect(iter([register]))
            try:
                async for _ in call:
                    pass
            except grpc.aio.AioRpcError as exc:
                return exc.code()
        return grpc.StatusCode.OK

    assert asyncio.run(register_as(mesh.agent_ids[0])) == grpc.StatusCode.PERMISSION_DENIED


def spawn_agent(mesh: LocalMesh, state_dir: Path, agent_id: str, token: str) -> subprocess.Popen:
    env = {**os.environ, "STRATAMESH_JOIN_TOKEN": token}
    return subprocess.Popen(
        [sys.executable, "-m", "stratamesh.cli", "agent", "--mesh", mesh.mesh, "--agent-id", agent_id,
         "--state-dir", str(state_dir), "--coordinator", mesh.grpc_address, "--enroll", mesh.enroll_address,
         "--metrics-port", "-1"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def test_an_agent_with_no_expired_revoked_or_forged_token_is_refused(mesh: LocalMesh, tmp_path: Path) -> None:
    db = mesh.registry_path()
    enroller, registry = open_enroller(db, default_pki_dir(db), mesh.mesh, time.time)
    try:
        expired, _ = enroller.create_token(0.2)
        revoked, _ = enroller.create_token(3600)
        enroller.revoke_token(revoked.token_id)
    finally:
        registry.close()
    time.sleep(0.5)
    forged = f"{mesh.join_token[:14]}{'0' * 32}"   # the mesh's valid token id, a guessed secret
    cases = {"no token": ("", "holds no mesh certificate"), "expired": (str(expired), "expired"),
             "revoked": (str(revoked), "revoked"), "forged": (forged, "secret")}
    processes = {name: spawn_agent(mesh, tmp_path / name.replace(" ", "-"), f"intruder-{i}", token)
                 for i, (name, (token, _)) in enumerate(cases.items())}
    for name, process in processes.items():
        _, stderr = process.communicate(timeout=120)
        assert process.returncode == EXIT_REFUSED, (name, stderr[-2000:])   # a supervisor leaves it down
        assert cases[name][1] in stderr, (name, stderr[-2000:])
        assert not (tmp_path / name.replace(" ", "-") / "cert.pem").exists()
    agents = {a["agent_id"] for a in httpx.get(f"{mesh.url}/admin/api/agents", headers=mesh.headers).json()["agents"]}
    assert not any(a.startswith("intruder") for a in agents)


def test_revoking_an_agent_cuts_it_off_and_its_stage_moves(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    with LocalMesh(str(tiny_models["llama"]), num_agents=3, num_stages=2, log_dir=str(tmp_path / "logs"),
                   db=str(tmp_path / "registry.db")) as mesh:
        before = completion(mesh)
        victim_address = stage_address(mesh, 0)
        victim = mesh.agent_index(victim_address)
        victim_tls = load_credentials(str(tmp_path / "logs" / mesh.agent_ids[victim]), mesh.agent_ids[victim],
                                      time.time())
        assert victim_tls is not None
        other_address = stage_address(mesh, 1)
        assert asyncio.run(push_activation(other_address, victim_tls)).num_messages == 1

        response = httpx.post(f"{mesh.url}/admin/api/agents/{mesh.agent_ids[victim]}/revoke", headers=mesh.headers)
        assert response.status_code == 200, response.text
        assert response.json()["revocation"]["revoked_serials"] == [pki.cert_info(victim_tls.cert_pem).serial]

        assert mesh.agents[victim].wait(timeout=30) == EXIT_REFUSED, "the coordinator refuses it; it exits so"
        log = Path(tmp_path / "logs" / f"agent{victim}.log").read_text()
        assert "refuses this agent" in log and "revoked" in log
        deadline = time.monotonic() + patient(60)      # (LocalMesh.wait_ready would object to the exited agent)
        while mesh.health().get("status") != "ok" and time.monotonic() < deadline:
            time.sleep(0.2)
        assert victim_address not in (stage_address(mesh, 0), stage_address(mesh, 1))
        assert completion(mesh) == before, "the spare took the stage: the same greedy text"
        # Its certificate opens no door: the other agents refuse its calls too.
        with pytest.raises(grpc.aio.AioRpcError) as err:
            asyncio.run(push_activation(stage_address(mesh, 1), victim_tls))
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        # Restarted with its certificate, it is refused again.
        mesh.agents[victim] = mesh._spawn_agent(victim)
        assert mesh.agents[victim].wait(timeout=60) == EXIT_REFUSED
        unknown = httpx.post(f"{mesh.url}/admin/api/agents/never-enrolled/revoke", headers=mesh.headers)
        assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "agent_not_found"


def test_a_wrong_api_key_gets_401_and_a_viewer_cannot_drain(mesh: LocalMesh) -> None:
    body = {"model": MODEL, "prompt": "The mesh", "max_tokens": 4}
    wrong = {"Authorization": "Bearer sk-sm-00000000-" + "a" * 43}
    for headers in ({}, wrong, {"Authorization": mesh.api_key}):          # none, a wrong one, not a bearer
        response = httpx.post(f"{mesh.url}/v1/completions", json=body, headers=headers, timeout=30)
        assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
    viewer = {"Authorization": f"Bearer {mesh.create_api_key('viewer', 'dashboard')}"}
    agent_id = mesh.agent_ids[0]
    assert httpx.get(f"{mesh.url}/admin/api/agents", headers=viewer).status_code == 200
    refused = httpx.post(f"{mesh.url}/admin/api/agents/{agent_id}/drain", headers=viewer)
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "insufficient_role"
    # ... nor through the CLI with that key, nor logged in as a viewer
    drain = subprocess.run([sys.executable, "-m", "stratamesh.cli", "drain", agent_id, "--url", mesh.url,
                            "--no-wait"], env={**os.environ, "STRATAMESH_API_KEY": viewer["Authorization"][7:]},
                           capture_output=True, text=True, timeout=60)
    assert drain.returncode == 1 and "this needs operator" in drain.stdout
    mesh.add_user("vera", "viewer-password", "viewer")
    with httpx.Client(base_url=mesh.url) as browser:
        assert browser.post("/admin/api/login", json={"username": "vera", "password": "viewer-password"}).is_success
        assert browser.post(f"/admin/api/agents/{agent_id}/drain").status_code == 403
    states = {a["agent_id"]: a["state"] for a in httpx.get(f"{mesh.url}/admin/api/agents",
                                                           headers=mesh.headers).json()["agents"]}
    assert states[agent_id] == "connected", "nothing was drained"
    assert completion(mesh)
