"""Mixture-of-experts MLPs: a router picks each token's top-k experts and weighs them, and each expert (a SwiGLU
MLP) runs only on the tokens routed to it, as one product per expert over its tokens, or as torch's grouped_mm
over them all (so only the experts some token picked are read: on a CPU, the memory traffic of the active
experts, not of all of them).

The families differ in their routers' normalisation (Mixtral renormalises the top-k probabilities always,
Qwen2-MoE and Qwen3-MoE where norm_topk_prob says so, and weigh in the input's dtype) and in a shared expert beside
the routed ones (Qwen2-MoE's, gated by a sigmoid). Computed in transformers' order: probabilities in float32, experts
in ascending order, each one's weighted output added to its tokens' rows."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from stratamesh.kernels.ops.mlp import swiglu

GROUPED_MM_ALIGN = 16       # bytes: grouped_mm's rows and pointers ("strides should be multiple of 16 bytes")


@dataclass(frozen=True, slots=True)
class Routing:
    """Each of N tokens' top_k experts [N, k] (int64) and their weights [N, k]."""

    experts: torch.Tensor
    weights: torch.Tensor

    def tokens_per_expert(self, num_experts: int) -> torch.Tensor:
        """How many of the tokens each expert got [num_experts] (int64)."""
        return torch.bincount(self.experts.flatten(), minlength=num_experts)


@dataclass(slots=True)
class ExpertLoad:
    """How a stage's routers spread tokens: those each expert got since the stage loaded (over its sparse layers), and
    the last step's imbalance, the most tokens an expert got over the mean per expert, in the step's most uneven
    layer (1: even; an expert-parallel group's slowest rank is the one holding the experts that get the most)."""

    tokens: list[int]
    last_imbalance: float = 0.0         # 0 before any step
    _step: float = 0.0

    def routed(self, counts: list[int]) -> None:
        """One sparse layer of the current step sent counts[e] tokens to expert e."""
        for expert, count in enumerate(counts):
            self.tokens[expert] += count
        total = sum(counts)
        if total:
            self._step = max(self._step, max(counts) * len(counts) / total)

    def stepped(self) -> None:
        """The current step ended (its layers routed)."""
        self.last_imbalance, self._step = self._step, 0.0


def route(h: torch.Tensor, router: torch.Tensor, top_k: int, renormalize: bool, weigh_in_input_dtype: bool) -> Routing:
    """The top_k experts of each token of h [N, hidden] by the router's logits (router [E, hidden]): softmax in
    float32, the top_k probabilities, renormalised to sum to 1 where renormalize, cast to h's dtype where
    weigh_in_input_dtype (Qwen's) or kept in float32 (Mixtral's)."""
    probs = torch.softmax(F.linear(h, router).float(), dim=-1)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return Routing(experts, weights.to(h.dtype) if weigh_in_input_dtype else weights)


def routed_experts(h: torch.Tensor, routing: Routing, gate_up: Any, down: Any, first_expert: int = 0,
                   num_experts: int = 0, counts: list[int] | None = None) -> torch.Tensor:
    """The routed experts' weighted sum for each token of h [N, hidden]: gate_up [E, 2 x inter, hidden] holds each
    expert's gate rows then its up rows, down [E, hidden, inter] (or, quantized, a sequence of E weights each, as
    swiglu takes them) -> [N, hidden] in h's dtype; counts: the tokens of each expert, if the caller has them
    (Routing.tokens_per_expert). Where they are an expert-parallel rank's own run of a layer's num_experts
    (first_expert on), only those experts' share, which the ranks' all-reduce sums.

    Stacked float experts whose rows grouped_mm takes (groupable) run as two grouped products over the tokens
    sorted by expert, an expert with no token skipped; the others one product per expert."""
    top_k, local = routing.experts.shape[1], len(gate_up)
    flat = routing.experts.flatten()                             # [N x k]: token t's picks at t*k .. t*k + k - 1
    order = torch.argsort(flat, stable=True)                     # grouped by expert, tokens in order within
    if counts is None:
        counts = routing.tokens_per_expert(num_experts or local).tolist()
    weights = routing.weights.flatten()
    out = torch.zeros_like(h)
    start = sum(counts[:first_expert])
    if groupable(h, gate_up, down):
        mine = counts[first_expert:first_expert + local]
        picks = order[start:start + sum(mine)]
        if len(picks):
            tokens = picks // top_k
            offsets = torch.tensor(mine, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(h.device)
            gate, up = F.grouped_mm(h[tokens], gate_up.transpose(1, 2), offs=offsets).chunk(2, dim=-1)
            y = F.grouped_mm(F.silu(gate) * up, down.transpose(1, 2), offs=offsets) * weights[picks, None]
            out.index_add_(0, tokens, y.to(out.dtype))     # each row's experts added in ascending order, as below
        return out
    for expert in range(first_expert, first_expert + local):
        count = counts[expert]
        if not count:
            continue
        picks = order[start:start + count]
        tokens = picks // top_k
        y = swiglu(h[tokens], gate_up[expert - first_expert], down[expert - first_expert]) * weights[picks, None]
        out.index_add_(0, tokens, y.to(out.dtype))
        start += count
    return out


def groupable(h: torch.Tensor, gate_up: Any, down: Any) -> bool:
    """Whether torch's grouped_mm multiplies these experts: stacked float tensors in h's dtype, on a CPU or a CUDA
    GPU of compute capability 8.0 on (Ampere), their rows (and h's) a multiple of 16 bytes, 16-byte aligned."""
    if not (hasattr(F, "grouped_mm") and isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor)
            and gate_up.dtype == down.dtype == h.dtype and h.dim() == 2):
        return False
    device = gate_up.device
    if device.type == "cuda":
        if torch.cuda.get_device_capability(device) < (8, 0):
            return False
    elif device.type != "cpu":
        return False
    size = h.element_size()
    return all(n * size % GROUPED_MM_ALIGN == 0 for n in (*gate_up.shape[1:], *down.shape[1:])) and all(
        t.data_ptr() % GROUPED_MM_ALIGN == 0 for t in (gate_up, down))


def shared_expert(h: torch.Tensor, gate_up: Any, down: Any, gate: torch.Tensor) -> torch.Tensor:
    """A shared expert's output for every token (Qwen2-MoE's): its SwiGLU MLP times sigmoid(gate . h), gate
    [1, hidden]."""
    return torch.sigmoid(F.linear(h, gate)) * swiglu(h, gate_up, down)
