"""FleetSnapshot: its JSON form, default links and speeds (test_fleet_file: the file's errors and schema)."""

from __future__ import annotations

import json

import pytest

from stratamesh.fleet.errors import InvalidInput
from stratamesh.partitioner.fleet_snapshot import NODE_LINK, ORIGIN, SITE_LINK, WAN_LINK, Device, FleetSnapshot, Link, fleet_from_dict
from stratamesh.fleet.boxes import Speed
from tests.partitioner.random_fleets import random_case

GOOD = {
    "origin_site": "home",
    "devices": [
        {"id": "laptop", "memory_bytes": 8_000_000_000, "tier": "edge", "site": "home", "node": "",
         "step_overhead_s": 0.002, "dtype": "float32",
         "speeds": [{"backend": "torch-cpu", "dtype": "float32", "flops": 2e11, "mem_bandwidth": 5e10}]},
        {"id": "gpu0", "memory_bytes": 80_000_000_000, "tier": "cloud", "site": "dc", "node": "box",
         "speeds": [{"backend": "torch-cuda", "dtype": "bfloat16", "flops": 9e14, "mem_bandwidth": 3e12},
                    {"backend": "torch-cuda", "dtype": "float32", "flops": 6e13, "mem_bandwidth": 3e12}]},
    ],
    "links": [{"a": "laptop", "b": "gpu0", "bandwidth": 1e7, "rtt_s": 0.03}],
}


def test_from_dict_reads_every_field() -> None:
    fleet = fleet_from_dict(GOOD)
    laptop, gpu = fleet.devices
    assert fleet.origin_site == "home"
    assert laptop == Device("laptop", 8_000_000_000, (Speed("torch-cpu", "float32", 2e11, 5e10),), "edge",
                            "home", "", 0.002, "float32")
    assert (gpu.tier, gpu.site, gpu.node, gpu.step_overhead_s, len(gpu.speeds), gpu.dtype) == (
        "cloud", "dc", "box", 0.0, 2, "")                      # no dtype: the model's
    assert fleet.links == (Link("laptop", "gpu0", 1e7, 0.03),)


def test_optional_fields_default() -> None:
    fleet = fleet_from_dict({"devices": [{"id": "x", "memory_bytes": 1, "speeds": []}]})
    assert fleet.devices == (Device("x", 1, ()),) and fleet.links == () and fleet.origin_site == ""


@pytest.mark.parametrize("seed", range(20))
def test_round_trip_through_json(seed: int) -> None:
    fleet = random_case(seed, device_dtypes=seed % 2 == 1).fleet
    raw = json.loads(json.dumps(fleet.to_dict()))
    assert fleet_from_dict(raw) == fleet
    assert fleet_from_dict(raw).to_dict() == raw


def _device(device_id: str, site: str = "", node: str = "") -> Device:
    return Device(device_id, 1, (Speed("torch-cpu", "float32", 1e9, 1e9),), site=site, node=node)


A, B = _device("a", "s1", "n1"), _device("b", "s1", "n1")        # one node
C = _device("c", "s1", "n2")                                    # same site, another node
D = _device("d", "s2")                                          # another site, its own node
E, F = _device("e", "s1"), _device("f", "s1")                   # node "" means a node of its own


@pytest.mark.parametrize("x, y, expected", [
    (A, B, NODE_LINK), (A, C, SITE_LINK), (A, D, WAN_LINK), (C, D, WAN_LINK), (E, F, SITE_LINK),
    (D, A, WAN_LINK), (B, A, NODE_LINK),
])
def test_default_links(x, y, expected) -> None:
    fleet = FleetSnapshot((A, B, C, D, E, F))
    assert fleet.link(x, y) == expected
    assert NODE_LINK.bandwidth > SITE_LINK.bandwidth > WAN_LINK.bandwidth
    assert NODE_LINK.rtt_s < SITE_LINK.rtt_s < WAN_LINK.rtt_s


@pytest.mark.parametrize("origin_site, device, expected", [
    ("", D, SITE_LINK),          # no origin site: near everyone
    ("s1", A, SITE_LINK),
    ("s1", D, WAN_LINK),
    ("elsewhere", A, WAN_LINK),
])
def test_default_origin_links(origin_site, device, expected) -> None:
    fleet = FleetSnapshot((A, B, C, D, E, F), origin_site=origin_site)
    assert fleet.link(None, device) == expected
    assert fleet.link(device, None) == expected


def test_measured_links_win_both_ways() -> None:
    ab, d_origin = Link("b", "a", 3e11, 1e-6), Link(ORIGIN, "d", 5e6, 0.1)
    fleet = FleetSnapshot((A, B, C, D), (ab, d_origin), origin_site="s2")
    assert fleet.link(A, B) == ab and fleet.link(B, A) == ab
    assert fleet.link(D, None) == d_origin and fleet.link(None, D) == d_origin
    assert fleet.link(A, C) == SITE_LINK and fleet.link(None, A) == WAN_LINK


def test_without_keeps_links_and_origin() -> None:
    fleet = fleet_from_dict(GOOD)
    smaller = fleet.without({"gpu0"})
    assert [d.id for d in smaller.devices] == ["laptop"]
    assert smaller.links == fleet.links and smaller.origin_site == "home"
    assert fleet.without(set()) == fleet


def test_unknown_device() -> None:
    with pytest.raises(InvalidInput, match="nope"):
        fleet_from_dict(GOOD).device("nope")


def test_speed_picks_the_fastest_backend_for_the_dtype() -> None:
    device = Device("x", 1, (
        Speed("onnxruntime", "float16", 5e12, 1e11),
        Speed("torch-cuda", "float16", 9e12, 1e11),
        Speed("torch-cuda", "float32", 9e13, 9e11),      # faster, but another dtype
        Speed("torch-cpu", "float16", 9e12, 2e10),
        Speed("triton", "float16", 9e12, 1e11),          # ties torch-cuda: the name breaks the tie
    ))
    assert device.speed("float16") == Speed("triton", "float16", 9e12, 1e11)
    assert device.speed("float32").backend == "torch-cuda"
    assert device.speed("bfloat16") is None
    reordered = Device("x", 1, tuple(reversed(device.speeds)))
    assert reordered.speed("float16") == device.speed("float16")


def test_two_measurements_of_one_pair_do_not_depend_on_their_order() -> None:
    """Two agents probing each other report a->b and b->a: the weaker measurement holds, whatever the order."""
    slow = {"a": "laptop", "b": "gpu0", "bandwidth": 1e6, "rtt_s": 0.05}
    fast = {"a": "gpu0", "b": "laptop", "bandwidth": 1e10, "rtt_s": 0.001}
    answers = []
    for links in ([slow, fast], [fast, slow]):
        try:
            fleet = fleet_from_dict({**GOOD, "links": links})
            answers.append(fleet.link(*fleet.devices))
        except InvalidInput:
            answers.append("rejected")
    assert answers[0] == answers[1] == Link("gpu0", "laptop", 1e6, 0.05)
