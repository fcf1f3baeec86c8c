"""Zeroconf advertising and browsing of coordinators and agents, bound to chosen interfaces only."""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import re
from collections.abc import AsyncIterator, Awaitable, Mapping, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field

from zeroconf import DNSQuestionType, InterfaceChoice, IPVersion, ServiceInfo, ServiceStateChange, Zeroconf
from zeroconf.asyncio import AsyncServiceBrowser, AsyncServiceInfo, AsyncZeroconf

from stratamesh.fleet.errors import InvalidInput, MeshError

log = logging.getLogger(__name__)

COORDINATOR_SERVICE = "_stratamesh._tcp.local."
# RFC 6763 7.2 caps a service name at 15 bytes ("stratamesh-agent" is 16; zeroconf's strict
# registration and Apple's mDNSResponder refuse it), hence "-agt".
AGENT_SERVICE = "_stratamesh-agt._tcp.local."
SERVICE_TYPES = {"coordinator": COORDINATOR_SERVICE, "agent": AGENT_SERVICE}
KINDS = {v: k for k, v in SERVICE_TYPES.items()}
LOOPBACK_INTERFACES = ("127.0.0.1",)
RESOLVE_TIMEOUT_MS = 3000
_MAX_LABEL_BYTES = 63


class DiscoveryTimeout(MeshError, TimeoutError):
    """No matching service was found on the mesh before the timeout."""


@dataclass(frozen=True, slots=True)
class ServiceRecord:
    """One advertised coordinator or agent of one mesh, as zeroconf carries it."""

    kind: str
    instance: str
    host: str
    port: int
    mesh: str = "default"
    properties: dict[str, str] = field(default_factory=dict)


def parse_record(type_: str, name: str, addresses: Sequence[str], port: int | None,
                 txt: Mapping[bytes, bytes | None]) -> ServiceRecord:
    """Validate the raw fields of a resolved service; raise InvalidInput naming the bad one."""
    kind = KINDS.get(type_)
    if kind is None:
        raise InvalidInput(f"service type {type_!r} is not a stratamesh service")
    if not name.endswith("." + type_) or len(name) == len(type_) + 1:
        raise InvalidInput(f"service name {name!r} has no instance label before {type_!r}")
    props = _decode_txt(txt)
    mesh = props.pop("mesh", "")
    if not mesh:
        raise InvalidInput(f"service {name!r}: TXT record lacks the required 'mesh' key")
    if port is None or not 1 <= port <= 65535:
        raise InvalidInput(f"service {name!r}: port {port!r} is not in 1..65535")
    host = _pick_address(name, addresses)
    return ServiceRecord(kind=kind, instance=name[: -len(type_) - 1], host=host, port=port,
                         mesh=mesh, properties=props)


def _decode_txt(txt: Mapping[bytes, bytes | None]) -> dict[str, str]:
    """TXT entries as text, within RFC 6763's sizes, the keys we read checked; a key without '=' reads as ""."""
    if len(txt) > _MAX_TXT_ENTRIES:
        raise InvalidInput(f"TXT record has {len(txt)} entries; at most {_MAX_TXT_ENTRIES} are read")
    out: dict[str, str] = {}
    for key, value in txt.items():
        if not 0 < len(key) + len(value or b"") + 1 <= _MAX_TXT_STRING_BYTES:
            raise InvalidInput(f"TXT entry {key[:32]!r} is over {_MAX_TXT_STRING_BYTES} bytes or has no key")
        try:
            out[key.decode("ascii")] = (value or b"").decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InvalidInput(f"TXT entry {key[:32]!r} is not an ASCII key with a UTF-8 value: {exc}") from None
    for key, check in _TXT_CHECKS.items():
        if key in out and not check(out[key]):
            raise InvalidInput(f"TXT entry {key}={out[key][:64]!r} is malformed")
    return out


def _is_port(text: str) -> bool:
    return text.isascii() and text.isdigit() and 1 <= int(text) <= 65535


