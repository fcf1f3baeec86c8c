"""Which agents are alive: heartbeat leases, failure reports, and bans for agents that keep dying."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

# The two ways the coordinator hears of trouble besides a lapsed lease; both at once mean dead at once.
CONTROL = "control"     # the agent's control stream ended
DATA = "data"           # a stage or the origin could not reach the agent's Stage service


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


class Liveness:
    """Leases and suspicions per agent id; time is always a parameter."""

    def __init__(self, config: LivenessConfig = LivenessConfig()):
        self.config = config
        self._agents: dict[str, _Agent] = {}

    def heard(self, agent_id: str, now: float) -> None:
        """The agent registered or sent a heartbeat: its lease starts again and suspicions are dropped."""
        agent = self._agents.setdefault(agent_id, _Agent(now))
        agent.deadline_s, agent.dead = now + self.config.lease_s, False
        agent.suspicions.clear()

    def expect(self, agent_id: str, now: float) -> None:
        """An agent known from before a coordinator restart: it has restart_grace_s to reconnect."""
        self._agents.setdefault(agent_id, _Agent(now + self.config.restart_grace_s))

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
        """Agents whose lease ran out since the last call, now declared dead (sorted)."""
        lapsed = sorted(a for a, s in self._agents.items() if not s.dead and s.deadline_s < now)
        for agent_id in lapsed:
            self._declare_dead(self._agents[agent_id], now)
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
        agent.deaths.append(now)
        while agent.deaths and agent.deaths[0] < now - config.flap_window_s:
            agent.deaths.popleft()
        if len(agent.deaths) >= config.flaps_to_ban:
            agent.banned_until = now + min(config.ban_s * 2 ** agent.num_bans, config.ban_max_s)
            agent.num_bans += 1
            agent.deaths.clear()
