"""A snapshot of the fleet the planner sees: devices (memory, measured speed, tier, site, node) and links."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from stratamesh.fleet.errors import InvalidInput
from stratamesh.fleet.boxes import Speed

SCHEMA_PATH = "docs/fleet.schema.json"   # the fleet file's JSON Schema (fleet_file.py), checked in to the repository
ORIGIN = "origin"          # the link endpoint that stands for the origin (tokens in, tokens out)
TIERS = ("edge", "cloud")   # a device's tier


def shards(backend: str) -> bool:
    """Whether a backend's stages may be tensor-parallel groups: not ONNX Runtime's (one rank: StageSpec)."""
    return not backend.startswith("onnxruntime")


@dataclass(frozen=True, slots=True)
class Device:
    """One GPU or one CPU box that can serve a stage."""

    id: str
    memory_bytes: int         # usable: free GPU memory, or available RAM
    speeds: tuple[Speed, ...]
    tier: str = "edge"
    site: str = ""            # a building or a cloud region: links inside one are fast
    node: str = ""            # a machine: GPUs on one node may form a tensor-parallel group; "" = id
    step_overhead_s: float = 0.0   # fixed cost of one step (framework, kernel launches)
    dtype: str = ""           # the dtype it computes this model in; "" = the profile's
    layer_overhead_s: float = 0.0  # fixed cost of each layer of a step (beside step_overhead_s)
    token_overhead_s: float = 0.0  # cost of each token of a step beyond its layers: the serving path (messages in
                                   # and out, scheduling), one token per sequence in a decode step

    @property
    def node_id(self) -> str:
        return self.node or self.id

    def speed(self, dtype: str) -> Speed | None:
        """The fastest measured backend for dtype (ties by backend name), or None."""
        return next(iter(self.speeds_for(dtype)), None)

    def speeds_for(self, dtype: str) -> list[Speed]:
        """Every backend measured for dtype, fastest first (most FLOP/s, then bandwidth, then backend name)."""
        return sorted((s for s in self.speeds if s.dtype == dtype), key=lambda s: (s.flops, s.mem_bandwidth, s.backend),
                      reverse=True)


@dataclass(frozen=True, slots=True)
class Link:
    """A measured link between two devices (or a device and ORIGIN), the same both ways."""

    a: str
    b: str
    bandwidth: float          # bytes/s
    rtt_s: float


# Links never measured: GPUs of one node talk over PCIe 4.0 x16, boxes of one site over 10 GbE, and sites
# over a 100 Mbit/s WAN with 40 ms round trips.
NODE_LINK = Link("", "", bandwidth=25e9, rtt_s=20e-6)
SITE_LINK = Link("", "", bandwidth=1.25e9, rtt_s=0.3e-3)
WAN_LINK = Link("", "", bandwidth=12.5e6, rtt_s=40e-3)


def _engineering(value: float) -> str:
    """value with an exponent that is a multiple of 3: 25e9, 12.5e6, 300e-6."""
    exponent = 3 * math.floor(math.log10(value) / 3) if value > 0 else 0
    return f"{value / 10.0 ** exponent:.4g}e{exponent}" if exponent else f"{value:.4g}"


def _link_text(link: Link) -> str:
    return f"{_engineering(link.bandwidth)} bytes/s with {_engineering(link.rtt_s)} s round trip"


# what a pair of devices no link names is priced at (the fleet file's links[] documents it)
DEFAULT_LINKS = (f"GPUs of one node {_link_text(NODE_LINK)}; devices of one site {_link_text(SITE_LINK)}; "
                 f"devices at different sites {_link_text(WAN_LINK)}")


@dataclass(frozen=True, slots=True)
class FleetSnapshot:
    """Devices and measured links; origin_site is where requests enter ("" = near every device)."""

    devices: tuple[Device, ...]
    links: tuple[Link, ...] = ()
    origin_site: str = ""
    _index: dict[tuple[str, str], Link] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        ids = [d.id for d in self.devices]
        if len(set(ids)) != len(ids) or ORIGIN in ids:
            raise InvalidInput(f"device ids must be unique and not {ORIGIN!r}")
        for link in self.links:   # two measurements of one pair (each end probed the other): the weaker holds
            key = _key(link.a, link.b)
            seen = self._index.get(key)
            self._index[key] = link if seen is None else Link(*key, min(seen.bandwidth, link.bandwidth),
                                                              max(seen.rtt_s, link.rtt_s))

    def device(self, device_id: str) -> Device:
        for d in self.devices:
            if d.id == device_id:
                return d
        raise InvalidInput(f"no device {device_id!r} in the fleet")

    def link(self, a: Device | None, b: Device | None) -> Link:
        """The link between two devices (None: the origin): measured, or the default for where they sit."""
        measured = self._index.get(_key(a.id if a else ORIGIN, b.id if b else ORIGIN))
        if measured is not None:
            return measured
        if a is None or b is None:
            device = a or b
            near = not self.origin_site or device is None or device.site == self.origin_site
            return SITE_LINK if near else WAN_LINK
        if a.node_id == b.node_id:
            return NODE_LINK
        return SITE_LINK if a.site == b.site else WAN_LINK

    def without(self, device_ids: set[str]) -> FleetSnapshot:
        """The same fleet minus some devices (their links stay; they are never asked for)."""
        return FleetSnapshot(tuple(d for d in self.devices if d.id not in device_ids), self.links, self.origin_site)

    def to_dict(self) -> dict[str, Any]:
        """The JSON form fleet_from_dict reads; a device's dtype only where it names one (it is optional)."""
        return {"origin_site": self.origin_site,
                "devices": [_device_dict(d) for d in self.devices],
                "links": [asdict(link) for link in self.links]}


def _speed_dict(speed: Speed) -> dict[str, Any]:
    """A speed's JSON form: its own overheads only where it has them (most backends use the device's); the decode
    rates a box measured are not the planner's (placement prices a device by them already)."""
    return {k: v for k, v in asdict(speed).items() if v is not None and k not in ("decode_flops", "decode_bandwidth")}


def _device_dict(device: Device) -> dict[str, Any]:
    out = {**asdict(device), "speeds": [_speed_dict(s) for s in device.speeds]}
    if not device.dtype:
        del out["dtype"]
    for measured in ("layer_overhead_s", "token_overhead_s"):   # (written only where measured, as fleets
        if not out[measured]:                                     # before them had none)
            del out[measured]
    return out


def _key(a: str, b: str) -> tuple[str, str]:
    return (a, b) if a <= b else (b, a)


def fleet_from_dict(raw: Mapping[str, Any]) -> FleetSnapshot:
    """A FleetSnapshot from its JSON form (to_dict's shape); InvalidInput names the bad field's path."""
    from stratamesh.partitioner.fleet_file import fleet_from_dict as parse   # the file's models build on this module

    return parse(raw)
