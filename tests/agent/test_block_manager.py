"""BlockManager: ref counts, the chained-hash prefix cache, LRU eviction, truncate, capacity."""

from __future__ import annotations

import subprocess
import sys

import pytest

from stratamesh.agent.engine.block_manager import BlockManager, NoFreeBlocks
from stratamesh.fleet.prefix import ROOT_HASH, block_hashes, chain_hash
from stratamesh.fleet.errors import InvalidInput, MeshError

BS = 4


def run_session(bm: BlockManager, seq_id: str, tokens: list[int], max_cached: int = 1 << 30) -> int:
    """Opens, computes all of tokens and commits, as a stage would; returns the cached tokens at open."""
    cached = bm.open(seq_id, tokens, max_cached)
    bm.reserve(seq_id, len(tokens))
    bm.commit(seq_id, tokens, len(tokens))
    return cached


def refs(bm: BlockManager, table: list[int]) -> list[int]:
    return [bm.blocks[b].ref_count for b in table]


def test_chain_hash_is_fixed_across_processes() -> None:
    assert chain_hash(ROOT_HASH, [1, 2, 3, 4]).hex() == "087a24230771ee662be37e5493b333d7"
    code = ("from stratamesh.fleet.prefix import chain_hash;"
            "print(chain_hash(chain_hash(b'', [1, 2, 3, 4]), [5, 6, 7, 8]).hex())")
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={"PYTHONHASHSEED": "123"})
    assert other.stdout.strip() == chain_hash(chain_hash(ROOT_HASH, [1, 2, 3, 4]), [5, 6, 7, 8]).hex()


def test_chain_hash_depends_on_parent_and_tokens() -> None:
    a = chain_hash(ROOT_HASH, [1, 2, 3, 4])
    assert chain_hash(a, [5, 6, 7, 8]) != chain_hash(ROOT_HASH, [5, 6, 7, 8])
    assert chain_hash(ROOT_HASH, [1, 2, 3, 5]) != a
    assert chain_hash(ROOT_HASH, [256]) != chain_hash(ROOT_HASH, [1])


def test_prefix_hit_after_a_session_with_the_same_prefix_closes() -> None:
    bm = BlockManager(8, BS)
    prompt = list(range(10))                        # 2 full blocks + 2 tokens
    assert run_session(bm, "a", prompt) == 0
    bm.free("a")
    assert bm.match_prefix(prompt) == 8
    assert bm.match_prefix(prompt[:7]) == 4
    assert bm.match_prefix(list(range(8)) + [99, 99, 99, 99]) == 8
    assert bm.match_prefix([0, 1, 2, 99]) == 0
    assert bm.open("b", prompt, 100) == 8
    assert bm.num_prefix_hit_tokens == 8 and bm.num_prefix_queries_tokens == 20


def test_same_block_content_at_a_different_prefix_does_not_hit() -> None:
    bm = BlockManager(8, BS)
    run_session(bm, "a", [1, 2, 3, 4, 5, 6, 7, 8])
    assert bm.match_prefix([5, 6, 7, 8]) == 0
    assert bm.match_prefix([9, 9, 9, 9, 5, 6, 7, 8]) == 0
    assert bm.match_prefix([1, 2, 3, 4, 5, 6, 7, 8]) == 8


def test_match_prefix_is_a_pure_query() -> None:
    bm = BlockManager(4, BS)
    run_session(bm, "a", list(range(8)))
    bm.free("a")
    before = (bm.num_free_blocks, list(bm.evictable), bm.num_prefix_queries_tokens)
    assert bm.match_prefix(list(range(8))) == 8
    assert (bm.num_free_blocks, list(bm.evictable), bm.num_prefix_queries_tokens) == before


