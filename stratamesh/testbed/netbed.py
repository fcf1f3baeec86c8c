"""A WAN test bed on one Linux box: hosts as network namespaces, WAN links emulated with tc netem, NAT'd sites.

    PREFIX-wan   bridge wan0: the "internet" (10.77.N.0/24, N the first subnet no route here uses), in a namespace
      │          of its own
      ├─ cloud hosts   10.77.N.11, .12 ...   each on its own cable, with the link profile it was given
      ├─ this process  10.77.N.254           (attach_here: a LAN cable, so tests and benchmarks reach the hosts)
      └─ site routers  10.77.N.201, .202 ... one per site: its uplink cable carries the site's WAN profile
           └─ bridge lan0 in the router's namespace (192.168.K.0/24, router 192.168.K.1), masquerade out:
                edge hosts 192.168.K.11 ...   they dial out through the router and cannot be dialed

A link profile shapes both directions of a cable: half the round trip each way, the rate, and the loss each way.
Where the kernel has tc netem, a shaped cable is a veth pair with netem on both ends; where it has not (netem is
a module some kernels, Firecracker's among them, leave out), it is two TAP devices joined by the user-space
emulator in link_emulator.py, one process for the whole bed. Every interface has a 65000-byte MTU, so that
the emulator moves a TCP segment of up to 64 KiB as one frame. Hosts of one site share its uplink, as boxes
behind one home router do. Nothing touches this machine's real network: traffic goes between namespaces made
here, and close() deletes every one (a cable in this process's namespace goes with its other end). Root and
iproute2 are needed; NAT also needs nft or iptables.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass

from stratamesh.fleet.errors import MeshError

WAN_SUBNETS = "10.77"        # each bed's WAN is a /24 of this /16 that no route of this namespace uses yet
MTU = 65000


class NetbedUnavailable(MeshError):
    """This machine cannot build the test bed (not Linux, not root, no iproute2, namespaces refused, no NAT tool)."""


@dataclass(frozen=True, slots=True)
class LinkProfile:
    """How a cable behaves: rate (0 = as fast as the box goes), round-trip delay, and loss in each direction."""

    name: str
    rate_mbit: float = 0.0
    rtt_ms: float = 0.0
    loss_pct: float = 0.0

    def numbers(self) -> dict[str, float]:
        """The shape without the name (what the link emulator takes)."""
        return {"rate_mbit": self.rate_mbit, "rtt_ms": self.rtt_ms, "loss_pct": self.loss_pct}

    def netem_args(self) -> list[str]:
        """tc netem's arguments for one direction of the cable ([] for an unshaped one)."""
        args = []
        if self.rtt_ms:
            args += ["delay", f"{self.rtt_ms / 2:g}ms"]
        if self.rate_mbit:
            args += ["rate", f"{self.rate_mbit:g}mbit"]
        if self.loss_pct:
            args += ["loss", f"{self.loss_pct:g}%"]
        return args


LAN = LinkProfile("lan")
PROFILES = {p.name: p for p in (
    LAN,
    LinkProfile("wan-100mbit-20ms", rate_mbit=100, rtt_ms=20),
    LinkProfile("wan-20mbit-80ms", rate_mbit=20, rtt_ms=80),
    LinkProfile("lossy-1pct", rate_mbit=100, rtt_ms=20, loss_pct=1),
)}


@dataclass(frozen=True, slots=True)
class Host:
    """A host of the test bed: its namespace and its address; site is "" for a host on the WAN itself."""

    name: str
    namespace: str
    address: str
    site: str = ""

    def command(self, argv: list[str]) -> list[str]:
        """argv as run on this host."""
        return ["ip", "netns", "exec", self.namespace, *argv]


@dataclass(frozen=True, slots=True)
class Site:
    """A NAT'd site: its router (the WAN address its hosts' connections come from) and its LAN's subnet."""

    name: str
    router: Host
    subnet: str         # "192.168.K"


