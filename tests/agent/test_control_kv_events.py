"""The agent's KV event reports to the coordinator's router: cut into messages of a bounded number of hashes."""

from __future__ import annotations

from stratamesh.agent.control import _messages
from stratamesh.fleet.kv import KvEvents


def h(i: int) -> bytes:
    return i.to_bytes(16, "big")


def test_a_report_too_big_for_one_message_is_cut_in_pieces_of_which_only_the_first_clears() -> None:
    whole = KvEvents("s1", 16, True, tuple(h(i) for i in range(5)))
    small = KvEvents("s2", 16, False, (h(10),), (h(11),))
    messages = _messages([whole, small], max_hashes=2)
    assert [[(r.assignment_id, r.cleared, len(r.stored), len(r.evicted)) for r in m] for m in messages] == [
        [("s1", True, 2, 0)], [("s1", False, 2, 0)], [("s1", False, 1, 0), ("s2", False, 1, 0)], [("s2", False, 0, 1)]]
    assert [x for m in messages for r in m if r.assignment_id == "s1" for x in r.stored] == list(whole.stored)


def test_an_empty_clearing_report_is_still_sent() -> None:
    assert _messages([KvEvents("s", 16, True, ())]) == [[KvEvents("s", 16, True, ())]]
    assert _messages([]) == []
