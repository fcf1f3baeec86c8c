"""Token sampling: the logits processed (logit_bias, min_tokens, penalties), then greedy, or temperature + min-p +
top-k + top-p with randomness keyed by (seed, position).

A batch of rows is sampled where its logits are (on a GPU stage, on the GPU: the host gets back the width of the
longest kept prefix and the picked ids), each row with its own settings. The only randomness is one uniform number
a row, drawn on the host from its (seed, position): whatever device computes the rest, a replay of a position draws
the same token (up to the device's rounding of the probabilities)."""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from stratamesh.fleet.sessions import Logprobs, SamplingParams


@dataclass(frozen=True, slots=True)
class History:
    """What a row's penalties and min_tokens count: the request's prompt and the output it has so far."""

    prompt: Sequence[int]
    output: Sequence[int]


NO_HISTORY = History((), ())


def processed_logits(logits: torch.Tensor, params: Sequence[SamplingParams],
                     histories: Sequence[History]) -> torch.Tensor:
    """Float32 logits [B, vocab] as each row's params change them before its pick, in vLLM's order: its logit_bias
    added and (while its output is shorter than min_tokens) its stop tokens banned, then the repetition penalty
    on the tokens of its prompt and output (a positive logit divided by it, a negative one multiplied), the
    frequency penalty times each token's count in its output and the presence penalty once for each token in it
    subtracted. Computed on logits' device, in one pass over the batch."""
    logits = logits.float().clone()
    rows, vocab, device = len(params), logits.shape[-1], logits.device
    bias = [(i, token, b) for i, p in enumerate(params) for token, b in p.logit_bias if token < vocab]
    if bias:
        index = torch.tensor([i * vocab + token for i, token, _ in bias], device=device)
        logits.view(-1).index_add_(0, index, torch.tensor([b for _, _, b in bias], device=device))
    banned = [i * vocab + token for i, (p, h) in enumerate(zip(params, histories, strict=True))
              if len(h.output) < p.min_tokens for token in p.stop_token_ids if token < vocab]
    if banned:
        logits.view(-1)[torch.tensor(banned, device=device)] = float("-inf")
    if not any(p.counts_output for p in params):
        return logits
    counts = _counts([h.output for h in histories], rows, vocab, device)           # [B, vocab]
    repetition = torch.tensor([p.repetition_penalty for p in params], device=device)[:, None]
    if any(p.repetition_penalty != 1.0 for p in params):
        seen = (counts > 0) | (_counts([h.prompt for h in histories], rows, vocab, device) > 0)
        penalized = torch.where(logits > 0, logits / repetition, logits * repetition)
        logits = torch.where(seen, penalized, logits)
    frequency = torch.tensor([p.frequency_penalty for p in params], device=device)[:, None]
    presence = torch.tensor([p.presence_penalty for p in params], device=device)[:, None]
    return logits - frequency * counts - presence * (counts > 0)


def token_logprobs(logits: torch.Tensor, token_ids: Sequence[int], num_top: Sequence[int]) -> list[Logprobs]:
    """Each row's token's log-probability under logits [B, vocab] (log-softmax in float32: the model's, before any
    sampling setting) and its num_top likeliest tokens', computed on logits' device (two copies to the host)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    picked = logprobs.gather(-1, torch.tensor(token_ids, device=logits.device)[:, None])[:, 0].tolist()
    k = max(num_top, default=0)
    top_values, top_ids = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], logprobs[:, :0].long())
    top_values, top_ids = top_values.tolist(), top_ids.tolist()
    return [Logprobs(token, value, tuple(zip(top_ids[i][:n], top_values[i][:n], strict=True)))
            for i, (token, value, n) in enumerate(zip(token_ids, picked, num_top, strict=True))]


def _counts(token_lists: Sequence[Sequence[int]], rows: int, vocab: int, device: torch.device) -> torch.Tensor:
    """How many times each token id occurs in each row's list: float32 [rows, vocab]."""
    index = [i * vocab + t for i, tokens in enumerate(token_lists) for t in tokens if 0 <= t < vocab]
    counts = torch.zeros(rows * vocab, dtype=torch.float32, device=device)
    if index:
        counts.index_add_(0, torch.tensor(index, device=device), torch.ones(len(index), device=device))
    return counts.view(rows, vocab)


def sample(logits: torch.Tensor, params: SamplingParams, position: int) -> int:
    """Pick the token at `position` from logits [vocab]; the same (seed, position) gives the same token."""
    if params.is_greedy:
        return int(torch.argmax(logits))
    return sample_rows(logits[None], [params], [position])[0]


def sample_rows(logits: torch.Tensor, params: Sequence[SamplingParams], positions: Sequence[int]) -> list[int]:
    """The token of each row of logits [B, vocab] drawn with its params (none greedy) at its position, computed on
    logits' device: temperature, then min-p, then top-k, then top-p over the highest-first order, then the inverse
    CDF at the row's uniform draw (one copy of the kept width and one of the tokens to the host). The logits are
    processed already (processed_logits), where a row's params say so."""
    device, vocab = logits.device, logits.shape[-1]
    temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device)
    scaled = logits.float() / temperature[:, None]
    if any(p.min_p > 0 for p in params):     # tokens less likely than min_p x the likeliest are out
        probs = torch.softmax(scaled, dim=-1)
        min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device)[:, None]
        scaled = scaled.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), float("-inf"))
    top_ks = [min(p.top_k or vocab, vocab) for p in params]
    if max(top_ks) < vocab:     # every row keeps at most its top-k: only those need ordering
        sorted_logits, token_ids = torch.topk(scaled, max(top_ks), dim=-1)          # [B, K], highest first
    else:
        sorted_logits, token_ids = torch.sort(scaled, dim=-1, descending=True)      # [B, V]
    ranks = torch.arange(sorted_logits.shape[-1], device=device)
    kept = torch.tensor(top_ks, device=device)                                      # [B]: a prefix of each row
    if min(top_ks) < sorted_logits.shape[-1]:
        sorted_logits = sorted_logits.masked_fill(ranks >= kept[:, None], float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    if any(p.top_p < 1.0 for p in params):
        # top-p: the smallest prefix whose mass reaches top_p (a token stays if the mass before it is < top_p)
        top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device)
        mass_before = torch.cumsum(probs, dim=-1) - probs
        nucleus = (mass_before < top_p[:, None]).sum(dim=-1).clamp(min=1)
        kept = torch.where(top_p < 1.0, torch.minimum(kept, nucleus), kept)
    width = int(kept.max())                                                         # the inverse CDF needs no more
    head = probs[:, :width].masked_fill(ranks[:width] >= kept[:, None], 0.0)
    cdf = torch.cumsum(head.double(), dim=-1)                                       # [B, width], ends near 1
    u = torch.tensor([_uniform(p.seed, pos) for p, pos in zip(params, positions, strict=True)],
                     dtype=torch.float64, device=device)
    idx = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)           # [B, 1]
    return token_ids.gather(-1, torch.minimum(idx, kept[:, None] - 1)).squeeze(-1).tolist()


def _uniform(seed: int | None, position: int) -> float:
    """A uniform draw in [0, 1) keyed by (seed, position), or by OS randomness when seed is None."""
    if seed is None:
        key = secrets.randbits(63)
    else:
        digest = hashlib.blake2b(f"{seed}:{position}".encode(), digest_size=8).digest()
        key = int.from_bytes(digest, "little") & (2**63 - 1)
    return float(torch.rand((), generator=torch.Generator(device="cpu").manual_seed(key), dtype=torch.float64))
