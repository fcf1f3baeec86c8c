"""The `stratamesh` command: up, coordinator, agent, token, key, user, revoke, drain, model tiny, plan, bench."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stratamesh.bench.options import add_serve_arguments
from stratamesh.drain_command import add_drain_arguments, run_drain
from stratamesh.plan_command import add_plan_arguments, plan_main
from stratamesh.rollout_command import add_rollback_arguments, add_rollout_arguments, run_rollback, run_rollout
from stratamesh.security_commands import (add_key_arguments, add_revoke_arguments, add_token_arguments,
                                          add_user_arguments, run_key, run_revoke, run_token, run_user)
from stratamesh.fleet import event_loop
from stratamesh.fleet.errors import EXIT_REFUSED, InvalidInput, MeshError, Refused
from stratamesh.coordinator.records import SCALE_DOWN_AFTER_S, Autoscale
from stratamesh.fleet.sessions import Speculation
from stratamesh.fleet.stages import AGENT_RUNTIMES, MAX_REPLICAS, MAX_TP_DEGREE, QUANTIZATIONS
from stratamesh.fleet.states import DEFAULT_ROUTER_MODE, ROUTER_MODES, TOOL_CALL_PARSERS
from stratamesh.partitioner.wire_codec import WIRE_CODECS
from stratamesh.fleet.logs import configure_logging, set_process_fields
from stratamesh.fleet.wire.polling import use_classic_polling

if TYPE_CHECKING:
    from stratamesh.launcher import LocalMesh

log = logging.getLogger("stratamesh")


def main(argv: list[str] | None = None) -> None:
    use_classic_polling()   # before any command loads gRPC (nothing imported above does)
    argv = sys.argv[1:] if argv is None else argv
    parser = _parser()
    args = parser.parse_args(argv)
    if getattr(args, "config", None) and getattr(args, "action", "") == "run":   # stratamesh agent --config FILE
        args = parser.parse_args(_with_config(argv, args))
    configure_logging(args.log_level, args.log_format)
    if not hasattr(args, "func"):
        parser.print_help()
        raise SystemExit(2)
    args.func(args)


def _with_config(argv: list[str], args: argparse.Namespace) -> list[str]:
    """argv with the agent's --config file's flags put before the command line's own (which win)."""
    from stratamesh.service_command import config_argv

    at = argv.index("agent") + 1
    try:
        return [*argv[:at], *config_argv(args.config, args.command_parser, argv[at:]), *argv[at:]]
    except InvalidInput as e:
        sys.exit(f"stratamesh agent: {e}")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="stratamesh", description=__doc__)
    parser.add_argument("--log-level", default=os.environ.get("STRATAMESH_LOG", "info"))
    parser.add_argument("--log-format", choices=("text", "json"),
                        default=os.environ.get("STRATAMESH_LOG_FORMAT", "text"),
                        help="json: one object per line with agent_id and trace_id")
    commands = parser.add_subparsers(metavar="COMMAND")
    for add_command in (_add_up, _add_coordinator, _add_agent, _add_credentials_commands, _add_model, _add_plan,
                        _add_bench):
        add_command(commands)
    return parser


def _add_up(commands: argparse._SubParsersAction) -> None:
    """`stratamesh up`: a local mesh, supervised until Ctrl-C."""
    up = commands.add_parser("up", help="a coordinator and N agents on this machine, serving a model")
    up.add_argument("--agents", type=int, default=3)
    up.add_argument("--stages", type=int, default=0,
                    help="pipeline stages of the model (default: one per agent; fewer leaves spares)")
    up.add_argument("--model", help="a Hugging Face folder; default: the built-in demo model")
    up.add_argument("--http-port", type=int, default=8000)
    up.add_argument("--quantize", choices=QUANTIZATIONS, default="",
                    help="the model's weights in int8 or int4 (see coordinator)")
    up.add_argument("--runtime", choices=AGENT_RUNTIMES, default="torch",
                    help="what computes the agents' stages (see agent)")
    up.add_argument("--replicas", type=_int_in(1, MAX_REPLICAS), default=1,
                    help="pipelines serving the model side by side (see coordinator); --stages defaults to "
                         "agents / replicas")
    _add_autoscaling(up, see="see coordinator; --stages defaults to agents / max replicas")
    up.add_argument("--router-mode", choices=ROUTER_MODES, default=DEFAULT_ROUTER_MODE, help="see coordinator")
    up.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, help="see coordinator")
    up.add_argument("--speculative-config", type=_json_object, metavar="JSON",
                    help="see coordinator; a draft_model config naming no model drafts the built-in demo model with "
                         "its built-in draft")
    up.add_argument("--fresh", action="store_true",
                    help="start a new mesh (new CA, keys and login); the old one's folder is moved aside")
    _add_insecure_argument(up)
    up.set_defaults(func=_up)


