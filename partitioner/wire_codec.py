"""How activations cross each link: the most exact codec whose transfer stays a small share of the sender's step."""

from __future__ import annotations

from stratamesh.fleet.errors import InvalidInput

# A link may take this share of the sending stage's step before a narrower codec pays: the transfer of one step
# overlaps the next step's compute, but the bytes also queue behind one another on a slow uplink.
LINK_SHARE = 0.25
# A link that moves one step's activations raw in less than this stays raw whatever the share: narrowing it saves
# less than a hop's own overhead, and an exact link keeps a mesh of small models on a LAN equal to its reference.
RAW_BELOW_S = 0.001
CODEC_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1}
# "auto" lets the planner choose per link; the others force one codec on every link (to compare them)
WIRE_CODECS = ("auto", "float32", "float16", "bfloat16", "int8")


def check_policy(policy: str) -> str:
    if policy not in WIRE_CODECS:
        raise InvalidInput(f"wire codec {policy!r} is not one of {', '.join(WIRE_CODECS)}")
    return policy


def bytes_ratio(codec: str, wire: str) -> float:
    """Bytes on the link with codec ("": raw in wire) per byte of wire, the dtype activations travel in otherwise."""
    return CODEC_BYTES[codec or wire] / CODEC_BYTES[wire]


def choose_codec(wire: str, transfer_s: float, compute_s: float) -> str:
    """The codec of one link ("" for raw in wire, "float16" or "int8"): the first, from the most exact, whose transfer
    of one step's activations (transfer_s in wire) fits in LINK_SHARE of the sending stage's step compute_s."""
    if transfer_s < RAW_BELOW_S:
        return ""
    narrower = ["float16"] if wire == "float32" else []
    for codec in ["", *narrower]:
        if transfer_s * bytes_ratio(codec, wire) <= LINK_SHARE * compute_s:
            return codec
    return "int8"
