"""The roster: which agents are connected, what each holds loaded, and whether each is still alive."""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection
from dataclasses import replace

from stratamesh.coordinator.control.probes import AgentLink, PeerProbes, peers_of, probe
from stratamesh.coordinator.liveness import CONTROL, DATA, Liveness, LivenessConfig
from stratamesh.coordinator.records import StageRecord
from stratamesh.coordinator.registry_store import RegistryStore
from stratamesh.fleet.errors import MeshError
from stratamesh.fleet.states import AgentState, StageState
from stratamesh.fleet.boxes import Capabilities, Peer, Registration, Telemetry
from stratamesh.fleet.control_messages import ControlMessage, LinkMeasurement, Release, Shutdown
from stratamesh.fleet.wire.stream import address_host

log = logging.getLogger(__name__)

# Heartbeat telemetry kept per agent: an hour, and at most this many rows (an hour of 1 s heartbeats).
TELEMETRY_MAX_AGE_S = 3600.0
TELEMETRY_MAX_ROWS_PER_AGENT = 3600
TELEMETRY_PRUNE_EVERY_S = 60.0
# Heartbeats are taken in memory (liveness, the newest telemetry) and reach the registry in one transaction per
# flush (every tick): each agent's newest last_seen, and its telemetry history at most once per this many seconds
# (a fleet of 10,000 agents at 0.5 s would otherwise write 20,000 rows a second).
TELEMETRY_RECORD_EVERY_S = 5.0
# Routes believe a drop in a link's bandwidth once two readings in a row show it (Roster.bandwidth); a reading under
# this share of the one before is measured again at once, so that a real drop counts within seconds.
DROP_CONFIRM = 0.5


class AgentNotConnected(MeshError, LookupError):
    """No agent of that id is connected to this coordinator."""


