"""Discovery: pure TXT/record parsing by table, and advertise/browse over zeroconf on 127.0.0.1."""

from __future__ import annotations

import asyncio
import logging
import sys
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing

import pytest
from zeroconf import InterfaceChoice, IPVersion, ServiceInfo
from zeroconf.asyncio import AsyncZeroconf

from stratamesh.fleet.discovery import (
    AGENT_SERVICE, COORDINATOR_SERVICE, Advertiser, Browser, DiscoveryTimeout, ServiceRecord,
    parse_record)
from stratamesh.fleet.errors import InvalidInput, MeshError

FIND_TIMEOUT_S = 10.0
C = COORDINATOR_SERVICE
GOOD_TXT = {b"mesh": b"m1", b"version": b"0.1"}


@pytest.mark.parametrize("type_, name, addresses, port, txt, expected", [
    (C, f"coord.{C}", ["127.0.0.1"], 7000, GOOD_TXT,
     ServiceRecord("coordinator", "coord", "127.0.0.1", 7000, "m1", {"version": "0.1"})),
    (AGENT_SERVICE, f"agent-7.{AGENT_SERVICE}", ["10.0.0.2"], 1, {b"mesh": b"m", b"agent_id": b"a7"},
     ServiceRecord("agent", "agent-7", "10.0.0.2", 1, "m", {"agent_id": "a7"})),
    (C, f"c.{C}", ["fe80::1", "192.168.1.5"], 65535, {b"mesh": b"m", b"flag": None},
     ServiceRecord("coordinator", "c", "192.168.1.5", 65535, "m", {"flag": ""})),
    (C, f"c.{C}", ["bogus", "::1"], 80, {b"mesh": "méš".encode()},
     ServiceRecord("coordinator", "c", "::1", 80, "méš", {})),
])
def test_parse_record_accepts(type_, name, addresses, port, txt, expected) -> None:
    assert parse_record(type_, name, addresses, port, txt) == expected


@pytest.mark.parametrize("type_, name, addresses, port, txt, field", [
    ("_http._tcp.local.", "x._http._tcp.local.", ["127.0.0.1"], 80, GOOD_TXT, "service type"),
    (C, C, ["127.0.0.1"], 80, GOOD_TXT, "instance"),
    (C, "x._other._tcp.local.", ["127.0.0.1"], 80, GOOD_TXT, "instance"),
    (C, f"x.{C}", ["127.0.0.1"], 80, {b"version": b"1"}, "mesh"),
    (C, f"x.{C}", ["127.0.0.1"], 80, {b"mesh": b""}, "mesh"),
    (C, f"x.{C}", ["127.0.0.1"], 80, {b"mesh": None}, "mesh"),
    (C, f"x.{C}", ["127.0.0.1"], 80, {b"mesh": b"\xff\xfe"}, "UTF-8"),
    (C, f"x.{C}", ["127.0.0.1"], 80, {b"mesh": b"m", b"\xc3": b"v"}, "UTF-8"),
    (C, f"x.{C}", ["127.0.0.1"], 0, GOOD_TXT, "port"),
    (C, f"x.{C}", ["127.0.0.1"], 65536, GOOD_TXT, "port"),
    (C, f"x.{C}", ["127.0.0.1"], None, GOOD_TXT, "port"),
    (C, f"x.{C}", [], 80, GOOD_TXT, "address"),
    (C, f"x.{C}", ["not-an-ip"], 80, GOOD_TXT, "address"),
])
def test_parse_record_rejects(type_, name, addresses, port, txt, field) -> None:
    with pytest.raises(InvalidInput, match=field):
        parse_record(type_, name, addresses, port, txt)


@pytest.mark.parametrize("interfaces", [InterfaceChoice.All, InterfaceChoice.Default, [], "127.0.0.1"])
def test_refuses_interfaces_that_are_not_addresses(interfaces) -> None:
    with pytest.raises(InvalidInput):
        Advertiser(interfaces=interfaces)
    with pytest.raises(InvalidInput):
        Browser(interfaces=interfaces)


@pytest.mark.parametrize("record", [
    ServiceRecord("router", "x", "127.0.0.1", 80),
    ServiceRecord("agent", "a.b", "127.0.0.1", 80),
    ServiceRecord("agent", "x" * 64, "127.0.0.1", 80),
    ServiceRecord("agent", "x", "127.0.0.1", 0),
    ServiceRecord("agent", "x", "localhost", 80),
    ServiceRecord("agent", "x", "127.0.0.1", 80, mesh=""),
    ServiceRecord("agent", "x", "127.0.0.1", 80, properties={"mesh": "other"}),
])
async def test_advertiser_rejects_bad_records(record: ServiceRecord) -> None:
    advertiser = Advertiser()
    with pytest.raises(InvalidInput):
        await advertiser.start(record)
    await advertiser.close()


def _unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def mesh() -> str:
    return _unique("mesh")


@pytest.fixture
async def browser() -> AsyncIterator[Browser]:
    b = Browser()
    yield b
    await b.close()


@pytest.fixture
async def advertisers() -> AsyncIterator[list[Advertiser]]:
    started: list[Advertiser] = []
    yield started
    for a in started:
        await a.close()


async def _advertise(advertisers: list[Advertiser], record: ServiceRecord) -> Advertiser:
    a = Advertiser(interfaces=["127.0.0.1"], ip_version=IPVersion.V4Only)
    advertisers.append(a)
    await a.start(record)
    return a


async def test_browser_finds_advertised_coordinator(browser, advertisers, mesh) -> None:
    record = ServiceRecord("coordinator", _unique("coord"), "127.0.0.1", 50051, mesh,
                           {"version": "0.1.0"})
    await _advertise(advertisers, record)
    assert await browser.find("coordinator", mesh, FIND_TIMEOUT_S) == record


