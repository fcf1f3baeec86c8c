"""Version checks at join, with real processes: an agent whose data plane speaks a protocol the coordinator does not
is refused with a message naming both versions (in its log, and as an event), and exits as a refusal (a supervisor
leaves it down); an agent of another software version that speaks a compatible protocol joins."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from stratamesh.fleet.errors import EXIT_REFUSED
from stratamesh.fleet.versions import PROTOCOL_VERSION, REPORT_PROTOCOL_ENV, REPORT_VERSION_ENV
from stratamesh.launcher import LocalMesh
from tests.patience import patient, wait_until

pytestmark = pytest.mark.slow


def test_an_agent_of_another_protocol_is_refused_and_one_of_another_build_joins(tiny_models: dict[str, Path],
                                                                               tmp_path: Path) -> None:
    newer = PROTOCOL_VERSION + 1
    with LocalMesh(str(tiny_models["llama"]), num_agents=1, insecure=True, log_dir=str(tmp_path / "logs")) as mesh:
        mesh.extra_env = {REPORT_PROTOCOL_ENV: str(newer)}
        refused = mesh._spawn_agent(1)
        mesh.extra_env = {REPORT_VERSION_ENV: "0.0.1-older"}
        older_build = mesh._spawn_agent(2)
        mesh.extra_env = {}
        assert refused.wait(timeout=patient(60)) == EXIT_REFUSED
        says = f"speaks data-plane protocol {newer}; this coordinator"
        log = (tmp_path / "logs" / "agent1.log").read_text()
        assert "refuses this agent" in log and says in log and "upgrade the coordinator" in log, log[-2000:]

        def agents() -> dict[str, str]:
            body = httpx.get(f"{mesh.url}/admin/api/agents", headers=mesh.headers).json()
            return {a["agent_id"]: a["state"] for a in body["agents"]}
        wait_until(lambda: mesh.agent_ids[2] in agents(), 60)
        body = httpx.get(f"{mesh.url}/admin/api/agents", headers=mesh.headers).json()
        joined = {a["agent_id"]: (a["software_version"], a["protocol_version"]) for a in body["agents"]}
        assert joined[mesh.agent_ids[2]] == ("0.0.1-older", PROTOCOL_VERSION)
        assert mesh.agent_ids[1] not in agents() and older_build.poll() is None
        events = httpx.get(f"{mesh.url}/admin/api/events", headers=mesh.headers).json()["events"]
        (event,) = [e for e in events if e["kind"] == "agent_refused"]
        assert event["agent_id"] == mesh.agent_ids[1] and says in event["detail"]
