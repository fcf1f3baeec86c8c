"""What a build of stratamesh speaks: its software version, and its data plane's protocol version (the Stage
service's messages, how activations and KV travel). A coordinator plans pipelines only over agents whose data
plane it can speak (COMPATIBLE_PROTOCOLS), and refuses at join one it cannot, naming both versions. Agents of
another software version that speak a compatible protocol join: a fleet upgrades box by box.

Raise PROTOCOL_VERSION with any change a peer of the old build would misread; keep COMPATIBLE_PROTOCOLS to what
this build still serves. STRATAMESH_REPORT_PROTOCOL / STRATAMESH_REPORT_VERSION make a process report other
versions than its own (for upgrade tests; nothing else reads them)."""

from __future__ import annotations

import os
from functools import cache
from importlib import metadata

PROTOCOL_VERSION = 2    # 2: runs that follow one another into the pipeline (StepChunk.pending_from, SessionRewind)
COMPATIBLE_PROTOCOLS = range(1, PROTOCOL_VERSION + 1)     # oldest..newest a coordinator of this build plans with
REPORT_PROTOCOL_ENV = "STRATAMESH_REPORT_PROTOCOL"
REPORT_VERSION_ENV = "STRATAMESH_REPORT_VERSION"


def software_version() -> str:
    """This build's version, as its package says ("unknown" run from a tree that was never installed)."""
    return os.environ.get(REPORT_VERSION_ENV) or _installed_version()


@cache
def _installed_version() -> str:        # (read once: a simulated fleet registers thousands of agents)
    try:
        return metadata.version("stratamesh")
    except metadata.PackageNotFoundError:
        return "unknown"


def protocol_version() -> int:
    """The data-plane protocol this process reports."""
    return int(os.environ.get(REPORT_PROTOCOL_ENV, PROTOCOL_VERSION))


def incompatibility(agent_id: str, protocol: int, software: str) -> str | None:
    """Why this coordinator cannot plan with an agent of that protocol and software version; None if it can."""
    if protocol in COMPATIBLE_PROTOCOLS:
        return None
    speaks = (f"protocol {COMPATIBLE_PROTOCOLS.start}" if len(COMPATIBLE_PROTOCOLS) == 1
              else f"protocols {COMPATIBLE_PROTOCOLS.start}-{COMPATIBLE_PROTOCOLS.stop - 1}")
    theirs = f"data-plane protocol {protocol}" if protocol else "no protocol version (a build before version checks)"
    advice = "upgrade the agent" if protocol < COMPATIBLE_PROTOCOLS.start else "upgrade the coordinator"
    return (f"agent {agent_id} (stratamesh {software or 'unknown'}) speaks {theirs}; this coordinator (stratamesh "
            f"{software_version()}) speaks data-plane {speaks}: {advice}")
