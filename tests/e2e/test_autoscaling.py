"""The autoscaler with real processes: six agents, a model of two stages autoscaled between one and three replicas.
Under load that misses its target the replicas grow to three, and once the load is gone they shrink to one, with
no request failed; re-deployed with a minimum of zero, the idle model gives back its last replica, and the next
request waits for a cold start and is answered. (The decisions themselves: tests/coordinator/test_autoscale.py.)"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from stratamesh.launcher import LocalMesh
from tests.patience import patient, wait_until

pytestmark = pytest.mark.slow

FIRST_CLIENTS, MORE_CLIENTS = 1, 3      # the load rises: one client, then four (its arrivals grow)
PAUSE_S = 0.05      # between a client's requests: load enough, and CPU left for the suite's other tests


def model_view(mesh: LocalMesh, model_id: str) -> dict[str, Any]:
    models = httpx.get(f"{mesh.url}/admin/api/models", headers=mesh.headers, timeout=30).json()["models"]
    return next(m for m in models if m["model_id"] == model_id)


def replicas(mesh: LocalMesh, model_id: str) -> tuple[int, int]:
    """(desired, ready) replicas of the model, as the admin API says."""
    view = model_view(mesh, model_id)
    return view["num_replicas"], view["ready_replicas"]


def scaled(mesh: LocalMesh) -> list[str]:
    events = httpx.get(f"{mesh.url}/admin/api/events", params={"limit": 200}, headers=mesh.headers).json()["events"]
    return [e["detail"] for e in reversed(events) if e["kind"] == "replicas_scaled"]


def test_replicas_follow_the_load_up_and_down_and_an_idle_model_scales_to_zero_and_starts_cold(
        tiny_models: dict[str, Path], tmp_path: Path) -> None:
    folder = str(tiny_models["llama"])
    # a time-to-first-token target no request meets: any load asks for one more replica, once the last one serves
    args = ["--min-replicas", "1", "--max-replicas", "3", "--slo-ttft-ms", "0.001", "--scale-down-after", "1"]
    with LocalMesh(folder, num_agents=6, num_stages=2, insecure=True, coordinator_args=args,
                   log_dir=str(tmp_path / "logs")) as mesh:
        model_id = Path(folder).name
        assert replicas(mesh, model_id) == (1, 1)              # it starts at its minimum; four agents stand by
        stop, statuses = threading.Event(), []

        def client() -> None:
            with httpx.Client(timeout=patient(120), headers=mesh.headers) as http:
                while not stop.wait(PAUSE_S):
                    response = http.post(f"{mesh.url}/v1/completions", json={
                        "model": model_id, "prompt": "the mesh follows its load", "max_tokens": 12})
                    statuses.append(response.status_code)

        clients = [threading.Thread(target=client) for _ in range(FIRST_CLIENTS + MORE_CLIENTS)]
        for thread in clients[:FIRST_CLIENTS]:
            thread.start()
        try:
            # a replica added for a missed target must help, or the load must have grown, for the next to come
            # (coordinator/control/autoscale.py): the load grows once the second replica is asked for
            wait_until(lambda: replicas(mesh, model_id)[0] >= 2, 120)
            for thread in clients[FIRST_CLIENTS:]:
                thread.start()
            wait_until(lambda: replicas(mesh, model_id) == (3, 3), 180)
        finally:
            stop.set()
            for thread in clients:
                if thread.is_alive():
                    thread.join()
        wait_until(lambda: replicas(mesh, model_id) == (1, 1), 120)     # the load is gone: back to the minimum
        assert statuses and set(statuses) == {200}, statuses
        decisions = scaled(mesh)
        assert [d.split(": ", 2)[1] for d in decisions] == ["1 -> 2 replicas", "2 -> 3 replicas", "3 -> 2 replicas",
                                                              "2 -> 1 replicas"], decisions
        assert "time to first token" in decisions[0] and "above its target 0.001 ms" in decisions[0]
        view = model_view(mesh, model_id)
        assert max(p["ready"] for p in view["autoscale"]["history"]) == 3
        assert view["autoscale"]["last_decision"] == decisions[-1]
        metrics = httpx.get(f"{mesh.url}/metrics", headers=mesh.headers).text
        assert f'stratamesh:desired_replicas{{model_name="{model_id}"}} 1.0' in metrics
        assert f'stratamesh:ready_replicas{{model_name="{model_id}"}} 1.0' in metrics

        # the same model, now allowed to go to zero while idle
        deployed = httpx.post(f"{mesh.url}/admin/api/models", headers=mesh.headers, json={
            "path": folder, "model_id": model_id, "num_stages": 2, "min_replicas": 0, "max_replicas": 3,
            "scale_down_after_s": 1})
        assert deployed.status_code == 202, deployed.text
        wait_until(lambda: model_view(mesh, model_id)["state"] == "scaled_to_zero", 120)
        assert replicas(mesh, model_id) == (0, 0) and "no request for 1 s" in scaled(mesh)[-1]
        assert httpx.get(f"{mesh.url}/health").json()["models"][model_id] == "scaled_to_zero"
        answer = httpx.post(f"{mesh.url}/v1/completions", headers=mesh.headers, timeout=patient(300), json={
            "model": model_id, "prompt": "a cold start", "max_tokens": 4, "temperature": 0, "ignore_eos": True})
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 4
        assert "cold start: 1 request(s) wait for a replica" in scaled(mesh)[-1]
        # the autoscaler's next look finds the replica serving, and says how long the start took
        wait_until(lambda: model_view(mesh, model_id)["autoscale"]["last_cold_start_s"] is not None, 30)
        view = model_view(mesh, model_id)
        assert view["ready_replicas"] == 1 and 0 < view["autoscale"]["last_cold_start_s"] < patient(300)