def check_can_build(prefix: str) -> None:
    """Raises NetbedUnavailable saying why this machine cannot run the test bed."""
    if sys.platform != "linux":
        raise NetbedUnavailable("network namespaces are a Linux feature")
    if os.geteuid() != 0:
        raise NetbedUnavailable("creating network namespaces needs root")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise NetbedUnavailable(f"the `{tool}` command (iproute2) is missing")
    probe = subprocess.run(["ip", "netns", "add", f"{prefix}-probe"], capture_output=True, text=True)
    if probe.returncode != 0:     # root in a container without CAP_SYS_ADMIN, say
        raise NetbedUnavailable(f"cannot create a network namespace here: {probe.stderr.strip()}")
    subprocess.run(["ip", "netns", "del", f"{prefix}-probe"], capture_output=True)


def nat_tool() -> str:
    """"nft" or "iptables", whichever this machine has; NetbedUnavailable if neither."""
    for tool in ("nft", "iptables"):
        if shutil.which(tool) is not None:
            return tool
    raise NetbedUnavailable("a NAT'd site needs nft or iptables (apt-get install nftables)")


@functools.cache
def kernel_has_netem() -> bool:
    """Whether tc can attach a netem qdisc here (tried on the loopback of a throwaway namespace)."""
    probe = f"sm-netem-{os.getpid()}"
    if subprocess.run(["ip", "netns", "add", probe], capture_output=True).returncode != 0:
        return False
    try:
        tried = subprocess.run(["ip", "netns", "exec", probe, "tc", "qdisc", "add", "dev", "lo", "root", "netem",
                                "delay", "1ms"], capture_output=True)
        return tried.returncode == 0
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)


def free_wan_subnet() -> str:
    """The first 10.77.N (a /24) that no route in this process's namespace uses: another bed attached here
    (a test running beside this one, say) keeps its own."""
    routes = subprocess.run(["ip", "-4", "route", "show"], capture_output=True, text=True).stdout
    for n in range(256):
        if f"{WAN_SUBNETS}.{n}.0/24" not in routes:
            return f"{WAN_SUBNETS}.{n}"
    raise NetbedUnavailable(f"every /24 of {WAN_SUBNETS}.0.0/16 is routed here already")


def stop_on_sigterm() -> None:
    """Makes SIGTERM raise KeyboardInterrupt, as Ctrl-C does, so that a `kill` tears a test bed down too."""
    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt
    signal.signal(signal.SIGTERM, interrupt)


def run(*argv: str) -> str:
    """Runs one command; raises NetbedUnavailable with its message if it fails, else returns its output."""
    result = subprocess.run(argv, capture_output=True, text=True)
    if result.returncode != 0:
        raise NetbedUnavailable(f"{' '.join(argv)}: {result.stderr.strip() or result.stdout.strip()}")
    return result.stdout