_MAX_TXT_ENTRIES = 32
_MAX_TXT_STRING_BYTES = 255        # one TXT character-string (RFC 6763 6.1)
_TXT_CHECKS = {"http": _is_port, "enroll": _is_port, "grpc": _is_port,
               "mesh": lambda v: 0 < len(v) <= 63 and v.isprintable(),
               "agent_id": lambda v: re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}", v) is not None}


def _pick_address(name: str, addresses: Sequence[str]) -> str:
    """The first valid address, IPv4 preferred."""
    parsed = []
    for text in addresses:
        try:
            parsed.append(ipaddress.ip_address(text.split("%", 1)[0]))
        except ValueError:
            log.debug("service %s: ignoring bad address %r", name, text)
    if not parsed:
        raise InvalidInput(f"service {name!r} has no valid address (got {list(addresses)!r})")
    parsed.sort(key=lambda a: a.version)
    return str(parsed[0])


def parse_service(info: ServiceInfo) -> ServiceRecord:
    """Pull the raw fields out of a resolved ServiceInfo and validate them with parse_record."""
    return parse_record(info.type, info.name, info.parsed_addresses(), info.port,
                        info.properties)


def _check_interfaces(interfaces: Sequence[str]) -> list[str]:
    """Explicit interface addresses; refuses InterfaceChoice.All/Default (they hit real NICs)."""
    if isinstance(interfaces, (InterfaceChoice, str)) or not interfaces:
        raise InvalidInput(f"interfaces must be a non-empty list of addresses, got {interfaces!r}")
    for addr in interfaces:
        try:
            ipaddress.ip_address(addr)
        except ValueError:
            raise InvalidInput(f"interface {addr!r} is not an IP address") from None
    return list(interfaces)


def _service_info(record: ServiceRecord) -> ServiceInfo:
    """The zeroconf ServiceInfo that advertises record."""
    type_ = SERVICE_TYPES.get(record.kind)
    if type_ is None:
        raise InvalidInput(f"kind must be one of {sorted(SERVICE_TYPES)}, got {record.kind!r}")
    if not record.instance or len(record.instance.encode()) > _MAX_LABEL_BYTES or "." in record.instance:
        raise InvalidInput(f"instance {record.instance!r} must be 1-63 bytes without dots")
    if not record.mesh or "mesh" in record.properties:
        raise InvalidInput("mesh must be non-empty and properties must not repeat it")
    if not 1 <= record.port <= 65535:
        raise InvalidInput(f"port {record.port} is not in 1..65535")
    try:
        ipaddress.ip_address(record.host)
    except ValueError:
        raise InvalidInput(f"host {record.host!r} is not an IP address") from None
    host_label = re.sub(r"[^A-Za-z0-9-]", "-", record.instance)
    return ServiceInfo(type_, f"{record.instance}.{type_}", port=record.port,
                       properties={"mesh": record.mesh, **record.properties},
                       server=f"{host_label}.local.", parsed_addresses=[record.host])


class Advertiser:
    """Registers one ServiceRecord on the given interfaces until closed."""

    def __init__(self, interfaces: Sequence[str] = LOOPBACK_INTERFACES,
                 ip_version: IPVersion = IPVersion.V4Only) -> None:
        self._interfaces = _check_interfaces(interfaces)
        self._ip_version = ip_version
        self._zc: AsyncZeroconf | None = None
        self._info: ServiceInfo | None = None
        self._announcing: Awaitable[None] | None = None

    async def start(self, record: ServiceRecord) -> None:
        """Announce record; skips name probing, so the instance name must be unique on the link."""
        if self._zc is not None:
            raise MeshError("Advertiser already started; close it first")
        info = _service_info(record)
        self._zc = AsyncZeroconf(interfaces=self._interfaces, ip_version=self._ip_version)
        try:
            # cooperating_responders skips the name probe (~1.2 s on this project's VMs). The returned task
            # sends three announcements over ~0.45 s; the first goes out at once, so don't wait.
            self._announcing = await self._zc.async_register_service(
                info, cooperating_responders=True)
        except BaseException:
            await self.close()
            raise
        self._info = info
        log.info("advertising %s on %s:%d", info.name, record.host, record.port)

    async def close(self) -> None:
        """Send goodbyes and close the zeroconf instance; safe to call twice."""
        zc, info, self._zc, self._info = self._zc, self._info, None, None
        if zc is None:
            return
        if isinstance(self._announcing, asyncio.Future):
            self._announcing.cancel()
        self._announcing = None
        try:
            if info is not None:
                await (await zc.async_unregister_service(info))
        finally:
            await zc.async_close()