def _add_coordinator(commands: argparse._SubParsersAction) -> None:
    """`stratamesh coordinator`: the daemon of the control plane, the origin and the HTTP API."""
    coordinator = commands.add_parser("coordinator", help="run the coordinator")
    coordinator.add_argument("--registry", "--db", dest="db", default="stratamesh.db", metavar="LOCATION",
                             help="the registry: an SQLite file path, sqlite:///PATH, or postgresql://USER@HOST/DB "
                                  "(shared by a mesh's coordinators: docs/registry.md)")
    coordinator.add_argument("--pki-dir", default="",
                             help="the mesh's CA, made on first start (default: <registry>.pki beside an SQLite "
                                  "file; required with PostgreSQL, the same on every coordinator)")
    coordinator.add_argument("--name", default="",
                             help="this coordinator's name among its mesh's on a PostgreSQL registry (default: "
                                  "HOSTNAME:HTTP_PORT)")
    coordinator.add_argument("--lease-ttl", type=_seconds, default=10.0, metavar="S",
                             help="on PostgreSQL the coordinators share a lease: a standby takes over a leader that "
                                  "did not renew it for S seconds; the leader stops by itself before (default 10)")
    coordinator.add_argument("--enroll-port", type=int, default=0,
                             help="where agents present join tokens (0: any free port; advertised on zeroconf)")
    _add_insecure_argument(coordinator)
    coordinator.add_argument("--bootstrap-file", default="", metavar="FILE",
                             help="keep a join token, an operator API key and an admin login in FILE (JSON, mode "
                                  "0600): those in it that still work are kept, new ones replace the rest")
    _add_admission_limits(coordinator)
    coordinator.add_argument("--host", default="127.0.0.1")
    coordinator.add_argument("--grpc-port", type=int, default=0)
    coordinator.add_argument("--http-port", type=int, default=8000)
    coordinator.add_argument("--advertise-host")
    coordinator.add_argument("--mesh", default="default")
    coordinator.add_argument("--interface", action="append", dest="interfaces",
                             help="zeroconf interface address (repeatable; default 127.0.0.1)")
    coordinator.add_argument("--model", help="a Hugging Face folder to deploy")
    coordinator.add_argument("--served-model-name", default="")
    coordinator.add_argument("--stages", type=int, default=1, help="pipeline stages for --model")
    coordinator.add_argument("--first-site", default="", metavar="SITE",
                             help="data residency: --model's first stage (it sees token ids) runs at this site")
    coordinator.add_argument("--last-site", default="", metavar="SITE",
                             help="... and its last stage (it produces them)")
    coordinator.add_argument("--quantize", choices=QUANTIZATIONS, default="",
                             help="--model's matrices, LM head and embedding quantized on the single-process stages "
                                  "of agents that measured the format: int8 (a scale per row: a quarter of "
                                  "float32's memory) or int4 (a scale per 32 weights: about a sixth)")
    coordinator.add_argument("--replicas", type=_int_in(1, MAX_REPLICAS), default=1, metavar="N",
                             help="pipelines serving --model side by side, each on agents of its own; a replica "
                                  "is planned once the agents the others leave can hold one")
    _add_autoscaling(coordinator)
    coordinator.add_argument("--router-mode", choices=ROUTER_MODES, default=DEFAULT_ROUTER_MODE,
                             help="how a request picks one of a model's ready replicas: the one with the least "
                                  "work ahead of its prompt, counting what the replicas' prefix caches hold (kv); "
                                  "in turn (round-robin); or the one whose busiest stage runs and queues the fewest "
                                  "sequences (least-load)")
    coordinator.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS,
                             help="how the models write tool calls, for the chat API to parse them (default: the "
                                  "format each model's chat template shows: <tool_call> blocks are hermes, "
                                  "<|python_tag|> llama3_json, [TOOL_CALLS] mistral)")
    coordinator.add_argument("--speculative-config", type=_speculative_config,
                             help="speculative decoding, as vLLM's JSON: "
                                  '\'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}\' '
                                  "(ngram: prompt lookup over the prompt and the output so far); each decode step "
                                  "carries the drafts, which the last stage verifies at once")
    coordinator.add_argument("--wire-codec", choices=WIRE_CODECS, default="auto",
                             help="how activations cross each link between stages: the most exact codec whose "
                                  "transfer stays within a quarter of the sending stage's step, from the links' "
                                  "measured bandwidth (auto: raw in the receiver's dtype, then float16, then int8 "
                                  "with per-token scales); or one codec on every link")
    _add_disaggregation(coordinator)
    coordinator.add_argument("--trace-sample-rate", type=float, default=1.0,
                             help="fraction of requests traced (spans at every stage; 0 turns tracing off)")
    coordinator.add_argument("--agent-lease", type=float, default=2.0, metavar="SECONDS",
                             help="an agent not heard from for this long is declared dead and its stages re-planned")
    coordinator.add_argument("--route-wait", type=_seconds, default=30.0, metavar="SECONDS",
                             help="how long a request waits for its model to load or recover (a re-plan after an "
                                  "agent died) before it is refused with 503")
    _add_trace_export_arguments(coordinator)
    coordinator.set_defaults(func=_coordinator)


