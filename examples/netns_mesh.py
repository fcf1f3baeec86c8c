"""A mesh across Linux network namespaces acting as separate hosts (needs root and iproute2).

    sudo .venv/bin/python examples/netns_mesh.py                  # agents find the coordinator by zeroconf
    sudo .venv/bin/python examples/netns_mesh.py --no-zeroconf    # ... or dial its address, as across a WAN

Every "host" is a network namespace with one address on a shared bridge (stratamesh/testbed/netbed.py, the WAN test bed,
with every cable a LAN here); the bridge sits in a namespace of its own, so nothing here touches the machine's
real network:

    PREFIX-wan      wan0, the bridge (a switch: no address)
    PREFIX-coord    10.77.N.11   the coordinator: HTTP on :8000, gRPC (mTLS) on :50051, enrollment on :50052
    PREFIX-client   10.77.N.12   an application host that calls the API
    PREFIX-h1 ...   10.77.N.13 ...  one agent each

Each agent enrolls with a join token made by `stratamesh token create`, and from then on every gRPC
call between the hosts is mutual TLS; the client host sends an API key (made in the coordinator's registry)
with every call to the HTTP API. The hosts share this machine's CPUs, files and hostname; only their
networks are apart. On real hosts run
the same commands without `ip netns exec`. Everything is torn down at the end, also on Ctrl-C or an error.
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from stratamesh.coordinator.access import AccessStore
from stratamesh.coordinator.registry import Registry
from stratamesh.testbed.netbed import Host, Netbed, NetbedUnavailable, check_can_build, stop_on_sigterm
from stratamesh.sdk.local import builtin_model_dir

SKIP = 77                  # exit status when this machine cannot run the example (the automake "skipped" code)
HTTP_PORT, GRPC_PORT, ENROLL_PORT = 8000, 50051, 50052   # fixed ports are fine: each namespace has its own


class Processes:
    """Daemons started inside namespaces, each logging to its own file; stop() ends them all."""

    def __init__(self, log_dir: Path):
        self.log_dir = log_dir
        self.running: dict[str, subprocess.Popen] = {}

    def start(self, name: str, host: Host, args: list[str], env: dict[str, str] | None = None) -> None:
        with open(self.log_dir / f"{name}.log", "wb") as log:
            self.running[name] = subprocess.Popen(
                host.command([sys.executable, "-m", "stratamesh.cli", *args]),
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env={**os.environ, **(env or {})})

    def check_alive(self) -> None:
        for name, process in self.running.items():
            if process.poll() is not None:
                raise RuntimeError(f"{name} exited with status {process.returncode}")

    def stop(self) -> None:
        """SIGTERM to each (a clean shutdown), SIGKILL to any still running after 10 s."""
        for process in self.running.values():
            if process.poll() is None:
                process.terminate()
        for process in self.running.values():
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    def print_logs(self, num_lines: int = 15) -> None:
        for name in self.running:
            lines = (self.log_dir / f"{name}.log").read_text(errors="replace").splitlines()[-num_lines:]
            print(f"--- {name}.log (last {len(lines)} lines)", *lines, sep="\n", file=sys.stderr)


def run_mesh(args: argparse.Namespace, prefix: str, network: Netbed, daemons: Processes) -> int:
    """Builds the network, starts the daemons and runs the client on its own host; returns its exit status."""
    network.create()
    coordinator = network.add_host("coord")
    client_host = network.add_host("client")
    db = str(daemons.log_dir / "registry.db")
    # On the coordinator's box, before it starts: this makes the mesh's CA and a join token for the agents.
    token = subprocess.run([sys.executable, "-m", "stratamesh.cli", "token", "create", "--db", db, "--create",
                            "--mesh", prefix, "--expires", "1h"],
                           check=True, capture_output=True, text=True).stdout.split()[0]
    api_key = create_api_key(db)
    # Each daemon listens on, advertises and runs zeroconf on its own host's address.
    address = coordinator.address
    daemons.start("coordinator", coordinator, [
        "coordinator", "--mesh", prefix, "--db", db, "--host", address, "--interface", address,
        "--http-port", str(HTTP_PORT), "--grpc-port", str(GRPC_PORT), "--enroll-port", str(ENROLL_PORT),
        "--model", builtin_model_dir(), "--stages", str(args.agents)])
    for index in range(1, args.agents + 1):
        host = network.add_host(f"h{index}")
        dial = (["--coordinator", f"{address}:{GRPC_PORT}", "--enroll", f"{address}:{ENROLL_PORT}"]
                if args.no_zeroconf else [])
        daemons.start(f"agent-h{index}", host, [
            "agent", "--mesh", prefix, "--name", f"h{index}", "--host", host.address, "--interface", host.address,
            "--threads", "1", "--state-dir", str(daemons.log_dir / f"h{index}"), *dial],
            env={"STRATAMESH_JOIN_TOKEN": token})
    print(f"{args.agents + 2} hosts on {network.wan_subnet}.0/24; daemons starting (logs in {daemons.log_dir}) ...",
          flush=True)

    # The client runs this same file on the client host; it reaches only the coordinator's address.
    client = subprocess.Popen(client_host.command([sys.executable, __file__, "--client-of", f"http://{address}:{HTTP_PORT}",
                                                   "--agents", str(args.agents), "--timeout", str(args.timeout)]),
                              env={**os.environ, "STRATAMESH_API_KEY": api_key})
    try:
        while client.poll() is None:
            daemons.check_alive()
            time.sleep(0.2)
    finally:
        if client.poll() is None:
            client.kill()
            client.wait()
    return client.returncode


def create_api_key(db: str) -> str:
    """A key for the client host, made in the coordinator's registry (as `stratamesh key create` would). It reads
    the plan from the admin API, so it is a viewer's: a "client" key opens only /v1."""
    registry = Registry(db)
    try:
        return AccessStore(registry).create_key("viewer", "netns example", time.time())[0]
    finally:
        registry.close()


