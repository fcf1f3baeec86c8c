"""Starts a coordinator and N agents as processes on this machine, and stops every one of them."""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from stratamesh import forked
from stratamesh.agent.cpus import cpu_shares, format_cpus
from stratamesh.fleet.errors import MeshError
from stratamesh.forked import ForkedProcess
from stratamesh.testbed.netbed import Host
from stratamesh.fleet.state import is_postgres, make_private_dir
from stratamesh.fleet.wire.channels import MeshTls, make_channel
from stratamesh.supervisor import Supervisor
from stratamesh.fleet.wire.enroll import enroll

log = logging.getLogger(__name__)

_COORDINATOR_LINE = re.compile(r"stratamesh coordinator: http=(\S+) grpc=(\S+) enroll=(\S+)")
_STANDBY_LINE = re.compile(r"stratamesh coordinator standing by: http=(\S+) grpc=(\S+)")
_AGENT_LINE = re.compile(r"stratamesh agent: id=(\S+) stage=(\S+) metrics=(\S+)")


GPU_MEMORY_UTILIZATION = 0.9     # of a GPU, for all this box's agents together (each gets its share)
PATIENCE_ENV = "STRATAMESH_PATIENCE"   # multiplies every limit a local mesh waits under (a slow or shared box)


def patience(environ: dict[str, str] | None = None) -> float:
    """$STRATAMESH_PATIENCE (default 1): how many times longer than asked this box's mesh processes may take to
    start and get ready before LocalMesh gives up on them (the test suite sets it from the machine's speed)."""
    value = (os.environ if environ is None else environ).get(PATIENCE_ENV, "")
    try:
        return max(1.0, float(value)) if value else 1.0
    except ValueError:
        raise LaunchError(f"{PATIENCE_ENV}={value!r} is not a number") from None


Process = subprocess.Popen | ForkedProcess    # a mesh process: started, or forked from a fork server (stratamesh/forked.py)


class LaunchError(MeshError):
    """A process of the local mesh failed to start or the mesh never became ready."""


def _limit_s(timeout_s: float) -> float:
    """timeout_s as this box's patience stretches it."""
    return timeout_s * patience()


# The coordinator's limits that a slow box can outrun, at their defaults (`stratamesh coordinator --help`)
AGENT_LEASE_S = 2.0      # an agent unheard for this long is dead: a busy box can delay a heartbeat past it
ROUTE_WAIT_S = 30.0      # a request waits this long for its model to recover: a busy box can take longer to re-plan


def patient_coordinator_args(environ: dict[str, str] | None = None) -> list[str]:
    """The coordinator's lease and route wait stretched by this box's patience (none where it is 1: the defaults);
    a mesh's own coordinator_args come after them, and win."""
    factor = patience(environ)
    if factor == 1.0:
        return []
    return ["--agent-lease", f"{AGENT_LEASE_S * factor:g}", "--route-wait", f"{ROUTE_WAIT_S * factor:g}"]