def _add_agent(commands: argparse._SubParsersAction) -> None:
    """`stratamesh agent`: the daemon on every box."""
    agent = commands.add_parser("agent", help="run an agent daemon")
    agent.add_argument("action", nargs="?", choices=("run", "service"), default="run",
                       help="run (default): the daemon; service: print a systemd unit that runs it with --config")
    agent.add_argument("--config", metavar="FILE",
                       help="read every flag from a TOML file (keys: the flags' names, e.g. coordinator = "
                            "\"10.0.0.2:7000\", quiet-hours = [\"22:00-07:00\"]); flags given here override it")
    agent.add_argument("--service-user", default="", metavar="USER",
                       help="service: the user the unit runs the agent as (default: a dynamic user)")
    agent.add_argument("--name", default=None)
    agent.add_argument("--agent-id", default=None,
                       help="a stable id for this box (default: a new one per start); the coordinator knows a "
                            "restarted agent by it, and bans one that keeps dying")
    agent.add_argument("--host", default="127.0.0.1")
    agent.add_argument("--port", type=int, default=0)
    agent.add_argument("--advertise-host")
    agent.add_argument("--coordinator", help="host:port of the coordinator, or several comma-separated (a coordinator "
                       "and its standbys: the control stream goes on at the next when one fails); default: zeroconf")
    agent.add_argument("--join-token", default=os.environ.get("STRATAMESH_JOIN_TOKEN", ""),
                       help="from `stratamesh token create`: enrolls the agent if it holds no certificate "
                       "(default: $STRATAMESH_JOIN_TOKEN)")
    agent.add_argument("--join-token-file", default="", metavar="FILE",
                       help="read the join token from FILE instead, when enrolling: its text, or the join_token of "
                       "a coordinator's --bootstrap-file (read once the coordinator is found, so a coordinator "
                       "started beside the agent may write it; keeps the token out of the process list)")
    agent.add_argument("--state-dir", default="", help="the agent's key and certificate "
                       "(default: agent-<mesh> in $STRATAMESH_HOME, else $XDG_STATE_HOME/stratamesh, else "
                       "~/.local/state/stratamesh)")
    agent.add_argument("--enroll", metavar="HOST:PORT",
                       help="the coordinator's enrollment endpoint (A:P,B:P: its standbys' too, tried in turn); "
                            "default: zeroconf (needed with --coordinator)")
    _add_insecure_argument(agent)
    agent.add_argument("--mesh", default="default")
    agent.add_argument("--interface", action="append", dest="interfaces")
    agent.add_argument("--threads", type=int, default=0,
                       help="compute threads (0: one a CPU of --cpus, else torch's default)")
    agent.add_argument("--cpus", type=_cpu_list, default=(), metavar="LIST",
                       help="the CPUs it computes on, as in 0-3,6: every thread of the agent pinned to them (agents "
                            "sharing a box each on cores of their own)")
    _add_engine_arguments(agent)
    agent.add_argument("--site", default="", help="where this box is (a building, a cloud region)")
    agent.add_argument("--tier", choices=("edge", "cloud"), default="edge")
    agent.add_argument("--ranks", type=_int_in(1, MAX_TP_DEGREE), default=0, metavar="N",
                       help="ranks a tensor-parallel stage here may have; default: the number of GPUs, else 1")
    agent.add_argument("--no-gpu", action="store_true",
                       help="serve on the CPU only, as if the box had no GPU (it reports none to the planner)")
    agent.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto",
                       help="what this agent's stages compute in; auto: the planner picks per device (a GPU: the "
                            "checkpoint's dtype, float16 for bfloat16 before Ampere; a CPU: float32, bfloat16 for a "
                            "bfloat16 checkpoint where the CPU has native bf16)")
    agent.add_argument("--runtime", choices=AGENT_RUNTIMES, default="torch",
                       help="what computes this agent's stages; onnxruntime: ONNX Runtime's CPU provider, in float32 "
                            "(each stage is exported once, into the cache folder: seconds for the demo model, minutes "
                            "for billions of parameters); auto: the planner picks torch or onnxruntime per stage, by "
                            "the speeds measured of both (the first start measures ONNX Runtime's: about 25 s)")
    _add_owner_limits(agent)
    agent.add_argument("--fetch-weights", choices=("missing", "always"), default="missing",
                       help="fetch a stage's tensors from peers or the coordinator (sha256-checked, kept in the "
                            "cache folder): only when its model folder is not on this box (default), or always")
    agent.add_argument("--weights-dir", default="", metavar="PATH",
                       help="where fetched tensors are kept, one sparse copy per checkpoint (default: the cache "
                            "folder's weights/)")
    agent.add_argument("--remeasure", action="store_true",
                       help="measure matmul and copy speed again instead of reusing this box's cached figures")
    agent.add_argument("--metrics-port", type=int, default=0,
                       help="Prometheus /metrics port on --host (0: any free port; -1: none)")
    _add_trace_export_arguments(agent)
    agent.set_defaults(func=_agent, command_parser=agent)


def _add_autoscaling(parser: argparse.ArgumentParser, see: str = "") -> None:
    """A model's replicas following its load (coordinator/autoscaler.py); see: "see coordinator" for up's."""
    parser.add_argument("--min-replicas", type=_int_in(0, MAX_REPLICAS), metavar="N",
                        help=see or "autoscaling: the fewest replicas of --model (0: it scales to zero when idle, its "
                             "next request waiting for a cold start); with --max-replicas its replicas follow the "
                             "load and --replicas is ignored (default 1)")
    parser.add_argument("--max-replicas", type=_int_in(1, MAX_REPLICAS), metavar="N",
                        help=see or "autoscaling: the most replicas of --model (default: --min-replicas)")
    parser.add_argument("--slo-ttft-ms", type=_milliseconds, metavar="MS",
                        help=see or "autoscaling: the p90 time to first token to keep under")
    parser.add_argument("--slo-itl-ms", type=_milliseconds, metavar="MS",
                        help=see or "autoscaling: the p90 inter-token latency to keep under")
    parser.add_argument("--scale-down-after", type=_seconds, metavar="SECONDS",
                        help=see or "autoscaling: a replica is given back once the load has wanted fewer for this "
                             f"long (default {SCALE_DOWN_AFTER_S:g})")


def _autoscale(args: argparse.Namespace, command: str) -> Autoscale | None:
    """The autoscaling the flags ask for (None if they name no bound nor target)."""
    try:
        return Autoscale.of(args.min_replicas, args.max_replicas, args.slo_ttft_ms, args.slo_itl_ms,
                            args.scale_down_after)
    except InvalidInput as e:
        sys.exit(f"stratamesh {command}: {e}")


def _autoscale_args(autoscale: Autoscale | None) -> list[str]:
    """The coordinator's flags for this autoscaling (what up passes on)."""
    if autoscale is None:
        return []
    named = [("--min-replicas", autoscale.min_replicas), ("--max-replicas", autoscale.max_replicas),
             ("--slo-ttft-ms", autoscale.slo_ttft_ms), ("--slo-itl-ms", autoscale.slo_itl_ms),
             ("--scale-down-after", autoscale.scale_down_after_s)]
    return [part for flag, value in named if value is not None for part in (flag, f"{value:g}")]


