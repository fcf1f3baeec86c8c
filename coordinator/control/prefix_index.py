"""What the router knows of the prefix caches: the block hashes each stage holds, as its KV events say, and the
prompts it sent to each replica lately, which that replica's stages will hold once their prefill is done."""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

from stratamesh.fleet.kv import KvEvents

# How long a prompt routed to a replica counts as cached there before its stages report it: long enough to
# cover the wait for a prefill behind others, short enough that a prompt that never got there is forgotten.
EXPECTED_FOR_S = 10.0


class PrefixIndex:
    """Per stage (assignment id), the hashes of the KV blocks its prefix cache holds; per replica (plan id), the
    hashes of prompts routed there and not yet reported by its stages."""

    def __init__(self, clock: Callable[[], float]):
        self._clock = clock
        self._cached: dict[str, set[bytes]] = {}
        self._expected: dict[str, dict[bytes, float]] = {}     # plan id -> hash -> until when
        self._plan_of: dict[str, str] = {}                      # assignment id -> the plan it is a stage of

    def apply(self, events: KvEvents) -> None:
        """A stage's report: cleared starts its set over; an evicted block is no longer expected on its replica."""
        cached = self._cached.setdefault(events.assignment_id, set())
        if events.cleared:
            cached.clear()
        cached.difference_update(events.evicted)
        cached.update(events.stored)
        expected = self._expected.get(self._plan_of.get(events.assignment_id, ""))
        if expected:
            for h in events.evicted:
                expected.pop(h, None)

    def expect(self, plan_id: str, assignment_ids: Collection[str], hashes: Sequence[bytes]) -> None:
        """The prompt with these block hashes was just routed to the replica of plan_id (these stages)."""
        until = self._clock() + EXPECTED_FOR_S
        self._plan_of.update((a, plan_id) for a in assignment_ids)
        expected = self._expected.setdefault(plan_id, {})
        for h in hashes:
            expected[h] = until

    def cached_blocks(self, plan_id: str, assignment_ids: Collection[str], hashes: Sequence[bytes],
                      expected: bool = True) -> int:
        """How many leading blocks of the prompt every stage of the replica holds, or (expected) is about to."""
        now = self._clock()
        expected = self._expected.get(plan_id, {}) if expected else {}
        stages = [self._cached.get(a, set()) for a in assignment_ids]
        for i, h in enumerate(hashes):
            if expected.get(h, 0.0) < now and not all(h in cached for cached in stages):
                return i
        return len(hashes)

    def keep(self, plan_ids: Collection[str], assignment_ids: Collection[str]) -> None:
        """Forgets the stages and replicas no longer served, and expectations past their time."""
        now = self._clock()
        self._cached = {a: cached for a, cached in self._cached.items() if a in assignment_ids}
        self._plan_of = {a: p for a, p in self._plan_of.items() if a in assignment_ids}
        self._expected = {p: {h: t for h, t in expected.items() if t >= now}
                          for p, expected in self._expected.items() if p in plan_ids}

    def num_cached(self, assignment_id: str) -> int:
        """How many blocks the stage's prefix cache holds, as its reports say."""
        return len(self._cached.get(assignment_id, ()))
