"""`stratamesh model rollout MODEL FOLDER` and `stratamesh model rollback MODEL`: a model's next revision through the
coordinator's admin API (coordinator/rollouts.py), followed step by step until it is promoted or rolled back."""

from __future__ import annotations

import argparse
import time
import urllib.error
import urllib.parse
from collections.abc import Callable
from typing import Any

from stratamesh.drain_command import add_api_arguments, admin_call
from stratamesh.fleet.states import RolloutState

POLL_S = 1.0


def add_rollout_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_id", metavar="MODEL", help="the served model's id")
    parser.add_argument("path", metavar="FOLDER", help="the new revision's folder, as the agents see it")
    parser.add_argument("--steps", type=_steps, help="the canary's shares in percent, e.g. 5,25,100 (the default)")
    parser.add_argument("--step-seconds", type=float, help="each share held at least this long (default 60)")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds to follow it")
    parser.add_argument("--no-wait", action="store_true", help="start it and return")
    add_api_arguments(parser)


def add_rollback_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_id", metavar="MODEL", help="the served model's id")
    add_api_arguments(parser)


def run_rollout(args: argparse.Namespace, say: Callable[[str], None] = print) -> int:
    """Starts the rollout and reports each step; 0 once its revision serves every request."""
    body = {"path": args.path, **({"steps": args.steps} if args.steps else {}),
            **({"step_s": args.step_seconds} if args.step_seconds is not None else {})}
    try:
        rollout = admin_call(_url(args, "/rollout"), "POST", args.api_key, body)["model"]["rollout"]
        say(_describe(rollout))
        deadline = time.monotonic() + args.timeout
        while not args.no_wait and rollout["state"] == RolloutState.CANARY:
            if time.monotonic() > deadline:
                say(f"still at {rollout['share']}% after {args.timeout:.0f} s; the coordinator carries on")
                return 1
            time.sleep(POLL_S)
            before, rollout = rollout, _model(args)["rollout"]
            if (rollout["state"], rollout["step"], rollout["canary_ready"]) != (
                    before["state"], before["step"], before["canary_ready"]):
                say(_describe(rollout))
    except (urllib.error.URLError, OSError, ValueError) as exc:
        say(f"rollout of {args.model_id} failed: {exc}")
        return 1
    return 0 if args.no_wait or rollout["state"] == RolloutState.PROMOTED else 1


def run_rollback(args: argparse.Namespace, say: Callable[[str], None] = print) -> int:
    try:
        say(_describe(admin_call(_url(args, "/rollout"), "DELETE", args.api_key)["model"]["rollout"]))
    except (urllib.error.URLError, OSError, ValueError) as exc:
        say(f"roll-back of {args.model_id} failed: {exc}")
        return 1
    return 0


def _model(args: argparse.Namespace) -> dict[str, Any]:
    models = admin_call(f"{args.url.rstrip('/')}/admin/api/models", "GET", args.api_key)["models"]
    return next(m for m in models if m["model_id"] == args.model_id)


def _url(args: argparse.Namespace, tail: str) -> str:
    return f"{args.url.rstrip('/')}/admin/api/models/{urllib.parse.quote(args.model_id, safe='/')}{tail}"


def _describe(rollout: dict[str, Any]) -> str:
    revision, state = rollout["revision"], rollout["state"]
    if state == RolloutState.CANARY:
        loaded = "serving" if rollout["canary_ready"] else "loading"
        return f"revision {revision}: canary {loaded}, {rollout['share']}% of the requests" + (
            f" ({rollout['reason']})" if rollout["reason"] else "")
    if state == RolloutState.PROMOTED:
        return f"revision {revision} promoted: it serves every request ({rollout['reason']})"
    return f"revision {revision} rolled back: {rollout['reason']}"


def _steps(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not percentages separated by commas: {text!r}") from None