def _add_admission_limits(coordinator: argparse.ArgumentParser) -> None:
    """What the coordinator's HTTP API takes in at once (coordinator/api/admission.py)."""
    coordinator.add_argument("--max-requests", type=int, default=256, metavar="N",
                             help="generations and embeddings in flight; more get 429 with Retry-After")
    coordinator.add_argument("--max-requests-per-key", type=int, default=64, metavar="N",
                             help="... per API key or admin user")
    coordinator.add_argument("--max-prompt-tokens", type=int, default=0, metavar="N",
                             help="longest prompt taken (0: the model's context)")
    coordinator.add_argument("--max-tokens", type=int, default=0, metavar="N",
                             help="largest max_tokens taken, and the default (0: the context's room)")


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("a JSON object")
    return value


def _speculative_config(text: str) -> Speculation:
    """--speculative-config: vLLM's JSON (fleet.sessions.Speculation.of says what it takes)."""
    try:
        return Speculation.of(_json_object(text))
    except InvalidInput as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def _add_disaggregation(coordinator: argparse.ArgumentParser) -> None:
    """Prefill/decode disaggregation: which replicas prefill long prompts apart."""
    coordinator.add_argument("--prefill-replicas", type=_int_in(0, MAX_REPLICAS), default=0, metavar="N",
                             help="prefill/decode disaggregation: the first N replicas prefill long prompts, whose "
                                  "KV then moves over gRPC to the replica the router picked to decode them; the "
                                  "others serve every other request whole (default 0: off)")
    coordinator.add_argument("--disagg-min-prompt", type=_int_in(1, 10_000_000), default=512, metavar="TOKENS",
                             help="a prompt prefills apart only if at least this many of its tokens are not "
                                  "cached on its decode replica (default 512)")
    coordinator.add_argument("--disagg-max-queue", type=_int_in(0, 10_000_000), default=2048, metavar="TOKENS",
                             help="... and while the prefill replica has at most this many prompt tokens still to "
                                  "prefill (default 2048)")


def _add_engine_arguments(agent: argparse.ArgumentParser) -> None:
    """What each of the agent's stage engines may hold and batch (agent/engine/)."""
    agent.add_argument("--kv-cache-gib", type=_gib, default=0.0,
                       help="paged KV cache per CPU stage (default: what the plan reserved for it, at least 0.5)")
    agent.add_argument("--gpu-memory-utilization", type=_fraction, default=0.9, metavar="FRACTION",
                       help="share of a GPU its stage may fill (weights, workspace, then the KV cache: what is "
                            "left), as vLLM's; agents sharing a GPU split it")
    agent.add_argument("--max-batch-tokens", type=int, default=512, help="tokens per step (chunked prefill)")
    agent.add_argument("--max-batch-seqs", type=int, default=64)
    agent.add_argument("--no-prefix-cache", action="store_true", help="turn off prefix caching")
    agent.add_argument("--enforce-eager", action="store_true",
                       help="run a GPU stage's decode steps eagerly, not as CUDA graphs (as vLLM's flag)")


def _add_owner_limits(agent: argparse.ArgumentParser) -> None:
    """The agent's flags for its box's owner: when it rests (agent/owner_limits.py)."""
    owner = agent.add_argument_group("the owner's limits", "the agent rests (its stages move to other agents) once a "
                                     "limit has been crossed for --limit-grace, and serves again once none has been "
                                     "for --limit-cooldown")
    owner.add_argument("--max-gpu-temp", type=float, metavar="C", help="the hottest GPU (or --sensor-file reading)")
    owner.add_argument("--max-power-w", type=float, metavar="W", help="the GPUs' (and --sensor-file's) draw together")
    owner.add_argument("--max-host-load", type=float, metavar="CORES",
                       help="cores' worth of CPU the owner's own processes (all but this agent's) may use")
    owner.add_argument("--quiet-hours", action="append", default=[], metavar="HH:MM-HH:MM",
                       help="local times to rest, e.g. 22:00-07:00 (repeatable)")
    owner.add_argument("--limit-grace", type=_duration, default=30.0, metavar="DURATION",
                       help="how long a limit must be crossed before the agent rests (default 30s)")
    owner.add_argument("--limit-cooldown", type=_duration, default=300.0, metavar="DURATION",
                       help="how long no limit must be crossed before it serves again (default 5m)")
    owner.add_argument("--sensor-file", default="", metavar="PATH",
                       help='JSON the owner\'s script keeps current for sensors NVML does not see: '
                            '{"temperatures_c": [71.5], "power_w": 35}')


def _add_credentials_commands(commands: argparse._SubParsersAction) -> None:
    """`stratamesh drain`, `token`, `key`, `user` and `revoke`: commands on a running mesh and its registry."""
    _exiting(commands, "drain", "move an agent's stages and live sessions (with their KV) to other agents, then let "
             "it exit", add_drain_arguments, run_drain)
    _exiting(commands, "token", "join tokens for new agents (run on the coordinator's box)", add_token_arguments,
             run_token)
    _exiting(commands, "key", "API keys for /v1 and /admin/api (run on the coordinator's box)", add_key_arguments,
             run_key)
    _exiting(commands, "user", "admin UI users and their roles (run on the coordinator's box)", add_user_arguments,
             run_user)
    _exiting(commands, "revoke", "revoke an agent's certificate: the mesh cuts it off at once", add_revoke_arguments,
             run_revoke)


def _exiting(commands: argparse._SubParsersAction, name: str, help_text: str,
             add_arguments: Callable[[argparse.ArgumentParser], None],
             run: Callable[[argparse.Namespace], int]) -> None:
    """A command whose flags add_arguments adds, which exits with the status run returns."""
    parser = commands.add_parser(name, help=help_text)
    add_arguments(parser)
    parser.set_defaults(func=lambda args: sys.exit(run(args)))


