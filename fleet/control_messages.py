"""The control plane's messages: what the coordinator sends an agent (CoordinatorMessage) and what an agent reports
(AgentMessage), the typed unions both ends match on."""

from __future__ import annotations

from dataclasses import dataclass

from stratamesh.fleet.boxes import Peer, Registration, Telemetry
from stratamesh.fleet.kv import KvEvents
from stratamesh.fleet.stages import Assignment, StageStatus
from stratamesh.fleet.weights import WeightsProgress


@dataclass(frozen=True, slots=True)
class Release:
    """The coordinator to an agent: drop this stage and every session on it."""

    assignment_id: str


@dataclass(frozen=True, slots=True)
class Shutdown:
    """The coordinator to an agent: exit (cleanly; a drained agent gets this)."""

    reason: str


@dataclass(frozen=True, slots=True)
class ProbeLinks:
    """The coordinator to an agent: measure your links to these peers and report them."""

    peers: tuple[Peer, ...]


@dataclass(frozen=True, slots=True)
class RtcOffer:
    """A WebRTC offer on its way through the coordinator: from the caller, peer_id names the callee; to the callee,
    the coordinator has set it to the caller (whose control stream it came on, so nobody can offer as another).
    cert_pem: the caller's mesh certificate, which is also its DTLS certificate (b"" in an insecure mesh)."""

    call_id: str
    peer_id: str
    sdp: str
    cert_pem: bytes = b""


@dataclass(frozen=True, slots=True)
class RtcAnswer:
    """The callee's answer to an RtcOffer (peer_id: the callee, as the coordinator relays it), or why it refused."""

    call_id: str
    peer_id: str
    sdp: str = ""
    cert_pem: bytes = b""
    error: str = ""


@dataclass(frozen=True, slots=True)
class LinkMeasurement:
    """A measured link from agent_id to a peer (error instead of figures when the probe failed). An agent's report
    leaves agent_id and measured_at_s to the coordinator (its stream says who, its clock when); the registry keeps
    each link's newest, whole."""

    peer_agent_id: str
    rtt_s: float = 0.0
    bandwidth_bytes_per_s: float = 0.0
    error: str = ""
    agent_id: str = ""
    measured_at_s: float = 0.0


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """An agent to the coordinator: it is alive, serves num_sessions sessions, and took this telemetry (or none)."""

    seq: int
    num_sessions: int = 0
    telemetry: Telemetry | None = None


@dataclass(frozen=True, slots=True)
class LinkReport:
    """An agent to the coordinator: its links to the peers a ProbeLinks named, as measured."""

    links: tuple[LinkMeasurement, ...]


@dataclass(frozen=True, slots=True)
class KvEventReport:
    """An agent to the coordinator: its stages' prefix-cache changes, one KvEvents per stage (or piece of one)."""

    reports: tuple[KvEvents, ...]


@dataclass(frozen=True, slots=True)
class Welcome:
    """The coordinator to an agent: registered as agent_id, heartbeat at this pace (sent again when the pace changes);
    nat: the address its connections come from when it is behind NAT ("": it is not)."""

    agent_id: str
    heartbeat_interval_s: float
    nat: str = ""


@dataclass(frozen=True, slots=True)
class RevokedSerials:
    """The coordinator to an agent: every certificate serial the mesh has revoked (the whole list, not a change)."""

    serials: frozenset[str]


# What the coordinator's domain code sends an agent over its control stream (the control service converts it).
ControlMessage = Assignment | Release | Shutdown | ProbeLinks


# Everything the coordinator sends an agent: the control service adds welcomes, revocations and relayed signalling.
CoordinatorMessage = Welcome | ControlMessage | RevokedSerials | RtcOffer | RtcAnswer


# Everything an agent sends the coordinator on its control stream, a Registration first.
AgentMessage = (Registration | Heartbeat | StageStatus | LinkReport | KvEventReport | WeightsProgress | RtcOffer
                | RtcAnswer)
