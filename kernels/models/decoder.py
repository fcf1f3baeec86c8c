"""A decoder as a stage: a contiguous slice of its layers, of any family kernels.models.families knows."""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import replace
from typing import TypeVar

import torch
import torch.nn.functional as F

from stratamesh.fleet.errors import CheckpointError, InvalidInput
from stratamesh.fleet.stages import StageSpec
from stratamesh.fleet.states import Runtime
from stratamesh.kernels.models.checkpoint import (EMBED, FINAL_NORM, LM_HEAD, open_checkpoint, quantizable,
                                                  stage_tensor_names)
from stratamesh.kernels.models.config import ModelConfig, read_config
from stratamesh.kernels.models.families import layer_class
from stratamesh.kernels.models.families.llama import MATRICES, Step, weight
from stratamesh.kernels.ops.attention import Attention
from stratamesh.kernels.ops.kv_cache import KVCache
from stratamesh.kernels.ops.moe import ExpertLoad
from stratamesh.kernels.ops.paged_attention import PagedBatch, PagedKVCache, SeqSlice
from stratamesh.kernels.ops.quant import (SCALE_SUFFIX, PackedInt4Weight, embedding, for_cpu_kernel, linear,
                                          quantize_int4, quantize_int8, takes_int4)
from stratamesh.kernels.ops.rope import rope_attention_factor, rope_cos_sin, rope_inv_freq

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
ONE_SEQUENCE_BLOCK = 16      # a paged one_sequence cache's block


def _unchanged(x: torch.Tensor) -> torch.Tensor:
    return x


T = TypeVar("T")