@dataclass
class LocalMesh:
    """A coordinator and num_agents agent processes on loopback, found through zeroconf."""

    model_dir: str
    num_agents: int = 3
    num_stages: int | None = None
    mesh: str = field(default_factory=lambda: f"local-{uuid.uuid4().hex[:8]}")
    db: str | None = None
    http_port: int = 0
    grpc_port: int = 0                  # the coordinator's (0: any free port)
    enroll_port: int = 0                # ... and its enrollment endpoint's
    log_dir: str | None = None          # None: a folder of its own under /tmp (see keep_logs)
    state_dir: str | None = None        # registry, CA, agents' keys and bootstrap credentials, kept after stop();
                                        # None: the log folder, and stop() deletes the credentials there
    keep_logs: bool = True              # False: stop() deletes that folder (not a log_dir the caller gave)
    threads_per_agent: int = 0          # 0: the agent's share of this box's cores (or of pin_cpus's CPUs)
    pin_cpus: bool = False              # each agent pinned to a share of its own of the CPUs this process may use,
                                        # where there are as many as agents (agent.cpus.cpu_shares); `up` pins
    use_zeroconf: bool = True           # False: agents get the coordinator's address on the command line
    insecure: bool = False              # True: plaintext, no CA, no enrollment (development only)
    fork_agents: bool = field(default_factory=forked.wanted)   # the processes on loopback (agents, coordinator)
                                        # forked from a fork server that imported torch and the coordinator's
                                        # libraries once (stratamesh/forked.py); default: STRATAMESH_FORK_SERVER=1
    extra_env: dict[str, str] = field(default_factory=dict)
    agent_args: list[str] = field(default_factory=list)   # appended to every agent's command line
    agent_args_by_index: dict[int, list[str]] = field(default_factory=dict)   # ... and to that agent's
    coordinator_args: list[str] = field(default_factory=list)   # appended to the coordinator's command line
    say: Callable[[str], None] | None = None    # hears, while start() waits, of each stage an agent could not load
    # On a test bed (stratamesh/testbed/netbed.py): the hosts the coordinator and agents (by index) run on; None / absent: this
    # machine's loopback. An agent finds the coordinator by zeroconf only on the same site as it (the multicast
    # stays inside a site); across the WAN it dials the coordinator's address.
    coordinator_host: Host | None = None
    agent_hosts: dict[int, Host] = field(default_factory=dict)
    coordinator: subprocess.Popen | None = None
    standbys: list[Process] = field(default_factory=list)    # other coordinators of the mesh (start_standby)
    agents: list[Process] = field(default_factory=list)
    agent_addresses: list[str] = field(default_factory=list)
    agent_metrics: list[str] = field(default_factory=list)   # host:port of each agent's /metrics
    agent_ids: list[str] = field(default_factory=list)       # stable per index: a restarted agent keeps its id
    url: str = ""
    grpc_address: str = ""
    enroll_address: str = ""            # "-" when insecure
    join_token: str = ""                # what every agent of this mesh enrolls with
    api_key: str = ""                   # an operator key for the HTTP API ("" when insecure: none is needed)
    admin_login: tuple[str, str] = ("", "")   # an operator's user name and password for the admin UI
    supervisor: Supervisor | None = None          # set by supervise()
    _own_logs: str = field(default="", repr=False)   # the log folder this mesh made itself
    _printed: dict[Process, list[str]] = field(default_factory=dict, repr=False)   # each process's stdout lines
    _client_tls: MeshTls | None = field(default=None, repr=False)

    def start(self, timeout_s: float = 120.0) -> LocalMesh:
        """Starts every process and waits until /health says the model is ready and every agent is connected (a
        spare, which the plan need not wait for, may take longer to join than the stages' agents)."""
        if any(p.poll() is None for p in (self.coordinator, *self.agents) if p is not None):
            raise LaunchError("this mesh is already running (entering its with-block starts it): a second start "
                              "would leave the first processes behind")
        atexit.register(self.stop)  # never leave daemons behind, even if the caller forgets
        # Agents that find the coordinator by zeroconf start beside it, not after it: importing torch takes each of
        # them seconds of CPU, which the coordinator's own start (~1 s) overlaps. They read the join token from the
        # coordinator's bootstrap file when they enroll, once they found it: it wrote the file before advertising.
        early = self._agents_find_coordinator()
        self._spawn_coordinator(True, self._ports())
        spawned = [self._spawn_agent(index) for index in range(self.num_agents)] if early else []
        self._coordinator_started(timeout_s)
        if not early:
            spawned = [self._spawn_agent(index) for index in range(self.num_agents)]
        for index, process in enumerate(spawned):  # they import torch in parallel; collect addresses after
            self._agent_started(index, self._await_line(process, _AGENT_LINE, timeout_s))
        self.wait_ready(timeout_s)
        self.wait_connected(self.num_agents, timeout_s)
        return self

    def start_coordinator(self, timeout_s: float = 60.0, deploy: bool = True) -> None:
        """Starts the coordinator; deploy=False relies on the registry to remember the model."""
        self._start_coordinator(timeout_s, deploy, self._ports())

    def _ports(self) -> list[str]:
        """The coordinator's ports as this mesh asks for them (0: any free one)."""
        ports = ["--http-port", str(self.http_port), "--grpc-port", str(self.grpc_port)]
        return ports if self.insecure else [*ports, "--enroll-port", str(self.enroll_port)]

    def restart_coordinator(self, timeout_s: float = 60.0) -> None:
        """Starts the coordinator again where it was (its HTTP, gRPC and enrollment ports), from its registry alone:
        the model, its plan and every credential handed out stay as they were."""
        ports = ["--http-port", self.url.rsplit(":", 1)[1], "--grpc-port", self.grpc_address.rsplit(":", 1)[1]]
        if not self.insecure:
            ports += ["--enroll-port", self.enroll_address.rsplit(":", 1)[1]]
        self._start_coordinator(timeout_s, False, ports, bootstrap=False)

    def start_standby(self, http_port: int, grpc_port: int, timeout_s: float = 60.0) -> tuple[Process, str]:
        """Starts another coordinator of this mesh on its PostgreSQL registry (the model and everything else from
        there), and waits until it stands by; returns it and the URL of its HTTP API, which serves while it stands
        by. take_over waits for it to lead."""
        args = self._coordinator_args(["--http-port", str(http_port), "--grpc-port", str(grpc_port)])
        standby = self._spawn(f"coordinator-{http_port}", [*args, *patient_coordinator_args(), *self.coordinator_args])
        self.standbys.append(standby)
        url, _ = self._await_line(standby, _STANDBY_LINE, timeout_s)
        return standby, url

    def take_over(self, standby: Process, timeout_s: float) -> None:
        """Waits until standby leads (it prints its addresses once it took the lease and bound its ports); this mesh
        talks to it as its coordinator from then on."""
        self.url, self.grpc_address, self.enroll_address = self._await_line(standby, _COORDINATOR_LINE, timeout_s)
        self.standbys.remove(standby)
        self.coordinator = standby

    def _start_coordinator(self, timeout_s: float, deploy: bool, ports: list[str], bootstrap: bool = True) -> None:
        self._spawn_coordinator(deploy, ports, bootstrap)
        self._coordinator_started(timeout_s)

    def _agents_find_coordinator(self) -> bool:
        """Whether every agent finds the coordinator by zeroconf: then it may start before the coordinator listens (one
        told its address, in its own arguments, dials it at once)."""
        told = any("--coordinator" in args for args in (self.agent_args, *self.agent_args_by_index.values()))
        return (self.use_zeroconf and not told
                and all(self._same_site(self.agent_hosts.get(i)) for i in range(self.num_agents)))

    def _spawn_coordinator(self, deploy: bool, ports: list[str], bootstrap: bool = True) -> None:
        args = self._coordinator_args(ports)
        if deploy:
            args += ["--model", self.model_dir, "--stages", str(self.num_stages or self.num_agents)]
        if self.coordinator_host is not None:
            args += _on_host(self.coordinator_host)
        if not self.insecure and bootstrap:   # a join token, operator key, admin password: those still working, or new
            args += ["--bootstrap-file", self._bootstrap_path()]
        self.coordinator = self._spawn("coordinator", [*args, *patient_coordinator_args(), *self.coordinator_args],
                                       host=self.coordinator_host)

    def _coordinator_args(self, ports: list[str]) -> list[str]:
        """A coordinator of this mesh on its registry, on ports: insecure, or with the mesh's CA where it is not
        beside the registry (a PostgreSQL one)."""
        args = ["coordinator", "--mesh", self.mesh, "--db", self.registry_path(), *ports]
        if self.insecure:
            return [*args, "--insecure"]
        return [*args, "--pki-dir", self.pki_dir()] if is_postgres(self.registry_path()) else args

    def _coordinator_started(self, timeout_s: float) -> None:
        """Waits for the coordinator to print its addresses; takes its bootstrap credentials."""
        self.url, self.grpc_address, self.enroll_address = self._await_line(
            self.coordinator, _COORDINATOR_LINE, timeout_s)
        if not self.insecure:   # what the coordinator wrote at start: a join token and an operator key
            bootstrap = json.loads(Path(self._bootstrap_path()).read_text())
            self.join_token = self.join_token or bootstrap["join_token"]
            self.api_key = self.api_key or bootstrap["api_key"]
            self.admin_login = (bootstrap["admin_user"], bootstrap["admin_password"])

    def registry_path(self) -> str:
        """The coordinator's registry: an SQLite file in its state folder unless db names another (a file, or a
        PostgreSQL database)."""
        return self.db or str(Path(self._state(), "registry.db"))

    def pki_dir(self) -> str:
        """The mesh's CA: beside an SQLite registry, in the state folder with a PostgreSQL one."""
        registry = self.registry_path()
        if is_postgres(registry):
            return str(Path(self._state(), "pki"))
        return f"{registry}.pki"

    def agent_state_dir(self, index: int) -> str:
        """Where agent number index keeps its key and certificate."""
        folder = Path(self.state_dir, "agents") if self.state_dir else Path(self._logs())
        return str(folder / self.agent_ids[index])

    def _bootstrap_path(self) -> str:
        return str(Path(self._state(), "bootstrap.json"))

    @property
    def headers(self) -> dict[str, str]:
        """What an HTTP call to this mesh's API sends to be let in."""
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def create_api_key(self, role: str, name: str) -> str:
        """A new API key (`stratamesh key create`): client (/v1), viewer or operator (/admin/api too)."""
        return self._command("key", "create", "--role", role, "--name", name).split()[0]

    def add_user(self, username: str, password: str, role: str) -> None:
        """Adds an admin UI user, viewer or operator (`stratamesh user add`)."""
        self._command("user", "add", username, "--role", role, "--password-stdin", stdin=password + "\n")

    def client_tls(self) -> MeshTls | None:
        """Credentials for this process to call the mesh's gRPC services (None when insecure): it enrolls
        once with the mesh's join token, as an agent does."""
        if self.insecure:
            return None
        if self._client_tls is None:
            enrolling = lambda: asyncio.run(enroll(self.enroll_address, self.join_token, self.mesh,  # noqa: E731
                                                   f"{self.mesh}-launcher"))
            with concurrent.futures.ThreadPoolExecutor(1) as pool:   # callers may be inside an event loop
                self._client_tls = pool.submit(enrolling).result()
        return self._client_tls

    def channel(self, address: str) -> grpc.aio.Channel:
        """A gRPC channel from this process to a mesh process (an agent's Stage service, the coordinator)."""
        return make_channel(address, tls=self.client_tls())

    def _command(self, *args: str, stdin: str | None = None) -> str:
        """Runs a `stratamesh` credentials command on this mesh's registry; returns what it printed."""
        result = subprocess.run([sys.executable, "-m", "stratamesh.cli", "--log-level", "warning", *args,
                                 "--db", self.registry_path()], input=stdin, capture_output=True, text=True,
                                timeout=60)
        if result.returncode != 0:
            raise LaunchError(f"stratamesh {' '.join(args[:2])} failed: {result.stdout}{result.stderr}")
        return result.stdout

    def start_agent(self, index: int, timeout_s: float = 60.0) -> Process:
        """Starts agent number index (a new one, or one that was killed, under its old id); waits until it listens."""
        process = self._spawn_agent(index)
        self._agent_started(index, self._await_line(process, _AGENT_LINE, timeout_s))
        return process

    def kill_agent(self, index: int) -> None:
        """kill -9 of one agent: no goodbye to anyone, as when a box loses power."""
        _kill(self.agents[index])

    def rank_pids(self, index: int) -> dict[int, list[int]]:
        """rank -> pids of the tensor-parallel ranks (1..N-1) that agent number index launched (Linux /proc): one
        per group it holds, and it may hold two of a stage for a while (a standby plan's, loading beside the
        serving one; a released stage's, kept for reuse)."""
        out: dict[int, list[int]] = {}
        for pid in children(self.agents[index].pid):
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
            except OSError:
                continue
            if "stratamesh.agent.engine.tp_worker" in argv:
                out.setdefault(int(argv[argv.index("--rank") + 1]), []).append(pid)
        return dict(sorted(out.items()))

    def agent_index(self, address: str) -> int:
        """Which agent serves its stages at this address."""
        return self.agent_addresses.index(address)

    def _agent_started(self, index: int, line: tuple[str, ...]) -> None:
        for values, value in ((self.agent_addresses, line[1]), (self.agent_metrics, line[2])):
            values.extend([""] * (index + 1 - len(values)))
            values[index] = value

    def _spawn_agent(self, index: int) -> Process:
        cpus = sorted(os.sched_getaffinity(0))
        threads = self.threads_per_agent or max(1, len(cpus) // max(self.num_agents, 1))
        own = cpu_shares(cpus, self.num_agents)[index % self.num_agents] if self.pin_cpus else ()
        while len(self.agent_ids) <= index:
            self.agent_ids.append(f"{self.mesh}-a{len(self.agent_ids)}")
        # agents on this box share its GPU, if it has one, as they share its cores (callers' agent_args come last,
        # and override)
        share = GPU_MEMORY_UTILIZATION / max(self.num_agents, 1)
        args = ["agent", "--mesh", self.mesh, "--name", f"agent{index}", "--agent-id", self.agent_ids[index],
                "--threads", str(threads), "--gpu-memory-utilization", f"{share:.4f}"]
        if own and len(own) < len(cpus) and index not in self.agent_hosts:   # (a test bed host has cores of its own)
            args += ["--cpus", format_cpus(own)]
        host = self.agent_hosts.get(index)
        if host is not None:
            args += [*_on_host(host), *_site_of(host)]
        if not self.use_zeroconf or not self._same_site(host):
            args += ["--coordinator", self.grpc_address, "--enroll", self.enroll_address]
        # the join token is read from the bootstrap file the coordinator keeps it in (it renews an expired one there)
        args += ["--insecure"] if self.insecure else ["--state-dir", self.agent_state_dir(index),
                                                       "--join-token-file", self._bootstrap_path()]
        process = self._spawn(f"agent{index}", [*args, *self.agent_args, *self.agent_args_by_index.get(index, [])],
                              host=host)
        if index < len(self.agents):
            self.agents[index] = process
        else:
            self.agents.append(process)
        return process

    def _same_site(self, host: Host | None) -> bool:
        """Whether an agent on host shares a LAN with the coordinator (both on loopback, or one test-bed site)."""
        coordinator = self.coordinator_host
        if host is None or coordinator is None:
            return host is None and coordinator is None
        return host.site == coordinator.site

    def metrics_text(self, index: int) -> str:
        """Agent index's /metrics page; fetched from inside its test-bed host when it runs on one (nobody outside a
        NAT'd site can reach a host on it)."""
        url = f"http://{self.agent_metrics[index]}/metrics"
        host = self.agent_hosts.get(index)
        if host is None:
            with urllib.request.urlopen(url, timeout=10) as response:
                return response.read().decode()
        fetch = "import sys, urllib.request; print(urllib.request.urlopen(sys.argv[1], timeout=10).read().decode())"
        return subprocess.run(host.command([sys.executable, "-c", fetch, url]), capture_output=True, text=True,
                              timeout=60, check=True).stdout

    def agent_sums(self, sample: str, by: str, **only: str) -> dict[str, float]:
        """One sample of the agents' /metrics ("stratamesh:link_activation_bytes_total", a histogram's "..._sum"),
        summed over the agents by one of its labels, of the samples whose labels match only."""
        from prometheus_client.parser import text_string_to_metric_families

        sums: dict[str, float] = {}
        for index in range(len(self.agent_metrics)):
            for family in text_string_to_metric_families(self.metrics_text(index)):
                for s in family.samples:
                    if s.name == sample and all(s.labels.get(k) == v for k, v in only.items()):
                        sums[s.labels[by]] = sums.get(s.labels[by], 0.0) + s.value
        return sums

    def wait_ready(self, timeout_s: float) -> None:
        """Waits until /health says every model is ready (LaunchError after timeout_s)."""
        health = self._wait_health(lambda h: h.get("status") == "ok", timeout_s)
        if health.get("status") != "ok":
            errors = "; ".join(f"agent {e['agent_id']}: {e['error']}" for e in health.get("load_errors", ()))
            raise LaunchError(f"mesh not ready after {_limit_s(timeout_s):.0f} s: "
                              + (f"stages failed to load: {errors}" if errors else str(health)))

    def wait_connected(self, num_agents: int, timeout_s: float) -> None:
        """Waits until /health counts num_agents agents connected (LaunchError after timeout_s)."""
        health = self._wait_health(lambda h: h.get("num_agents", 0) >= num_agents, timeout_s)
        if health.get("num_agents", 0) < num_agents:
            raise LaunchError(f"{health.get('num_agents', 0)} of {num_agents} agents connected after "
                              f"{_limit_s(timeout_s):.0f} s")

    def _wait_health(self, done: Callable[[dict], bool], timeout_s: float) -> dict:
        """/health polled until done(it) or timeout_s (times patience) passes (a mesh process dying raises
        LaunchError); the last."""
        deadline, told = time.monotonic() + _limit_s(timeout_s), set()
        while True:
            self._check_alive()
            health = self.health()
            for line in load_error_lines(health, told):
                if self.say is not None:
                    self.say(line)
            if done(health) or time.monotonic() >= deadline:
                return health
            time.sleep(0.2)

    def health(self) -> dict:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=5) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as exc:
            return json.loads(exc.read() or b"{}")
        except (OSError, ValueError):
            return {}

    def kill_coordinator(self) -> None:
        """kill -9 of the coordinator, as in a crash: the agents and their loaded stages stay up."""
        if self.coordinator is not None:
            _kill(self.coordinator)
            self.coordinator = None

    def stop_coordinator(self) -> None:
        if self.coordinator is not None:
            _terminate(self.coordinator)
            self.coordinator = None

    def supervise(self, say: Callable[[str], None] | None = None) -> Supervisor:
        """From now until stop(), dead processes are started again (stratamesh/supervisor.py); say() hears of it."""
        # kept before its thread starts: a Ctrl-C between the two would leave a thread that stop() never stops,
        # restarting the processes stop() ends
        self.supervisor = Supervisor(self, say)
        return self.supervisor.start()

    def stop(self) -> None:
        """Stops every process this mesh started (SIGTERM, then SIGKILL after a grace period)."""
        if self.supervisor is not None:      # first: the exits below are not failures to repair
            self.supervisor.stop()
            self.supervisor = None
        for process in self.agents:
            _signal(process, signal.SIGTERM)
        self.stop_coordinator()
        for process in [*self.standbys, *self.agents]:
            _terminate(process)
        self.standbys.clear()
        self.agents.clear()
        self.agent_addresses.clear()
        self.agent_metrics.clear()
        if not self.keep_logs and self._own_logs:
            shutil.rmtree(self._own_logs, ignore_errors=True)
        elif self.log_dir and not self.state_dir:
            self._forget_secrets()

    def _forget_secrets(self) -> None:
        """Deletes the credentials this mesh kept in its log folder (the CA when its registry is there too, the
        agents' keys, the bootstrap key and password): the logs stay for reading, the keys die with the mesh."""
        logs = Path(self.log_dir).resolve()
        secrets = [logs / "bootstrap.json", *(logs / agent_id for agent_id in self.agent_ids),
                   Path(self.pki_dir()).resolve()]
        for path in secrets:
            if path.is_relative_to(logs) and path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            elif path.is_relative_to(logs):
                path.unlink(missing_ok=True)

    def __enter__(self) -> LocalMesh:
        return self if self.coordinator is not None else self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------ internals
    def _logs(self) -> str:
        if self.log_dir is None:
            self.log_dir = self._own_logs = f"/tmp/stratamesh-{self.mesh}"
        make_private_dir(self.log_dir)      # without a state_dir it holds the registry and the keys
        return self.log_dir

    def _state(self) -> str:
        return str(make_private_dir(self.state_dir)) if self.state_dir else self._logs()

    def _spawn(self, name: str, args: list[str], env: dict[str, str] | None = None,
               host: Host | None = None) -> Process:
        log_file = open(Path(self._logs(), f"{name}.log"), "ab")
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.extra_env, **(env or {})}
        if args[0] in ("agent", "coordinator") and host is None and self.fork_agents:
            server = forked.fork_server(env)
            if server.can_fork(env):
                try:
                    return server.fork(args, env, log_file.fileno())
                finally:
                    log_file.close()
        argv = [sys.executable, "-m", "stratamesh.cli", *args]
        process = subprocess.Popen(
            host.command(argv) if host is not None else argv, env=env,   # `ip netns exec` execs: same pid
            stdout=subprocess.PIPE, stderr=log_file, start_new_session=True)
        log_file.close()
        return process

    def _await_line(self, process: Process, pattern: re.Pattern[str],
                    timeout_s: float) -> tuple[str, ...]:
        """Waits for the process to print a line pattern matches (one it printed before counts: a standby says
        where it stands by, then where it leads); one thread drains its stdout for as long as it runs."""
        printed = self._printed.get(process)
        if printed is None:
            printed = self._printed[process] = []

            def read() -> None:
                assert process.stdout is not None
                for raw in process.stdout:
                    printed.append(raw.decode(errors="replace"))

            threading.Thread(target=read, daemon=True).start()
        deadline = time.monotonic() + _limit_s(timeout_s)
        while time.monotonic() < deadline:
            if found := next((m.groups() for line in list(printed) if (m := pattern.search(line))), None):
                return found
            if process.poll() is not None:
                raise LaunchError(f"{_role(process)} exited with {process.returncode}; see {self.log_dir}")
            time.sleep(0.05)
        raise LaunchError(f"{_role(process)} printed no address in {_limit_s(timeout_s):.0f} s")

    def _check_alive(self) -> None:
        for process in [self.coordinator, *self.agents]:
            if process is not None and process.poll() is not None:
                raise LaunchError(f"a mesh process exited with {process.returncode}; see {self.log_dir}")


