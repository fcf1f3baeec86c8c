"""The origin's own links: it measures its link to each agent when the agent connects and every period, and records
them in the roster as ORIGIN's (the planner places a model's first and last stages by them)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence

from stratamesh.coordinator.control.probes import LINK_PROBE_EVERY_S
from stratamesh.coordinator.control.roster import Roster
from stratamesh.fleet.links import measure_peers
from stratamesh.fleet.boxes import Peer
from stratamesh.fleet.control_messages import LinkMeasurement
from stratamesh.partitioner.fleet_snapshot import ORIGIN

log = logging.getLogger(__name__)

POLL_S = 1.0    # how soon a newly connected agent gets its link to the origin measured

MeasurePeers = Callable[[Sequence[Peer]], Awaitable[list[LinkMeasurement]]]


def due_peers(peers: Sequence[Peer], probed_at: Mapping[Peer, float], now: float, every_s: float) -> list[Peer]:
    """The peers never probed at their current address, or last probed every_s ago or more."""
    return [p for p in peers if p not in probed_at or now >= probed_at[p] + every_s]


class OriginLinkProber:
    """Measures the origin's link to each agent when it connects and every every_s; records them as ORIGIN's."""

    def __init__(self, roster: Roster, clock: Callable[[], float], every_s: float = LINK_PROBE_EVERY_S,
                 measure: MeasurePeers = measure_peers):
        self._roster = roster
        self._clock = clock
        self._every_s = every_s
        self._measure = measure
        self._probed_at: dict[Peer, float] = {}
        self._peers: list[Peer] = []
        self._membership = -1       # the roster's membership count self._peers was read at

    async def probe_due(self) -> list[Peer]:
        """Measures and records the links that are due; returns the peers it probed."""
        if self._roster.membership != self._membership:   # read again only when agents came or went: it lists
            self._membership = self._roster.membership     # every agent, and this runs every second
            self._peers = self._roster.peers()
            # An agent that left is forgotten, so its reconnection counts as new.
            connected = set(self._peers)
            self._probed_at = {p: t for p, t in self._probed_at.items() if p in connected}
        now = self._clock()
        due = due_peers(self._peers, self._probed_at, now, self._every_s)
        if due:
            self._probed_at.update((p, now) for p in due)
            self._roster.links_reported(ORIGIN, await self._measure(due))
        return due

    async def run(self, poll_s: float = POLL_S) -> None:
        """Probes whatever is due every poll_s until cancelled."""
        while True:
            try:
                await self.probe_due()
            except Exception:  # the registry or the planner failing must not end the probing for good
                log.exception("origin link probe failed")
            await asyncio.sleep(poll_s)
