"""A last stage's token picks: greedy rows by one argmax, sampled rows by one sample_rows() where the logits are,
keyed by (seed, position)."""

from __future__ import annotations

import torch

from stratamesh.agent.engine.scheduler import ScheduledChunk
from stratamesh.agent.engine.sequence import WorkItem
from stratamesh.agent.engine.stage_runner import Picking, _pick
from stratamesh.fleet.sessions import SamplingParams
from stratamesh.kernels.ops.sampler import sample


def decode_chunk(session_id: str, position: int) -> ScheduledChunk:
    return ScheduledChunk(session_id, WorkItem(session_id, position, (7,), True), 0, 1, position, [0], True, True)


def test_a_batch_of_greedy_and_sampled_rows_picks_what_each_row_alone_would() -> None:
    torch.manual_seed(3)
    logits = torch.randn(5, 50)
    chunks = [decode_chunk(f"s{i}", 10 + i) for i in range(5)]
    sampling = {"s0": SamplingParams(), "s1": SamplingParams(temperature=0.8, seed=1),
                "s2": SamplingParams(temperature=1.0, top_k=5, seed=2), "s3": SamplingParams(),
                "s4": SamplingParams(temperature=0.7, top_p=0.9, seed=4)}
    picks = _pick(chunks, logits, Picking(sampling))
    # the new token's position is the chunk's end: each sampled row draws with its own (seed, position)
    assert picks == {c.session_id: sample(logits[i], sampling[c.session_id], c.start_pos + 1)
                     for i, c in enumerate(chunks)}
    assert picks["s0"] == int(logits[0].argmax()) and picks["s3"] == int(logits[3].argmax())
    # and the sampled rows were drawn, not taken greedily
    assert any(picks[s] != int(logits[i].argmax()) for i, s in ((1, "s1"), (2, "s2"), (4, "s4")))