def load_error_lines(health: dict, told: set[tuple[str, str]]) -> list[str]:
    """A line for each load failure in a /health body not told before (told: (assignment id, error) pairs, which
    this adds to)."""
    lines = []
    for e in health.get("load_errors", ()):
        if (e["assignment_id"], e["error"]) not in told:
            told.add((e["assignment_id"], e["error"]))
            lines.append(f"agent {e['agent_id']} could not load its stage of {e['model_id']}: {e['error']}")
    return lines


def _on_host(host: Host) -> list[str]:
    """A daemon's flags to listen on, advertise and run zeroconf on a test-bed host's address."""
    return ["--host", host.address, "--interface", host.address]


def _site_of(host: Host) -> list[str]:
    """An agent's --site: the test-bed site its host is on (none for a host on the WAN itself)."""
    return ["--site", host.site] if host.site else []


def _role(process: Process) -> str:
    """"coordinator" or "agent": the command a mesh process was started with."""
    return process.args[process.args.index("stratamesh.cli") + 1]


def _signal(process: Process, sig: int) -> None:
    if process.poll() is None:
        try:
            process.send_signal(sig)
        except ProcessLookupError:
            pass


def children(pid: int) -> list[int]:
    """The processes pid started (its threads' children, Linux /proc)."""
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return out


def _kill(process: Process) -> None:
    _signal(process, signal.SIGKILL)
    process.wait()


def _terminate(process: Process, grace_s: float = 10.0) -> None:
    _signal(process, signal.SIGTERM)
    try:
        process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
