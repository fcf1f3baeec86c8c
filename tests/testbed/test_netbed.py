"""The WAN test bed: link profiles shape real traffic between namespaces, a NAT'd site dials out and cannot be
dialed, and nothing is left behind, also after Ctrl-C."""

from __future__ import annotations

import json
import secrets
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from stratamesh.testbed.netbed import LAN, PROFILES, Host, LinkProfile, Netbed, NetbedUnavailable, check_can_build, nat_tool

PROBE = str(Path(__file__).with_name("tcp_probe.py"))
PORT = 7100


@pytest.mark.parametrize(("profile", "args"), [
    (LAN, []),
    (LinkProfile("x", rtt_ms=80), ["delay", "40ms"]),
    (LinkProfile("x", rate_mbit=20, rtt_ms=80), ["delay", "40ms", "rate", "20mbit"]),
    (LinkProfile("x", rate_mbit=100, rtt_ms=20, loss_pct=1), ["delay", "10ms", "rate", "100mbit", "loss", "1%"]),
])
def test_a_profile_is_half_its_round_trip_each_way(profile: LinkProfile, args: list[str]) -> None:
    assert profile.netem_args() == args


def test_the_profiles_the_issue_names() -> None:
    assert {(p.rate_mbit, p.rtt_ms, p.loss_pct) for p in PROFILES.values()} == {
        (0, 0, 0), (100, 20, 0), (20, 80, 0), (100, 20, 1)}


@pytest.fixture
def servers() -> Iterator[list[subprocess.Popen]]:
    started: list[subprocess.Popen] = []
    yield started
    for process in started:
        process.kill()
        process.wait()


def serve(host: Host, servers: list[subprocess.Popen]) -> None:
    process = subprocess.Popen(host.command([sys.executable, PROBE, "serve", str(PORT)]), stdout=subprocess.PIPE,
                               text=True)
    servers.append(process)
    assert process.stdout.readline().strip() == "ready"


def call(host: Host, address: str, num_bytes: int = 0) -> dict:
    out = subprocess.run(host.command([sys.executable, PROBE, "call", address, str(PORT), str(num_bytes)]),
                         capture_output=True, text=True, timeout=60, check=True).stdout
    return json.loads(out)


def test_a_shaped_cable_delays_and_limits_what_crosses_it(netbed: Netbed, servers: list) -> None:
    near, far = netbed.add_host("near"), netbed.add_host("far", PROFILES["wan-20mbit-80ms"])
    serve(far, servers)
    result = call(near, far.address, num_bytes=2_000_000)
    assert result["seen_as"] == near.address
    assert min(result["rtts_s"]) >= 0.080                  # the profile's round trip, at least, every time
    assert result["transfer_s"] >= 2_000_000 * 8 / 20e6    # no faster than 20 Mbit/s


def test_a_cable_can_be_reshaped(netbed: Netbed, servers: list) -> None:
    near, far = netbed.add_host("near"), netbed.add_host("far", PROFILES["wan-100mbit-20ms"])
    netbed.shape("far", LinkProfile("slower", rtt_ms=60))
    serve(far, servers)
    assert min(call(near, far.address)["rtts_s"]) >= 0.060


def test_a_nat_site_dials_out_but_cannot_be_dialed(netbed: Netbed, servers: list) -> None:
    try:
        nat_tool()
    except NetbedUnavailable as exc:
        pytest.skip(str(exc))
    cloud = netbed.add_host("cloud")
    site = netbed.add_site("home", PROFILES["wan-100mbit-20ms"])
    box1, box2 = netbed.add_site_host("home", "box1"), netbed.add_site_host("home", "box2")
    for host in (cloud, box2):
        serve(host, servers)
    out = call(box1, cloud.address)
    assert out["seen_as"] == site.router.address           # masqueraded as the router
    assert min(out["rtts_s"]) >= 0.020                     # across the site's uplink
    assert call(box1, box2.address)["seen_as"] == box1.address    # inside the site: a LAN
    assert "error" in call(cloud, box1.address)
    assert "error" in call(cloud, box2.address)


def test_ctrl_c_tears_the_bed_down(tmp_path: Path) -> None:
    prefix = f"sm-{secrets.token_hex(3)}"
    try:
        check_can_build(prefix)
    except NetbedUnavailable as exc:
        pytest.skip(f"the WAN test bed cannot run here: {exc}")
    script = tmp_path / "bed.py"
    script.write_text(
        "import signal, sys, threading\n"
        # Ctrl-C as in a terminal: a run started as a background job inherits SIGINT ignored
        "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
        "from stratamesh.testbed.netbed import Netbed, PROFILES\n"
        f"with Netbed({prefix!r}) as bed:\n"
        "    bed.attach_here()\n"
        "    bed.add_host('a')\n"
        "    bed.add_host('b', PROFILES['wan-20mbit-80ms'])\n"
        "    print('ready', flush=True)\n"
        "    threading.Event().wait()\n")
    process = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout.readline().strip() == "ready"
        assert len(Netbed(prefix).leftovers()) == 4        # the WAN, two hosts, and the cable here
        process.send_signal(signal.SIGINT)
        process.wait(timeout=30)
        assert Netbed(prefix).leftovers() == []
    finally:
        process.kill()
        process.wait()
        Netbed(prefix).close_leftovers()


def test_a_peer_that_cannot_be_dialed_is_reached_over_webrtc(netbed: Netbed) -> None:
    """On a host with no route off the bed: a reachable peer gets gRPC, a refused one fails as a peer that is down
    does, and one there is no route to gets a data channel, signalled to its agent, carrying the same messages."""
    host = netbed.add_host("solo")
    probe = str(Path(__file__).with_name("reach_probe.py"))
    out = subprocess.run(host.command([sys.executable, probe, host.address]), capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    sent = [f"s{i}" for i in range(5)]
    assert result["transports"] == {"serving": "grpc", "refused": "grpc", "no-route": "webrtc"}
    assert result["grpc_received"] == sent and result["rtc_received"] == sent
    assert result["offered"] == ["behind-nat"]
    assert result["broken"] == ["refused"]
