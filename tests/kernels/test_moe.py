"""Mixture-of-experts MLPs against transformers' own sparse MoE blocks (Mixtral's, Qwen2-MoE's with its shared
expert, Qwen3-MoE's), random weights of odd shapes: the same routing and the same output."""

from __future__ import annotations

import pytest
import torch

from stratamesh.kernels.ops.moe import Routing, groupable, route, routed_experts, shared_expert

HIDDEN, INTER, EXPERTS, TOP_K = 48, 40, 7, 3


def _randomized(block: torch.nn.Module, seed: int) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return block.eval()


def mixtral_block(seed: int = 0) -> torch.nn.Module:
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    config = MixtralConfig(hidden_size=HIDDEN, intermediate_size=INTER, num_local_experts=EXPERTS,
                           num_experts_per_tok=TOP_K)
    return _randomized(MixtralSparseMoeBlock(config), seed)


def qwen_block(family: str, norm_topk_prob: bool, seed: int = 0) -> torch.nn.Module:
    if family == "qwen2_moe":
        from transformers import Qwen2MoeConfig as Config
        from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock as Block
        extra = {"shared_expert_intermediate_size": 56}
    else:
        from transformers import Qwen3MoeConfig as Config
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock as Block
        extra = {}
    config = Config(hidden_size=HIDDEN, moe_intermediate_size=INTER, num_experts=EXPERTS, num_experts_per_tok=TOP_K,
                    norm_topk_prob=norm_topk_prob, **extra)
    return _randomized(Block(config), seed)


def hidden(num_tokens: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(num_tokens, HIDDEN, generator=torch.Generator().manual_seed(seed))


def experts_as(grouped: bool, *stacked: torch.Tensor) -> tuple:
    """Stacked experts as routed_experts takes them: the stacks (which grouped_mm multiplies where groupable), or a
    tuple of each expert's matrix (one product per expert, as quantized experts run)."""
    return stacked if grouped else tuple(tuple(t) for t in stacked)


@pytest.mark.parametrize("grouped", [True, False], ids=["grouped_mm", "per-expert"])
@pytest.mark.parametrize("num_tokens", [1, 5, 64])
def test_mixtral_routing_and_experts_are_transformers(num_tokens: int, grouped: bool) -> None:
    block, h = mixtral_block(), hidden(num_tokens)
    routing = route(h, block.gate.weight, TOP_K, renormalize=True, weigh_in_input_dtype=False)
    _, weights, experts = block.gate(h)
    assert torch.equal(routing.experts, experts) and torch.equal(routing.weights, weights)
    gate_up, down = experts_as(grouped, block.experts.gate_up_proj.detach(), block.experts.down_proj.detach())
    assert groupable(h, gate_up, down) == grouped
    ours = routed_experts(h, routing, gate_up, down)
    with torch.no_grad():
        theirs = block(h[None])[0]
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)


@pytest.mark.parametrize("family", ["qwen2_moe", "qwen3_moe"])
@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_qwen_moe_routing_shared_expert_and_experts_are_transformers(family: str, norm_topk_prob: bool) -> None:
    block, h = qwen_block(family, norm_topk_prob), hidden(33)
    routing = route(h, block.gate.weight, TOP_K, renormalize=norm_topk_prob, weigh_in_input_dtype=True)
    _, weights, experts = block.gate(h)
    assert torch.equal(routing.experts, experts) and torch.equal(routing.weights, weights)
    ours = routed_experts(h, routing, block.experts.gate_up_proj, block.experts.down_proj)
    if family == "qwen2_moe":
        shared = block.shared_expert
        ours = ours + shared_expert(h, torch.cat((shared.gate_proj.weight, shared.up_proj.weight)),
                                    shared.down_proj.weight, block.shared_expert_gate.weight)
    with torch.no_grad():
        theirs = block(h[None])[0]
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)