def test_ref_counts_of_a_shared_prefix() -> None:
    bm = BlockManager(8, BS)
    run_session(bm, "a", list(range(8)))
    shared = bm.block_table("a")
    assert bm.open("b", list(range(8)) + [50, 51], 8) == 8
    assert bm.open("c", list(range(8)), 7) == 4         # rounded down to whole blocks
    assert refs(bm, shared) == [3, 2]
    assert bm.block_table("b") == shared and bm.block_table("c") == shared[:1]
    table_b = bm.reserve("b", 10)
    assert table_b[:2] == shared and refs(bm, table_b[2:]) == [1]
    bm.free("a")
    assert refs(bm, shared) == [2, 1]
    bm.free("b")
    bm.free("c")
    assert refs(bm, shared) == [0, 0] and bm.num_free_blocks == 8 and bm.usage == 0.0


def test_usage_and_free_blocks() -> None:
    bm = BlockManager(4, BS)
    assert bm.num_free_blocks == 4 and bm.usage == 0.0
    bm.open("a", [], 0)
    assert bm.reserve("a", 5) == [0, 1]
    assert bm.num_free_blocks == 2 and bm.usage == 0.5
    assert bm.reserve("a", 8) == [0, 1]                 # already has the slots
    assert bm.reserve("a", 9) == [0, 1, 2] and bm.usage == 0.75


def test_lru_eviction_takes_never_hashed_blocks_first_then_the_oldest_release() -> None:
    bm = BlockManager(5, BS)
    run_session(bm, "a", [1] * 4)
    run_session(bm, "b", [2] * 4)
    run_session(bm, "c", [3] * 4)
    bm.free("b")
    bm.free("a")
    bm.free("c")                                        # LRU order: b, a, c
    bm.open("x", [], 0)
    bm.reserve("x", 8)                                  # the 2 never-hashed blocks
    assert [bm.match_prefix([t] * 4) for t in (1, 2, 3)] == [4, 4, 4]
    bm.reserve("x", 12)
    assert [bm.match_prefix([t] * 4) for t in (1, 2, 3)] == [4, 0, 4]
    bm.reserve("x", 16)
    assert [bm.match_prefix([t] * 4) for t in (1, 2, 3)] == [0, 0, 4]


def test_pinning_takes_a_cached_block_out_of_the_lru() -> None:
    bm = BlockManager(2, BS)
    run_session(bm, "a", [1] * 4)
    bm.free("a")
    assert bm.open("b", [1] * 4 + [2], 4) == 4
    bm.open("c", [], 0)
    bm.reserve("c", 4)
    assert not bm.can_reserve("c", 8)                   # the pinned block is not evictable
    assert bm.match_prefix([1] * 4) == 4


def test_free_releases_the_tail_first_so_the_prefix_is_evicted_last() -> None:
    bm = BlockManager(3, BS)
    tokens = list(range(12))
    run_session(bm, "a", tokens)
    bm.free("a")
    bm.open("x", [], 0)
    bm.reserve("x", 4)
    assert bm.match_prefix(tokens) == 8


def test_commit_caches_only_full_blocks_and_only_once() -> None:
    bm = BlockManager(8, BS)
    bm.open("a", [], 0)
    bm.reserve("a", 7)
    bm.commit("a", list(range(7)), 3)
    assert bm.match_prefix(list(range(7))) == 0
    bm.commit("a", list(range(7)), 7)
    assert bm.match_prefix(list(range(8))) == 4
    bm.open("b", [], 0)                                 # same content computed concurrently
    bm.reserve("b", 4)
    bm.commit("b", list(range(4)), 4)
    bm.free("b")
    assert bm.match_prefix(list(range(4))) == 4
    assert len(bm.evictable) == 0 and len(bm.free_ids) == 6   # b's duplicate block is freed plain


def test_truncate_releases_blocks_beyond_the_kept_tokens() -> None:
    bm = BlockManager(8, BS)
    run_session(bm, "a", list(range(12)))
    table = bm.block_table("a")
    bm.free("a")
    assert bm.open("b", list(range(13)), 12) == 12
    bm.truncate("b", 4)
    assert bm.block_table("b") == table[:1] and refs(bm, table) == [1, 0, 0]
    assert bm.match_prefix(list(range(12))) == 12       # released blocks stay cached
    bm.truncate("b", 0)
    assert bm.block_table("b") == [] and bm.num_free_blocks == 8


