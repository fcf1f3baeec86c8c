"""Dataclass values as JSON-ready dicts and lists, fast: for what the coordinator serves and stores many of a second
(heartbeat telemetry, the admin API's agents)."""

from __future__ import annotations

from dataclasses import fields, is_dataclass
from typing import Any

_SCALARS = frozenset({str, int, float, bool, type(None)})
_FIELDS: dict[type, tuple[str, ...]] = {}       # a dataclass type -> its field names, looked up once


def plain(value: Any) -> Any:
    """A dataclass value (and those nested in it, in tuples and dicts) as JSON-ready dicts and lists: what
    dataclasses.asdict gives, without its deep copies, which were most of the cost of listing 10,000 agents."""
    kind = type(value)
    if kind in _SCALARS:
        return value
    names = _FIELDS.get(kind)
    if names is not None:
        return {name: plain(getattr(value, name)) for name in names}
    if isinstance(value, (tuple, list)):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if is_dataclass(value) and not isinstance(value, type):
        _FIELDS[kind] = tuple(f.name for f in fields(value))
        return plain(value)
    return value
