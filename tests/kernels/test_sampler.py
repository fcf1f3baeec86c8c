"""sample() and sample_rows(): greedy, seeded reproducibility keyed by position, top-k / top-p, the distribution, a
batch of rows of their own settings, and a GPU's draws."""

from __future__ import annotations

import pytest
import torch

from stratamesh.fleet.sessions import SamplingParams
from stratamesh.kernels.ops.sampler import History, processed_logits, sample, sample_rows
from tests.sampling_reference import reference_processed


def logits(seed: int, vocab: int = 500) -> torch.Tensor:
    return torch.randn(vocab, generator=torch.Generator().manual_seed(seed)) * 3


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=1.0, top_k=1, seed=None),
                                    SamplingParams(temperature=5.0, top_p=1e-6, seed=None),
                                    SamplingParams(temperature=1.0, top_k=1, top_p=0.5, seed=3)])
def test_degenerate_settings_are_greedy(params):
    for seed in range(20):
        x = logits(seed)
        assert sample(x, params, position=seed) == int(x.argmax())


def test_seeded_sampling_is_reproducible_and_position_dependent():
    x = logits(0)
    params = SamplingParams(temperature=2.0, seed=1234)
    run = [sample(x, params, position=p) for p in range(64)]
    assert run == [sample(x, params, position=p) for p in range(64)]
    assert sample(x, params, position=40) == run[40]   # a replay from any position
    assert len(set(run)) > 10                          # the position moves the draw
    other_seed = [sample(x, SamplingParams(temperature=2.0, seed=99), position=p) for p in range(64)]
    assert other_seed != run


def test_unseeded_sampling_varies():
    x = logits(0)
    draws = {sample(x, SamplingParams(temperature=2.0), position=0) for _ in range(30)}
    assert len(draws) > 3


def test_top_k_and_top_p_restrict_the_support():
    x = logits(1)
    top5 = set(torch.topk(x, 5).indices.tolist())
    probs = torch.softmax(x, dim=0)
    sorted_probs, order = torch.sort(probs, descending=True)
    nucleus_size = int((torch.cumsum(sorted_probs, 0) - sorted_probs < 0.6).sum())
    nucleus = set(order[:nucleus_size].tolist())
    k_draws = {sample(x, SamplingParams(temperature=1.0, top_k=5, seed=7), position=p) for p in range(300)}
    p_draws = {sample(x, SamplingParams(temperature=1.0, top_p=0.6, seed=7), position=p) for p in range(300)}
    assert k_draws == top5
    assert p_draws == nucleus and nucleus_size > 1


def test_sampled_frequencies_follow_softmax_with_temperature():
    x = torch.tensor([2.0, 1.0, 0.0, -1.0])
    params = SamplingParams(temperature=0.7, seed=2024)
    n = 4000
    counts = torch.bincount(torch.tensor([sample(x, params, position=p) for p in range(n)]), minlength=4)
    expected = torch.softmax(x / 0.7, dim=0) * n
    # chi-square with 3 degrees of freedom; 16.3 is its 0.999 quantile
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 16.3, (counts, expected)


@pytest.mark.parametrize("params", [
    # every row with a top-k (the rows' widest top-k ordered, narrower ones masked), then none with one, then mixed
    [SamplingParams(1.0, top_k=5, seed=1), SamplingParams(0.7, top_k=50, seed=2), SamplingParams(2.0, top_k=1)],
    [SamplingParams(1.0, seed=1), SamplingParams(0.7, top_p=0.8, seed=2), SamplingParams(1.3, top_p=0.3, seed=3)],
    [SamplingParams(1.0, top_k=5, top_p=0.5, seed=4), SamplingParams(0.9, seed=5), SamplingParams(0.5, top_p=0.95)],
])
def test_a_batch_of_rows_draws_what_each_row_alone_draws(params) -> None:
    for trial in range(40):
        x = torch.stack([logits(100 * trial + i) for i in range(len(params))])
        positions = [trial, 3 * trial + 1, 7]
        seeded = [p if p.seed is not None else SamplingParams(p.temperature, p.top_k, p.top_p, seed=trial)
                  for p in params]
        assert sample_rows(x, seeded, positions) == [sample(x[i], p, pos) for i, (p, pos) in
                                                     enumerate(zip(seeded, positions))]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_rows_sampled_on_a_gpu_draw_what_the_cpu_draws() -> None:
    x = torch.randn(16, 32000, generator=torch.Generator().manual_seed(5)) * 3
    params = [SamplingParams(0.8, top_k=(0, 40)[i % 2], top_p=(1.0, 0.9)[i // 8], seed=i) for i in range(16)]
    positions = list(range(100, 116))
    assert sample_rows(x.cuda(), params, positions) == sample_rows(x, params, positions)


# ---------------------------------------------------------------- logits processing (vLLM's order and formulas)

PROCESSING = [
    SamplingParams(logit_bias=((3, 5.0), (40, -100.0), (7, 0.25))),
    SamplingParams(min_tokens=4, stop_token_ids=(0, 2, 9)),
    SamplingParams(min_tokens=2, stop_token_ids=(0, 2, 9)),             # the output has reached it: no ban
    SamplingParams(repetition_penalty=1.7),
    SamplingParams(repetition_penalty=0.6),
    SamplingParams(frequency_penalty=1.5),
    SamplingParams(presence_penalty=-0.8),
    SamplingParams(temperature=0.9, seed=1, presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2,
                   logit_bias=((1, 2.0),), min_tokens=9, stop_token_ids=(4,)),
    SamplingParams(),
]


def test_each_row_is_processed_by_its_own_formulas_in_one_batch() -> None:
    """Every bias, ban and penalty against the formula written out, rows of different settings side by side; the
    prompt and output repeat tokens (so counts above one matter) and logits of both signs are penalized."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(len(PROCESSING), 60, generator=g) * 4
    histories = [History(torch.randint(0, 60, (12,), generator=g).tolist(),
                         torch.randint(0, 20, (3,), generator=g).tolist()) for _ in PROCESSING]
    got = processed_logits(logits, PROCESSING, histories)
    for i, (p, h) in enumerate(zip(PROCESSING, histories, strict=True)):
        expected = reference_processed(logits[i], p, list(h.prompt), list(h.output))
        torch.testing.assert_close(got[i], expected, atol=1e-6, rtol=0)
        assert torch.equal(got[i], logits[i]) == (not p.processes_logits or p.min_tokens == 2), i   # each bit
    assert torch.isinf(got[1, [0, 2, 9]]).all() and not torch.isinf(got[2]).any()
    assert torch.equal(got[8], logits[8])


def test_min_p_keeps_only_the_tokens_within_its_share_of_the_likeliest() -> None:
    x = torch.tensor([4.0, 3.5, 2.0, 1.0, 0.0, -1.0])
    probs = torch.softmax(x, dim=-1)
    within = {i for i in range(6) if probs[i] >= 0.1 * probs.max()}
    params = SamplingParams(temperature=1.0, min_p=0.1, seed=7)
    picks = {sample(x, params, position=pos) for pos in range(400)}
    assert picks == within and len(within) == 3       # every kept token drawn, none of the others
    assert len({sample(x, SamplingParams(temperature=1.0, seed=7), position=pos) for pos in range(400)}) > 3
