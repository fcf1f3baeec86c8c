"""Which agents are alive: heartbeat leases, failure reports, and bans for agents that keep dying."""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

# The two ways the coordinator hears of trouble besides a lapsed lease; both at once mean dead at once.
CONTROL = "control"     # the agent's control stream ended
DATA = "data"           # a stage or the origin could not reach the agent's Stage service


# A fleet's heartbeats are kept under about this many a second: beyond MAX_HEARTBEATS_PER_S x the base interval
# agents, each beats less often (the interval doubles, as Kubernetes stretches node status updates with cluster
# size), and a lease is then at least LEASE_BEATS intervals long.
MAX_HEARTBEATS_PER_S = 2000.0
LEASE_BEATS = 4
# More leases than this share of the live agents (and at least MASS_LAPSE_MIN) running out at one check is more
# likely the coordinator not hearing (too busy to read its streams, or its own network down) than that many boxes
# dying together: each gets one more lease before it is declared dead (Kubernetes holds back evictions likewise
# when a large share of a zone goes unready at once).
MASS_LAPSE_SHARE = 0.1
MASS_LAPSE_MIN = 5
STALL_MIN_S = 0.05      # a liveness check this late (or more) means the coordinator stalled: leases get it back


def heartbeat_interval(base_s: float, num_agents: int, current_s: float | None = None) -> float:
    """The interval agents should heartbeat at in a fleet of num_agents: base_s, doubled while the fleet would send
    more than MAX_HEARTBEATS_PER_S; from current_s it comes back down only once the fleet is under half that (so a
    fleet near a threshold does not flip between two intervals)."""
    interval = max(current_s or base_s, base_s)
    while num_agents / interval > MAX_HEARTBEATS_PER_S:
        interval *= 2
    while interval / 2 >= base_s and num_agents / (interval / 2) < MAX_HEARTBEATS_PER_S / 2:
        interval /= 2
    return interval


@dataclass(frozen=True, slots=True)
class LivenessConfig:
    """How soon an agent is declared dead, and how long one that flaps is kept out of plans."""

    lease_s: float = 2.0            # an agent not heard from for this long is dead
    flap_window_s: float = 120.0    # deaths this close together count as flapping ...
    flaps_to_ban: int = 3           # ... and this many of them ban the agent from plans
    ban_s: float = 10.0             # the first ban; each further one doubles ...
    ban_max_s: float = 300.0        # ... up to this
    restart_grace_s: float = 10.0   # after a coordinator restart, how long agents of its plans have to reconnect


@dataclass(slots=True)
class _Agent:
    deadline_s: float               # dead if not heard from by then
    dead: bool = False
    suspicions: set[str] = field(default_factory=set)
    deaths: deque[float] = field(default_factory=deque)
    banned_until: float = float("-inf")
    num_bans: int = 0
    reprieved: bool = False         # its lease lapsed in a mass lapse and was extended once