def run_through(steps: Generator[None, None, T]) -> T:
    """Runs a suspendable computation (a generator that yields between its parts) to its end; returns its result."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


class StageModel:
    """Layers [start, end) of a decoder, plus the embedding if first and the final norm + LM head if last (an
    embedding model's last stage has the final norm alone, and pools)."""

    paged_only = False      # whether it attends over a paged KV cache only (new_cache refuses)

    def __init__(self, config: ModelConfig, spec: StageSpec, tensors: dict[str, torch.Tensor], world_size: int = 1,
                 reduce: Callable[[torch.Tensor], torch.Tensor] = _unchanged) -> None:
        """world_size > 1: tensors are one rank's shards of a tensor-parallel stage (kernels.models.tp), and reduce
        sums the partial outputs of its o and down projections over the ranks."""
        _check_shapes(config, tensors, world_size)
        self.config, self.spec = config, spec
        self.dtype = TORCH_DTYPES[spec.dtype]
        self._take(tensors)
        self._inv_freq = rope_inv_freq(config.rotary_dim, config.rope_theta, config.rope_scaling).to(spec.device)
        self._rope_factor = rope_attention_factor(config.rope_scaling)
        self._local_inv_freq = None if config.local_rope_theta is None else rope_inv_freq(
            config.rotary_dim, config.local_rope_theta, config.local_rope_scaling).to(spec.device)
        self._norm = layer_class(config).norm
        # The heads this model computes and how partial outputs of the attention and MLP projections combine.
        self.num_heads, self.num_kv_heads = config.num_heads // world_size, config.num_kv_heads // world_size
        self.reduce = reduce
        # a mixture of experts: the tokens its routers send each expert, and how evenly (every rank of a group
        # routes every token: rank 0's counts are the whole stage's)
        self.expert_load = ExpertLoad([0] * config.moe.num_experts) if config.moe else None

    @property
    def tensor_names(self) -> list[str]:
        return list(self._tensors)

    @property
    def param_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._tensors.values())

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        return dict(self._tensors)

    @property
    def step_read_bytes(self) -> int:
        """The bytes of weights every step reads, whatever its tokens: all the stage holds but an embedding only
        looked up (a row a token), unless its head is that matrix, read whole."""
        head_reads_it = self._lm_head is not None and self.config.tie_word_embeddings and LM_HEAD not in self._tensors
        looked_up = self._embed is not None and not head_reads_it
        embedding = (EMBED, EMBED + SCALE_SUFFIX) if looked_up else ()
        return self.param_bytes - sum(t.numel() * t.element_size() for name, t in self._tensors.items()
                                      if name in embedding)

    @property
    def kv_bytes_per_token(self) -> int:
        """The K and V bytes one token of context holds in this stage's layers (a step reads them per sequence)."""
        layers = self.spec.end_layer - self.spec.start_layer
        return 2 * layers * self.num_kv_heads * self.config.head_dim * self.dtype.itemsize

    def decode_read_bytes(self, context_tokens: int) -> int:
        """What a decode step reads from memory: the stage's weights once, and the KV of the context its sequences
        attend over (context_tokens, all of them together)."""
        return self.step_read_bytes + context_tokens * self.kv_bytes_per_token

    def reshard(self, tensors: dict[str, torch.Tensor], num_heads: int, num_kv_heads: int,
                reduce: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Swaps in shards of its tensors that compute num_heads / num_kv_heads of the heads and a slice of the
        MLP; reduce combines the partial outputs of the o and down projections (see kernels.models.tp)."""
        self._take(tensors)
        self.num_heads, self.num_kv_heads, self.reduce = num_heads, num_kv_heads, reduce

    def _take(self, tensors: dict[str, torch.Tensor]) -> None:
        """Takes over tensors (their q, k, v, gate and up become views of fused matrices: see LlamaLayer.fuse)."""
        spec = self.spec
        self._tensors = tensors
        layer = layer_class(self.config)
        self._layers = [layer.fuse(tensors, i) for i in range(spec.start_layer, spec.end_layer)]
        self._embed = weight(tensors, EMBED) if spec.is_first else None
        self._final_norm = tensors.get(FINAL_NORM) if spec.is_last else None
        head = EMBED if self.config.tie_word_embeddings else LM_HEAD
        self._lm_head = weight(tensors, head) if spec.is_last and self.config.has_lm_head else None
        if spec.quantize and spec.device == "cpu" and spec.runtime == Runtime.TORCH:
            self._repack_for_cpu()       # (an ONNX Runtime stage computes its head in its runtime: export_head)

    def _repack_for_cpu(self) -> None:
        """Its 4-bit matrices in the torch CPU kernel's layout (quant.PackedInt4Weight), each stored once: the
        tensors' entries of a repacked matrix stay as shapes alone (on the meta device: param_bytes counts them),
        but for a head tied to the embedding, whose lookup reads the rows as stored (the repacked copy is counted
        as a LM_HEAD entry of its own)."""
        self._layers = [replace(layer, **{m: for_cpu_kernel(getattr(layer, m)) for m in MATRICES})
                        for layer in self._layers]
        head = self._lm_head
        self._lm_head = None if head is None else for_cpu_kernel(head)
        tied_head = isinstance(self._lm_head, PackedInt4Weight) and self.config.tie_word_embeddings
        tensors = self._tensors
        for name in [n for n, t in tensors.items() if t.dtype == torch.uint8 and n + SCALE_SUFFIX in tensors]:
            for suffix in ("", SCALE_SUFFIX):
                shape_only = torch.empty_like(tensors[name + suffix], device="meta")
                if name != EMBED or self._embed is None:
                    tensors[name + suffix] = shape_only
                elif tied_head:                     # the lookup's rows kept as stored, the head's tiles beside them
                    tensors[LM_HEAD + suffix] = shape_only

    def new_cache(self, chunk_tokens: int = 256) -> KVCache:
        c = self.config
        return KVCache(len(self._layers), self.num_kv_heads, c.head_dim, self.dtype, self.spec.device, chunk_tokens)

    def new_paged_cache(self, num_blocks: int, block_size: int) -> PagedKVCache:
        """An empty paged KV cache for this stage's layers (its own KV heads), in its dtype and on its device."""
        c = self.config
        return PagedKVCache(len(self._layers), num_blocks, block_size, self.num_kv_heads, c.head_dim, self.dtype,
                            self.spec.device)

    @torch.inference_mode()
    def forward(self, inputs: torch.Tensor, positions: torch.Tensor, attn: Attention) -> torch.Tensor:
        """Run this stage's layers over N tokens at positions [N] -> hidden [N, hidden].

        inputs: token ids [N] on the first stage, else the previous stage's hidden [N, hidden].
        attn: a KVCache (one sequence, positions consecutive from at most its num_tokens) or a PagedBatch."""
        return run_through(self.forward_layers(inputs, positions, attn))

    def forward_layers(self, inputs: torch.Tensor, positions: torch.Tensor, attn: Attention,
                       checked: bool = False) -> Generator[None, None, torch.Tensor]:
        """forward(), suspended after each layer (so that one thread can serve other work between layers); the
        generator returns the hidden states. Run it under torch.inference_mode(). checked: the caller already
        made sure check_inputs() passes (a stage engine validates what arrives), so it is not done again."""
        if not checked:
            self.check_inputs(inputs, positions, attn)
        x = self._embed_inputs(inputs)                          # x: [N, hidden]
        if positions.device != x.device or positions.dtype != torch.long:
            positions = positions.to(x.device, torch.long)
        cos, sin = rope_cos_sin(self._inv_freq, positions, self.dtype, self._rope_factor)   # [N, D]
        step = Step(self.config, self.num_heads, self.num_kv_heads, cos[:, None], sin[:, None],   # [N, 1, D]:
                    positions, attn, self.reduce, expert_load=self.expert_load)                    # over heads
        if self._local_inv_freq is not None:
            cos, sin = rope_cos_sin(self._local_inv_freq, positions, self.dtype)
            step.local_cos, step.local_sin = cos[:, None], sin[:, None]
        for local_idx, layer in enumerate(self._layers):
            x = layer.forward(x, step, local_idx, self.config.window_for_layer(self.spec.start_layer + local_idx))
            yield
        if self.expert_load is not None:
            self.expert_load.stepped()
        return x

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head: hidden [T, hidden] -> float32 logits [T, vocab]; last stage only."""
        if self._lm_head is None:
            raise InvalidInput(f"stage [{self.spec.start_layer}, {self.spec.end_layer}) has no LM head (it is not "
                               "the last stage, or the model is an embedding model)")
        h = self._norm(hidden.to(self.dtype), self._final_norm, self.config.rms_norm_eps)
        logits, cap = linear(h, self._lm_head), self.config.final_logit_softcap
        return (logits if cap is None else torch.tanh(logits / cap) * cap).float()

    @torch.inference_mode()
    def pool(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm + L2 normalization of each row: hidden [T, hidden] (each a prompt's last token, vLLM's LAST
        pooling) -> float32 unit vectors [T, hidden]; last stage only."""
        if self._final_norm is None:
            raise InvalidInput(f"stage [{self.spec.start_layer}, {self.spec.end_layer}) is not the last stage")
        h = self._norm(hidden.to(self.dtype), self._final_norm, self.config.rms_norm_eps)
        return F.normalize(h.float(), dim=-1)

    def check_inputs(self, inputs: torch.Tensor, positions: torch.Tensor, attn: Attention) -> None:
        """InvalidInput unless forward() takes these: token ids in the vocabulary (first stage) or hidden states
        of the model's width, and one position per row that attn can attend at."""
        if self._embed is not None:
            if inputs.dtype != torch.long or inputs.dim() != 1:
                raise InvalidInput(f"first stage inputs must be token ids [T] int64, got {inputs.dtype} "
                                   f"{tuple(inputs.shape)}")
            if inputs.numel() and not 0 <= int(inputs.min()) <= int(inputs.max()) < self.config.vocab_size:
                raise InvalidInput(f"token ids must be in [0, {self.config.vocab_size})")
        elif not inputs.is_floating_point() or inputs.dim() != 2 or inputs.shape[1] != self.config.hidden_size:
            raise InvalidInput(f"stage inputs must be hidden states [T, {self.config.hidden_size}], got "
                               f"{inputs.dtype} {tuple(inputs.shape)}")
        self._check_positions(positions, inputs.shape[0], attn)

    def _embed_inputs(self, inputs: torch.Tensor) -> torch.Tensor:
        if self._embed is not None:
            ids = inputs if inputs.device == self._inv_freq.device else inputs.to(self._inv_freq.device)
            x = embedding(ids, self._embed, self.dtype)
            if self.config.embed_scale is None:
                return x
            return x * torch.tensor(self.config.embed_scale, device=x.device).to(x.dtype)   # (rounded as Gemma's)
        if inputs.dtype == self.dtype and inputs.device == self._inv_freq.device:
            return inputs
        return inputs.to(device=self._inv_freq.device, dtype=self.dtype)

    def _check_positions(self, positions: torch.Tensor, num_tokens: int, attn: Attention) -> torch.Tensor:
        positions = positions.to(self.spec.device, torch.long)
        if positions.shape != (num_tokens,) or num_tokens == 0:
            raise InvalidInput(f"positions must be [N] = [{num_tokens}] with N > 0, got {tuple(positions.shape)}")
        try:
            attn.check_positions(positions)
        except ValueError as e:
            raise InvalidInput(str(e)) from e
        return positions


def greedy_tokens(stage: StageModel, prompt_ids: list[int], num_tokens: int) -> list[int]:
    """num_tokens greedy tokens after prompt_ids (EOS does not stop it) from a stage holding the whole model, through
    one sequence's KV cache (one_sequence): the single-process way of running what a mesh runs."""
    forward, out = one_sequence(stage, len(prompt_ids) + num_tokens), []
    hidden = forward(torch.tensor(prompt_ids), 0)
    for i in range(num_tokens):
        out.append(int(stage.logits(hidden[-1:])[0].argmax()))
        hidden = forward(torch.tensor(out[-1:]), len(prompt_ids) + i)
    return out


def one_sequence(stage: StageModel, max_tokens: int) -> Callable[[torch.Tensor, int], torch.Tensor]:
    """forward(inputs, start) -> hidden: the stage over one sequence's next tokens (or hidden states) at positions
    start, start + 1, ..., each call after the last, up to max_tokens in all. Its KV cache is contiguous, or paged
    (one block table) for a stage that attends over a paged cache only (StageModel.paged_only)."""
    if not stage.paged_only:
        cache = stage.new_cache()
        return lambda inputs, start: stage.forward(inputs, torch.arange(start, start + len(inputs)), cache)
    paged = stage.new_paged_cache(-(-max_tokens // ONE_SEQUENCE_BLOCK), ONE_SEQUENCE_BLOCK)
    table = list(range(paged.num_blocks))

    def forward(inputs: torch.Tensor, start: int) -> torch.Tensor:
        batch = PagedBatch(paged, [SeqSlice(0, len(inputs), start, table)])
        return stage.forward(inputs, batch.positions, batch)

    return forward


def load_stage(spec: StageSpec, config: ModelConfig | None = None) -> StageModel:
    """Build the stage spec names from the HF folder spec.model_path, reading only its own tensors (config: its
    config.json, if the caller read it already)."""
    config = config or read_config(spec.model_path)
    tensors = open_checkpoint(spec.model_path, spec.quantize).load(checked_tensor_names(spec, config),
                                                                    TORCH_DTYPES[spec.dtype], spec.device)
    return StageModel(config, spec, quantize_tensors(tensors, config, spec.quantize) if spec.quantize else tensors)


def checked_tensor_names(spec: StageSpec, config: ModelConfig) -> list[str]:
    """The names of the tensors the stage holds; CheckpointError if the model is not the one the spec names, or if
    its device is not one of this process (check_device)."""
    if config.num_layers != spec.num_layers:
        raise CheckpointError(f"{spec.model_path} has {config.num_layers} layers, the stage spec says "
                              f"{spec.num_layers}")
    check_device(spec.device)
    return stage_tensor_names(config, spec.start_layer, spec.end_layer)


def quantize_tensors(tensors: dict[str, torch.Tensor], config: ModelConfig, quantize: str = "int8"
                     ) -> dict[str, torch.Tensor]:
    """The stage's tensors with its layers' projection matrices, its LM head and its embedding in the format
    quantize names (kernels.ops.quant: "int8", or "int4" where a matrix's rows are a multiple of its groups, int8
    otherwise), each with its scales under name + SCALE_SUFFIX; norms and biases stay as they are. In place: each
    float matrix is dropped as soon as its quantized form exists; one read quantized already (a GGUF file's Q4_0
    matrices: kernels.models.gguf) stays as it is."""
    for name in list(tensors):
        if quantizable(name) and name + SCALE_SUFFIX not in tensors:
            w = tensors[name]
            if quantize == "int4" and takes_int4(w):
                q4 = quantize_int4(w)
                tensors[name], tensors[name + SCALE_SUFFIX] = q4.packed, q4.scale
            else:
                q8 = quantize_int8(w)
                tensors[name], tensors[name + SCALE_SUFFIX] = q8.q, q8.scale
    return tensors


def check_device(device: str) -> None:
    """CheckpointError unless this process can place tensors on device ("cpu", "cuda" or "cuda:N")."""
    if not device.startswith("cuda"):
        return
    if not torch.cuda.is_available():
        raise CheckpointError(f"stage device {device} asked for, but this box has no CUDA device torch can use")
    index = int(device.partition(":")[2] or 0)
    if index >= torch.cuda.device_count():
        raise CheckpointError(f"stage device {device} asked for, but this box has {torch.cuda.device_count()} "
                              f"CUDA device(s)")


def _check_shapes(config: ModelConfig, tensors: dict[str, torch.Tensor], world_size: int = 1) -> None:
    """CheckpointError if a tensor's shape disagrees with the config (of one rank's shards, when world_size > 1)."""
    c = config
    expected = layer_class(config).shapes(config, world_size)
    top = {EMBED: (c.vocab_size, c.hidden_size), LM_HEAD: (c.vocab_size, c.hidden_size), FINAL_NORM: (c.hidden_size,)}
    for name, t in tensors.items():
        want = top.get(name) or expected.get(name.split(".", 3)[-1])
        shape = tuple(t.shape)
        if t.dtype == torch.uint8 and name + SCALE_SUFFIX in tensors:    # 4-bit: two weights a byte
            shape = (shape[0], 2 * shape[1])
        if want is not None and shape != want:
            raise CheckpointError(f"tensor {name!r} has shape {shape}, config implies {want}")
