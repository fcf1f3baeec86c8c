"""The `stratamesh` command as a user runs it: a real process."""

from __future__ import annotations

import json
import os
import re
import signal
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from stratamesh.kernels.demo_model import read_book, words_of
from tests.patience import wait_until
from tests.readme import readme_completion


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


def test_up_refuses_more_replicas_than_its_agents_hold(tmp_path: Path) -> None:
    env = {**os.environ, "STRATAMESH_HOME": str(tmp_path / "home")}
    result = stratamesh("up", "--agents", "3", "--replicas", "2", "--stages", "2", env=env)
    assert result.returncode == 1 and "2 replicas of 2 stages need 4 agents; --agents is 3" in result.stderr
    assert not (tmp_path / "home").exists()            # nothing was started, nor any state made
    result = stratamesh("coordinator", "--replicas", "0")
    assert result.returncode == 2 and "--replicas: must be in 1..64, got 0" in result.stderr
    result = stratamesh("up", "--model", str(tmp_path), "--speculative-config",
                        '{"method": "draft_model", "num_speculative_tokens": 4}', env=env)
    assert result.returncode == 1 and "names its draft's folder as its model" in result.stderr, result.stderr
    assert not (tmp_path / "home").exists()


@pytest.mark.parametrize(("change", "command", "says"), [
    ({"model_type": "gemma7"}, "up", "config.json model_type 'gemma7' is not supported; supported: llama, mistral"),
    ({"rope_scaling": {"rope_type": "su", "factor": 2.0}}, "up", "config.json rope type 'su' is not supported"),
    ({"model_type": "gemma7"}, "coordinator", "config.json model_type 'gemma7' is not supported"),
])   # (every refusal's words: tests/fleet/test_model_folder.py)
def test_up_and_a_coordinator_refuse_a_model_they_cannot_serve_in_one_line(tmp_path: Path, change: dict, command: str,
                                                                           says: str) -> None:
    from stratamesh.kernels.tiny_model import write_tiny_model

    model = write_tiny_model(tmp_path / "model", num_layers=2, hidden_size=64, intermediate_size=128)
    (model / "config.json").write_text(json.dumps({**json.loads((model / "config.json").read_text()), **change}))
    env = {**os.environ, "STRATAMESH_HOME": str(tmp_path / "home")}
    args = ["--db", str(tmp_path / "r.db"), "--mesh", "cli-test"] if command == "coordinator" else []
    result = stratamesh(command, "--model", str(model), *args, env=env)
    lines = result.stderr.splitlines()
    assert result.returncode == 1 and len(lines) == 1, result.stderr
    assert lines[0].startswith(f"stratamesh {command}: {says}"), lines
    assert not (tmp_path / "home").exists() and not (tmp_path / "r.db").exists()     # nothing started, no state


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def start_up(env: dict[str, str], *flags: str, num_agents: int = 2) -> tuple[subprocess.Popen, str]:
    """`stratamesh up` on a free port; returns the process and what it printed once it was up."""
    errors = tempfile.TemporaryFile()     # what `up` says on stderr, for a failure's message
    up = subprocess.Popen([sys.executable, "-m", "stratamesh.cli", "up", "--agents", str(num_agents),
                           "--http-port", "0", *flags],
                          stdout=subprocess.PIPE, stderr=errors, text=True, env=env)
    up.errors = errors
    lines: list[str] = []
    deadline = time.monotonic() + 120
    while not lines or "Ctrl-C stops" not in lines[-1] and time.monotonic() < deadline and up.poll() is None:
        lines.append(up.stdout.readline())
    return up, "".join(lines)


def ctrl_c(up: subprocess.Popen) -> None:
    up.send_signal(signal.SIGINT)
    code = up.wait(timeout=60)
    up.errors.seek(0)
    assert code == 0, up.errors.read().decode(errors="replace")[-4000:]


def stop_up(up: subprocess.Popen) -> None:
    """After a failed test: Ctrl-C first, so that `up` stops its coordinator and agents too."""
    if up.poll() is None:
        up.send_signal(signal.SIGINT)
        try:
            up.wait(timeout=60)
        except subprocess.TimeoutExpired:
            up.kill()


def printed(pattern: str, text: str) -> str:
    found = re.search(pattern, text)
    assert found, text
    return found.group(1)