def run_client(url: str, num_agents: int, timeout_s: float) -> int:
    """On the client host: waits for the mesh, prints where each stage runs, and completes a prompt."""
    headers = {"Authorization": f"Bearer {os.environ['STRATAMESH_API_KEY']}"}   # /health needs none
    deadline = time.monotonic() + timeout_s
    health: dict = {}
    while not (health.get("status") == "ok" and health.get("num_agents") == num_agents):
        if time.monotonic() > deadline:
            print(f"the mesh was not ready after {timeout_s:.0f} s: {health}", file=sys.stderr)
            return 1
        time.sleep(0.5)
        try:
            health = httpx.get(f"{url}/health", timeout=5).json()
        except httpx.HTTPError:
            pass   # the coordinator is still starting
    agents = {a["agent_id"]: a for a in httpx.get(f"{url}/admin/api/agents", headers=headers).json()["agents"]}
    plans = httpx.get(f"{url}/admin/api/plans", headers=headers).json()["plans"]
    (plan,) = [p for p in plans if p["state"] == "active"]
    stages = sorted(plan["stages"], key=lambda s: s["start_layer"])
    hosts = {agents[s["agent_id"]]["address"].rsplit(":", 1)[0] for s in stages}
    print(f"plan: {len(stages)} stages on {len(hosts)} hosts")
    for index, stage in enumerate(stages):
        agent = agents[stage["agent_id"]]
        print(f"  stage {index}: layers [{stage['start_layer']}, {stage['end_layer']}) on {agent['name']} "
              f"at {agent['address']}")
    model = httpx.get(f"{url}/v1/models", headers=headers).json()["data"][0]["id"]
    body = {"model": model, "prompt": "Across the bridge", "max_tokens": 16, "temperature": 0}
    response = httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=60)
    response.raise_for_status()
    # The built-in model has random weights: the text is gibberish, but it crossed every host.
    print(f"completion: {response.json()['choices'][0]['text']!r}")
    return 0


def run_and_tear_down(args: argparse.Namespace, prefix: str) -> int:
    """Runs the mesh; whatever happens (an error, Ctrl-C, a kill), stops every process and deletes every namespace."""
    stop_on_sigterm()   # `kill` tears down as Ctrl-C does
    network = Netbed(prefix)
    daemons = Processes(Path(tempfile.mkdtemp(prefix=f"{prefix}-logs-")))
    status = 1
    try:
        status = run_mesh(args, prefix, network, daemons)
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        status = 130
    except subprocess.CalledProcessError as exc:
        print(f"failed: {' '.join(exc.cmd)}: {exc.stderr.strip()}", file=sys.stderr)
    except (RuntimeError, NetbedUnavailable) as exc:
        print(f"failed: {exc}", file=sys.stderr)
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):   # a second Ctrl-C must not cut the teardown short
            signal.signal(sig, signal.SIG_IGN)
        daemons.stop()
        network.close()
    if status in (0, 130):
        shutil.rmtree(daemons.log_dir)
    else:
        daemons.print_logs()
    leftovers = network.leftovers()
    if leftovers:
        print(f"namespaces left behind: {leftovers}", file=sys.stderr)
        return 1
    print("torn down: processes stopped, namespaces deleted")
    return status


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--agents", type=int, default=3, help="agent hosts (one stage each)")
    parser.add_argument("--no-zeroconf", action="store_true",
                        help="agents dial the coordinator's address instead of finding it by zeroconf")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for the mesh")
    parser.add_argument("--client-of", metavar="URL", help=argparse.SUPPRESS)   # the client host's part
    args = parser.parse_args()
    if args.client_of:
        try:
            sys.exit(run_client(args.client_of, args.agents, args.timeout))
        except KeyboardInterrupt:   # Ctrl-C reaches the client too; the parent reports it
            sys.exit(130)

    prefix = f"sm-{secrets.token_hex(3)}"   # unique: parallel runs never share a namespace
    try:
        check_can_build(prefix)
    except NetbedUnavailable as reason:
        print(f"skipped: {reason}", file=sys.stderr)
        sys.exit(SKIP)
    print(f"namespaces: {prefix}-*", flush=True)
    sys.exit(run_and_tear_down(args, prefix))


if __name__ == "__main__":
    main()