def test_truncate_into_a_block_uncaches_it_unless_shared() -> None:
    bm = BlockManager(8, BS)
    run_session(bm, "a", list(range(8)))
    bm.free("a")
    bm.open("b", list(range(9)), 8)
    bm.truncate("b", 6)                                 # b alone holds block 1: it stops being cached
    assert bm.match_prefix(list(range(8))) == 4
    bm.open("c", list(range(9)), 4)
    bm.open("d", list(range(9)), 4)
    with pytest.raises(InvalidInput, match="start_pos 2"):
        bm.truncate("c", 2)
    assert bm.block_table("c") == bm.block_table("d")   # nothing changed


def test_capacity_is_checked_and_a_blind_reserve_raises() -> None:
    bm = BlockManager(2, BS)
    bm.open("a", [], 0)
    assert bm.can_reserve("a", 8) and not bm.can_reserve("a", 9)
    with pytest.raises(NoFreeBlocks) as err:
        bm.reserve("a", 9)
    assert isinstance(err.value, MeshError)
    assert bm.block_table("a") == [] and bm.num_free_blocks == 2


def test_disabled_cache_never_matches() -> None:
    bm = BlockManager(4, BS, enable_prefix_cache=False)
    assert run_session(bm, "a", list(range(8))) == 0
    bm.free("a")
    assert bm.match_prefix(list(range(8))) == 0
    assert bm.open("b", list(range(8)), 8) == 0
    assert not bm.hash_to_block and not bm.evictable and bm.num_free_blocks == 4


# ------------------------------------------------------------------ KV events, for the coordinator's router
def test_kv_events_report_what_the_cache_gained_and_lost_since_the_last_report() -> None:
    bm = BlockManager(3, BS)
    first = bm.take_kv_events("s1")
    assert first is not None and first.cleared and first.stored == () and first.assignment_id == "s1"
    assert bm.take_kv_events("s1") is None                       # nothing changed since
    run_session(bm, "a", [1] * 8)
    a = block_hashes([1] * 8, BS)
    report = bm.take_kv_events("s1")
    assert (report.cleared, set(report.stored), report.evicted, report.block_size) == (False, set(a), (), BS)
    bm.free("a")                                                 # freed but still cached: no change
    assert bm.take_kv_events("s1") is None
    run_session(bm, "b", [2] * 8)                                # needs 2 blocks: the older of a's is evicted
    b = block_hashes([2] * 8, BS)
    report = bm.take_kv_events("s1")
    assert set(report.stored) == set(b) and set(report.evicted) <= set(a) and report.evicted
    assert set(bm.hash_to_block) == (set(a) - set(report.evicted)) | set(b)


def test_a_hash_cached_and_evicted_between_two_reports_is_reported_as_it_is_now() -> None:
    bm = BlockManager(1, BS)
    bm.take_kv_events("s")
    run_session(bm, "a", [1] * 4)
    bm.free("a")
    run_session(bm, "b", [2] * 4)                                # evicts a's block before anyone heard of it
    report = bm.take_kv_events("s")
    assert report.stored == tuple(block_hashes([2] * 4, BS)) and report.evicted == tuple(block_hashes([1] * 4, BS))


def test_kv_events_start_over_after_resend_all_or_too_many_changes(monkeypatch: pytest.MonkeyPatch) -> None:
    bm = BlockManager(8, BS)
    bm.take_kv_events("s")
    run_session(bm, "a", [1] * 8)
    bm.resend_all_kv()                                           # e.g. a new control stream: its coordinator knows nothing
    report = bm.take_kv_events("s")
    assert report.cleared and set(report.stored) == set(block_hashes([1] * 8, BS))
    monkeypatch.setattr("stratamesh.agent.engine.block_manager.MAX_PENDING_KV_CHANGES", 2)
    run_session(bm, "b", [2] * 12)                               # 3 changes pile up, more than are kept
    report = bm.take_kv_events("s")
    assert report.cleared and set(report.stored) == set(bm.hash_to_block) and len(report.stored) == 5


def test_a_disabled_prefix_cache_reports_no_kv_events() -> None:
    bm = BlockManager(4, BS, enable_prefix_cache=False)
    run_session(bm, "a", [1] * 8)
    assert bm.take_kv_events("s") is None