def _add_model(commands: argparse._SubParsersAction) -> None:
    """`stratamesh model tiny` and `model train-demo`: model folders."""
    from stratamesh.fleet.stages import MODEL_TYPES      # (pure values: the families a tiny checkpoint can be of)

    model = commands.add_parser("model", help="model folders")
    model_commands = model.add_subparsers(metavar="ACTION")
    tiny = model_commands.add_parser("tiny", help="write a random-weight checkpoint with a real tokenizer")
    tiny.add_argument("--arch", choices=MODEL_TYPES, default="llama")
    tiny.add_argument("--out", required=True)
    tiny.add_argument("--layers", type=int, default=6)
    tiny.add_argument("--hidden", type=int, default=256)
    tiny.add_argument("--intermediate", type=int, default=512)
    tiny.add_argument("--heads", type=int, default=4)
    tiny.add_argument("--kv-heads", type=int, default=2)
    tiny.add_argument("--vocab", type=int, default=1024)
    tiny.add_argument("--context", type=int, default=2048)
    tiny.add_argument("--tie-embeddings", action="store_true")
    tiny.add_argument("--embedding", action="store_true",
                      help="an embedding model (the base model without an LM head), served on /v1/embeddings")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                      help="the dtype the weights are stored in")
    tiny.set_defaults(func=_model_tiny)
    _exiting(model_commands, "rollout", "roll out another revision of a served model: a canary takes a share of the "
             "requests that steps up, or rolls back by itself", add_rollout_arguments, run_rollout)
    _exiting(model_commands, "rollback", "roll a model's running rollout back", add_rollback_arguments, run_rollback)
    train_demo = model_commands.add_parser(
        "train-demo", help="train the demo model (the one `up` serves) on the bundled public-domain novel")
    train_demo.add_argument("--out", required=True)
    train_demo.add_argument("--steps", type=int, help="optimizer steps (default: as the shipped model was trained)")
    train_demo.add_argument("--seed", type=int, default=0)
    train_demo.add_argument("--draft", nargs="?", const=True, default=None, metavar="TARGET",
                            help="train the demo model's draft instead (speculative decoding's draft_model), of the "
                                 "demo model in TARGET (default: the built-in one)")
    train_demo.set_defaults(func=_model_train_demo)


def _add_plan(commands: argparse._SubParsersAction) -> None:
    """`stratamesh plan`: the planner over a fleet file."""
    plan = commands.add_parser("plan", help="plan a model's stages over a fleet file (no daemon needed)")
    add_plan_arguments(plan)
    plan.set_defaults(func=lambda args: sys.exit(plan_main(args)))


def _add_bench(commands: argparse._SubParsersAction) -> None:
    """`stratamesh bench serve`, `chaos`, `plan` and `control`."""
    bench = commands.add_parser("bench", help="benchmarks")
    bench_commands = bench.add_subparsers(metavar="BENCHMARK")
    serve = bench_commands.add_parser("serve", help="serving throughput and latency, like `vllm bench serve`")
    add_serve_arguments(serve)
    serve.set_defaults(func=_bench_serve)
    chaos = bench_commands.add_parser("chaos", help="kill -9 agents at random under load; check every output")
    chaos.add_argument("--model", help="a Hugging Face folder; default: the built-in demo model")
    chaos.add_argument("--agents", type=int, default=4)
    chaos.add_argument("--stages", type=int, default=3)
    chaos.add_argument("--duration", type=float, default=60.0, help="seconds of load")
    chaos.add_argument("--clients", type=int, default=16, help="concurrent streaming clients")
    chaos.add_argument("--kill-every", type=float, default=10.0, help="seconds between kills")
    chaos.add_argument("--jobs", type=int, default=32, help="distinct prompts the clients cycle through")
    chaos.add_argument("--prompt-len", type=int, default=32)
    chaos.add_argument("--max-tokens", type=int, default=64)
    chaos.add_argument("--seed", type=int, default=0)
    chaos.add_argument("--margin", type=float, default=1e-4,
                       help="draw greedy prompts whose every step leads its runner-up logit by this much, so that a "
                            "failover's reordered float sums cannot change them (0: any prompt)")
    chaos.set_defaults(func=_bench_chaos)
    plan_check = bench_commands.add_parser(
        "plan", help="local meshes of N agents: the planner's predicted tokens/s next to the measured")
    plan_check.add_argument("--model", help="a Hugging Face folder; default: the built-in demo model")
    plan_check.add_argument("--agents", default="1,2,3,4", help="mesh sizes to run in turn (default: 1,2,3,4)")
    plan_check.add_argument("--input-len", type=int, default=128)
    plan_check.add_argument("--output-len", type=int, default=64)
    plan_check.add_argument("--rounds", type=int, default=3, help="waves of requests at the predicted concurrency")
    plan_check.set_defaults(func=_bench_plan)
    control = bench_commands.add_parser(
        "control", help="thousands of simulated agents against a coordinator: joins, heartbeats, CPU, API latency")
    control.add_argument("--agents", default="1000,5000,10000", help="fleet sizes to run in turn")
    control.add_argument("--processes", type=int, default=0,
                         help="processes the simulated agents run in (default: one per 2,500 agents)")
    control.add_argument("--window", type=float, default=20.0, help="seconds of steady load measured per size")
    control.add_argument("--join-timeout", type=float, default=60.0)
    control.add_argument("--churn-per-min", type=float, default=0.0,
                         help="times per minute each simulated agent drops its stream and comes back")
    control.add_argument("--mtls", action="store_true", help="a secure mesh: certificates issued in bulk")
    control.add_argument("--registry", default="", metavar="POSTGRESQL_URL",
                         help="also run each size on a database of its own on this PostgreSQL server (its user may "
                              "create databases), against SQLite in the same run")
    control.add_argument("--capable", action="store_true",
                         help="simulated boxes with the RAM for a stage (but slow): the planner weighs their joins")
    control.add_argument("--log-dir", default="",
                         help="keep the daemons' logs (and registry) here, a folder per fleet size")
    control.set_defaults(func=_bench_control)