class Netbed:
    """The namespaces, cables and routers of one test bed; a context manager that deletes them all on exit."""

    def __init__(self, prefix: str):
        self.prefix = prefix                # names every namespace, and the cable in this process's namespace
        self.wan_ns = f"{prefix}-wan"
        self.wan_subnet = ""                # "10.77.N", chosen by create()
        self.hosts: dict[str, Host] = {}
        self.sites: dict[str, Site] = {}
        self._namespaces: list[str] = []
        self._num_wan_hosts = 0
        self._link_emulator: Emulator | None = None
        self._emulated: set[str] = set()     # cables (by their port on the WAN bridge) the emulator carries

    def __enter__(self) -> Netbed:
        self.create()
        return self

    def create(self) -> None:
        """Checks that this machine can build it, and makes the WAN; NetbedUnavailable says why not."""
        check_can_build(self.prefix)
        self.wan_subnet = free_wan_subnet()
        self._add_namespace(self.wan_ns)
        self._bridge(self.wan_ns, "wan0")

    def __exit__(self, *exc: object) -> None:
        self.close()

    def add_host(self, name: str, profile: LinkProfile = LAN) -> Host:
        """A host on the WAN (a cloud box, say) with a public address, on a cable shaped by profile."""
        self._num_wan_hosts += 1
        host = Host(name, f"{self.prefix}-{name}", f"{self.wan_subnet}.{10 + self._num_wan_hosts}")
        self._add_namespace(host.namespace)
        self._cable(self.wan_ns, "wan0", _port(name), host.namespace, "eth0", f"{host.address}/24", profile)
        self.hosts[name] = host
        return host

    def add_site(self, name: str, profile: LinkProfile = LAN) -> Site:
        """A NAT'd site: a router on the WAN whose uplink is shaped by profile, masquerading its LAN's hosts."""
        tool = nat_tool()
        index = len(self.sites) + 1
        router = Host(f"{name}-router", f"{self.prefix}-{name}", f"{self.wan_subnet}.{200 + index}", site=name)
        self._add_namespace(router.namespace)
        self._cable(self.wan_ns, "wan0", _port(name), router.namespace, "wan", f"{router.address}/24", profile)
        subnet = f"192.168.{index}"
        self._bridge(router.namespace, "lan0", f"{subnet}.1/24")
        run(*router.command(["sysctl", "-qw", "net.ipv4.ip_forward=1"]))
        _masquerade(router, tool)
        site = Site(name, router, subnet)
        self.sites[name] = site
        return site

    def add_site_host(self, site_name: str, name: str) -> Host:
        """A host on a site's LAN: it reaches the WAN through the site's router, and nobody there reaches it."""
        site = self.sites[site_name]
        number = 11 + sum(1 for h in self.hosts.values() if h.site == site_name)
        host = Host(name, f"{self.prefix}-{name}", f"{site.subnet}.{number}", site=site_name)
        self._add_namespace(host.namespace)
        self._cable(site.router.namespace, "lan0", name, host.namespace, "eth0", f"{host.address}/24", LAN)
        run("ip", "-n", host.namespace, "route", "add", "default", "via", f"{site.subnet}.1")
        self.hosts[name] = host
        return host

    def attach_here(self) -> str:
        """Plugs this process's namespace into the WAN on a LAN cable (10.77.N.254) so that it can call the hosts'
        services; returns the address. Only the test bed's subnet is routed through it."""
        name = f"{self.prefix}-op"
        address = f"{self.wan_subnet}.254"
        run("ip", "link", "add", name, "type", "veth", "peer", "name", "op", "netns", self.wan_ns)
        run("ip", "-n", self.wan_ns, "link", "set", "op", "master", "wan0", "up")
        run("ip", "addr", "add", f"{address}/24", "dev", name)
        run("ip", "link", "set", name, "mtu", str(MTU))
        run("ip", "-n", self.wan_ns, "link", "set", "op", "mtu", str(MTU))
        run("ip", "link", "set", name, "up")
        return address

    def shape(self, name: str, profile: LinkProfile) -> None:
        """Re-shapes the cable of a WAN host or the uplink of a site (both directions) to profile."""
        if _port(name) in self._emulated:
            self._emulator().command(op="shape", name=_port(name), **profile.numbers())
            return
        device, ns = ("wan", self.sites[name].router.namespace) if name in self.sites else \
            ("eth0", self.hosts[name].namespace)
        _netem(self.wan_ns, _port(name), profile)
        _netem(ns, device, profile)

    def close(self) -> None:
        """Deletes every namespace made here, their cables with them, and the cable in this namespace."""
        if self._link_emulator is not None:     # first: its TAP fds would keep the namespaces alive a while
            self._link_emulator.close()
            self._link_emulator = None
        subprocess.run(["ip", "link", "del", f"{self.prefix}-op"], capture_output=True)
        for ns in reversed(self._namespaces):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self._namespaces.clear()

    def leftovers(self) -> list[str]:
        """Namespaces and links of this test bed that still exist (none after close())."""
        namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
        found = [line.split()[0] for line in namespaces.splitlines() if line.startswith(f"{self.prefix}-")]
        return found + [line.split(":")[1].strip().split("@")[0] for line in links.splitlines()
                        if line.split(":")[1].strip().startswith(f"{self.prefix}-")]

    def close_leftovers(self) -> None:
        """Deletes what leftovers() finds (what a process killed without its teardown left behind)."""
        for name in self.leftovers():
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
            subprocess.run(["ip", "link", "del", name], capture_output=True)

    # ------------------------------------------------------------ internals
    def _add_namespace(self, ns: str) -> None:
        run("ip", "netns", "add", ns)
        self._namespaces.append(ns)
        run("ip", "-n", ns, "link", "set", "lo", "up")   # tensor-parallel ranks and local tools talk over loopback

    def _bridge(self, ns: str, name: str, address: str = "") -> None:
        run("ip", "-n", ns, "link", "add", name, "type", "bridge")
        if address:
            run("ip", "-n", ns, "addr", "add", address, "dev", name)
        run("ip", "-n", ns, "link", "set", name, "up")

    def _cable(self, bridge_ns: str, bridge: str, port: str, ns: str, device: str, address: str,
               profile: LinkProfile) -> None:
        """One end (port) plugged into the bridge, the other (device, with address) in ns: a veth pair, shaped by
        netem if it must be and can, or two TAPs joined by the link emulator."""
        emulated = bool(profile.netem_args()) and not kernel_has_netem()
        if emulated:
            run("ip", "-n", bridge_ns, "tuntap", "add", "dev", port, "mode", "tap")
            run("ip", "-n", ns, "tuntap", "add", "dev", device, "mode", "tap")
        else:
            run("ip", "-n", bridge_ns, "link", "add", port, "type", "veth", "peer", "name", device, "netns", ns)
        for where, name in ((bridge_ns, port), (ns, device)):
            run("ip", "-n", where, "link", "set", name, "mtu", str(MTU))
        run("ip", "-n", bridge_ns, "link", "set", port, "master", bridge, "up")
        run("ip", "-n", ns, "addr", "add", address, "dev", device)
        run("ip", "-n", ns, "link", "set", device, "up")
        if emulated:
            self._emulator().command(op="cable", name=port, a=[bridge_ns, port], b=[ns, device], **profile.numbers())
            self._emulated.add(port)
        elif profile.netem_args():
            _netem(bridge_ns, port, profile)
            _netem(ns, device, profile)

    def _emulator(self) -> Emulator:
        if self._link_emulator is None:
            self._link_emulator = Emulator()
        return self._link_emulator