class Browser:
    """Finds and watches stratamesh services of one mesh on the given interfaces."""

    def __init__(self, interfaces: Sequence[str] = LOOPBACK_INTERFACES,
                 ip_version: IPVersion = IPVersion.V4Only) -> None:
        # Create inside the running event loop: zeroconf then shares it instead of a thread.
        self._zc = AsyncZeroconf(interfaces=_check_interfaces(interfaces), ip_version=ip_version)
        self._browsers: set[AsyncServiceBrowser] = set()
        self._warned: set[str] = set()

    async def find(self, kind: str, mesh: str, timeout_s: float) -> ServiceRecord:
        """The first record of kind in mesh; DiscoveryTimeout if none shows up in timeout_s."""
        try:
            async with asyncio.timeout(timeout_s), aclosing(self.watch(kind, mesh)) as records:
                async for record in records:
                    return record
        except TimeoutError:
            pass
        raise DiscoveryTimeout(f"no {kind} of mesh {mesh!r} found within {timeout_s:g} s")

    async def watch(self, kind: str, mesh: str) -> AsyncIterator[ServiceRecord]:
        """Yield each new or changed record of kind in mesh (a restarted service yields again)."""
        type_ = SERVICE_TYPES.get(kind)
        if type_ is None:
            raise InvalidInput(f"kind must be one of {sorted(SERVICE_TYPES)}, got {kind!r}")
        queue: asyncio.Queue[tuple[str, ServiceStateChange]] = asyncio.Queue()
        loop = asyncio.get_running_loop()

        def on_change(zeroconf: Zeroconf, service_type: str, name: str,
                      state_change: ServiceStateChange) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, (name, state_change))

        browser = AsyncServiceBrowser(self._zc.zeroconf, type_, handlers=[on_change],
                                      question_type=DNSQuestionType.QM)
        self._browsers.add(browser)
        try:
            async for record in self._resolve_changes(queue, type_, mesh):
                yield record
        finally:
            if browser in self._browsers:   # else close() has cancelled it already: a second cancel raises
                self._browsers.discard(browser)
                await browser.async_cancel()

    async def _resolve_changes(self, queue: asyncio.Queue[tuple[str, ServiceStateChange]],
                               type_: str, mesh: str) -> AsyncIterator[ServiceRecord]:
        """Turn browser events into records of mesh, skipping repeats and bad records."""
        last: dict[str, ServiceRecord] = {}
        while True:
            name, change = await queue.get()
            if change is ServiceStateChange.Removed:
                last.pop(name, None)
                continue
            record = await self._resolve(type_, name)
            if record is None or record.mesh != mesh or last.get(name) == record:
                continue
            last[name] = record
            yield record

    async def _resolve(self, type_: str, name: str) -> ServiceRecord | None:
        """Resolve and validate one service; None (with one log line) if it fails."""
        info = AsyncServiceInfo(type_, name)
        if not await info.async_request(self._zc.zeroconf, RESOLVE_TIMEOUT_MS,
                                        question_type=DNSQuestionType.QM):
            log.debug("service %s did not resolve", name)
            return None
        try:
            return parse_service(info)
        except InvalidInput as exc:
            # A peer that keeps sending a bad record is logged once at warning, then at debug.
            level = logging.DEBUG if name in self._warned else logging.WARNING
            self._warned.add(name)
            log.log(level, "dropping malformed service record %s: %s", name, exc)
            return None

    async def close(self) -> None:
        """Stop every watch and close the zeroconf instance."""
        for browser in list(self._browsers):
            await browser.async_cancel()
        self._browsers.clear()
        await self._zc.async_close()
