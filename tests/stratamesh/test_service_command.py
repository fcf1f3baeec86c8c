"""`stratamesh agent --config FILE` (every flag from TOML, the command line's over it) and `stratamesh agent
service` (a systemd unit, checked with systemd-analyze where it exists)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from stratamesh import cli

CONFIG = """
coordinator = "10.0.0.2:7000"
mesh = "shop"
threads = 2
quiet-hours = ["22:00-07:00", "12:00-13:00"]
max_gpu_temp = 80
kv-cache-gib = 1.5
insecure = true
no-gpu = false
"""


def parsed(tmp_path: Path, *argv: str, config: str = CONFIG):
    path = tmp_path / "agent.toml"
    path.write_text(config)
    argv_ = ["agent", "--config", str(path), *argv]
    parser = cli._parser()
    return parser.parse_args(cli._with_config(argv_, parser.parse_args(argv_)))


def test_a_config_file_sets_every_flag_and_the_command_line_wins(tmp_path: Path) -> None:
    args = parsed(tmp_path)
    assert (args.coordinator, args.mesh, args.threads, args.max_gpu_temp, args.kv_cache_gib) == (
        "10.0.0.2:7000", "shop", 2, 80.0, 1.5)
    assert args.quiet_hours == ["22:00-07:00", "12:00-13:00"] and args.insecure and not args.no_gpu
    args = parsed(tmp_path, "--mesh", "lab", "--threads=4", "--quiet-hours", "01:00-02:00")
    assert (args.mesh, args.threads, args.quiet_hours, args.coordinator) == ("lab", 4, ["01:00-02:00"],
                                                                            "10.0.0.2:7000")


@pytest.mark.parametrize("config, says", [
    ('coordinatr = "x"', "'coordinatr' is no flag of `stratamesh agent`"),
    ("insecure = 1", "insecure is a switch"),
    ('mesh = ["a", "b"]', "mesh takes one value"),
    ("mesh = [", "not TOML"),
])
def test_a_bad_config_file_is_refused_saying_what_is_wrong(tmp_path: Path, config: str, says: str,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        parsed(tmp_path, config=config)
    assert says in str(exit_.value.code)


def test_a_value_the_flag_would_refuse_is_refused_as_on_the_command_line(tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parsed(tmp_path, config='threads = "many"')
    assert "--threads: invalid int value: 'many'" in capsys.readouterr().err


def test_the_service_unit_runs_the_agent_from_its_config_and_verifies(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "agent.toml"
    config.write_text(CONFIG)
    cli.main(["agent", "service", "--config", str(config)])
    unit = capsys.readouterr().out
    assert f"agent --config {config}" in unit and "Restart=on-failure" in unit
    assert "RestartPreventExitStatus=3" in unit and "StateDirectory=stratamesh" in unit and "DynamicUser=yes" in unit
    cli.main(["agent", "service", "--config", str(config), "--service-user", "edge"])
    assert "User=edge" in capsys.readouterr().out
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed here: the unit's syntax was not verified")
    path = tmp_path / "stratamesh-agent.service"
    path.write_text(unit)
    check = subprocess.run([analyze, "verify", str(path)], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stderr