async def test_find_agent_kind_only(browser, advertisers, mesh) -> None:
    await _advertise(advertisers, ServiceRecord("coordinator", _unique("c"), "127.0.0.1", 4000, mesh))
    agent = ServiceRecord("agent", _unique("a"), "127.0.0.1", 4001, mesh, {"agent_id": "a1"})
    await _advertise(advertisers, agent)
    assert await browser.find("agent", mesh, FIND_TIMEOUT_S) == agent


async def test_mesh_names_isolate(browser, advertisers, mesh) -> None:
    other = ServiceRecord("coordinator", _unique("c"), "127.0.0.1", 4100, _unique("other"))
    await _advertise(advertisers, other)
    with pytest.raises(DiscoveryTimeout, match=mesh) as info:
        await browser.find("coordinator", mesh, 2.5)
    assert isinstance(info.value, MeshError) and isinstance(info.value, TimeoutError)
    mine = ServiceRecord("coordinator", _unique("c"), "127.0.0.1", 4101, mesh)
    await _advertise(advertisers, mine)
    assert await browser.find("coordinator", mesh, FIND_TIMEOUT_S) == mine
    assert await browser.find("coordinator", other.mesh, FIND_TIMEOUT_S) == other


async def test_watch_sees_restarted_coordinator_on_new_port(browser, advertisers, mesh) -> None:
    instance = _unique("coord")
    first = await _advertise(advertisers, ServiceRecord("coordinator", instance, "127.0.0.1", 5001, mesh))
    async with aclosing(browser.watch("coordinator", mesh)) as records:
        async with asyncio.timeout(FIND_TIMEOUT_S):
            assert (await anext(records)).port == 5001
        await first.close()
        await _advertise(advertisers, ServiceRecord("coordinator", instance, "127.0.0.1", 5002, mesh))
        async with asyncio.timeout(FIND_TIMEOUT_S):
            assert (await anext(records)).port == 5002


async def test_find_after_restart_returns_new_port(browser, advertisers, mesh) -> None:
    instance = _unique("coord")
    first = await _advertise(advertisers, ServiceRecord("coordinator", instance, "127.0.0.1", 6001, mesh))
    assert (await browser.find("coordinator", mesh, FIND_TIMEOUT_S)).port == 6001
    await first.close()
    await _advertise(advertisers, ServiceRecord("coordinator", instance, "127.0.0.1", 6002, mesh))
    assert (await browser.find("coordinator", mesh, FIND_TIMEOUT_S)).port == 6002


_ADVERTISE_AND_WAIT = """
import asyncio, sys
from stratamesh.fleet.discovery import Advertiser, ServiceRecord
async def main():
    await Advertiser().start(ServiceRecord("coordinator", sys.argv[1], "127.0.0.1", int(sys.argv[3]), sys.argv[2]))
    print("up", flush=True)
    await asyncio.sleep(60)
asyncio.run(main())
"""


async def _spawn_advertiser(instance: str, mesh: str, port: int) -> asyncio.subprocess.Process:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _ADVERTISE_AND_WAIT, instance, mesh, str(port),
        stdout=asyncio.subprocess.PIPE)
    assert await asyncio.wait_for(proc.stdout.readline(), FIND_TIMEOUT_S) == b"up\n"
    return proc


async def test_watch_sees_coordinator_restarted_after_crash(browser, mesh) -> None:
    """A SIGKILLed coordinator sends no goodbye; its successor's announcement must still win."""
    instance = _unique("coord")
    procs = [await _spawn_advertiser(instance, mesh, 5101)]
    try:
        async with aclosing(browser.watch("coordinator", mesh)) as records:
            async with asyncio.timeout(FIND_TIMEOUT_S):
                assert (await anext(records)).port == 5101
            procs[0].kill()
            await procs[0].wait()
            procs.append(await _spawn_advertiser(instance, mesh, 5102))
            async with asyncio.timeout(FIND_TIMEOUT_S):
                assert (await anext(records)).port == 5102
        assert (await browser.find("coordinator", mesh, FIND_TIMEOUT_S)).port == 5102
    finally:
        for proc in procs:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()


async def test_browser_drops_malformed_txt_and_logs_once(browser, advertisers, mesh, caplog) -> None:
    bad_name = f"{_unique('bad')}.{COORDINATOR_SERVICE}"
    bad = ServiceInfo(COORDINATOR_SERVICE, bad_name, port=7001, properties={b"version": b"1"},
                      server="bad-host.local.", parsed_addresses=["127.0.0.1"])
    zc = AsyncZeroconf(interfaces=["127.0.0.1"], ip_version=IPVersion.V4Only)
    try:
        await (await zc.async_register_service(bad, cooperating_responders=True))
        caplog.set_level(logging.DEBUG, logger="stratamesh.fleet.discovery")
        good = ServiceRecord("coordinator", _unique("good"), "127.0.0.1", 7002, mesh)
        # The bad one is seen first: a watch started before the good one exists must skip it.
        with pytest.raises(DiscoveryTimeout):
            await browser.find("coordinator", mesh, 2.5)
        await _advertise(advertisers, good)
        assert await browser.find("coordinator", mesh, FIND_TIMEOUT_S) == good
    finally:
        await zc.async_close()
    bad_lines = [r for r in caplog.records if bad_name in r.getMessage()]
    assert bad_lines and bad_lines[0].levelno == logging.WARNING
    assert all(r.levelno == logging.DEBUG for r in bad_lines[1:])
