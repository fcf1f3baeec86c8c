"""The WAN test bed as a fixture: for its own tests here, and for tests elsewhere that need hosts apart
(tests/fleet/test_links.py imports it)."""

from __future__ import annotations

import secrets
from collections.abc import Iterator

import pytest

from stratamesh.testbed.netbed import Netbed, NetbedUnavailable, check_can_build


@pytest.fixture
def netbed() -> Iterator[Netbed]:
    """A WAN test bed of network namespaces (skips where this machine cannot build one); checks nothing is left."""
    prefix = f"sm-{secrets.token_hex(3)}"
    try:
        check_can_build(prefix)
    except NetbedUnavailable as exc:
        pytest.skip(f"the WAN test bed cannot run here: {exc}")
    with Netbed(prefix) as bed:
        yield bed
    assert bed.leftovers() == []
