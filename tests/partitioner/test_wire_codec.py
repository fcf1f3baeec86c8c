"""Which codec a link between two stages uses: the most exact whose transfer fits in a quarter of the sender's step."""

from __future__ import annotations

import pytest

from stratamesh.fleet.errors import InvalidInput
from stratamesh.partitioner.wire_codec import LINK_SHARE, RAW_BELOW_S, bytes_ratio, check_policy, choose_codec

STEP_S = 0.020       # at the link share, 5 ms of transfer: over RAW_BELOW_S, so the share decides


@pytest.mark.parametrize("wire, transfer_s, expected", [
    ("float32", 0.0, ""),                              # a LAN: raw, exact
    ("float32", LINK_SHARE * STEP_S, ""),              # right at the share: still raw
    ("float32", 1.5 * LINK_SHARE * STEP_S, "float16"),  # half the bytes fit
    ("float32", 2.0 * LINK_SHARE * STEP_S, "float16"),
    ("float32", 2.5 * LINK_SHARE * STEP_S, "int8"),     # only a quarter fits
    ("float32", 100 * LINK_SHARE * STEP_S, "int8"),     # nothing fits: the narrowest
    ("bfloat16", 0.5 * LINK_SHARE * STEP_S, ""),
    ("bfloat16", 1.5 * LINK_SHARE * STEP_S, "int8"),    # a 16-bit wire has no narrower float to go to
    ("float16", 3 * LINK_SHARE * STEP_S, "int8"),
])
def test_the_most_exact_codec_that_fits_the_links_share(wire: str, transfer_s: float, expected: str) -> None:
    assert choose_codec(wire, transfer_s, STEP_S) == expected


def test_a_link_that_moves_a_step_in_under_a_millisecond_stays_raw() -> None:
    assert RAW_BELOW_S == 0.001
    assert choose_codec("float32", 0.0009, 0.0001) == ""        # 9x the step, but a loopback's microseconds
    assert choose_codec("float32", 0.0011, 0.0001) == "int8"


@pytest.mark.parametrize("codec, wire, ratio", [
    ("", "float32", 1.0), ("float16", "float32", 0.5), ("int8", "float32", 0.25), ("int8", "bfloat16", 0.5),
    ("", "float16", 1.0)])
def test_bytes_ratio(codec: str, wire: str, ratio: float) -> None:
    assert bytes_ratio(codec, wire) == ratio


def test_a_policy_must_be_a_known_codec() -> None:
    assert check_policy("int8") == "int8"
    with pytest.raises(InvalidInput, match="wire codec 'zstd' is not one of auto, float32"):
        check_policy("zstd")