class Roster:
    """The connected agents: the link to each, the assignments each reported loaded, the Stage address each
    serves at, its newest telemetry and its liveness. It records their comings and goings in the registry and
    sends them what they must load or release; which stages they should hold is the plans' business."""

    def __init__(self, registry: RegistryStore, clock: Callable[[], float], liveness: LivenessConfig,
                 link_probe_every_s: float):
        self._registry = registry
        self._clock = clock
        self.liveness = Liveness(liveness)
        self._probes = PeerProbes(clock, link_probe_every_s)
        self._links: dict[str, AgentLink] = {}
        self._loaded: dict[str, set[str]] = {}  # agent id -> assignment ids it reported loaded
        self.versions: dict[str, tuple[str, int]] = {}   # agent id -> (software, protocol) it last joined with
        self._addresses: dict[str, str] = {}   # Stage address -> the agent last seen serving there
        self._address_of: dict[str, str] = {}  # ... and the other way
        self.telemetry: dict[str, Telemetry] = {}  # agent id -> its newest heartbeat telemetry
        self.telemetry_at: dict[str, float] = {}   # ... and when it came
        self._seen: dict[str, float] = {}          # heartbeats since the last flush: agent id -> the newest
        self._unrecorded: dict[str, tuple[Telemetry, float]] = {}   # telemetry due in the history, newest
        self._recorded_at: dict[str, float] = {}   # when each agent's telemetry history last got a row
        self._pruned_at = float("-inf")
        self.membership = 0     # bumped whenever an agent connects or is forgotten: who peers() lists may differ
        # (from, to) agent ids -> the newest reading of that link (rtt_s, bytes/s), as the registry keeps them
        self._newest = {(r.agent_id, r.peer_agent_id): (r.rtt_s, r.bandwidth_bytes_per_s) for r in registry.links()}
        self._earlier: dict[tuple[str, str], tuple[float, float]] = {}     # ... and the one before, since this start

    def start(self, now: float) -> None:
        """After a (re)start no agent is connected until it says so."""
        for agent in self._registry.agents():
            if agent.state not in (AgentState.DISCONNECTED, AgentState.DEAD):
                self._registry.set_agent_state(agent.agent_id, AgentState.DISCONNECTED, now)

    @property
    def num_agents(self) -> int:
        return len(self._links)

    def peers(self) -> list[Peer]:
        """Every connected agent the coordinator can dial and the address of its Stage and Link services, by agent
        id (not those behind NAT)."""
        return peers_of(self._links, seen_from="")

    def stage_address(self, agent_id: str) -> str:
        """Where a connected agent's Stage service listens (AgentNotConnected otherwise)."""
        link = self._links.get(agent_id)
        if link is None:
            raise AgentNotConnected(f"agent {agent_id!r} is not connected")
        return link.stage_address

    def nat(self, agent_id: str) -> str:
        """The address a connected agent is behind NAT at ("": it is not, or is not connected)."""
        link = self._links.get(agent_id)
        return link.nat if link is not None else ""

    def nearest(self, agent_id: str, others: Collection[str]) -> list[str]:
        """The Stage addresses of the connected agents among others, those on agent_id's site first."""
        link = self._links.get(agent_id)
        site = link.capabilities.site if link is not None else None
        near = [self._links[a] for a in dict.fromkeys(others) if a in self._links and a != agent_id]
        return [o.stage_address for o in sorted(near, key=lambda o: not site or o.capabilities.site != site)]

    def plannable(self, excluded: Collection[str]) -> dict[str, Capabilities]:
        """Connected agents not banned for flapping nor excluded, and what they can do."""
        now = self._clock()
        return {a: link.capabilities for a, link in self._links.items()
                if not self.liveness.is_banned(a, now) and a not in excluded}

    def serving(self, stage: StageRecord) -> bool:
        """Whether the stage's agent reported it loaded."""
        return stage.assignment_id in self._loaded.get(stage.agent_id, ())

    def lacks(self, stage: StageRecord) -> bool:
        """Whether the stage's agent is connected and has not loaded it."""
        return stage.agent_id in self._links and not self.serving(stage)

    def holds(self, agent_id: str, assignment_id: str) -> bool:
        """Whether the agent reported the stage loaded (and has not released it since)."""
        return assignment_id in self._loaded.get(agent_id, ())

    def send(self, agent_id: str, message: ControlMessage) -> None:
        self._links[agent_id].send(message)

    def connect(self, link: AgentLink, registration: Registration, planned: Collection[str]) -> None:
        """Adopts a (re)connecting agent and the stages it still holds that are planned; releases the others."""
        now = self._clock()
        self.liveness.heard(link.agent_id, now)
        self._links[link.agent_id] = link
        self.versions[link.agent_id] = (registration.software_version, registration.protocol_version)
        self.membership += 1
        # A restarted agent listens on a new port: its old address points nowhere now.
        old = self._address_of.get(link.agent_id)
        if old is not None and self._addresses.get(old) == link.agent_id:
            del self._addresses[old]
        self._addresses[link.stage_address], self._address_of[link.agent_id] = link.agent_id, link.stage_address
        loaded = self._loaded[link.agent_id] = set()
        with self._registry.transaction():      # one commit per join
            self._registry.upsert_agent(link.agent_id, registration.name, link.stage_address,
                                        registration.capabilities, now)
            self._registry.set_agent_state(link.agent_id, AgentState.CONNECTED, now)
            self._registry.log_event("agent_connected", link.stage_address, now, agent_id=link.agent_id)
            for held in registration.held:
                if held.assignment_id in planned:
                    loaded.add(held.assignment_id)
                    self._registry.set_stage_state(held.assignment_id, StageState.READY)
                else:
                    link.send(Release(held.assignment_id))
        self._probes.joined(link, self._links)

    def disconnect(self, link: AgentLink) -> bool:
        """Drops the agent's stream; False if a newer stream of the agent took over, or it was declared dead."""
        if self._links.get(link.agent_id) is not link:
            return False
        self._forget(link.agent_id)
        return True

    def record_drained(self, agent_id: str) -> None:
        """A drained agent went as told: not a failure, and no lease to keep."""
        now = self._clock()
        self.liveness.forget(agent_id)
        self._registry.set_agent_state(agent_id, AgentState.DRAINED, now)
        self._registry.log_event("agent_drained", "", now, agent_id=agent_id)

    def lost(self, agent_id: str) -> bool:
        """Records that the agent's stream dropped unasked; True if that makes it dead."""
        now = self._clock()
        self._registry.set_agent_state(agent_id, AgentState.DISCONNECTED, now)
        self._registry.log_event("agent_disconnected", "", now, agent_id=agent_id)
        return self.liveness.suspect(agent_id, CONTROL, now)

    def heartbeat(self, agent_id: str, telemetry: Telemetry | None = None) -> None:
        """Records that the agent is alive, and what it reported about its load."""
        if agent_id not in self._links:
            return  # a stream the coordinator is closing: its agent was declared dead
        now = self._clock()
        self.liveness.heard(agent_id, now)
        self._seen[agent_id] = now
        if telemetry is not None:
            self.telemetry[agent_id], self.telemetry_at[agent_id] = telemetry, now
            if now >= self._recorded_at.get(agent_id, float("-inf")) + TELEMETRY_RECORD_EVERY_S:
                self._unrecorded[agent_id] = (telemetry, now)

    def flush(self) -> None:
        """Writes the heartbeats taken since the last flush to the registry, in one transaction."""
        if not self._seen and not self._unrecorded:
            return
        seen, self._seen = self._seen, {}
        unrecorded, self._unrecorded = self._unrecorded, {}
        self._registry.record_heartbeats(seen, [(a, t, ts) for a, (t, ts) in unrecorded.items()])
        self._recorded_at.update((a, ts) for a, (_, ts) in unrecorded.items())

    def unreachable(self, address: str) -> str | None:
        """The data plane could not reach this Stage address: its agent, if that makes it dead."""
        agent_id = self._addresses.get(address)
        if agent_id is not None and self.liveness.suspect(agent_id, DATA, self._clock()):
            return agent_id
        return None

    def expired(self) -> list[str]:
        """Agents whose lease ran out since the last call, now declared dead."""
        return self.liveness.expired(self._clock())

    def cut_off(self, agent_id: str) -> list[str]:
        """Closes a dead agent's stream and records its death; returns the Stage addresses it served at."""
        now = self._clock()
        link = self._links.get(agent_id)
        if link is not None:
            self._forget(agent_id)
            link.close()
        banned = self.liveness.banned_until(agent_id)
        detail = f"flapping: banned from plans for {banned - now:.0f} s" if banned > now else ""
        if self._registry.agent(agent_id) is not None:
            self._registry.set_agent_state(agent_id, AgentState.DEAD, now)
        self._registry.log_event("agent_dead", detail, now, agent_id=agent_id)
        log.warning("agent %s declared dead%s", agent_id, f" ({detail})" if detail else "")
        address = self._address_of.get(agent_id)
        return [address] if address is not None and self._addresses.get(address) == agent_id else []

    def _forget(self, agent_id: str) -> None:
        del self._links[agent_id]
        self.membership += 1
        self._loaded.pop(agent_id, None)
        self.telemetry.pop(agent_id, None)
        self.telemetry_at.pop(agent_id, None)
        self._recorded_at.pop(agent_id, None)

    def links_reported(self, agent_id: str, links: list[LinkMeasurement]) -> None:
        """Stores an agent's link measurements for the planner and the operator. A reading under DROP_CONFIRM of the
        one before asks the agent to measure that link again at once: bandwidth() believes a drop only when a second
        reading confirms it."""
        self._registry.record_links(agent_id, links, self._clock())
        again: list[AgentLink] = []
        for m in links:
            if m.error:
                log.info("agent %s could not measure its link to %s: %s", agent_id, m.peer_agent_id, m.error)
                continue
            key = (agent_id, m.peer_agent_id)
            before = self._newest.get(key)
            if before is not None:
                self._earlier[key] = before
            self._newest[key] = (m.rtt_s, m.bandwidth_bytes_per_s)
            if before and m.bandwidth_bytes_per_s < DROP_CONFIRM * before[1] and m.peer_agent_id in self._links:
                again.append(self._links[m.peer_agent_id])
        if again and agent_id in self._links:
            probe(self._links[agent_id], again)

    def bandwidth(self, sender: str, receiver: str) -> float | None:
        """The bandwidth (bytes/s) from sender to receiver that routes pick its codec by (or, unmeasured, the other
        way's); None. It is the better of the link's two newest readings: one slow reading (a busy moment of either
        box, or of the network) does not make a LAN link lossy and the mesh's output another. A real drop shows in
        the second reading too, which links_reported() asks for at once."""
        for key in ((sender, receiver), (receiver, sender)):
            newest = self._newest.get(key)
            if newest and newest[1]:
                return _better(newest, self._earlier.get(key))[1]
        return None

    def links(self) -> list[LinkMeasurement]:
        """The registry's measured links as the planner prices them: the round trip and the bandwidth of each at the
        better of its two newest readings, as bandwidth() gives routes, so one slow reading moves no stage either."""
        out = []
        for r in self._registry.links():
            earlier = self._earlier.get((r.agent_id, r.peer_agent_id))
            rtt_s, bandwidth = _better((r.rtt_s, r.bandwidth_bytes_per_s), earlier)
            out.append(replace(r, rtt_s=rtt_s, bandwidth_bytes_per_s=bandwidth))
        return out

    def same_box(self, a: str, b: str) -> bool:
        """Whether two connected agents run on one box: the same hostname, and Stage services on the same IP address.
        Their link is a copy through that box's loopback, whose probe measures how busy the box is, not a network.
        (Both, because network namespaces on one box share its hostname, and sites behind NAT may reuse addresses.)"""
        x, y = self._links.get(a), self._links.get(b)
        return (x is not None and y is not None
                and on_one_box(x.capabilities.hostname, x.stage_address, y.capabilities.hostname, y.stage_address))

    def tick(self) -> None:
        """Writes the heartbeats taken, prunes old telemetry, and re-probes links when due."""
        self.flush()
        now = self._clock()
        if now >= self._pruned_at + TELEMETRY_PRUNE_EVERY_S:
            self._pruned_at = now
            self._registry.prune_telemetry(now, TELEMETRY_MAX_AGE_S, TELEMETRY_MAX_ROWS_PER_AGENT)
        self._probes.tick(self._links)

    def record_loaded(self, agent_id: str, assignment_id: str, loaded: bool) -> None:
        """An agent's report that it has (or no longer has) an assignment loaded."""
        held = self._loaded.setdefault(agent_id, set())
        if loaded:
            held.add(assignment_id)
        else:
            held.discard(assignment_id)

    def release_all_but(self, wanted: set[str]) -> None:
        """Tells every connected agent to release what it holds outside wanted."""
        for agent_id, loaded in self._loaded.items():
            if not loaded or agent_id not in self._links:
                continue
            for assignment_id in sorted(loaded - wanted):
                loaded.discard(assignment_id)
                self._links[agent_id].send(Release(assignment_id))

    def release_held(self, agent_id: str) -> list[str]:
        """Tells a connected agent to release everything it holds; returns those assignments."""
        link = self._links[agent_id]
        held = sorted(self._loaded.pop(agent_id, set()))
        for assignment_id in held:
            link.send(Release(assignment_id))
        return held

    def shut_down(self, agent_id: str, reason: str) -> list[str]:
        """Tells a connected agent to release everything and exit; returns the assignments it was holding."""
        held = self.release_held(agent_id)
        self._links[agent_id].send(Shutdown(reason))
        self._registry.set_agent_state(agent_id, AgentState.DRAINED, self._clock())
        return held

    def is_connected(self, agent_id: str) -> bool:
        return agent_id in self._links


def _better(newest: tuple[float, float], earlier: tuple[float, float] | None) -> tuple[float, float]:
    """A link's (round trip s, bytes/s), each at the better of its newest reading and the one before it (if any)."""
    if earlier is None:
        return newest
    return min(newest[0], earlier[0]), max(newest[1], earlier[1])


def on_one_box(hostname_a: str, stage_address_a: str, hostname_b: str, stage_address_b: str) -> bool:
    """Whether two agents run on one box: the same hostname, and Stage services on the same IP address (Roster.same_box
    says why both)."""
    return hostname_a == hostname_b and address_host(stage_address_a) == address_host(stage_address_b)
