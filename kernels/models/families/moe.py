"""Mixtures of experts: the Llama layer (Mixtral), Qwen2's (Qwen2-MoE: q/k/v biases) or Qwen3's (Qwen3-MoE: q and k
normed per head) attention, and in each sparse layer (ModelConfig.moe) a router and its experts in place of the
MLP (kernels/ops/moe.py), with Qwen2-MoE's gated shared expert beside them; the other layers keep a dense MLP.

Checkpoints name each expert's projections apart, as the released ones do (Mixtral's block_sparse_moe.experts.{e}.w1,
w3 and w2; Qwen's mlp.experts.{e}.gate_proj, up_proj, down_proj); a stage stacks them per layer, each expert's gate
and up rows fused, into [experts, 2 x inter, hidden] and [experts, hidden, inter]."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from stratamesh.kernels.models.config import ModelConfig
from stratamesh.kernels.models.families.llama import QK_NORMS, LlamaLayer, Step, Weight, fuse_weight, weight
from stratamesh.kernels.models.families.qwen3 import Qwen3Layer
from stratamesh.kernels.ops.moe import route, routed_experts, shared_expert
from stratamesh.kernels.ops.quant import SCALE_SUFFIX

Experts = torch.Tensor | tuple[Weight, ...]     # a layer's experts' matrices: stacked, or one (quantized) weight each


@dataclass(slots=True)
class MoeLayer(LlamaLayer):
    """Mixtral's layer; a sparse one holds router [E, hidden], experts_gate_up [E, 2 x inter, hidden] and
    experts_down [E, hidden, inter] (quantized: a weight per expert), and gate_up and down are None."""

    router: torch.Tensor | None = None
    experts_gate_up: Experts | None = None
    experts_down: Experts | None = None
    shared_gate_up: Weight | None = None            # Qwen2-MoE's shared expert, and its gate [1, hidden]
    shared_down: Weight | None = None
    shared_gate: torch.Tensor | None = None
    first_expert: int = 0       # the first of its experts (an expert-parallel rank holds a run of them)

    # where a sparse layer's router and experts are (after "model.layers.{i}."), and each expert's projections
    MOE: ClassVar[str] = "block_sparse_moe."
    EXPERT_PROJECTIONS: ClassVar[tuple[str, str, str]] = ("w1", "w3", "w2")     # gate, up, down
    ALWAYS_RENORMALIZE: ClassVar[bool] = True       # Mixtral's router: its top-k always sum to 1
    WEIGH_IN_INPUT_DTYPE: ClassVar[bool] = False    # (Mixtral's weights stay float32; Qwen's cast to the input's)

    @classmethod
    def _mlp_fused(cls, t: dict[str, torch.Tensor], p: str) -> dict[str, object]:
        router = t.get(p + cls.MOE + "gate.weight")
        if router is None:
            return LlamaLayer._mlp_fused(t, p)      # a dense layer of the model
        experts = f"{p}{cls.MOE}experts."      # (an expert-parallel rank holds a run of the router's experts)
        gate, up, down = ([(e, f"{experts}{e}.{proj}.weight") for e in range(router.shape[0])
                           if f"{experts}{e}.{proj}.weight" in t] for proj in cls.EXPERT_PROJECTIONS)
        pairs = list(zip(gate, up, down, strict=True))
        if gate[0][1] + SCALE_SUFFIX in t:      # quantized: each expert's gate|up and down a weight of its own
            gate_up: Experts = tuple(fuse_weight(t, [g, u]) for (_, g), (_, u), _ in pairs)
            experts_down: Experts = tuple(weight(t, d) for _, _, (_, d) in pairs)
        else:
            gate_up = torch.stack([torch.cat((t[g], t[u])) for (_, g), (_, u), _ in pairs])
            experts_down = torch.stack([t[d] for _, _, (_, d) in pairs])
            inter = gate_up.shape[1] // 2
            for e, ((_, g), (_, u), (_, d)) in enumerate(pairs):          # views: the copies go
                t[g], t[u], t[d] = gate_up[e, :inter], gate_up[e, inter:], experts_down[e]
        fused = dict(gate_up=None, down=None, router=router, experts_gate_up=gate_up, experts_down=experts_down,
                     first_expert=gate[0][0])
        shared = p + cls.MOE + "shared_expert."
        if shared + "gate_proj.weight" in t:
            fused.update(shared_gate_up=fuse_weight(t, [shared + "gate_proj.weight", shared + "up_proj.weight"]),
                         shared_down=weight(t, shared + "down_proj.weight"),
                         shared_gate=t[p + cls.MOE + "shared_expert_gate.weight"])
        return fused

    @classmethod
    def _mlp_tensor_names(cls, config: ModelConfig, layer_idx: int) -> list[str]:
        moe = config.moe
        if moe is None or not moe.is_sparse(layer_idx):
            return LlamaLayer._mlp_tensor_names(config, layer_idx)
        p = f"model.layers.{layer_idx}.{cls.MOE}"
        names = [p + "gate.weight"] + [f"{p}experts.{e}.{proj}.weight" for e in range(moe.num_experts)
                                       for proj in cls.EXPERT_PROJECTIONS]
        if moe.shared_intermediate:
            names += [f"{p}shared_expert.{n}.weight" for n in ("gate_proj", "up_proj", "down_proj")]
            names.append(p + "shared_expert_gate.weight")
        return names

    @classmethod
    def shapes(cls, c: ModelConfig, world_size: int = 1) -> dict[str, tuple[int, ...]]:
        shapes = LlamaLayer.shapes.__func__(cls, c, world_size)     # (a slotted dataclass: no bare super())
        moe = c.moe
        if moe is None:
            return shapes
        inter, shared, hidden = moe.expert_intermediate, moe.shared_intermediate // world_size, c.hidden_size
        expert = dict(zip(cls.EXPERT_PROJECTIONS, ((inter, hidden), (inter, hidden), (hidden, inter))))
        shapes[cls.MOE + "gate.weight"] = (moe.num_experts, hidden)
        shapes.update({f"{cls.MOE}experts.{e}.{proj}.weight": shape for e in range(moe.num_experts)
                       for proj, shape in expert.items()})
        shapes.update({cls.MOE + "shared_expert.gate_proj.weight": (shared, hidden),
                       cls.MOE + "shared_expert.up_proj.weight": (shared, hidden),
                       cls.MOE + "shared_expert.down_proj.weight": (hidden, shared),
                       cls.MOE + "shared_expert_gate.weight": (1, hidden)})
        return shapes

    def mlp(self, h: torch.Tensor, step: Step) -> torch.Tensor:
        if self.router is None:
            return LlamaLayer.mlp(self, h, step)
        moe = step.config.moe
        routing = route(h, self.router, moe.top_k, self.ALWAYS_RENORMALIZE or moe.renormalize,
                        self.WEIGH_IN_INPUT_DTYPE)
        counts = routing.tokens_per_expert(moe.num_experts).tolist()
        if step.expert_load is not None:
            step.expert_load.routed(counts)
        out = routed_experts(h, routing, self.experts_gate_up, self.experts_down, self.first_expert, moe.num_experts,
                             counts)
        if self.shared_gate_up is not None:     # (a rank's slice of it: the gate's scalar is every rank's)
            out = out + shared_expert(h, self.shared_gate_up, self.shared_down, self.shared_gate)
        return step.reduce(out)


@dataclass(slots=True)
class Qwen2MoeLayer(MoeLayer):
    """Qwen2-MoE's: Qwen2's attention (its q/k/v biases by qkv_bias), mlp.experts and a shared expert."""

    MOE: ClassVar[str] = "mlp."
    EXPERT_PROJECTIONS: ClassVar[tuple[str, str, str]] = ("gate_proj", "up_proj", "down_proj")
    ALWAYS_RENORMALIZE: ClassVar[bool] = False      # norm_topk_prob says
    WEIGH_IN_INPUT_DTYPE: ClassVar[bool] = True


@dataclass(slots=True)
class Qwen3MoeLayer(Qwen2MoeLayer):
    """Qwen3-MoE's: Qwen3's attention (q and k RMS-normed per head), its experts as Qwen2-MoE's, no shared one."""

    HEAD_NORMS: ClassVar[tuple[str, ...]] = QK_NORMS
    rotate = Qwen3Layer.rotate
