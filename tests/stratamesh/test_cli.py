"""The `stratamesh` command as a user runs it: a real process."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest


def stratamesh(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "stratamesh.cli", *args], capture_output=True, text=True,
                          timeout=120, **kwargs)


def test_model_tiny_writes_a_hugging_face_folder(tmp_path: Path) -> None:
    result = stratamesh("model", "tiny", "--arch", "mistral", "--out", str(tmp_path / "m"), "--layers", "3",
                        "--hidden", "64", "--intermediate", "128", "--vocab", "800")
    assert result.returncode == 0, result.stderr
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert (config["model_type"], config["num_hidden_layers"], config["hidden_size"]) == ("mistral", 3, 64)
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (tmp_path / "m" / name).is_file()


def test_model_tiny_embedding_writes_an_embedding_model(tmp_path: Path) -> None:
    result = stratamesh("model", "tiny", "--arch", "llama", "--embedding", "--out", str(tmp_path / "e"),
                        "--layers", "2", "--hidden", "64", "--intermediate", "128")
    assert result.returncode == 0, result.stderr
    config = json.loads((tmp_path / "e" / "config.json").read_text())
    assert config["architectures"] == ["LlamaModel"] and not (tmp_path / "e" / "generation_config.json").exists()


def test_bad_arguments_fail_with_usage() -> None:
    result = stratamesh("model", "tiny", "--arch", "gpt5", "--out", "/tmp/x")
    assert result.returncode == 2 and "invalid choice" in result.stderr


def test_an_agent_asked_for_too_many_ranks_is_refused_with_the_range() -> None:
    result = stratamesh("agent", "--ranks", "9")
    assert result.returncode == 2 and "--ranks: must be in 1..8, got 9" in result.stderr


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


@pytest.mark.slow
@pytest.mark.parametrize("insecure", [False, True])
def test_up_serves_the_builtin_model_and_ctrl_c_stops_everything(tmp_path: Path, insecure: bool) -> None:
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    up = subprocess.Popen([sys.executable, "-m", "stratamesh.cli", "up", "--agents", "2", "--http-port", "0",
                           *(["--insecure"] if insecure else [])],
                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        lines: list[str] = []
        deadline = time.monotonic() + 120
        while not lines or "Ctrl-C stops" not in lines[-1] and time.monotonic() < deadline and up.poll() is None:
            lines.append(up.stdout.readline())
        text = "".join(lines)
        url = re.search(r"API\s+(http://\S+)/v1", text)
        assert url, text
        url = url.group(1)
        children = _children(up.pid)
        assert len(children) == 3                         # a coordinator and 2 agents
        body = {"model": "tiny-llama", "prompt": "The mesh", "max_tokens": 8}
        if insecure:
            assert "INSECURE DEVELOPMENT MODE" in text and "API key" not in text
            headers = {}
        else:
            key = re.search(r"API key (sk-sm-\S+)", text)
            assert key and "--join-token smj1." in text, text
            assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 401
            headers = {"Authorization": f"Bearer {key.group(1)}"}
            assert f"Authorization: Bearer {key.group(1)}" in text       # the printed curl works as printed
            login = re.search(r"log in as (\S+) / (\S+)", text)
            assert login, text
            answer = httpx.post(f"{url}/admin/api/login", json={"username": login[1], "password": login[2]})
            assert answer.status_code == 200 and answer.json()["user"]["role"] == "operator"
        response = httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=60)
        assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 8
        up.send_signal(signal.SIGINT)
        assert up.wait(timeout=60) == 0
        for pid in children:
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
        logs = Path(re.search(r"logs\s+(\S+)", text).group(1))
        assert (logs / "coordinator.log").exists(), "the logs stay for reading"
        kept = [p.name for p in logs.rglob("*") if p.name.endswith((".key", ".pem")) or p.name == "bootstrap.json"]
        assert kept == [], "keys and passwords do not outlive the mesh"
    finally:
        if up.poll() is None:
            up.kill()


def test_a_coordinator_given_a_folder_without_a_model_says_so(tmp_path: Path) -> None:
    result = stratamesh("coordinator", "--model", str(tmp_path), "--db", str(tmp_path / "r.db"),
                        "--http-port", "0", "--mesh", "cli-test")
    assert result.returncode == 1
    assert "config.json" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize(("architecture", "endpoint", "field"), [
    ("LlamaForCausalLM", "/v1/completions", '"prompt"'), ("LlamaModel", "/v1/embeddings", '"input"')])
def test_up_shows_a_call_the_model_serves(tmp_path: Path, architecture: str, endpoint: str, field: str) -> None:
    from stratamesh.cli import _example_call

    (tmp_path / "config.json").write_text(json.dumps({"architectures": [architecture]}))
    call = _example_call("http://127.0.0.1:8000", str(tmp_path), "m", "sk-sm-0a1b2c3d-secret")
    assert f"http://127.0.0.1:8000{endpoint}" in call and field in call and '"model": "m"' in call
    assert "Authorization: Bearer sk-sm-0a1b2c3d-secret" in call
    assert "Authorization" not in _example_call("http://127.0.0.1:8000", str(tmp_path), "m")   # --insecure
