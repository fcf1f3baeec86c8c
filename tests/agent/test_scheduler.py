"""Scheduler: decode first, chunked prefill under a token budget, FCFS, preemption, open/trim, properties."""

from __future__ import annotations

import ast
import random
import sys
from pathlib import Path

import pytest

from stratamesh.agent.engine.block_manager import BlockManager
from stratamesh.agent.engine.scheduler import Batch, Scheduler
from stratamesh.agent.engine.sequence import WorkItem
from stratamesh.fleet.errors import InvalidInput

BS = 4
ENGINE = Path(__file__).resolve().parents[2] / "agent" / "engine"
PURE = ("block_manager.py", "scheduler.py", "sequence.py")
ALLOWED = {"stratamesh.fleet.stages", "stratamesh.fleet.sessions", "stratamesh.fleet.kv", "stratamesh.fleet.errors",
           "stratamesh.fleet.prefix", "stratamesh.agent.engine.block_manager", "stratamesh.agent.engine.scheduler",
           "stratamesh.agent.engine.sequence"}


def make(num_blocks: int = 64, max_batch_tokens: int = 1024, max_batch_seqs: int = 64) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, BS), max_batch_tokens, max_batch_seqs)


def item(sid: str, start: int, tokens: list[int] | range, sample: bool = True) -> WorkItem:
    return WorkItem(sid, start, tuple(tokens), sample, step=0, payload=None)


def step(s: Scheduler) -> Batch | None:
    batch = s.schedule()
    if batch is not None:
        s.postprocess(batch)
    return batch


def spans(batch: Batch) -> list[tuple[str, int, int, bool]]:
    return [(c.session_id, c.start_pos, c.num_tokens, c.sample) for c in batch.chunks]


def prefilled(s: Scheduler, sid: str, prompt: list[int]) -> None:
    """Opens sid and runs its whole prompt alone, so that its next item is a decode."""
    start = s.open(sid, prompt, 0)
    s.add(item(sid, start, prompt[start:]))
    while s.sessions[sid].queue:
        step(s)


