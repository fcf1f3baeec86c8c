"""`stratamesh drain AGENT`: asks the coordinator to drain an agent, then follows the drain to its end."""

from __future__ import annotations

import argparse
import json
import os
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

from stratamesh.fleet.states import DrainState

POLL_S = 0.2


def add_drain_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("agent_id", metavar="AGENT", help="the agent's id (see /admin/api/agents)")
    add_api_arguments(parser)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds to follow the drain")
    parser.add_argument("--no-wait", action="store_true", help="start the drain and return")


def add_api_arguments(parser: argparse.ArgumentParser) -> None:
    """--url and --api-key of a command that calls the coordinator's admin API."""
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the coordinator's HTTP API")
    parser.add_argument("--api-key", default=os.environ.get("STRATAMESH_API_KEY", ""),
                        help="an operator's API key (default: $STRATAMESH_API_KEY)")


def run_drain(args: argparse.Namespace, say: Callable[[str], None] = print) -> int:
    """Starts the drain and reports each change of state; the exit code is 0 once the agent is drained."""
    path = f"{args.url.rstrip('/')}/admin/api/agents/{args.agent_id}/drain"
    try:
        drain = admin_call(path, "POST", args.api_key)["drain"]
        say(_describe(drain))
        deadline = time.monotonic() + args.timeout
        while not args.no_wait and drain["state"] not in ("drained", "failed"):
            if time.monotonic() > deadline:
                say(f"still {drain['state']} after {args.timeout:.0f} s; the coordinator carries on")
                return 1
            time.sleep(POLL_S)
            state, drain = drain["state"], admin_call(path, "GET", args.api_key)["drain"]
            if drain["state"] != state:
                say(_describe(drain))
    except (urllib.error.URLError, OSError, ValueError) as exc:
        say(f"drain of {args.agent_id} failed: {exc}")
        return 1
    return 0 if args.no_wait or drain["state"] == DrainState.DRAINED else 1


def admin_call(url: str, method: str, api_key: str = "", body: dict[str, Any] | None = None) -> dict[str, Any]:
    """One admin API call (body: its JSON); ValueError carries the error message the API answered."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    data = b"" if method == "POST" else None
    if body is not None:
        data, headers = json.dumps(body).encode(), {**headers, "Content-Type": "application/json"}
    request = urllib.request.Request(url, method=method, data=data, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:   # the API's error shape: {"error": {"message": ...}}
        body = json.loads(exc.read() or b"{}")
        raise ValueError(body.get("error", {}).get("message") or f"HTTP {exc.code}") from None


def _describe(drain: dict[str, Any]) -> str:
    agent, state = drain["agent_id"], drain["state"]
    if state == DrainState.MOVING_STAGES:
        moves = "; ".join(f"{s['model']} layers {s['layers'][0]}-{s['layers'][1]} -> {s['to']}"
                          for s in drain["stages"])
        return f"draining {agent}: loading its stages elsewhere ({moves or 'it serves none'})"
    if state == DrainState.MOVING_SESSIONS:
        return f"draining {agent}: stages switched over; moving live sessions with their KV"
    if state == DrainState.DRAINED:
        took = drain["finished_unix_s"] - drain["started_unix_s"]
        return f"{agent} drained in {took:.1f} s: {drain['sessions_asked']} live sessions moved; it exits now"
    return f"drain of {agent} failed: {drain['error']}"
