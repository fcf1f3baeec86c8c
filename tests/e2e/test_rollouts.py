"""Rollouts with real processes, under a steady stream of requests: a canary revision whose checkpoint is broken (NaN
weights: its last stage fails every session it gets) is rolled back by itself and no request of the serving revision
fails; a good one (the same weights in another folder) steps up to every request and is promoted, with no request
failed at all; the stage specs and the requests' records say which revision served."""

from __future__ import annotations

import shutil
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

from stratamesh.fleet.model_folder import revision_of
from stratamesh.launcher import LocalMesh
from tests.patience import patient, wait_until

pytestmark = pytest.mark.slow

NUM_CLIENTS = 3
PAUSE_S = 0.05      # between a client's requests: load enough, and CPU left for the suite's other tests


def model_view(mesh: LocalMesh, model_id: str) -> dict[str, Any]:
    models = httpx.get(f"{mesh.url}/admin/api/models", headers=mesh.headers, timeout=30).json()["models"]
    return next(m for m in models if m["model_id"] == model_id)


def broken_copy(folder: Path, out: Path) -> Path:
    """The model with NaN in its LM head: every logit it makes is NaN."""
    shutil.copytree(folder, out)
    tensors = load_file(out / "model.safetensors")
    tensors["lm_head.weight"] = torch.full_like(tensors["lm_head.weight"], float("nan"))
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


class Clients:
    """NUM_CLIENTS threads sending completions one after another until stopped; each answer's status kept."""

    def __init__(self, mesh: LocalMesh, model_id: str) -> None:
        self.statuses: list[int] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(mesh, model_id)) for _ in range(NUM_CLIENTS)]
        for thread in self._threads:
            thread.start()

    def _run(self, mesh: LocalMesh, model_id: str) -> None:
        with httpx.Client(timeout=patient(120), headers=mesh.headers) as http:
            while not self._stop.wait(PAUSE_S):
                self.statuses.append(http.post(f"{mesh.url}/v1/completions", json={
                    "model": model_id, "prompt": "a canary in the mesh", "max_tokens": 8}).status_code)

    def stop(self) -> list[int]:
        self._stop.set()
        for thread in self._threads:
            thread.join()
        return self.statuses


def test_a_broken_canary_rolls_back_by_itself_and_a_good_one_is_promoted_with_no_request_of_the_old_failed(
        tiny_models: dict[str, Path], tmp_path: Path) -> None:
    folder = tiny_models["llama"]
    model_id = folder.name
    bad, good = broken_copy(folder, tmp_path / "bad"), Path(shutil.copytree(folder, tmp_path / "good"))
    with LocalMesh(str(folder), num_agents=3, num_stages=1, insecure=True, log_dir=str(tmp_path / "logs")) as mesh:
        serving = model_view(mesh, model_id)["revision"]
        assert serving == revision_of(folder)
        clients = Clients(mesh, model_id)
        try:
            started = httpx.post(f"{mesh.url}/admin/api/models/{model_id}/rollout", headers=mesh.headers,
                                 json={"path": str(bad), "steps": [50, 100], "step_s": 1})
            assert started.status_code == 202, started.text
            assert started.json()["model"]["rollout"]["revision"] == revision_of(bad)
            wait_until(lambda: model_view(mesh, model_id)["rollout"]["state"] == "rolled_back", 180)
        finally:
            statuses = clients.stop()
        rollout = model_view(mesh, model_id)["rollout"]
        assert "the canary failed" in rollout["reason"], rollout
        records = httpx.get(f"{mesh.url}/admin/api/requests", params={"limit": 1000}, headers=mesh.headers).json()
        failed = [r for r in records["requests"] if r["error"]]
        assert failed and {r["revision"] for r in failed} == {revision_of(bad)}      # the canary's, alone
        assert "logits are not finite" in failed[0]["error"]
        assert any(r["revision"] == serving and not r["error"] for r in records["requests"])
        assert statuses.count(200) >= 1
        events = httpx.get(f"{mesh.url}/admin/api/events", params={"limit": 100}, headers=mesh.headers).json()
        assert "rollout_rolled_back" in {e["kind"] for e in events["events"]}

        clients = Clients(mesh, model_id)
        try:
            started = httpx.post(f"{mesh.url}/admin/api/models/{model_id}/rollout", headers=mesh.headers,
                                 json={"path": str(good), "steps": [50, 100], "step_s": 1})
            assert started.status_code == 202, started.text
            wait_until(lambda: model_view(mesh, model_id)["rollout"]["state"] == "promoted", 180)
        finally:
            statuses = clients.stop()
        assert statuses and set(statuses) == {200}, statuses
        view = model_view(mesh, model_id)
        assert view["revision"] == revision_of(good) and view["path"] == str(good.resolve())
        plans = httpx.get(f"{mesh.url}/admin/api/plans", headers=mesh.headers).json()["plans"]
        assert [(p["replica"], p["state"]) for p in plans] == [(0, "active")]
        answer = httpx.post(f"{mesh.url}/v1/completions", headers=mesh.headers, timeout=patient(60),
                            json={"model": model_id, "prompt": "after the rollout", "max_tokens": 4})
        assert answer.status_code == 200
        newest = httpx.get(f"{mesh.url}/admin/api/requests", params={"limit": 1}, headers=mesh.headers).json()
        assert newest["requests"][0]["revision"] == revision_of(good)
