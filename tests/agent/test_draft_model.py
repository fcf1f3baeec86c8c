"""The draft_model proposer: a draft served as a stage is (paged, batched), whose KV follows what the target kept,
so its guesses are always its own greedy continuation of the session's tokens."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from stratamesh.agent.engine.draft_model import DraftModel
from stratamesh.agent.engine.proposers import Proposers
from stratamesh.fleet.errors import InvalidInput
from stratamesh.fleet.sessions import Speculation
from stratamesh.fleet.stages import StageSpec
from tests.agent.test_dataplane import greedy_reference


@pytest.fixture
def draft_dir(tiny_model) -> Path:
    return tiny_model("llama", num_layers=2, hidden_size=64, intermediate_size=128, seed=3)


def continuation(draft_dir: Path, tokens: list[int], count: int) -> tuple[int, ...]:
    """The draft's greedy continuation of tokens, in one process without paging (the reference)."""
    return tuple(greedy_reference(StageSpec("d", str(draft_dir), 0, 2, 2), tokens, count))


def test_a_draft_guesses_its_greedy_continuation_of_each_session_batched(draft_dir: Path) -> None:
    draft = DraftModel(draft_dir)
    sessions = {"a": ([5, 17, 42, 99, 7], 4), "b": (list(range(30, 70)), 2), "c": ([1], 3)}
    guesses = draft.propose(sessions)
    assert guesses == {s: continuation(draft_dir, tokens, n) for s, (tokens, n) in sessions.items()}


def test_a_sessions_draft_kv_follows_what_the_target_kept(draft_dir: Path) -> None:
    """Turn after turn the target keeps some guesses and picks its own token after them: the draft forgets the
    rejected positions and continues from the target's tokens, as a fresh run over them would."""
    draft = DraftModel(draft_dir)
    tokens = [8, 6, 7, 5, 3, 0, 9]
    for kept, target_pick in ((4, 123), (1, 77), (0, 500), (2, 11), (3, 9)):
        guesses = draft.propose({"s": (tokens, 4)})["s"]
        assert guesses == continuation(draft_dir, tokens, 4), tokens
        # the target keeps `kept` guesses and then picks its own token
        tokens = tokens + list(guesses[:kept]) + [target_pick]
    session = draft.scheduler.sessions["s"]
    assert session.token_ids[:len(tokens) - 1] == tokens[:-1]


def test_a_draft_out_of_kv_blocks_guesses_less_and_starts_afresh_next_time(draft_dir: Path) -> None:
    draft = DraftModel(draft_dir, kv_tokens=32)             # 2 blocks of 16: one session of 20 tokens at a time
    first = draft.propose({"a": (list(range(1, 21)), 3)})
    both = draft.propose({"a": ([*range(1, 21), *first["a"]], 3), "b": (list(range(40, 60)), 3)})
    assert len([s for s, guesses in both.items() if guesses]) == 1      # one was preempted: no guesses this turn
    again = draft.propose({"b": (list(range(40, 60)), 3)})
    assert again["b"] == continuation(draft_dir, list(range(40, 60)), 3)


def test_a_draft_model_must_share_the_targets_tokenizer(draft_dir: Path, tiny_model, tmp_path: Path) -> None:
    target = tiny_model("llama", num_layers=2, hidden_size=64, intermediate_size=128)
    proposers = Proposers(str(target), 1024)
    proposers.open("ok", Speculation("draft_model", 3, model=str(draft_dir)))
    assert proposers.propose({"ok": (Speculation("draft_model", 3, model=str(draft_dir)), [1, 2, 3], 2)})["ok"] \
        == continuation(draft_dir, [1, 2, 3], 2)
    other = Path(shutil.copytree(draft_dir, tmp_path / "other-tokenizer"))
    (other / "tokenizer.json").write_text((other / "tokenizer.json").read_text().replace('"<|im_end|>"', '"<|x|>"'))
    with pytest.raises(InvalidInput, match="share the target's tokenizer"):
        proposers.open("bad", Speculation("draft_model", 3, model=str(other)))
    with pytest.raises(InvalidInput, match="not a folder on this agent"):
        proposers.open("bad", Speculation("draft_model", 3, model=str(tmp_path / "nowhere")))
    untold = Path(shutil.copytree(draft_dir, tmp_path / "no-tokenizer-file"))
    (untold / "tokenizer.json").unlink()         # (a GGUF draft's tokenizer is inside it): the vocabularies must match
    with pytest.raises(InvalidInput, match="has 1024 tokens, the target 2048"):
        Proposers(str(target), 2048).open("bad", Speculation("draft_model", 3, model=str(untold)))
    assert list(proposers.sessions) == ["ok"]
