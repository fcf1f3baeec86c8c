"""The fleet file: its pydantic models, the checked-in JSON Schema, and errors that name the field's path."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from stratamesh.fleet.errors import InvalidInput
from stratamesh.partitioner.fleet_snapshot import ORIGIN, Device, Link
from stratamesh.fleet.boxes import Speed
from stratamesh.partitioner.fleet_file import (
    SCHEMA_PATH, _engineering, fleet_from_dict, fleet_json_schema, fleet_schema_text,
)

REPO = Path(__file__).resolve().parents[2]
UNITS = ("bytes", "FLOP/s", "bytes/s", "seconds")

FILE = {
    "origin_site": "home",
    "devices": [
        {"id": "laptop", "memory_bytes": 8_000_000_000, "site": "home", "step_overhead_s": 0.002,
         "speeds": [{"backend": "torch-cpu", "dtype": "float32", "flops": 2e11, "mem_bandwidth": 5e10}]},
        {"id": "gpu0", "memory_bytes": 80e9, "tier": "cloud", "site": "dc", "node": "box", "dtype": "bfloat16",
         "token_overhead_s": 5e-5, "speeds": [{"backend": "torch-cuda", "dtype": "bfloat16", "flops": 9e14, "mem_bandwidth": 3e12}]},
    ],
    "links": [{"a": "laptop", "b": "gpu0", "bandwidth": 1e7, "rtt_s": 0.03},
              {"a": ORIGIN, "b": "gpu0", "bandwidth": 5e6, "rtt_s": 0.05}],
}


def test_the_checked_in_schema_is_what_the_models_make() -> None:
    checked_in = (REPO / SCHEMA_PATH).read_text()
    assert checked_in == fleet_schema_text(), f"regenerate it: stratamesh plan --fleet-schema > {SCHEMA_PATH}"
    assert json.loads(checked_in)["required"] == ["devices"]


def _properties(schema: dict) -> list[tuple[str, dict, bool]]:
    """(name, property, required) of every object in the schema."""
    objects = [schema, *schema["$defs"].values()]
    return [(name, prop, name in o.get("required", ())) for o in objects for name, prop in o["properties"].items()]


def test_every_number_states_its_unit_and_every_optional_field_its_default() -> None:
    properties = _properties(fleet_json_schema())
    assert {"memory_bytes", "flops", "mem_bandwidth", "bandwidth", "rtt_s", "step_overhead_s", "origin_site",
            "links"} <= {name for name, _, _ in properties}
    for name, prop, required in properties:
        if prop.get("type") in ("number", "integer"):
            assert any(unit in prop["description"] for unit in UNITS), name
        if not required:
            assert "default" in prop and "default" in prop["description"], name


def test_the_schema_refuses_what_the_parse_refuses() -> None:
    device = fleet_json_schema()["$defs"]["DeviceEntry"]
    assert device["additionalProperties"] is False
    assert (device["properties"]["memory_bytes"]["type"], device["properties"]["memory_bytes"]["minimum"]) == (
        "integer", 0)
    assert device["properties"]["tier"]["enum"] == ["edge", "cloud"]
    assert "" in device["properties"]["dtype"]["enum"] and "float64" not in device["properties"]["dtype"]["enum"]


def test_the_parse_makes_the_planner_types() -> None:
    fleet = fleet_from_dict(FILE)
    laptop, gpu = fleet.devices
    assert laptop == Device("laptop", 8_000_000_000, (Speed("torch-cpu", "float32", 2e11, 5e10),), "edge", "home",
                            "", 0.002, "")
    assert gpu.memory_bytes == 80_000_000_000 and isinstance(gpu.memory_bytes, int)     # 80e9 is whole
    assert (gpu.tier, gpu.node, gpu.dtype, gpu.token_overhead_s) == ("cloud", "box", "bfloat16", 5e-5)
    assert fleet.links == (Link("laptop", "gpu0", 1e7, 0.03), Link(ORIGIN, "gpu0", 5e6, 0.05))
    assert fleet.link(None, gpu) == Link(ORIGIN, "gpu0", 5e6, 0.05)


def _broken(path: tuple, value) -> dict:
    """FILE with the field at path set to value (or removed, for DELETE)."""
    raw = copy.deepcopy(FILE)
    *parents, key = path
    holder = raw
    for p in parents:
        holder = holder[p]
    if value is DELETE:
        del holder[key]
    else:
        holder[key] = value
    return raw


DELETE = object()


@pytest.mark.parametrize("path, value, message", [
    (("devices",), DELETE, "devices: required field missing"),
    (("devices",), None, "devices: must be a list (got null)"),
    (("devices", 0), "laptop", "devices[0]: must be an object (got 'laptop')"),
    (("devices", 0, "id"), DELETE, "devices[0].id: required field missing"),
    (("devices", 1, "id"), 7, "devices[1].id: must be a string (got 7)"),
    (("devices", 1, "id"), "laptop", "devices[1].id: 'laptop' is devices[0]'s id too; ids must be unique"),
    (("devices", 1, "id"), ORIGIN,
     "devices[1].id: 'origin' stands for where requests enter; a device must be named otherwise"),
    (("devices", 0, "memory_bytes"), DELETE, "devices[0].memory_bytes: required field missing"),
    (("devices", 0, "memory_bytes"), -5, "devices[0].memory_bytes: must be at least 0 (got -5)"),
    (("devices", 0, "memory_bytes"), 8.5, "devices[0].memory_bytes: must be a whole number (got 8.5)"),
    (("devices", 0, "memory_bytes"), "lots", "devices[0].memory_bytes: must be a whole number (got 'lots')"),
    (("devices", 0, "memory_bytes"), True, "devices[0].memory_bytes: must be a whole number (got true)"),
    (("devices", 0, "memroy_bytes"), 5, "devices[0].memroy_bytes: unknown field"),
    (("devices", 0, "speeds"), DELETE, "devices[0].speeds: required field missing"),
    (("devices", 0, "speeds"), {"flops": 1}, "devices[0].speeds: must be a list (got an object)"),
    (("devices", 0, "tier"), "fog", "devices[0].tier: must be 'edge' or 'cloud' (got 'fog')"),
    (("devices", 0, "dtype"), "fp16",
     "devices[0].dtype: must be '', 'bfloat16', 'float16', 'float32' or 'int8' (got 'fp16')"),
    (("devices", 0, "step_overhead_s"), -0.1, "devices[0].step_overhead_s: must be at least 0 (got -0.1)"),
    (("devices", 0, "step_overhead_s"), float("nan"), "devices[0].step_overhead_s: must be a finite number (got NaN)"),
    (("devices", 0, "step_overhead_s"), float("inf"),
     "devices[0].step_overhead_s: must be a finite number (got Infinity)"),
    (("devices", 1, "token_overhead_s"), -1e-4, "devices[1].token_overhead_s: must be at least 0 (got -0.0001)"),
    (("devices", 0, "speeds", 0, "backend"), DELETE, "devices[0].speeds[0].backend: required field missing"),
    (("devices", 1, "speeds", 0, "flops"), 0, "devices[1].speeds[0].flops: must be more than 0 (got 0)"),
    (("devices", 1, "speeds", 0, "flops"), "fast", "devices[1].speeds[0].flops: must be a number (got 'fast')"),
    (("devices", 1, "speeds", 0, "flops"), float("inf"), "devices[1].speeds[0].flops: must be a finite number "
                                                         "(got Infinity)"),
    (("devices", 1, "speeds", 0, "mem_bandwidth"), -5e9,
     "devices[1].speeds[0].mem_bandwidth: must be more than 0 (got -5000000000.0)"),
    (("devices", 1, "speeds", 0, "tflops"), 9e2, "devices[1].speeds[0].tflops: unknown field"),
    (("links",), {"a": "x"}, "links: must be a list (got an object)"),
    (("links", 0, "a"), DELETE, "links[0].a: required field missing"),
    (("links", 0, "a"), "gpu9", "links[0].a: no device 'gpu9' in devices (nor is it 'origin')"),
    (("links", 1, "b"), "laptop2", "links[1].b: no device 'laptop2' in devices (nor is it 'origin')"),
    (("links", 0, "bandwidth"), 0, "links[0].bandwidth: must be more than 0 (got 0)"),
    (("links", 0, "bandwidth"), float("nan"), "links[0].bandwidth: must be a finite number (got NaN)"),
    (("links", 0, "rtt_s"), -0.001, "links[0].rtt_s: must be at least 0 (got -0.001)"),
    (("links", 0, "rtt_s"), None, "links[0].rtt_s: must be a number (got null)"),
    (("links", 0, "rtt_ms"), 30, "links[0].rtt_ms: unknown field"),
    (("origin_site",), 3, "origin_site: must be a string (got 3)"),
    (("nodes",), [], "nodes: unknown field"),
])
def test_a_bad_field_is_named_by_its_path(path, value, message) -> None:
    with pytest.raises(InvalidInput) as caught:
        fleet_from_dict(_broken(path, value))
    assert str(caught.value) == message


@pytest.mark.parametrize("raw, message", [
    ([], "must be an object (got a list)"),
    ("fleet", "must be an object (got 'fleet')"),
    ({"devices": [{"id": "x"}]}, "devices[0].memory_bytes: required field missing (and 1 more error)"),
    ({"devices": [{"id": "x", "memory_bytes": -1, "speeds": [], "tier": "x", "site": 1}]},
     "devices[0].memory_bytes: must be at least 0 (got -1) (and 2 more errors)"),
])
def test_a_bad_file_says_its_first_error_and_how_many_more(raw, message) -> None:
    with pytest.raises(InvalidInput) as caught:
        fleet_from_dict(raw)
    assert str(caught.value) == message


def test_a_long_value_is_shortened() -> None:
    with pytest.raises(InvalidInput) as caught:
        fleet_from_dict(_broken(("devices", 0, "tier"), "x" * 100))
    assert str(caught.value) == f"devices[0].tier: must be 'edge' or 'cloud' (got '{'x' * 36}...)"


@pytest.mark.parametrize("value, text", [
    (25e9, "25e9"), (1.25e9, "1.25e9"), (12.5e6, "12.5e6"), (20e-6, "20e-6"), (0.3e-3, "300e-6"), (40e-3, "40e-3"),
    (7.0, "7"), (999.0, "999"),
])
def test_engineering_notation(value: float, text: str) -> None:
    assert _engineering(value) == text


def test_the_documented_example_is_a_fleet_file() -> None:
    page = (REPO / "docs" / "deploying.md").read_text()
    section = page[page.index("### The fleet file"):]
    start = section.index("```json\n") + len("```json\n")
    example = section[start:section.index("\n```", start)]
    fleet = fleet_from_dict(json.loads(example))
    assert [d.id for d in fleet.devices] == ["gpu0", "nuc"] and fleet.devices[0].memory_bytes == 22_000_000_000