def _port(name: str) -> str:
    """The name of a WAN host's (or site's) cable end on the WAN bridge."""
    return f"to-{name}"


class Emulator:
    """The link emulator process (link_emulator.py) carrying this bed's shaped cables where netem is missing."""

    def __init__(self) -> None:
        self._process = subprocess.Popen([sys.executable, "-m", "stratamesh.testbed.link_emulator"],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def command(self, **command: object) -> None:
        """Sends one command and waits for its answer; NetbedUnavailable if it failed."""
        assert self._process.stdin is not None and self._process.stdout is not None
        self._process.stdin.write(json.dumps(command) + "\n")
        self._process.stdin.flush()
        answer = self._process.stdout.readline().strip()
        if answer != "ok":
            raise NetbedUnavailable(f"link emulator, {command['op']} {command['name']}: {answer or 'exited'}")

    def close(self) -> None:
        """Ends the process (closing its stdin is its signal to stop)."""
        if self._process.stdin is not None:
            self._process.stdin.close()
        try:
            self._process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()


def _netem(ns: str, device: str, profile: LinkProfile) -> None:
    """Shapes what leaves device in ns (an unshaped profile removes the shaping)."""
    if not profile.netem_args():
        subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", device, "root"], capture_output=True)
        return
    # netem's queue holds packets for the whole delay: 10000 of them cover a 100 Mbit/s link's 40 ms and more
    run("ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", device, "root", "netem", "limit", "10000",
        *profile.netem_args())


def _masquerade(router: Host, tool: str) -> None:
    """The router rewrites its LAN's outgoing connections to its WAN address and lets no new one in from the WAN."""
    if tool == "nft":
        rules = ('table ip nat {\n chain postrouting {\n  type nat hook postrouting priority srcnat;\n'
                 '  oifname "wan" masquerade\n }\n}\n'
                 'table ip filter {\n chain forward {\n  type filter hook forward priority filter;\n'
                 '  iifname "wan" ct state new drop\n }\n}\n')
        result = subprocess.run(router.command(["nft", "-f", "-"]), input=rules, capture_output=True, text=True)
        if result.returncode != 0:
            raise NetbedUnavailable(f"nft in {router.namespace}: {result.stderr.strip()}")
        return
    run(*router.command(["iptables", "-t", "nat", "-A", "POSTROUTING", "-o", "wan", "-j", "MASQUERADE"]))
    run(*router.command(["iptables", "-A", "FORWARD", "-i", "wan", "-m", "conntrack", "--ctstate", "NEW",
                         "-j", "DROP"]))