class Liveness:
    """Leases and suspicions per agent id; time is always a parameter."""

    def __init__(self, config: LivenessConfig = LivenessConfig()):
        self.config = config
        self._agents: dict[str, _Agent] = {}
        self.interval_s = 0.0       # the heartbeat interval agents are told: a lease is at least LEASE_BEATS of it
        self.stalled_s = 0.0        # every stall given back to the leases since the start (stalled)
        self.num_declared_dead = 0  # deaths declared since the start, by lease or by both signs of failure
        # No live agent's deadline is earlier than this: expired() looks at every lease only once it has passed
        # (it is checked ten times a second, and 10,000 leases end some 24 s apart from their heartbeats).
        self._earliest_s = float("inf")

    @property
    def lease_s(self) -> float:
        """How long an agent may go unheard: the configured lease, or LEASE_BEATS heartbeats in a large fleet."""
        return max(self.config.lease_s, LEASE_BEATS * self.interval_s)

    def heard(self, agent_id: str, now: float) -> None:
        """The agent registered or sent a heartbeat: its lease starts again and suspicions are dropped."""
        agent = self._agents.setdefault(agent_id, _Agent(now))
        agent.deadline_s, agent.dead, agent.reprieved = now + self.lease_s, False, False
        agent.suspicions.clear()
        self._earliest_s = min(self._earliest_s, agent.deadline_s)

    def stalled(self, seconds: float) -> None:
        """The coordinator could not hear anyone for this long (its event loop was busy): nobody's silence in that
        time counts, so every lease is extended by it. (Not worth the walk over every lease for a hiccup.)"""
        if seconds < STALL_MIN_S:
            return
        self.stalled_s += seconds
        log.info("the coordinator stalled for %.2f s: leases extended by as much", seconds)
        for agent in self._agents.values():
            if not agent.dead:
                agent.deadline_s += seconds

    def expect(self, agent_id: str, now: float) -> None:
        """An agent known from before a coordinator restart: it has restart_grace_s to reconnect."""
        agent = self._agents.setdefault(agent_id, _Agent(now + self.config.restart_grace_s))
        self._earliest_s = min(self._earliest_s, agent.deadline_s)

    def forget(self, agent_id: str) -> None:
        """An agent that left on purpose (drained): no lease, no death, no ban."""
        self._agents.pop(agent_id, None)

    def suspect(self, agent_id: str, reason: str, now: float) -> bool:
        """Records a sign of failure (CONTROL or DATA); True if the agent is declared dead by it.

        One sign alone waits for the lease: a control stream drops when the coordinator restarts or a
        link blips, and one stage failing to reach another may be the link, not the agent. Both signs
        together (what kill -9 gives within milliseconds) are death at once."""
        agent = self._agents.get(agent_id)
        if agent is None or agent.dead:
            return False
        agent.suspicions.add(reason)
        if agent.suspicions >= {CONTROL, DATA}:
            self._declare_dead(agent, now)
            return True
        return False

    def expired(self, now: float) -> list[str]:
        """Agents whose lease ran out since the last call, now declared dead (sorted); in a mass lapse, those whose
        lease has not been extended yet get one more instead."""
        if now <= self._earliest_s:
            return []
        lapsed = sorted(a for a, s in self._agents.items() if not s.dead and s.deadline_s < now)
        live = sum(1 for s in self._agents.values() if not s.dead) if len(lapsed) >= MASS_LAPSE_MIN else 0
        if lapsed and len(lapsed) >= max(MASS_LAPSE_MIN, MASS_LAPSE_SHARE * live):
            first = [a for a in lapsed if not self._agents[a].reprieved]
            if first:
                log.warning("%d of %d agents' leases lapsed at once: this coordinator may not have heard them; "
                            "one more lease (%.1f s) before declaring them dead", len(first), live, self.lease_s)
            for agent_id in first:
                agent = self._agents[agent_id]
                agent.deadline_s, agent.reprieved = now + self.lease_s, True
            reprieved = set(first)
            lapsed = [a for a in lapsed if a not in reprieved]
        for agent_id in lapsed:
            self._declare_dead(self._agents[agent_id], now)
        self._earliest_s = min((s.deadline_s for s in self._agents.values() if not s.dead), default=float("inf"))
        return lapsed

    def is_dead(self, agent_id: str) -> bool:
        agent = self._agents.get(agent_id)
        return agent is not None and agent.dead

    def is_banned(self, agent_id: str, now: float) -> bool:
        agent = self._agents.get(agent_id)
        return agent is not None and now < agent.banned_until

    def banned_until(self, agent_id: str) -> float:
        """When the agent's ban ends (-inf if it was never banned)."""
        agent = self._agents.get(agent_id)
        return agent.banned_until if agent is not None else float("-inf")

    def _declare_dead(self, agent: _Agent, now: float) -> None:
        config = self.config
        agent.dead = True
        self.num_declared_dead += 1
        agent.deaths.append(now)
        while agent.deaths and agent.deaths[0] < now - config.flap_window_s:
            agent.deaths.popleft()
        if len(agent.deaths) >= config.flaps_to_ban:
            agent.banned_until = now + min(config.ban_s * 2 ** agent.num_bans, config.ban_max_s)
            agent.num_bans += 1
            agent.deaths.clear()
