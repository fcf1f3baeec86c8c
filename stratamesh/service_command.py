"""`stratamesh agent --config FILE`: every flag of the agent from a TOML file, the command line's flags over it; and
`stratamesh agent service`: the systemd unit that runs the agent from such a file on an edge box.

The file's keys are the flags' names without their dashes (`coordinator`, `max-gpu-temp`; an underscore for a dash
is taken too): a string or number is the flag's value, true gives a switch (false leaves it off), a list repeats
the flag (`quiet-hours = ["22:00-07:00"]`). Each value goes through the flag's own parsing, so a file is checked
as the command line is; an unknown key is refused by name.
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import sys
import tomllib
from collections.abc import Sequence
from pathlib import Path

from stratamesh.fleet.errors import EXIT_REFUSED, InvalidInput

NOT_IN_A_FILE = {"help", "config", "action"}


def config_argv(path: str, parser: argparse.ArgumentParser, given: Sequence[str]) -> list[str]:
    """The flags a TOML file stands for, less those the command line (given) sets: they win. InvalidInput for a
    file that cannot be read or parsed, or a key that is no flag of the agent."""
    try:
        table = tomllib.loads(Path(path).read_text())
    except OSError as exc:
        raise InvalidInput(f"--config {path}: cannot read it: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise InvalidInput(f"--config {path}: not TOML: {exc}") from None
    actions = {a.dest: a for a in parser._actions if a.option_strings and a.dest not in NOT_IN_A_FILE}
    on_command_line = {a.dest for a in actions.values()
                       if any(arg == flag or arg.startswith(f"{flag}=") for arg in given for flag in a.option_strings)}
    argv: list[str] = []
    for key, value in table.items():
        dest = key.replace("-", "_")
        action = actions.get(dest)
        if action is None:
            raise InvalidInput(f"--config {path}: {key!r} is no flag of `stratamesh agent` (it takes "
                               f"{', '.join(sorted(d.replace('_', '-') for d in actions))})")
        if dest in on_command_line:
            continue
        argv += _flag(path, key, action, value)
    return argv


def _flag(path: str, key: str, action: argparse.Action, value: object) -> list[str]:
    flag = action.option_strings[-1]
    if action.nargs == 0:       # a switch
        if not isinstance(value, bool):
            raise InvalidInput(f"--config {path}: {key} is a switch: true or false, not {value!r}")
        return [flag] if value else []
    values = value if isinstance(value, list) else [value]
    if isinstance(value, list) and not isinstance(action, argparse._AppendAction):
        raise InvalidInput(f"--config {path}: {key} takes one value, not a list")
    if any(isinstance(v, (dict, list, bool)) for v in values):
        raise InvalidInput(f"--config {path}: {key} takes a string or a number, not {value!r}")
    return [part for v in values for part in (flag, str(v))]


def systemd_unit(config: str, user: str = "", executable: str = "") -> str:
    """A systemd unit that runs `stratamesh agent --config CONFIG`: restarted when it fails (not when the
    coordinator refused it: a version it cannot speak, a revoked certificate), its key, certificate and caches in
    /var/lib/stratamesh, at a lower CPU and I/O weight than the owner's own work; the owner's limits (temperature,
    power, load, quiet hours) are the config file's, which the agent applies itself."""
    beside = Path(sys.executable).with_name("stratamesh")     # the venv's own script, where it was installed
    command = executable or (str(beside) if beside.exists() else shutil.which("stratamesh")) \
        or f"{sys.executable} -m stratamesh.cli"
    identity = f"User={user}\n" if user else "DynamicUser=yes\nSupplementaryGroups=video render\n"
    return f"""[Unit]
Description=stratamesh agent ({config})
Wants=network-online.target
After=network-online.target

[Service]
Type=simple
ExecStart={command} agent --config {shlex.quote(str(Path(config).resolve()))}
Restart=on-failure
RestartSec=5
# the coordinator refused this agent (a protocol it cannot speak, a revoked certificate): starting again won't help
RestartPreventExitStatus={EXIT_REFUSED}
{identity}StateDirectory=stratamesh
CacheDirectory=stratamesh
Environment=STRATAMESH_HOME=/var/lib/stratamesh
Environment=STRATAMESH_CACHE_DIR=/var/cache/stratamesh
# the owner's work comes first
Nice=10
CPUWeight=20
IOWeight=20
# SIGTERM stops it cleanly; drain it first (`stratamesh drain`) to move its sessions off with their KV
KillSignal=SIGTERM
TimeoutStopSec=90
NoNewPrivileges=yes
ProtectSystem=strict
ProtectHome=read-only
PrivateTmp=yes

[Install]
WantedBy=multi-user.target
"""
