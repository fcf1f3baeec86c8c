"""The fleet file of `stratamesh plan --fleet`: pydantic models (the published JSON Schema is made from them) and
their parse into a FleetSnapshot, with errors that name the field's path ("devices[2].memory_bytes: ...")."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError
from pydantic_core import ErrorDetails

from stratamesh.fleet.errors import InvalidInput
from stratamesh.partitioner.fleet_snapshot import (  # noqa: F401  (DEFAULT_LINKS, _engineering: the file's words)
    DEFAULT_LINKS, ORIGIN, SCHEMA_PATH, SITE_LINK, TIERS, WAN_LINK, Device, FleetSnapshot, Link, Speed, _engineering,
    _link_text,
)
from stratamesh.partitioner.profile import DTYPE_BYTES

SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"   # what pydantic's model_json_schema writes

Tier = Literal[TIERS]                                   # type: ignore[valid-type]  # built from the tuple
DeviceDtype = Literal[("", *sorted(DTYPE_BYTES))]       # type: ignore[valid-type]  # "" = the model's


def _whole_number(value: Any) -> Any:
    """JSON's 8e9 is a float; a count of bytes may be written so (8.5 stays a float, which is refused)."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


ByteCount = Annotated[int, BeforeValidator(_whole_number)]


class _Strict(BaseModel):
    # strict: a number is never a string or a bool, nor a string a number; forbid: a misspelt field is an error
    model_config = ConfigDict(strict=True, extra="forbid")


class SpeedEntry(_Strict):
    """What a device measured for one backend and dtype."""

    backend: str = Field(description='what ran it: "torch-cuda", "torch-cpu", "onnxruntime-cpu", ...')
    dtype: str = Field(description='the dtype it computed in, e.g. "bfloat16"')
    flops: float = Field(gt=0, allow_inf_nan=False, description="FLOP/s of a large matmul; finite, above 0")
    mem_bandwidth: float = Field(gt=0, allow_inf_nan=False, description="bytes/s of a large copy; finite, above 0")
    step_overhead_s: float | None = Field(None, ge=0, allow_inf_nan=False,
                                          description="this backend's own fixed cost per step, where it differs "
                                                      "from the device's; default null: the device's")
    layer_overhead_s: float | None = Field(None, ge=0, allow_inf_nan=False,
                                           description="this backend's own cost per layer of a step; default null: "
                                                       "the device's")


class DeviceEntry(_Strict):
    """One GPU or one CPU box that can serve a stage."""

    id: str = Field(description=f'unique, and not "{ORIGIN}" (which links use for where requests enter)')
    memory_bytes: ByteCount = Field(ge=0, description="bytes a stage may fill: free GPU memory, or available RAM; "
                                                      "at least 0")
    speeds: list[SpeedEntry] = Field(description="measured speeds, per backend and dtype; a device with none for "
                                                  "the dtype it computes in is left out of the plan")
    tier: Tier = Field("edge", description='"edge" or "cloud"; default "edge"')
    site: str = Field("", description='a building or a cloud region (links inside one are fast); default ""')
    node: str = Field("", description="a machine (GPUs of one node may form a tensor-parallel group); "
                                      'default "": a node of its own')
    step_overhead_s: float = Field(0.0, ge=0, allow_inf_nan=False,
                                   description="seconds of fixed cost per step (framework, kernel launches); "
                                               "finite, at least 0; default 0")
    dtype: DeviceDtype = Field("", description="the dtype it computes the model in; default \"\": the model's "
                                               "(stratamesh plan --dtype, else the config's)")
    layer_overhead_s: float = Field(0.0, ge=0, allow_inf_nan=False,
                                    description="seconds of fixed cost per layer of a step (beside step_overhead_s); "
                                                "finite, at least 0; default 0")
    token_overhead_s: float = Field(0.0, ge=0, allow_inf_nan=False,
                                    description="seconds per token of a step beyond its layers: the serving path "
                                                "(messages in and out, scheduling; a decode step has one token per "
                                                "sequence); finite, at least 0; default 0")


class LinkEntry(_Strict):
    """A measured link between two devices, or a device and the origin; the same both ways."""

    a: str = Field(description=f'a device id, or "{ORIGIN}" (where requests enter and tokens return)')
    b: str = Field(description=f'the other end: a device id, or "{ORIGIN}"')
    bandwidth: float = Field(gt=0, allow_inf_nan=False, description="bytes/s; finite, above 0")
    rtt_s: float = Field(ge=0, allow_inf_nan=False, description="round trip in seconds; finite, at least 0")