def _run_daemon(body: Callable[[asyncio.Event], Awaitable[None]]) -> None:
    """Runs body(stop) on an event loop; SIGINT or SIGTERM sets stop for a clean shutdown."""
    async def runner() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await body(stop)

    try:
        event_loop.run(runner())   # uvloop's, unless STRATAMESH_EVENT_LOOP=asyncio (fleet/event_loop.py)
    except MeshError as exc:      # bad flags, a bad model folder, ...: say so, no traceback
        log.error("%s", exc)
        raise SystemExit(EXIT_REFUSED if isinstance(exc, Refused) else 1) from None


def _add_insecure_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--insecure", action="store_true",
                        help="DEVELOPMENT ONLY: plaintext gRPC, no certificates, no join tokens")


def _add_trace_export_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--traces-json", default="", metavar="FILE",
                        help="append every span to FILE as OpenTelemetry JSON, one per line")
    parser.add_argument("--otlp-traces-endpoint", default="", metavar="URL",
                        help="export spans over OTLP/HTTP, e.g. http://collector:4318/v1/traces")


def _coordinator(args: argparse.Namespace) -> None:
    from stratamesh.coordinator.api.admission import Limits
    from stratamesh.coordinator.serving.router import Disaggregation
    from stratamesh.coordinator.daemon import run_coordinator
    from stratamesh.coordinator.options import CoordinatorOptions, ModelRequest
    from stratamesh.coordinator.liveness import LivenessConfig
    from stratamesh.coordinator.placement import SitePins

    if args.model:
        _check_model_folder("coordinator", args.model)
    models = (ModelRequest(args.model, args.served_model_name, args.stages, SitePins(args.first_site, args.last_site),
                           args.quantize, args.replicas, _autoscale(args, "coordinator")),
              ) if args.model else ()
    options = CoordinatorOptions(
        db=args.db, host=args.host, grpc_port=args.grpc_port, http_port=args.http_port,
        advertise_host=args.advertise_host, mesh=args.mesh,
        interfaces=tuple(args.interfaces or ["127.0.0.1"]), models=models,
        trace_sample_rate=args.trace_sample_rate, traces_json=args.traces_json,
        otlp_traces_endpoint=args.otlp_traces_endpoint, liveness=LivenessConfig(lease_s=args.agent_lease),
        insecure=args.insecure, pki_dir=args.pki_dir, enroll_port=args.enroll_port, bootstrap_file=args.bootstrap_file,
        router_mode=args.router_mode, codec_policy=args.wire_codec, route_wait_s=args.route_wait,
        disaggregation=Disaggregation(args.prefill_replicas, args.disagg_min_prompt, args.disagg_max_queue),
        limits=Limits(max_requests=args.max_requests, max_requests_per_caller=args.max_requests_per_key,
                      max_prompt_tokens=args.max_prompt_tokens, max_tokens=args.max_tokens),
        tool_call_parser=args.tool_call_parser, speculation=args.speculative_config, name=args.name,
        lease_ttl_s=args.lease_ttl)
    set_process_fields(component="coordinator", mesh=args.mesh)
    _run_daemon(lambda stop: run_coordinator(options, stop))


def _gib(text: str) -> float:
    """A size in GiB: a number >= 0."""
    value = _number(text)
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {value}")
    return value


def _milliseconds(text: str) -> float:
    """A time in milliseconds: a number > 0."""
    value = _number(text)
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of milliseconds > 0, got {value}")
    return value


def _seconds(text: str) -> float:
    """A time in seconds: a number > 0."""
    value = _number(text)
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {value}")
    return value


