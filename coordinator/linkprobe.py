"""The origin's links: the coordinator, where the origin runs, measures its own link to every connected agent."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence

from stratamesh.coordinator.deployer import LINK_PROBE_EVERY_S, Deployer
from stratamesh.fleet.links import measure_peers
from stratamesh.fleet.types import LinkMeasurement, Peer
from stratamesh.partitioner.fleet import ORIGIN

log = logging.getLogger(__name__)

POLL_S = 1.0    # how soon a newly connected agent gets its link to the origin measured

MeasurePeers = Callable[[Sequence[Peer]], Awaitable[list[LinkMeasurement]]]


def due_peers(peers: Sequence[Peer], probed_at: Mapping[Peer, float], now: float, every_s: float) -> list[Peer]:
    """The peers never probed at their current address, or last probed every_s ago or more."""
    return [p for p in peers if p not in probed_at or now >= probed_at[p] + every_s]


class OriginLinkProber:
    """Measures the origin's link to each agent when it connects and every every_s; records them as ORIGIN's."""

    def __init__(self, deployer: Deployer, clock: Callable[[], float], every_s: float = LINK_PROBE_EVERY_S,
                 measure: MeasurePeers = measure_peers):
        self._deployer = deployer
        self._clock = clock
        self._every_s = every_s
        self._measure = measure
        self._probed_at: dict[Peer, float] = {}

    async def probe_due(self) -> list[Peer]:
        """Measures and records the links that are due; returns the peers it probed."""
        peers = self._deployer.peers()
        # An agent that left is forgotten, so its reconnection counts as new.
        self._probed_at = {p: t for p, t in self._probed_at.items() if p in peers}
        now = self._clock()
        due = due_peers(peers, self._probed_at, now, self._every_s)
        if due:
            self._probed_at.update((p, now) for p in due)
            self._deployer.links_reported(ORIGIN, await self._measure(due))
        return due

    async def run(self, poll_s: float = POLL_S) -> None:
        """Probes whatever is due every poll_s until cancelled."""
        while True:
            try:
                await self.probe_due()
            except Exception:  # the registry or the planner failing must not end the probing for good
                log.exception("origin link probe failed")
            await asyncio.sleep(poll_s)