@pytest.mark.parametrize("grouped", [True, False], ids=["grouped_mm", "per-expert"])
def test_only_the_picked_experts_are_read_and_each_token_gets_its_own(grouped: bool) -> None:
    """Experts no token picked are never touched (their weights here are NaN), and a token's output is its own
    experts' weighted sum, whatever other tokens share the batch."""
    g = torch.Generator().manual_seed(5)
    gate_up = torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=g) * 0.2
    down = torch.randn(EXPERTS, HIDDEN, INTER, generator=g) * 0.2
    gate_up[[1, 4]], down[[1, 4]] = float("nan"), float("nan")
    gate_up, down = experts_as(grouped, gate_up, down)
    h = hidden(4)
    routing = Routing(torch.tensor([[0, 2], [3, 0], [2, 6], [6, 5]]), torch.rand(4, 2, generator=g))
    out = routed_experts(h, routing, gate_up, down)
    assert not out.isnan().any()
    for t in range(4):
        alone = routed_experts(h[t:t + 1], Routing(routing.experts[t:t + 1], routing.weights[t:t + 1]), gate_up, down)
        torch.testing.assert_close(out[t:t + 1], alone, rtol=1e-5, atol=1e-5)    # (batched products round apart)
    assert routing.tokens_per_expert(EXPERTS).tolist() == [2, 0, 2, 1, 0, 1, 2]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_experts_split_over_ranks_sum_to_the_whole_and_equal_one_product_per_expert(dtype) -> None:
    """An expert-parallel rank's run of the experts (first_expert on), including a run no token picked: the runs'
    outputs sum to all experts' (as the ranks' all-reduce sums them), and grouped_mm gives what one product per
    expert gives."""
    g = torch.Generator().manual_seed(9)
    gate_up = (torch.randn(8, 2 * INTER, HIDDEN, generator=g) * 0.2).to(dtype)
    down = (torch.randn(8, HIDDEN, INTER, generator=g) * 0.2).to(dtype)
    h = hidden(6).to(dtype)
    routing = Routing(torch.tensor([[0, 1], [2, 1], [0, 3], [3, 2], [1, 0], [2, 3]]),     # none picks 4-7
                      torch.rand(6, 2, generator=g).to(dtype))
    whole = routed_experts(h, routing, gate_up, down, num_experts=8)
    runs = [routed_experts(h, routing, gate_up[r:r + 2], down[r:r + 2], first_expert=r, num_experts=8)
            for r in range(0, 8, 2)]
    assert groupable(h, gate_up[:2], down[:2]) and not runs[2].any() and not runs[3].any()
    tolerance = {"rtol": 0, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 0.02, "atol": 0.02}
    torch.testing.assert_close(sum(runs), whole, **tolerance)
    per_expert = routed_experts(h, routing, *experts_as(False, gate_up, down), num_experts=8)
    torch.testing.assert_close(whole, per_expert, **tolerance)


def test_a_stages_expert_load_counts_each_experts_tokens_and_each_steps_most_uneven_layer(tiny_model) -> None:
    """Mixtral (every layer sparse, 5 experts, 2 a token): a step of n tokens sends 2n tokens to experts in each of
    its layers; its imbalance is the most an expert got over the mean, in the step's most uneven layer."""
    from stratamesh.fleet.stages import StageSpec
    from stratamesh.kernels.models.decoder import load_stage
    from stratamesh.kernels.ops.moe import ExpertLoad

    stage = load_stage(StageSpec("m", str(tiny_model("mixtral", num_layers=3)), 0, 3, 3))
    load = stage.expert_load
    assert load is not None and load.tokens == [0] * 5 and load.last_imbalance == 0
    ids = torch.arange(3, 19)
    stage.forward(ids, torch.arange(16), stage.new_cache())
    assert sum(load.tokens) == 3 * 16 * 2
    assert 1.0 <= load.last_imbalance <= 5 / 2       # an expert gets one of a token's 2 picks at most: 16 of 32
    by_hand = ExpertLoad([0] * 4)
    by_hand.routed([4, 4, 4, 4])
    by_hand.routed([8, 4, 2, 2])
    by_hand.stepped()
    assert by_hand.tokens == [12, 8, 6, 6] and by_hand.last_imbalance == 2.0
    assert load_stage(StageSpec("m", str(tiny_model("llama", num_layers=2)), 0, 2, 2)).expert_load is None
