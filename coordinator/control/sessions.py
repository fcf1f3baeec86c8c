"""The origin's sessions as the control plane sees them, without importing the origin (serving/ imports control/,
never the reverse): serving.sessions.SessionTable is the one the coordinator gives the Deployer and the Drainer."""

from __future__ import annotations

from collections.abc import Collection
from typing import Protocol


class Sessions(Protocol):
    def route_lost(self, address: str) -> None:
        """The agent at this Stage address was declared dead: the sessions routed through it fail over."""

    def assignments_in_use(self) -> Collection[str]:
        """The assignment ids of every stage a live (or moving) session runs on."""

    def move_off(self, address: str) -> int:
        """Asks every live session through this Stage address to move off it; returns how many were asked now."""

    def sessions_through(self, address: str) -> int:
        """Live and moving sessions routed through this Stage address."""


class NoSessions:
    """No origin: no session to fail over, move or keep a stage for."""

    def route_lost(self, address: str) -> None:
        pass

    def assignments_in_use(self) -> Collection[str]:
        return frozenset()

    def move_off(self, address: str) -> int:
        return 0

    def sessions_through(self, address: str) -> int:
        return 0
