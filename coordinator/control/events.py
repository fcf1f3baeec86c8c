"""What the control code and the origin tell each other, without either holding the other."""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class RouteWork:
    """The live generations whose route starts at one stage: the prompt tokens they have still to prefill, and how
    many are decoding."""

    prefill_tokens: int = 0
    num_decoding: int = 0


class Sessions(Protocol):
    """The origin's sessions as the control code sees them (the Origin is one)."""

    def route_lost(self, address: str) -> None:
        """The agent at this Stage address was declared dead: the sessions routed through it fail over."""

    def assignments_in_use(self) -> Collection[str]:
        """The assignment ids of every stage a live generation runs on."""

    def work(self) -> Mapping[str, RouteWork]:
        """The live generations' work, by the assignment id of their route's first stage."""


class NoSessions:
    """No origin: no session to fail over, no stage in use."""

    def route_lost(self, address: str) -> None:
        pass

    def assignments_in_use(self) -> Collection[str]:
        return frozenset()

    def work(self) -> Mapping[str, RouteWork]:
        return {}


class ControlEvents:
    """Carries the data plane's reports of unreachable Stage addresses from the origin to the roster, and the rests
    agents' owners ask for from the deployer to the drainer. Made first and given to each, it lets the origin be
    built before the deployer that takes it as its sessions, and the drainer after the deployer it drives."""

    def __init__(self) -> None:
        self._unreachable: list[Callable[[str], None]] = []
        self._rest: list[Callable[[str, str], None]] = []

    def on_unreachable(self, listener: Callable[[str], None]) -> None:
        """Calls listener with every address reported unreachable from now on."""
        self._unreachable.append(listener)

    def report_unreachable(self, address: str) -> None:
        """A generation could not reach this Stage address."""
        for listener in self._unreachable:
            listener(address)

    def on_rest(self, listener: Callable[[str, str], None]) -> None:
        """Calls listener(agent id, why) with every rest the owner's limits ask for from now on."""
        self._rest.append(listener)

    def rest_asked(self, agent_id: str, why: str) -> None:
        """An agent's owner's limits want it resting: its stages move off it (the Drainer's business)."""
        for listener in self._rest:
            listener(agent_id, why)