def _fraction(text: str) -> float:
    """A number in (0, 1]."""
    value = _number(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {value}")
    return value


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None


def _duration(text: str) -> float:
    """--limit-grace, --limit-cooldown: 90s, 30m, 24h or 7d, in seconds."""
    from stratamesh.coordinator.enrollment import parse_duration

    try:
        seconds = parse_duration(text)
    except InvalidInput as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if seconds is None:
        raise argparse.ArgumentTypeError("a limit's period cannot be never")
    return seconds


def _cpu_list(text: str) -> tuple[int, ...]:
    """An argparse type: a CPU list (agent --cpus)."""
    from stratamesh.agent.cpus import parse_cpus

    try:
        return parse_cpus(text)
    except InvalidInput as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _int_in(low: int, high: int) -> Callable[[str], int]:
    """An argparse type: an integer in low..high (--ranks, --replicas)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be in {low}..{high}, got {value}")
        return value

    return parse


def _agent(args: argparse.Namespace) -> None:
    if args.action == "service":
        from stratamesh.service_command import systemd_unit
        if not args.config:
            sys.exit("stratamesh agent service: give the --config FILE the unit runs the agent with")
        print(systemd_unit(args.config, args.service_user), end="")
        return
    from stratamesh.agent.credentials import default_state_dir, stored_agent_id
    from stratamesh.agent.daemon import AgentOptions, exit_now, run_agent
    from stratamesh.agent.engine.stage_engine import EngineConfig
    from stratamesh.agent.engine.tp_group import GroupFailed
    from stratamesh.agent.owner_limits import OwnerLimits, QuietHours

    state_dir = args.state_dir or default_state_dir(args.mesh)
    agent_id = args.agent_id or (stored_agent_id(state_dir) if not args.insecure else "")   # keep its name
    overrides = {k: v for k, v in (("name", args.name), ("agent_id", agent_id)) if v}
    options = AgentOptions(
        host=args.host, port=args.port, advertise_host=args.advertise_host,
        coordinator=args.coordinator, mesh=args.mesh,
        interfaces=tuple(args.interfaces or ["127.0.0.1"]), num_threads=args.threads, cpus=args.cpus,
        site=args.site,
        tier=args.tier, remeasure=args.remeasure, num_ranks=args.ranks,
        dtype="" if args.dtype == "auto" else args.dtype, use_gpus=not args.no_gpu,
        runtime=args.runtime,
        owner_limits=OwnerLimits(args.max_gpu_temp, args.max_power_w, args.max_host_load,
                                 tuple(QuietHours.parse(q) for q in args.quiet_hours), args.limit_grace,
                                 args.limit_cooldown),
        sensor_file=args.sensor_file, fetch_weights=args.fetch_weights,
        weights_dir=args.weights_dir,
        engine=EngineConfig(kv_cache_bytes=int(args.kv_cache_gib * (1 << 30)),
                            gpu_memory_utilization=args.gpu_memory_utilization,
                            max_batch_tokens=args.max_batch_tokens, max_batch_seqs=args.max_batch_seqs,
                            enable_prefix_cache=not args.no_prefix_cache, cuda_graphs=not args.enforce_eager),
        metrics_port=None if args.metrics_port < 0 else args.metrics_port, traces_json=args.traces_json,
        otlp_traces_endpoint=args.otlp_traces_endpoint, insecure=args.insecure, join_token=args.join_token,
        join_token_file=args.join_token_file,
        state_dir=state_dir, enroll=args.enroll, **overrides)
    set_process_fields(component="agent", agent_id=options.agent_id)

    async def serve(stop: asyncio.Event) -> None:
        try:
            await run_agent(options, stop)
        except GroupFailed as exc:    # stopped serving and said goodbye; the rest of the teardown may hang
            exit_now(str(exc))

    _run_daemon(serve)


def _model_tiny(args: argparse.Namespace) -> None:
    from stratamesh.kernels.tiny_model import write_tiny_model

    path = write_tiny_model(
        args.out, arch=args.arch, num_layers=args.layers, hidden_size=args.hidden,
        intermediate_size=args.intermediate, num_heads=args.heads, num_kv_heads=args.kv_heads,
        vocab_size=args.vocab, max_position_embeddings=args.context,
        tie_word_embeddings=args.tie_embeddings, seed=args.seed, embedding=args.embedding, dtype=args.dtype)
    print(path)


def _model_train_demo(args: argparse.Namespace) -> None:
    from dataclasses import replace

    from stratamesh.kernels.demo_model import DEMO_DIR, DRAFT_SETTINGS, TrainSettings, train_demo, train_draft

    defaults = DRAFT_SETTINGS if args.draft else TrainSettings()
    settings = replace(defaults, seed=args.seed, **({"steps": args.steps} if args.steps else {}))
    if args.draft:
        target = DEMO_DIR if args.draft is True else args.draft
        report = train_draft(args.out, target, settings, log=print)
    else:
        report = train_demo(args.out, settings, log=print)
    print(f"{report.out_dir}: {report.num_params / 1e6:.2f} M parameters, {report.weights_bytes / 1e6:.1f} MB of "
          f"weights, held-out perplexity {report.held_out_perplexity:.2f} ({report.seconds:.0f} s of training)")


def _bench_serve(args: argparse.Namespace) -> None:
    from stratamesh.bench.options import options_from_args
    from stratamesh.bench.serve import main as bench_serve_main

    try:
        bench_serve_main(options_from_args(args), args.json)
    except MeshError as exc:
        log.error("%s", exc)
        raise SystemExit(1) from None


def _bench_plan(args: argparse.Namespace) -> None:
    from stratamesh.bench.plan_check import plan_main
    from stratamesh.sdk.local import builtin_model_dir

    counts = [int(n) for n in args.agents.split(",")]
    checks = plan_main(args.model or builtin_model_dir(), counts, args.input_len, args.output_len, args.rounds)
    if not all(c.honest for c in checks):
        raise SystemExit(1)


def _bench_control(args: argparse.Namespace) -> None:
    from stratamesh.bench.control import control_main
    from stratamesh.sdk.local import builtin_model_dir

    control_main(str(builtin_model_dir()), [int(n) for n in args.agents.split(",")], args.processes, args.window,
                 args.join_timeout, args.churn_per_min, args.mtls, args.log_dir, args.capable, args.registry)


def _bench_chaos(args: argparse.Namespace) -> None:
    from stratamesh.bench.chaos import chaos_main
    from stratamesh.sdk.local import builtin_model_dir

    report = chaos_main(args.model or builtin_model_dir(), args.agents, args.stages, args.duration, args.clients,
                        args.kill_every, args.jobs, args.prompt_len, args.max_tokens, args.seed, args.margin)
    if report.num_failed or report.num_mismatched:
        raise SystemExit(1)


def _up_speculation(config: dict[str, Any], model: str | None) -> Speculation:
    """up's --speculative-config: a draft_model one naming no model drafts the built-in demo model (model None)
    with the built-in draft."""
    from stratamesh.sdk.local import builtin_draft_dir

    if config.get("method") == "draft_model" and not config.get("model") and model is None:
        config = dict(config, model=builtin_draft_dir())
    try:
        return Speculation.of(config)
    except InvalidInput as e:
        sys.exit(f"stratamesh up: --speculative-config: {e}")


def _up(args: argparse.Namespace) -> None:
    from stratamesh.fleet.model_folder import default_model_id
    from stratamesh.launcher import LocalMesh
    from stratamesh.fleet.state import up_folder
    from stratamesh.sdk.local import builtin_model_dir
    from stratamesh.up_state import forget_last_run, open_up_state

    autoscale = _autoscale(args, "up")
    replicas = autoscale.start if autoscale else args.replicas     # (the agents left over take replicas added later)
    num_stages = args.stages or max(1, args.agents // (autoscale.max_replicas if autoscale else args.replicas))
    if args.agents < num_stages * replicas:      # a local mesh has only its own agents: say so, start nothing
        sys.exit(f"stratamesh up: {replicas} replicas of {num_stages} stages need {num_stages * replicas} "
                 f"agents; --agents is {args.agents}")
    speculation = _up_speculation(args.speculative_config, args.model) if args.speculative_config else None
    model_dir = args.model or builtin_model_dir()
    _check_model_folder("up", model_dir)
    state = open_up_state(up_folder(os.environ), args.fresh, time.time())
    forget_last_run(state)
    coordinator_args = ["--replicas", str(args.replicas), "--router-mode", args.router_mode,
                        *_autoscale_args(autoscale)]
    coordinator_args += ["--quantize", args.quantize] if args.quantize else []
    coordinator_args += ["--tool-call-parser", args.tool_call_parser] if args.tool_call_parser else []
    if speculation is not None:
        coordinator_args += ["--speculative-config", json.dumps(speculation.config())]
    mesh = LocalMesh(model_dir, num_agents=args.agents, num_stages=num_stages, mesh=state.mesh,
                     http_port=args.http_port, log_dir=str(state.log_dir), state_dir=str(state.folder),
                     insecure=args.insecure, coordinator_args=coordinator_args, agent_args=["--runtime", args.runtime],
                     pin_cpus=True,       # agents as many as cores or fewer: each on cores of its own
                     fork_agents=False,   # each agent a process of its own, its command line in `ps`, a child of `up`
                     say=lambda line: print(f"{time.strftime('%H:%M:%S')} {line}", flush=True))
    for sig in (signal.SIGINT, signal.SIGTERM):   # set them even if our parent made us ignore SIGINT
        signal.signal(sig, _interrupt)
    print(f"{state.describe()}\nstarting a coordinator and {args.agents} agents for {model_dir} ...", flush=True)
    try:
        mesh.start()
        model_id = default_model_id(model_dir)
        print(f"\nstratamesh is up: {args.agents} agents serving '{model_id}'\n"
              f"  API     {mesh.url}/v1  (OpenAI-compatible)\n"
              f"  admin   {mesh.url}/admin/  (web UI)\n"
              f"  health  {mesh.url}/health\n"
              f"  state   {state.folder}  (registry, CA, keys: the next `stratamesh up` reuses them; --fresh: a new "
              f"mesh)\n  logs    {mesh.log_dir}\n"
              f"{_security_line(mesh)}\n\n"
              f"{_example_call(mesh.url, model_dir, model_id, mesh.api_key)}\n\n"
              "A process that dies is started again; Ctrl-C stops every process.", flush=True)
        supervisor = mesh.supervise(say=lambda line: print(f"{time.strftime('%H:%M:%S')} {line}", flush=True))
        while not supervisor.ended.wait(1.0):   # only a coordinator that cannot start again ends the mesh itself
            pass
        print("stopping the rest", file=sys.stderr)
        raise SystemExit(1)
    except KeyboardInterrupt:
        print("\nstopping ...", flush=True)
    finally:
        mesh.stop()


def _check_model_folder(command: str, model_dir: str) -> None:
    """Exits with one line naming the problem unless a mesh can serve the model in model_dir, before any process
    starts or agent loads it (fleet.model_folder)."""
    from stratamesh.fleet.errors import CheckpointError
    from stratamesh.fleet.model_folder import check_model_folder

    try:
        check_model_folder(model_dir)
    except CheckpointError as e:
        sys.exit(f"stratamesh {command}: {e}")


def _security_line(mesh: LocalMesh) -> str:
    if mesh.insecure:
        return (f"\n{'!' * 78}\n  INSECURE DEVELOPMENT MODE: plaintext gRPC, no certificates, no join tokens.\n"
                f"  Anyone who reaches these ports can join this mesh or read its traffic.\n{'!' * 78}")
    return (f"  API key {mesh.api_key}  (operator; export STRATAMESH_API_KEY=... for the SDK and CLI)\n"
            f"  mTLS    every agent enrolled with a join token; the mesh's CA is beside {mesh.registry_path()}\n"
            f"          another agent: stratamesh agent --mesh {mesh.mesh} --join-token {mesh.join_token} "
            f"--state-dir DIR\n"
            f"  UI      log in as {mesh.admin_login[0]} / {mesh.admin_login[1]}  (more users: stratamesh user add "
            f"NAME --role viewer{_db_flag(mesh.registry_path())})")


def _db_flag(registry: str) -> str:
    """' --db PATH', unless the credentials commands find this registry without it."""
    from stratamesh.fleet.state import default_registry

    return "" if Path(registry) == default_registry("", os.environ) else f" --db {registry}"


def _example_call(url: str, model_dir: str, model_id: str, api_key: str = "") -> str:
    """A curl command that uses the model: a completion, or an embedding for an embedding model."""
    from stratamesh.fleet.model_folder import read_config_json
    from stratamesh.fleet.stages import model_task

    config = read_config_json(model_dir)       # (a folder's config.json, or what a GGUF file says)
    endpoint, body = (("embeddings", '"input": ["The mesh", "Edge boxes"]') if model_task(config) == "embed"
                      else ("completions", '"prompt": "I went to", "max_tokens": 16, "temperature": 0'))
    auth = f" -H 'Authorization: Bearer {api_key}'" if api_key else ""
    return (f"  curl {url}/v1/{endpoint} -H 'Content-Type: application/json'{auth} \\\n"
            f"    -d '{{\"model\": \"{model_id}\", {body}}}'")


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":
    main()
