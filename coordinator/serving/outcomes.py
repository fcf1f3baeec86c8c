"""How an attempt of a request ended: values the attempt loop matches on, never raised."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from stratamesh.fleet.sessions import Hop


@dataclass(frozen=True, slots=True)
class Done:
    """The session ended: its last token (max_tokens, a stop token) or, for an embedding, its vector came."""


@dataclass(frozen=True, slots=True)
class Preempted:
    """A stage ran out of KV blocks for the session: the request replays the attempt after a pause."""


@dataclass(frozen=True, slots=True)
class RouteLost:
    """A stage of the route could not be reached (or its agent was declared dead): the request resumes on a route
    that avoids it."""

    address: str
    detail: str

    def __str__(self) -> str:
        return f"{self.address}: {self.detail}"


@dataclass(frozen=True, slots=True)
class HandOff:
    """A prefill's hand-off: the KV move (bytes pulled) to the route that decodes the session, and that route."""

    move: asyncio.Task[int]
    to: tuple[Hop, ...]


@dataclass(frozen=True, slots=True)
class Moved:
    """The session stopped, quiet on every stage of route, to move off a draining stage (or, with hand_off, off the
    route that prefilled it): the next attempt resumes it, KV and all, on its new route."""

    session_id: str
    route: tuple[Hop, ...]
    hand_off: HandOff | None = None


Outcome = Done | Preempted | RouteLost | Moved