@pytest.mark.parametrize("name", PURE)
def test_engine_core_imports_only_stdlib_and_fleet_values(name: str) -> None:
    tree = ast.parse((ENGINE / name).read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            modules = [node.module or ""]
        else:
            continue
        for module in modules:
            top = module.split(".")[0]
            assert module in ALLOWED or (top in sys.stdlib_module_names and top != "time"), module


def test_decodes_go_first_then_prefills_in_arrival_order() -> None:
    s = make()
    prefilled(s, "d1", [1] * 6)
    prefilled(s, "d2", [2] * 6)
    s.open("p1", [3] * 5, 0)
    s.open("p2", [4] * 3, 0)
    s.add(item("p2", 0, [4] * 3))
    s.add(item("d2", 6, [7]))
    s.add(item("p1", 0, [3] * 5))
    s.add(item("d1", 6, [8]))
    batch = step(s)
    assert spans(batch) == [("d2", 6, 1, True), ("d1", 6, 1, True), ("p2", 0, 3, True), ("p1", 0, 5, True)]
    assert batch.preempted == [] and not s.has_work and step(s) is None


def test_token_budget_splits_the_last_prefill_and_the_rest_runs_next_step() -> None:
    s = make(max_batch_tokens=8)
    s.open("a", list(range(6)), 0)
    s.open("b", list(range(10)), 0)
    s.add(item("a", 0, range(6)))
    s.add(item("b", 0, range(10)))
    first = step(s)
    assert spans(first) == [("a", 0, 6, True), ("b", 0, 2, False)]
    assert (first.chunks[1].begin, first.chunks[1].end) == (0, 2)
    second = step(s)
    assert spans(second) == [("b", 2, 8, True)]
    assert (second.chunks[0].begin, second.chunks[0].end) == (2, 10)
    assert s.sessions["b"].num_computed == 10 and step(s) is None


def test_sample_flag_is_false_for_an_item_that_does_not_ask() -> None:
    s = make(max_batch_tokens=4)
    s.open("a", list(range(6)), 0)
    s.add(item("a", 0, range(6), sample=False))
    assert [c.sample for b in (step(s), step(s)) for c in b.chunks] == [False, False]


def test_one_chunk_per_session_per_batch() -> None:
    s = make()
    s.open("a", list(range(8)), 0)
    s.add(item("a", 0, range(4), sample=False))
    s.add(item("a", 4, range(4, 8)))
    assert spans(step(s)) == [("a", 0, 4, False)]
    assert spans(step(s)) == [("a", 4, 4, True)]


def test_max_batch_seqs_caps_sessions_and_fcfs_keeps_the_rest() -> None:
    s = make(max_batch_seqs=2)
    for sid in "abc":
        s.open(sid, [1, 2], 0)
    for sid in "cab":
        s.add(item(sid, 0, [1, 2]))
    assert [c.session_id for c in step(s).chunks] == ["c", "a"]
    assert [c.session_id for c in step(s).chunks] == ["b"]


def test_every_chunk_carries_slots_for_its_positions() -> None:
    s = make()
    s.open("a", list(range(9)), 0)
    s.add(item("a", 0, range(9)))
    chunk = step(s).chunks[0]
    assert len(chunk.block_table) == 3
    s.add(item("a", 9, [5]))
    chunk = step(s).chunks[0]
    assert len(chunk.block_table) == 3 and chunk.start_pos == 9


def test_a_decode_without_blocks_preempts_the_newest_other_session() -> None:
    s = make(num_blocks=6)
    prefilled(s, "old", [1] * 8)                         # 2 blocks each, full; none left
    prefilled(s, "mid", [2] * 8)
    prefilled(s, "new", [3] * 8)
    s.add(item("old", 8, [9]))
    batch = step(s)
    assert spans(batch) == [("old", 8, 1, True)]
    assert batch.preempted == ["new"] and s.num_running == 2
    assert step(s) is None                               # reported once
    with pytest.raises(InvalidInput, match="preempted"):
        s.add(item("new", 8, [9]))
    s.close("new")
    assert s.open("new", [3] * 8, 100) == 4              # old evicted only new's tail block


def test_a_victim_already_in_the_batch_is_spared() -> None:
    s = make(num_blocks=4)
    prefilled(s, "old", [1] * 8)
    prefilled(s, "new", [2] * 8)
    s.add(item("new", 8, [9]))
    s.add(item("old", 8, [9]))
    batch = step(s)
    assert spans(batch) == [("new", 8, 1, True)] and batch.preempted == ["old"]


def test_a_decode_with_no_victim_preempts_itself_and_drops_its_items() -> None:
    s = make(num_blocks=2)
    prefilled(s, "a", [1] * 8)
    s.add(item("a", 8, [9]))
    batch = step(s)
    assert batch.chunks == [] and batch.preempted == ["a"]
    assert s.num_sessions == 0 and s.block_manager.num_free_blocks == 2 and not s.has_work


def test_a_prefill_without_blocks_waits_and_holds_back_later_prefills() -> None:
    s = make(num_blocks=4)
    prefilled(s, "a", [1] * 8)
    s.open("b", [2] * 12, 0)
    s.open("c", [3] * 2, 0)
    s.add(item("b", 0, [2] * 12))
    s.add(item("c", 0, [3] * 2))
    assert s.schedule() is None
    assert s.num_waiting == 2 and s.num_sessions == 3 and s.has_work
    s.close("a")
    assert [c.session_id for c in step(s).chunks] == ["b", "c"]


def test_prefills_that_wait_on_each_other_preempt_the_newest() -> None:
    s = make(num_blocks=4, max_batch_tokens=8)
    for sid in "ab":
        s.open(sid, [ord(sid)] * 16, 0)
        s.add(item(sid, 0, [ord(sid)] * 8, sample=False))
    assert spans(step(s)) == [("a", 0, 8, False)]
    assert spans(step(s)) == [("b", 0, 8, False)]        # now every block is taken
    for sid in "ab":
        s.add(item(sid, 8, [ord(sid)] * 8))
    batch = step(s)
    assert batch.chunks == [] and batch.preempted == ["b"]
    assert spans(step(s)) == [("a", 8, 8, True)]


def test_a_prefill_larger_than_the_whole_cache_preempts_itself() -> None:
    s = make(num_blocks=2)
    s.open("a", [1] * 12, 0)
    s.add(item("a", 0, [1] * 12))
    assert s.schedule() == Batch([], ["a"])


def test_open_pins_the_cached_prefix_and_the_first_chunk_trims_it() -> None:
    s = make()
    prompt = list(range(13))
    prefilled(s, "a", prompt)
    s.close("a")
    assert s.open("b", prompt, 100) == 12
    assert s.open("c", prompt[:12], 100) == 8           # at least one prompt token is computed
    assert s.open("d", prompt[:3], 100) == 0
    assert s.open("e", prompt, 5) == 4
    s.add(item("b", 4, prompt[4:]))                     # the origin settled on 4 (another stage had less)
    assert len(s.block_manager.block_table("b")) == 1
    assert spans(step(s)) == [("b", 4, 9, True)]
    assert len(s.block_manager.block_table("b")) == 4


@pytest.mark.parametrize("bad, field", [
    (item("x", 0, [1]), "session_id"),
    (item("a", 5, [4, 5, 6, 7]), "start_pos"),
    (item("a", 0, [9, 9]), "token_ids"),
    (item("a", 0, []), "token_ids"),
])
def test_add_rejects_bad_items_naming_the_field(bad: WorkItem, field: str) -> None:
    s = make()
    prefilled(s, "p", list(range(9)))
    s.close("p")
    assert s.open("a", list(range(9)), 5) == 4
    with pytest.raises(InvalidInput, match=field):
        s.add(bad)
    s.add(item("a", 4, range(4, 9)))
    with pytest.raises(InvalidInput, match="start_pos 4 .* expected 9"):
        s.add(item("a", 4, range(4, 9)))


def test_open_rejects_a_duplicate_or_empty_prompt() -> None:
    s = make()
    s.open("a", [1], 0)
    with pytest.raises(InvalidInput, match="session_id"):
        s.open("a", [1], 0)
    with pytest.raises(InvalidInput, match="prompt_token_ids"):
        s.open("b", [], 0)


# ---------------------------------------------------------------- random operations
def random_run(seed: int) -> list[Batch]:
    """Random opens, items, steps and closes on a small cache, checking invariants after each step."""
    rng = random.Random(seed)
    s = make(num_blocks=12, max_batch_tokens=rng.choice([3, 8, 32]), max_batch_seqs=rng.choice([2, 4]))
    prompts: dict[str, list[int]] = {}
    batches: list[Batch] = []
    for n in range(300):
        op = rng.random()
        live = sorted(set(prompts) & set(s.sessions))
        if op < 0.15 and len(prompts) < 8:
            sid = f"s{n}"
            base = rng.choice([[1] * 16, list(range(16))])     # shared prefixes, then a random tail
            prompts[sid] = base[:rng.randrange(14)] + [rng.randrange(3) for _ in range(rng.randrange(1, 5))]
            s.open(sid, prompts[sid], rng.randrange(16))
        elif op < 0.45 and live:
            feed(s, rng, rng.choice(live), prompts)
        elif op < 0.52 and prompts:
            sid = rng.choice(sorted(prompts))
            s.close(sid)
            del prompts[sid]
        else:
            batch = s.schedule()
            if batch is not None:
                check(s, batch)
                s.postprocess(batch)
                batches.append(batch)
    return batches


def feed(s: Scheduler, rng: random.Random, sid: str, prompts: dict[str, list[int]]) -> None:
    """Adds the session's next item: the rest of its prompt in random pieces, then one-token decodes."""
    session = s.sessions[sid]
    start = session.next_pos
    if start is None:   # the origin's choice: usually the pinned count, sometimes less (or mid-block)
        start = rng.choice([session.num_computed, session.num_computed // BS * BS - BS, rng.randrange(BS)])
        start = max(0, min(start, session.num_computed))
    if start < len(prompts[sid]):
        end = rng.randrange(start + 1, len(prompts[sid]) + 1)
        try:
            s.add(item(sid, start, prompts[sid][start:end], sample=end == len(prompts[sid])))
        except InvalidInput as err:  # mid-block into a block another live session shares
            assert "splits a cached block" in str(err) and session.next_pos is None
    else:
        s.add(item(sid, start, [rng.randrange(3)]))


def check(s: Scheduler, batch: Batch) -> None:
    bm = s.block_manager
    assert len({c.session_id for c in batch.chunks}) == len(batch.chunks)
    assert sum(c.num_tokens for c in batch.chunks) <= s.max_batch_tokens
    assert len(batch.chunks) <= s.max_batch_seqs
    for c in batch.chunks:
        assert len(c.block_table) * BS >= c.start_pos + c.num_tokens
        assert c.block_table == bm.block_table(c.session_id)
    owners: dict[int, list[str]] = {}
    for sid, table in bm.tables.items():
        for b in table:
            owners.setdefault(b, []).append(sid)
    for b, sids in owners.items():
        assert bm.blocks[b].ref_count == len(sids)
        assert len(sids) == 1 or bm.blocks[b].hash is not None, (b, sids)
    used = sum(1 for blk in bm.blocks if blk.ref_count > 0)
    assert used + bm.num_free_blocks == bm.num_blocks
    assert set(bm.tables) == set(s.sessions)


@pytest.mark.parametrize("seed", range(25))
def test_random_operations_keep_invariants_and_are_deterministic(seed: int) -> None:
    first, again = random_run(seed), random_run(seed)
    assert first and repr(first) == repr(again)


def test_a_pipeline_of_depth_k_decodes_a_kth_of_its_sessions_per_step() -> None:
    """With K stages, the first stage sends K micro-batches around so every stage has one to work on."""
    sched = Scheduler(BlockManager(num_blocks=64, block_size=4), max_batch_tokens=64, max_batch_seqs=64)
    sched.pipeline_depth = 3
    for i in range(7):
        sched.open(f"s{i}", [1, 2, 3], 0)
        sched.add(WorkItem(f"s{i}", 0, (1, 2, 3), True, 0))
    prefill = sched.schedule()
    assert len(prefill.chunks) == 7                 # prefills are not capped
    sched.postprocess(prefill)
    for i in range(7):
        sched.add(WorkItem(f"s{i}", 3, (9,), True, 1))
    sizes = []
    while (batch := sched.schedule()) is not None:
        sizes.append(len(batch.chunks))
        sched.postprocess(batch)
    assert sizes == [3, 3, 1]                       # ceil(7 / 3) decodes per step
    sched.pipeline_depth = 1
    for i in range(7):
        sched.add(WorkItem(f"s{i}", 4, (9,), True, 2))
    assert len(sched.schedule().chunks) == 7


def test_more_micro_batches_than_stages_split_the_decodes_finer() -> None:
    """Across a long link the first stage circulates more micro-batches than it has stages (micro_batches.py)."""
    sched = Scheduler(BlockManager(num_blocks=64, block_size=4), max_batch_tokens=64, max_batch_seqs=64)
    sched.pipeline_depth, sched.micro_batches = 2, 4
    for i in range(8):
        sched.open(f"s{i}", [1, 2, 3], 0)
        sched.add(WorkItem(f"s{i}", 0, (1, 2, 3), True, 0))
    sched.postprocess(sched.schedule())
    for i in range(8):
        sched.add(WorkItem(f"s{i}", 3, (9,), True, 1))
    assert sched.num_decoding == 8
    assert len(sched.schedule().chunks) == 2         # 8 sessions in 4 micro-batches


def test_resume_renames_a_quiet_session_keeping_its_blocks_and_decodes_go_on() -> None:
    s = make()
    prompt = list(range(10))
    prefilled(s, "old", prompt)
    s.add(item("old", 10, [7]))                 # one decode: 11 positions computed
    step(s)
    blocks = s.block_manager.block_table("old")
    history = prompt + [7, 8]                   # 8: the token sampled last, not yet computed
    assert s.resume("old", "new", history, max_cached_tokens=11) == 11
    assert "old" not in s.sessions and "old" not in s.block_manager.tables
    assert s.block_manager.block_table("new") == blocks
    s.add(item("new", 11, [8]))
    assert spans(step(s)) == [("new", 11, 1, True)]
    assert step(s) is None and s.sessions["new"].num_computed == 12
    assert step(s) is None


@pytest.mark.parametrize("history, queued, why", [
    (list(range(10)) + [7], False, "nothing new to run"),
    ([99] + list(range(1, 10)) + [7, 8], False, "tokens differ"),
    (list(range(10)) + [7, 8], True, "work queued"),
])
def test_a_session_that_cannot_resume_is_closed_and_none_returned(history, queued, why) -> None:
    s = make()
    prefilled(s, "old", list(range(10)))
    s.add(item("old", 10, [7]))
    step(s)
    if queued:
        s.add(item("old", 11, [8]))
    free = s.block_manager.num_free_blocks
    assert s.resume("old", "new", history, 11) is None, why
    assert "old" not in s.sessions and "new" not in s.sessions
    assert s.block_manager.num_free_blocks > free
    assert s.resume("absent", "new", history, 11) is None


def test_resume_caps_the_cached_tokens_so_a_shorter_peer_truncates_on_the_first_item() -> None:
    s = make()
    prefilled(s, "old", list(range(10)))
    assert s.resume("old", "new", list(range(12)), max_cached_tokens=4) == 4
    s.add(item("new", 4, range(4, 12)))         # the stage before had only 4 positions
    assert spans(step(s)) == [("new", 4, 8, True)]


def test_an_imported_session_holds_its_blocks_caches_full_ones_and_decodes_next() -> None:
    s = make()
    written: list[list[int]] = []
    tokens = list(range(10))
    s.import_session("moved", tokens, prompt_len=6, num_computed=9, write=written.append)
    assert written == [s.block_manager.block_table("moved")] and len(written[0]) == 3
    assert s.block_manager.match_prefix(tokens) == 8     # its two full blocks are in the prefix cache
    session = s.quiet("moved")
    assert session.num_computed == 9 and session.prompt_len == 6
    s.add(item("moved", 9, [9]))
    batch = step(s)
    assert spans(batch) == [("moved", 9, 1, True)] and batch.chunks[0].is_decode


def test_an_import_that_fails_to_write_or_fit_leaves_no_blocks_held() -> None:
    s = make(num_blocks=2)

    def broken(table: list[int]) -> None:
        raise RuntimeError("device gone")

    with pytest.raises(RuntimeError):
        s.import_session("a", list(range(6)), 3, 6, broken)
    assert s.block_manager.num_free_blocks == 2 and "a" not in s.sessions
    with pytest.raises(Exception, match="needs 3 blocks"):
        s.import_session("b", list(range(12)), 3, 12, lambda table: None)
    assert s.block_manager.num_free_blocks == 2 and "b" not in s.block_manager.tables
    with pytest.raises(InvalidInput, match="prompt_len"):
        s.import_session("c", [1, 2], 3, 1, lambda table: None)


def test_quiet_refuses_a_session_with_work_queued() -> None:
    s = make()
    s.open("a", [1, 2, 3], 0)
    assert s.quiet("a").num_computed == 0
    s.add(item("a", 0, [1, 2, 3]))
    with pytest.raises(InvalidInput, match="work queued"):
        s.quiet("a")


def drafted(sid: str, start: int, tokens: list[int], num_draft: int) -> WorkItem:
    """A decode step whose last num_draft tokens are drafted (speculative decoding)."""
    return WorkItem(sid, start, tuple(tokens), True, step=0, payload=None, num_draft=num_draft)


def test_a_step_after_drafts_may_start_where_their_verification_ended_and_the_rejected_are_forgotten() -> None:
    s = make(num_blocks=8)
    prefilled(s, "a", list(range(1, 7)))                   # 6 tokens: positions 0..5
    s.add(drafted("a", 6, [50, 51, 52, 53, 54], 4))        # a token, then 4 drafts at 7..10
    (chunk,) = step(s).chunks
    assert (chunk.start_pos, chunk.num_tokens) == (6, 5)   # all at once
    session = s.sessions["a"]
    assert session.num_computed == 11 and session.drafted_from == 7
    # the prefix cache holds the verified blocks only: 6..7 was not verified yet, so block 1 (4..7) is not cached
    assert len(s.block_manager.hashes["a"]) == 1
    s.add(item("a", 9, [60]))                              # two drafts kept (51, 52), 53 and 54 rejected
    assert session.token_ids == [1, 2, 3, 4, 5, 6, 50, 51, 52, 60] and session.num_computed == 9
    assert session.drafted_from is None and len(s.block_manager.tables["a"]) == 3    # 0..11 -> 0..9
    (chunk,) = step(s).chunks
    assert (chunk.start_pos, chunk.num_tokens) == (9, 1) and len(s.block_manager.hashes["a"]) == 2   # 4..7 now


def test_a_step_may_not_start_inside_verified_tokens_nor_rewind_without_drafts() -> None:
    s = make()
    prefilled(s, "a", list(range(1, 7)))
    s.add(drafted("a", 6, [50, 51, 52], 2))
    step(s)
    with pytest.raises(InvalidInput, match="start_pos 6 of session 'a', expected 9"):
        s.add(item("a", 6, [70]))                          # before the drafts: those tokens were verified
    s.add(item("a", 9, [60]))                              # every draft kept
    step(s)
    with pytest.raises(InvalidInput, match="expected 10"):
        s.add(item("a", 9, [61]))                          # no drafts to take back now


def test_drafted_tokens_are_never_split_across_steps() -> None:
    s = make(max_batch_tokens=3)
    prefilled(s, "a", [1, 2, 3])
    prefilled(s, "b", [4, 5, 6])
    s.add(item("b", 3, [7]))
    s.add(drafted("a", 3, [8, 9, 10], 2))
    assert spans(step(s)) == [("b", 3, 1, True)]          # a's three tokens do not fit beside b's: they wait
    assert spans(step(s)) == [("a", 3, 3, True)]


def test_a_refused_chunk_after_drafts_leaves_the_session_as_it_was() -> None:
    s = make()
    prefilled(s, "a", list(range(1, 7)))
    s.add(drafted("a", 6, [50, 51, 52], 2))
    step(s)
    session = s.sessions["a"]
    state = (list(session.token_ids), session.num_computed, session.next_pos, session.drafted_from)
    with pytest.raises(InvalidInput, match="empty"):
        s.add(item("a", 7, []))
    assert (list(session.token_ids), session.num_computed, session.next_pos, session.drafted_from) == state
    s.add(item("a", 8, [60]))                              # the first draft kept, the second rejected
    assert session.token_ids == [1, 2, 3, 4, 5, 6, 50, 51, 60] and session.drafted_from is None


def follower(sid: str, start: int, tokens: list[int], pending_from: int) -> WorkItem:
    """A run that followed another into the pipeline: its first token a guess too, unverified from pending_from."""
    return WorkItem(sid, start, tuple(tokens), True, step=0, payload=None, num_draft=len(tokens) - 1,
                    pending_from=pending_from)


def test_runs_following_unverified_ones_keep_their_drafts_unverified_and_a_rejection_drops_those_queued() -> None:
    s = make(num_blocks=8)
    prefilled(s, "a", list(range(1, 7)))                   # positions 0..5
    s.add(drafted("a", 6, [50, 51, 52], 2))                # 50 verified, drafts at 7..8
    step(s)
    s.add(follower("a", 9, [53, 54, 55], 7))               # follows it in: unverified from 7, still
    session = s.sessions["a"]
    assert session.drafted_from == 7 and session.next_pos == 12
    s.add(follower("a", 12, [56, 57], 7))                  # and another, queued behind it
    assert len(session.queue) == 2
    # the first run's second draft was rejected (the pick at 8 was 60): both followers are dropped here, queued
    dropped = s.reject("a", 8)
    assert [d.start_pos for d in dropped] == [9, 12] and not session.queue and not s.has_work
    assert session.token_ids == [1, 2, 3, 4, 5, 6, 50, 51] and session.next_pos == 8 and session.drafted_from is None
    s.add(item("a", 8, [60]))                              # the next run starts where the rewind said
    assert spans(step(s)) == [("a", 8, 1, True)]
    assert s.reject("a", 9) == []                          # a rewind past what it holds: nothing of it here
    with pytest.raises(InvalidInput, match="would forget verified tokens"):
        s.reject("a", 7)


def test_a_verified_follower_moves_the_verified_frontier_and_the_prefix_cache_takes_only_what_is_verified() -> None:
    s = make(num_blocks=8)
    prefilled(s, "a", list(range(1, 7)))
    s.add(drafted("a", 6, [50, 51], 1))                    # 50 verified, 51 drafted at 7
    step(s)
    s.add(follower("a", 8, [52, 53], 7))                   # 52 guessed at 8, 53 drafted
    step(s)
    assert len(s.block_manager.hashes["a"]) == 1           # 4..7 holds an unverified token (51)
    # the first run was kept whole and 52 was its pick: the next run follows the second, verified up to 9
    s.add(follower("a", 10, [54, 55], 9))
    session = s.sessions["a"]
    assert session.drafted_from == 9
    step(s)
    assert len(s.block_manager.hashes["a"]) == 2           # 4..7 verified now; 8..11 is not (53 at 9)


def test_runs_queued_after_their_loop_ended_are_dropped_before_a_move() -> None:
    s = make(num_blocks=8)
    prefilled(s, "a", list(range(1, 7)))
    s.add(drafted("a", 6, [50, 51], 1))
    step(s)
    s.add(follower("a", 8, [52, 53], 7))
    assert [d.start_pos for d in s.drop_unverified("a")] == [8]
    assert s.quiet("a").token_ids == [1, 2, 3, 4, 5, 6, 50, 51] and s.sessions["a"].num_computed == 8
    s.add(drafted("a", 8, [60, 61], 1))                    # a run of its own (not following): never dropped so
    assert s.drop_unverified("a") == [] and s.sessions["a"].queue
