"""The fork server's children behave as the processes subprocess starts: the command's output, exit code, signals,
environment and folder; and a child whose environment differs in what the server's imports read is not forked."""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile

import pytest

from stratamesh.forked import ForkServer, fork_server


@pytest.fixture(scope="module")
def server() -> ForkServer:
    return fork_server()


def run(server: ForkServer, *argv: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    with tempfile.TemporaryFile() as stderr:
        child = server.fork(list(argv), env or dict(os.environ), stderr.fileno())
        out = child.stdout.read().decode()
        code = child.wait(timeout=60)
        stderr.seek(0)
        return code, out, stderr.read().decode()


def test_a_child_prints_on_its_stdout_and_ends_with_the_commands_code(server: ForkServer) -> None:
    code, out, _ = run(server, "--help")
    assert code == 0 and "usage: stratamesh" in out
    code, out, err = run(server, "no-such-command")
    assert code == 2 and out == "" and "invalid choice" in err       # argparse's exit code, on its stderr


def test_a_child_runs_with_the_environment_and_folder_it_was_given(server: ForkServer, tmp_path) -> None:
    # `stratamesh token list` reads its registry from $STRATAMESH_DB; `model tiny --out` writes where it runs
    code, _, err = run(server, "token", "list", env={**os.environ, "STRATAMESH_DB": str(tmp_path / "none.db")})
    assert code != 0 and "none.db" in err, err
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        code, _, err = run(server, "model", "tiny", "--out", "tiny", "--layers", "1", "--hidden", "32", "--heads",
                           "2", "--kv-heads", "1", "--intermediate", "64", "--vocab", "300")
    finally:
        os.chdir(cwd)
    assert code == 0 and (tmp_path / "tiny" / "config.json").is_file(), err


def test_a_killed_child_reports_the_signal_as_popen_does(server: ForkServer) -> None:
    with tempfile.TemporaryFile() as stderr:
        child = server.fork(["agent", "--insecure", "--coordinator", "127.0.0.1:9", "--mesh", "forked-test",
                             "--metrics-port", "-1"], dict(os.environ), stderr.fileno())
        assert child.poll() is None
        with pytest.raises(subprocess.TimeoutExpired):
            child.wait(timeout=0.1)
        child.send_signal(signal.SIGKILL)
        assert child.wait(timeout=60) == -signal.SIGKILL and child.poll() == -signal.SIGKILL


def test_only_a_child_whose_import_time_environment_is_the_servers_is_forked(server: ForkServer) -> None:
    assert server.can_fork(dict(os.environ))
    assert server.can_fork({**os.environ, "STRATAMESH_CACHE_DIR": "/elsewhere"})    # read when used
    assert server.can_fork({**os.environ, "TORCHINDUCTOR_CACHE_DIR": "/tmp/x"})      # torch set it in the parent
    assert server.can_fork({**os.environ, "CUDA_DEVICE_ORDER": "PCI_BUS_ID"})         # a probe set it there
    assert not server.can_fork({**os.environ, "TORCH_LOGS": "+dynamo"})              # a TORCH* variable a user set
    assert not server.can_fork({**os.environ, "OMP_NUM_THREADS": "7"})             # read as torch loads
    assert not server.can_fork({k: v for k, v in os.environ.items() if not k.startswith("PYTHON")} | {
        "PYTHONPATH": "/elsewhere"})
