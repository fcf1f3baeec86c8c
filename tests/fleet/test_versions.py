"""Which agents a coordinator of this build lets join, by the data-plane protocol they report."""

from __future__ import annotations

import pytest

from stratamesh.fleet import versions
from stratamesh.fleet.boxes import Capabilities, Registration
from stratamesh.fleet.versions import COMPATIBLE_PROTOCOLS, PROTOCOL_VERSION, incompatibility
from stratamesh.fleet.wire import convert


def test_an_agent_of_a_compatible_protocol_joins_whatever_its_build() -> None:
    assert all(incompatibility("a", p, "0.0.1-older") is None for p in COMPATIBLE_PROTOCOLS)


@pytest.mark.parametrize("protocol, says", [
    (0, "speaks no protocol version (a build before version checks); this coordinator (stratamesh "),
    (PROTOCOL_VERSION + 1, f"speaks data-plane protocol {PROTOCOL_VERSION + 1}; this coordinator (stratamesh "),
])
def test_an_agent_of_another_protocol_is_refused_naming_both_versions(protocol: int, says: str) -> None:
    refusal = incompatibility("box-7", protocol, "9.9.9")
    assert refusal is not None and refusal.startswith("agent box-7 (stratamesh 9.9.9) " + says)
    assert (f"{versions.software_version()}) speaks data-plane protocols {COMPATIBLE_PROTOCOLS.start}-"
            f"{PROTOCOL_VERSION}") in refusal          # (protocol 1 agents still join: a fleet upgrades box by box)
    assert refusal.endswith("upgrade the agent" if protocol < PROTOCOL_VERSION else "upgrade the coordinator")


BOX = Capabilities("h", "cpu", 2, 8 << 30, 6 << 30)


def test_the_versions_a_process_reports_cross_the_wire(monkeypatch) -> None:
    assert (versions.protocol_version(), versions.software_version()) == (PROTOCOL_VERSION,
                                                                          versions._installed_version())
    monkeypatch.setenv(versions.REPORT_PROTOCOL_ENV, "7")
    monkeypatch.setenv(versions.REPORT_VERSION_ENV, "0.0.1-older")
    other = Registration("a", "a", "h:1", BOX, software_version=versions.software_version(),
                         protocol_version=versions.protocol_version())
    assert convert.agent_message_from_pb(convert.registration_to_pb(other)) == other
    assert (other.software_version, other.protocol_version) == ("0.0.1-older", 7)
