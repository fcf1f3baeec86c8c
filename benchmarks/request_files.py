"""The files of the repo one non-streaming /v1/completions passes through, measured, not read (issue #46).

    python benchmarks/request_files.py [--idle-s 5]

Starts a 2-agent local mesh of the tiny Llama with every process profiled (benchmarks/profile_hook: its
sitecustomize records the repo's (file, function) pairs called while a window is open), sends a warm-up request,
then records three windows: idle, one completion of 8 tokens, idle. A file counts if a function of it ran in the
request's window and in neither idle one (heartbeats, telemetry). Prints the files by folder and their count. The
processes are started, not forked (a fork server's children would not load the hook).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import httpx

from stratamesh.kernels.tiny_model import write_tiny_model
from stratamesh.launcher import LocalMesh

ROOT = Path(__file__).resolve().parents[1]
HOOK = Path(__file__).resolve().parent / "profile_hook"


def recorded(flag: Path, window: str) -> dict[str, set[tuple[str, str]]]:
    """pid -> the (file, function) pairs that process recorded in the window."""
    return {p.name.split(".")[-3]: {tuple(pair) for pair in json.loads(p.read_text())}
            for p in flag.parent.glob(f"{flag.name}.*.{window}.json")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--idle-s", type=float, default=5.0, help="each idle window's length")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="request-files-"))
    flag = work / "flag"
    os.environ.update(TRACE_FLAG=str(flag), TRACE_ROOT=str(ROOT), PYTHONPATH=str(HOOK))
    model_dir = write_tiny_model(work / "tiny-llama", num_layers=6)
    body = {"model": model_dir.name, "prompt": "hello there", "max_tokens": 8, "temperature": 0}

    with LocalMesh(str(model_dir), num_agents=2, insecure=True, fork_agents=False, log_dir=str(work / "logs")) as mesh:
        def complete() -> None:
            httpx.post(f"{mesh.url}/v1/completions", json=body, timeout=60).raise_for_status()

        def window(name: str, action) -> None:
            flag.write_text(name)
            time.sleep(0.3)                # every process's watcher has seen the window open (it polls at 10 ms)
            action()
            time.sleep(0.3)
            flag.write_text("")
            time.sleep(0.5)                # ... and has written it

        complete()                         # the first request's one-time work is not the path
        window("idle1", lambda: time.sleep(args.idle_s))
        window("request", complete)
        window("idle2", lambda: time.sleep(args.idle_s))

    request, idle = recorded(flag, "request"), [recorded(flag, "idle1"), recorded(flag, "idle2")]
    files: dict[str, set[str]] = defaultdict(set)
    for pid, calls in request.items():
        background = set().union(*(w.get(pid, set()) for w in idle))
        for path, function in calls - background:
            files[str(Path(path).relative_to(ROOT))].add(function)
    by_folder: dict[str, int] = defaultdict(int)
    print(f"| {'file':<44} | functions run for the request |\n|{'-' * 46}|{'-' * 31}|")
    for name in sorted(files):
        by_folder[name.split("/")[0]] += 1
        print(f"| {name:<44} | {', '.join(sorted(files[name])[:4])} |")
    print(f"\n{len(files)} files: " + ", ".join(f"{folder} {n}" for folder, n in sorted(by_folder.items())))


if __name__ == "__main__":
    main()
