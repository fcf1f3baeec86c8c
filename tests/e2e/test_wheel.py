"""The agent as an edge box gets it: the built wheel installed with pip into a fresh venv, run from its own `stratamesh`
script with a --config file against a coordinator, serving the demo model the wheel carries.

The fresh venv takes the wheel alone (`pip install --no-deps --no-index`); its dependencies (torch and the rest,
gigabytes a box downloads once) are this venv's, which a .pth file puts after the venv's own site-packages, so that
`stratamesh` is imported from the wheel's files and nothing else."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import httpx
import pytest

from stratamesh.launcher import LocalMesh
from tests.patience import patient, wait_until

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
NOT_SHIPPED = shutil.ignore_patterns(".git", ".venv", "build", "*.egg-info", "__pycache__", ".artifacts", "dist",
                                     ".pytest_cache")


def build_wheel(out: Path) -> Path:
    """The project's wheel, built from a copy of the checkout (setuptools writes build/ beside its sources)."""
    source = out / "source"
    shutil.copytree(REPO, source, symlinks=True, ignore=NOT_SHIPPED)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(out / "dist"), str(source)], check=True, timeout=patient(300))
    (wheel,) = (out / "dist").glob("stratamesh-*.whl")
    return wheel


def fresh_venv(path: Path, wheel: Path) -> Path:
    """A new venv holding the wheel, this venv's packages behind it; its python. (This venv's pip installs into it:
    `pip --python`, so the new one needs no pip of its own.)"""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True, timeout=patient(120))
    python = path / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", "-q",
                    str(wheel)], check=True, timeout=patient(300))
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    (Path(site) / "zz-dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return python


def test_the_wheel_installs_in_a_fresh_venv_and_its_agent_joins_with_a_config_file_and_serves(
        tmp_path: Path) -> None:
    python = fresh_venv(tmp_path / "venv", build_wheel(tmp_path))
    installed = subprocess.run([str(python), "-c", "import stratamesh; from stratamesh.sdk.local import "
                                "builtin_model_dir as d; print(stratamesh.__file__); print(d())"],
                               check=True, capture_output=True, text=True, cwd=tmp_path).stdout.split()
    assert all(line.startswith(str(tmp_path / "venv")) for line in installed), installed
    demo = Path(installed[1])
    assert (demo / "config.json").exists() and (demo / "model.safetensors").exists()     # the demo model inside

    mesh = LocalMesh(str(demo), num_agents=0, num_stages=1, insecure=True, log_dir=str(tmp_path / "logs"))
    try:
        mesh.start_coordinator(timeout_s=120)
        config = tmp_path / "agent.toml"
        config.write_text(f'coordinator = "{mesh.grpc_address}"\nmesh = "{mesh.mesh}"\ninsecure = true\n'
                          f'name = "edge-box"\nstate-dir = "{tmp_path / "state"}"\nthreads = 1\n')
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "STRATAMESH_FORK_SERVER")}
        log = (tmp_path / "logs" / "wheel-agent.log").open("w")
        agent = subprocess.Popen([str(tmp_path / "venv" / "bin" / "stratamesh"), "agent", "--config", str(config),
                                  "--site", "shop"], stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tmp_path)
        try:
            wait_until(lambda: mesh.health().get("status") == "ok" or agent.poll() is not None, 180)
            assert agent.poll() is None, (tmp_path / "logs" / "wheel-agent.log").read_text()[-3000:]
            agents = httpx.get(f"{mesh.url}/admin/api/agents", headers=mesh.headers).json()["agents"]
            (box,) = agents
            assert box["name"] == "edge-box" and box["capabilities"]["site"] == "shop"   # the file's, and the flag's
            answer = httpx.post(f"{mesh.url}/v1/completions", headers=mesh.headers, timeout=patient(120),
                                json={"model": demo.name, "prompt": "Once upon a time", "max_tokens": 8,
                                      "temperature": 0, "ignore_eos": True})    # 8 tokens, whatever it says
            assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 8
        finally:
            agent.terminate()
            agent.wait(timeout=patient(60))
            log.close()
    finally:
        mesh.stop()