def up_env(tmp_path: Path) -> dict[str, str]:
    """`up`'s state in tmp_path/home, its model in tmp_path/cache."""
    return {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"), "STRATAMESH_HOME": str(tmp_path / "home")}


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


COMPLETION = readme_completion()       # the call the README shows: the demo model answers it in the book's words


@pytest.mark.slow
@pytest.mark.parametrize("insecure", [False, True])
def test_up_serves_the_builtin_model_and_ctrl_c_stops_everything(tmp_path: Path, insecure: bool) -> None:
    """(insecure, the mesh also drafts with the demo model's built-in draft: a draft_model config naming no model)"""
    draft = ["--insecure", "--speculative-config", '{"method": "draft_model", "num_speculative_tokens": 4}']
    up, text = start_up(up_env(tmp_path), *(draft if insecure else []))
    try:
        url = printed(r"API\s+(http://\S+)/v1", text)
        children = _children(up.pid)
        assert len(children) == 3                         # a coordinator and 2 agents
        if insecure:
            assert "INSECURE DEVELOPMENT MODE" in text and "API key" not in text
            headers = {}
        else:
            key = printed(r"API key (sk-sm-\S+)", text)
            assert "--join-token smj1." in text, text
            assert httpx.post(f"{url}/v1/completions", json=COMPLETION, timeout=60).status_code == 401
            headers = {"Authorization": f"Bearer {key}"}
            assert f"Authorization: Bearer {key}" in text       # the printed curl works as printed
            login = re.search(r"log in as (\S+) / (\S+)", text)
            assert login, text
            answer = httpx.post(f"{url}/admin/api/login", json={"username": login[1], "password": login[2]})
            assert answer.status_code == 200 and answer.json()["user"]["role"] == "operator"
        response = httpx.post(f"{url}/v1/completions", json=COMPLETION, headers=headers, timeout=60)
        assert response.status_code == 200, response.text
        words = words_of(response.json()["choices"][0]["text"])
        assert len(words) >= COMPLETION["max_tokens"] // 3 and set(words) <= set(words_of(read_book().train)), words
        if insecure:        # the draft's guesses were verified, and some kept
            wait_until(lambda: httpx.get(f"{url}/admin/api/models", timeout=30).json()["models"][0]["speculation"][
                "accepted_tokens"] > 0, timeout_s=30)
        ctrl_c(up)
        for pid in children:
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
        state = Path(printed(r"state\s+(\S+)", text))
        logs = Path(printed(r"logs\s+(\S+)", text))
        assert state == tmp_path / "home" / "up" and logs == state / "logs"
        assert (logs / "coordinator.log").exists(), "the logs stay for reading"
        assert (state / "registry.db").exists(), "the mesh stays for the next `up`"
    finally:
        stop_up(up)


@pytest.mark.slow
def test_a_second_up_is_the_same_mesh_with_the_same_key_and_fresh_makes_a_new_one(tmp_path: Path) -> None:
    env = up_env(tmp_path)
    state = tmp_path / "home" / "up"
    up, first = start_up(env)
    try:
        ctrl_c(up)
        up, second = start_up(env, num_agents=1)     # fewer agents: the last run's 2-stage plan must not hold it up
        key, login = printed(r"API key (sk-sm-\S+)", first), printed(r"(log in as \S+ / \S+)", first)
        assert "a new one, kept in" in first and "the one kept in" in second
        assert printed(r"mesh (local-\w+)", first) == printed(r"mesh (local-\w+)", second)
        assert (printed(r"API key (sk-sm-\S+)", second), printed(r"(log in as \S+ / \S+)", second)) == (key, login)
        url = printed(r"API\s+(http://\S+)/v1", second)
        answer = httpx.post(f"{url}/v1/completions", json=COMPLETION, headers={"Authorization": f"Bearer {key}"},
                            timeout=60)
        assert answer.status_code == 200, "yesterday's key works today"
        # Every secret is its owner's only: files 0600 in folders 0700 (the logs are not secrets).
        folders = [tmp_path / "home", *(p for p in state.rglob("*") if p.is_dir() and p.name != "logs")]
        files = [p for p in state.rglob("*") if p.is_file() and p.parent.name != "logs"]
        assert {p.name for p in files} >= {"registry.db", "bootstrap.json", "mesh.json", "ca.key", "key.pem"}
        assert {str(p): mode(p) for p in folders} == {str(p): 0o700 for p in folders}
        assert {str(p): mode(p) for p in files} == {str(p): 0o600 for p in files}
        ctrl_c(up)

        up, fresh = start_up(env, "--fresh")
        aside = Path(printed(r"moved to (\S+)", fresh))
        assert aside.parent == state.parent and (aside / "registry.db").exists() and mode(aside) == 0o700
        new_key = printed(r"API key (sk-sm-\S+)", fresh)
        assert new_key != key and printed(r"mesh (local-\w+)", fresh) != printed(r"mesh (local-\w+)", first)
        url = printed(r"API\s+(http://\S+)/v1", fresh)
        for old_or_new, status in ((key, 401), (new_key, 200)):
            answer = httpx.post(f"{url}/v1/completions", json=COMPLETION, timeout=60,
                                headers={"Authorization": f"Bearer {old_or_new}"})
            assert answer.status_code == status
        ctrl_c(up)
    finally:
        stop_up(up)


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


def test_up_shows_a_call_a_gguf_model_serves(tiny_model, tmp_path: Path) -> None:
    from stratamesh.cli import _example_call
    from tests.gguf_writer import write_gguf

    gguf = write_gguf(tiny_model("llama"), tmp_path / "tiny.gguf", "Q8_0")
    assert '"prompt"' in _example_call("http://127.0.0.1:8000", str(gguf), "tiny")


def test_up_passes_its_autoscaling_to_the_coordinator_as_the_coordinator_reads_it() -> None:
    from stratamesh import cli
    from stratamesh.coordinator.records import Autoscale

    parser = cli._parser()
    up = parser.parse_args(["up", "--min-replicas", "0", "--max-replicas", "3", "--slo-itl-ms", "80",
                            "--scale-down-after", "20"])
    autoscale = cli._autoscale(up, "up")
    assert autoscale == Autoscale(0, 3, None, 80.0, 20.0) and autoscale.start == 1
    coordinator = parser.parse_args(["coordinator", *cli._autoscale_args(autoscale)])
    assert cli._autoscale(coordinator, "coordinator") == autoscale
    assert cli._autoscale(parser.parse_args(["coordinator"]), "coordinator") is None     # no flag: fixed replicas
    assert cli._autoscale(parser.parse_args(["coordinator", "--max-replicas", "2"]), "coordinator") == Autoscale(1, 2)
    with pytest.raises(SystemExit, match="min_replicas <= max_replicas"):
        cli._autoscale(parser.parse_args(["up", "--min-replicas", "3", "--max-replicas", "2"]), "up")