class FleetFile(_Strict):
    """A fleet for `stratamesh plan --fleet`: its devices, the links measured between them, where requests enter."""

    origin_site: str = Field("", description="the site where requests enter: a device there reaches the origin "
                                             f"over {_link_text(SITE_LINK)}, elsewhere over {_link_text(WAN_LINK)}, "
                                             'unless a link says otherwise; default "": every device is near it')
    devices: list[DeviceEntry] = Field(description="the devices the plan may use")
    links: list[LinkEntry] = Field([], description="measured links (two for one pair: the weaker holds); default "
                                                   f"[]; a pair not listed gets the default: {DEFAULT_LINKS}")


def fleet_json_schema() -> dict[str, Any]:
    """The fleet file's JSON Schema, from the models."""
    return {"$schema": SCHEMA_DIALECT, **FleetFile.model_json_schema()}


def fleet_schema_text() -> str:
    """fleet_json_schema as docs/fleet.schema.json holds it (`stratamesh plan --fleet-schema` prints this)."""
    return json.dumps(fleet_json_schema(), indent=2) + "\n"


def fleet_from_dict(raw: Any) -> FleetSnapshot:
    """A FleetSnapshot from the fleet file's JSON form; InvalidInput names the first bad field's path."""
    try:
        file = FleetFile.model_validate(raw)
    except ValidationError as exc:
        raise InvalidInput(_describe(exc.errors(include_url=False))) from None
    _check_ids(file)
    links = tuple(Link(x.a, x.b, x.bandwidth, x.rtt_s) for x in file.links)
    return FleetSnapshot(tuple(_device(d) for d in file.devices), links, file.origin_site)


def _device(entry: DeviceEntry) -> Device:
    speeds = tuple(Speed(s.backend, s.dtype, s.flops, s.mem_bandwidth, s.step_overhead_s, s.layer_overhead_s)
                   for s in entry.speeds)
    return Device(entry.id, entry.memory_bytes, speeds, tier=entry.tier, site=entry.site, node=entry.node,
                  step_overhead_s=entry.step_overhead_s, dtype=entry.dtype, layer_overhead_s=entry.layer_overhead_s,
                  token_overhead_s=entry.token_overhead_s)


def _check_ids(file: FleetFile) -> None:
    """Device ids are unique and not ORIGIN; a link joins two of them (or one and ORIGIN)."""
    index: dict[str, int] = {}
    for k, device in enumerate(file.devices):
        if device.id == ORIGIN:
            raise InvalidInput(f"devices[{k}].id: {ORIGIN!r} stands for where requests enter; "
                               f"a device must be named otherwise")
        if device.id in index:
            raise InvalidInput(f"devices[{k}].id: {device.id!r} is devices[{index[device.id]}]'s id too; "
                               f"ids must be unique")
        index[device.id] = k
    for k, link in enumerate(file.links):
        for end, name in (("a", link.a), ("b", link.b)):
            if name != ORIGIN and name not in index:
                raise InvalidInput(f"links[{k}].{end}: no device {name!r} in devices (nor is it {ORIGIN!r})")


def _describe(errors: Sequence[ErrorDetails]) -> str:
    """The first error as "path: problem (got value)", and how many more there are."""
    first = errors[0]
    path = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in first["loc"]).lstrip(".")
    more = f" (and {len(errors) - 1} more error{'s' if len(errors) > 2 else ''})" if len(errors) > 1 else ""
    return f"{path}: {_problem(first)}{more}" if path else f"{_problem(first)}{more}"


# pydantic's error types, said plainly; the placeholders are the error's ctx
PROBLEMS = {
    "greater_than_equal": "must be at least {ge:g}",
    "greater_than": "must be more than {gt:g}",
    "finite_number": "must be a finite number",
    "float_type": "must be a number",
    "int_type": "must be a whole number",
    "string_type": "must be a string",
    "list_type": "must be a list",
    "model_type": "must be an object",
    "literal_error": "must be {expected}",
}


def _problem(error: ErrorDetails) -> str:
    if error["type"] == "missing":
        return "required field missing"
    if error["type"] == "extra_forbidden":
        return "unknown field"
    template = PROBLEMS.get(error["type"])
    problem = template.format(**error.get("ctx", {})) if template else error["msg"]
    return f"{problem} (got {_shown(error['input'])})"


def _shown(value: Any) -> str:
    """value as the file spells it, shortened: 'fog', -5, true, null, NaN, an object, a list."""
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, list | tuple):
        return "a list"
    text = repr(value) if isinstance(value, str) else json.dumps(value, default=repr)
    return text if len(text) <= 40 else text[:37] + "..."
