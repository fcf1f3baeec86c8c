"""The only part of the agent that touches the device: a stage's weights, its paged KV cache, the forward pass."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Generator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from stratamesh.agent.engine.decode_graphs import DecodeGraphs, can_capture
from stratamesh.agent.engine.grammars import PendingMasks, masked_logits
from stratamesh.agent.engine.scheduler import Batch, ScheduledChunk
from stratamesh.agent.engine.memory import cpu_kv_bytes, gpu_kv_bytes, read_gpu_memory, step_workspace_bytes
from stratamesh.agent.engine.tp_group import Collectives, RankGroup
from stratamesh.fleet.state import cache_home
from stratamesh.fleet.states import Runtime
from stratamesh.fleet.sessions import Logprobs, SamplingParams
from stratamesh.fleet.stages import StageSpec
from stratamesh.kernels.models.config import ModelConfig, read_config
from stratamesh.kernels.models.decoder import TORCH_DTYPES, StageModel, load_stage, run_through
from stratamesh.kernels.models.onnx_stage import load_runtime_stage
from stratamesh.kernels.models.tp import check_tp, head_slice, load_tp_stage
from stratamesh.kernels.ops.paged_attention import PagedBatch, PagedKVCache, SeqSlice
from stratamesh.kernels.ops.sampler import NO_HISTORY, History, processed_logits, sample_rows, token_logprobs

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class StepOutput:
    """One step's result: hidden rows in batch order for the next stage, or what the last stage made of the chunks
    that asked for it: sampled tokens (with their log-probabilities where asked), or (an embedding model) pooled
    vectors; and the log-probabilities of the prompt tokens its chunks' rows predict, where asked."""

    hidden: torch.Tensor | None = None       # [sum of chunk lengths, hidden_size]
    tokens: Mapping[str, int] | None = None  # session id -> sampled token id
    embeddings: Mapping[str, torch.Tensor] | None = None   # session id -> unit vector [hidden_size], float32
    logprobs: Mapping[str, Logprobs] = field(default_factory=dict)     # session id -> its sampled token's
    prompt_logprobs: Mapping[str, list[Logprobs]] = field(default_factory=dict)   # session id -> its chunk's
    refused: Mapping[str, str] = field(default_factory=dict)   # session id -> why its grammar gave it no token
    # session id -> the drafted tokens its step carried that the model agreed with, in order (the sampled token,
    # in tokens, comes after them)
    accepted: Mapping[str, tuple[int, ...]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Picking:
    """What the last stage needs of a step's sessions to pick their tokens: each session's sampling params; the
    history of those whose params count their output; and, for a session that asks for its prompt's
    log-probabilities, the prompt tokens its chunk's first rows predict (the row at position p predicts p + 1); and
    the masks of the constrained sessions, as their grammars compute them beside the step (joined at the pick)."""

    params: Mapping[str, SamplingParams] = field(default_factory=dict)
    histories: Mapping[str, History] = field(default_factory=dict)
    prompt_targets: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    masks: PendingMasks | None = None


class StageRunner:
    """Runs batches of one stage, or of one rank of a tensor-parallel stage; call it from one thread at a time.

    Rank 0 of a group holds the other ranks (ranks) and hands each step and KV read or write to them."""

    def __init__(self, model: StageModel, num_blocks: int, rank: int = 0, ranks: RankGroup | None = None,
                 graph_batch: int = 0, capture: bool = True):
        """graph_batch > 0: decode steps of up to that many sessions run as CUDA graphs where can_capture() says they
        can (capture=False: the same static steps, run eagerly, as tests do off CUDA)."""
        self.model = model
        self.num_blocks = num_blocks
        block_size = model.spec.kv_block_size
        graphs = graph_batch > 0 and (not capture or can_capture(model, block_size))
        # with graphs, one more block than the sessions get: where a graph's padding rows write their KV
        self.cache = model.new_paged_cache(num_blocks + graphs, block_size)
        self.graphs = DecodeGraphs(model, self.cache, num_blocks, graph_batch, capture) if graphs else None
        self.kv_heads = head_slice(model.config.num_kv_heads, rank, model.spec.tp_degree)
        self.ranks = ranks

    @classmethod
    def load(cls, spec: StageSpec, kv_cache_bytes: int, on_group_failure: Callable[[str], None] | None = None,
             gpu_memory_utilization: float = 0.9, max_batch_tokens: int = 512, graph_batch: int = 0,
             onnx_cache: str | Path | None = None, onnx_threads: int = 0) -> StageRunner:
        """Loads the stage's own tensors and its paged KV cache (per rank, for a TP stage, whose other ranks it
        launches; on_group_failure hears, from any thread, that the group went down).

        The KV cache holds kv_cache_bytes on a CPU (0: what the plan reserved, spec.kv_cache_bytes); on a GPU, what
        gpu_memory_utilization of the GPU leaves after the weights and a workspace for steps of max_batch_tokens
        (agent.engine.memory). graph_batch > 0: a GPU stage's decode steps of up to that many sessions run as CUDA
        graphs (agent.engine.decode_graphs). A stage whose runtime is onnxruntime runs its layers in ONNX Runtime
        (kernels.models.onnx_stage), from an export kept in onnx_cache (default: the cache folder,
        fleet.state.cache_home), on onnx_threads threads (0: torch's)."""
        config = read_config(spec.model_path)
        check_tp(config, spec.tp_degree)
        kv_cache_bytes = cpu_kv_bytes(spec.kv_cache_bytes, kv_cache_bytes)
        if spec.runtime == Runtime.ONNXRUNTIME:
            model = load_runtime_stage(spec, onnx_cache or cache_home(os.environ), config, onnx_threads)
            return cls._loaded(model, _num_blocks(spec, config, kv_cache_bytes), None)
        if spec.device.startswith("cuda"):
            return cls._load_on_gpu(spec, config, on_group_failure, gpu_memory_utilization, max_batch_tokens,
                                    graph_batch)
        num_blocks = _num_blocks(spec, config, kv_cache_bytes)
        ranks = None
        if spec.tp_degree > 1:   # the other ranks load their shards while this one loads its own
            threads = max(1, torch.get_num_threads() // spec.tp_degree)
            ranks = RankGroup(spec, num_blocks, threads, on_group_failure)
        group: list[Collectives] = []      # bound once the other ranks are in
        try:
            model = _load_rank_0(spec, config, group)
            if ranks is not None:
                group.append(ranks.start())
        except BaseException:
            if ranks is not None:
                ranks.close()
            raise
        return cls._loaded(model, num_blocks, ranks)

    @classmethod
    def _load_on_gpu(cls, spec: StageSpec, config: ModelConfig, on_group_failure: Callable[[str], None] | None,
                     utilization: float, max_batch_tokens: int, graph_batch: int) -> StageRunner:
        """On a GPU the weights come first (rank 0's shard, then the others'): the KV cache gets what is left."""
        torch.cuda.set_device(spec.device)
        group: list[Collectives] = []      # bound once the other ranks are in
        model = _load_rank_0(spec, config, group)
        workspace = step_workspace_bytes(config, max_batch_tokens, model.dtype.itemsize, spec.is_last, spec.tp_degree)
        kv_bytes = gpu_kv_bytes(read_gpu_memory(spec.device), utilization, workspace)
        if kv_bytes < spec.kv_cache_bytes:
            log.warning("stage [%d, %d) of %s: its plan reserved %.2f GiB of KV cache, %s leaves %.2f GiB (raise "
                        "--gpu-memory-utilization): fewer sessions fit than planned", spec.start_layer,
                        spec.end_layer, spec.model_id, spec.kv_cache_bytes / 2**30, spec.device, kv_bytes / 2**30)
        num_blocks = _num_blocks(spec, config, kv_bytes)
        ranks = None
        if spec.tp_degree > 1:
            ranks = RankGroup(spec, num_blocks, 1, on_group_failure)
            group.append(ranks.start())
        return cls._loaded(model, num_blocks, ranks, graph_batch)

    @classmethod
    def _loaded(cls, model: StageModel, num_blocks: int, ranks: RankGroup | None,
                graph_batch: int = 0) -> StageRunner:
        runner, spec = cls(model, num_blocks, 0, ranks, graph_batch), model.spec
        log.info("stage [%d, %d) of %s on %s in %s, %d rank(s): %.1f MB of weights, %d KV blocks of %d tokens "
                 "(%.1f MB) per rank; decode steps %s", spec.start_layer, spec.end_layer, spec.model_id, spec.device,
                 spec.dtype, spec.tp_degree, model.param_bytes / 1e6, num_blocks, spec.kv_block_size,
                 runner.cache.nbytes / 1e6,
                 f"as CUDA graphs for {runner.graphs.sizes} sessions" if runner.graphs else "eager")
        return runner

    def close(self) -> None:
        """Stops the other ranks of a tensor-parallel stage; nothing to do for one process."""
        if self.ranks is not None:
            self.ranks.close()

    @torch.inference_mode()
    def forward(self, inputs: torch.Tensor, seqs: list[SeqSlice]) -> torch.Tensor:
        """The stage's layers over a step's chunks: hidden [N, hidden]; rank 0 of a group runs it on every rank."""
        return run_through(self.forward_steps(inputs, seqs))

    def forward_steps(self, inputs: torch.Tensor, seqs: list[SeqSlice]) -> Generator[None, None, torch.Tensor]:
        """forward(), suspended after each layer (see StageModel.forward_layers; run it under inference mode)."""
        attn = PagedBatch(self.cache, seqs)
        if self.ranks is None:   # the engine checked the token ids and widths, and the positions are the batch's own
            return (yield from self.model.forward_layers(inputs, attn.positions, attn, checked=True))
        # rank 0 of a group checks again before the other ranks start: a bad input found on rank 0 alone would leave
        # them waiting in an all-reduce (on a GPU this costs a host sync a step, on groups only)
        self.model.check_inputs(inputs, attn.positions, attn)
        self.ranks.forward(inputs, tuple(seqs))
        try:
            return (yield from self.model.forward_layers(inputs, attn.positions, attn, checked=True))
        except Exception as exc:   # the ranks are out of step now
            raise self.ranks.fail(f"{type(exc).__name__}: {exc}") from exc

    def read_kv(self, block_table: list[int], num_tokens: int) -> torch.Tensor:
        """K and V of a session's positions [0, num_tokens): [2, layers, num_tokens, kv heads, head dim], on the CPU
        (every head: the other ranks of a group send theirs)."""
        local = self._read_local_kv(block_table, num_tokens)
        if self.ranks is None:
            return local
        return torch.cat([local, *self.ranks.read_kv(tuple(block_table), num_tokens)], dim=3)

    def write_kv(self, block_table: list[int], kv: torch.Tensor) -> None:
        """Writes what read_kv() returned (from a stage of the same layout) into the blocks of block_table."""
        if self.ranks is not None:
            self.ranks.write_kv(tuple(block_table), kv)
        self._write_local_kv(block_table, kv[:, :, :, self.kv_heads])

    def _read_local_kv(self, block_table: list[int], num_tokens: int) -> torch.Tensor:
        cache = self.cache
        ids = torch.tensor(block_table[:-(-num_tokens // cache.block_size)], dtype=torch.long, device=cache.device)
        # each layer's blocks [blocks, block_size, H, D] -> token slots [blocks * block_size, H, D] -> the first n
        return torch.stack([torch.stack([layer[ids].flatten(0, 1)[:num_tokens] for layer in layers])
                            for layers in (cache.k, cache.v)]).cpu()

    def _write_local_kv(self, block_table: list[int], kv: torch.Tensor) -> None:
        cache, num_tokens = self.cache, kv.shape[2]
        num_blocks = -(-num_tokens // cache.block_size)
        ids = torch.tensor(block_table[:num_blocks], dtype=torch.long, device=cache.device)
        padded = torch.zeros((2, kv.shape[1], num_blocks * cache.block_size, *kv.shape[3:]), dtype=cache.dtype)
        padded[:, :, :num_tokens] = kv
        padded = padded.to(cache.device).unflatten(2, (num_blocks, cache.block_size))  # [2, L, blocks, bs, H, D]
        for layer in range(cache.num_layers):
            cache.k[layer][ids] = padded[0, layer]
            cache.v[layer][ids] = padded[1, layer]

    @torch.inference_mode()
    def run(self, batch: Batch, payloads: list[torch.Tensor | None], picking: Picking = Picking()) -> StepOutput:
        """One forward pass over every chunk of the batch; payloads[i] holds chunk i's input rows; the last stage
        picks the tokens of the chunks that ask for one as picking says."""
        return run_through(self.run_steps(batch, payloads, picking))

    def run_steps(self, batch: Batch, payloads: list[torch.Tensor | None],
                  picking: Picking = Picking()) -> Generator[None, None, StepOutput]:
        """run(), suspended after each layer: the caller may serve other work between layers of a long step (run it
        under torch.inference_mode())."""
        model, seqs, q_start = self.model, [], 0
        for chunk in batch.chunks:
            length = chunk.end - chunk.begin
            seqs.append(SeqSlice(q_start, length, chunk.start_pos, chunk.block_table))
            q_start += length
        if model.spec.is_first:
            inputs = torch.tensor([t for c in batch.chunks for t in c.item.token_ids[c.begin:c.end]])
        else:
            inputs = torch.cat(payloads)                           # [N, hidden]
        if self.graphs is not None and self.graphs.fits(seqs):   # a decode step: one graph launch
            out = self.graphs.run(seqs, inputs)                   # hidden, or the last stage's logits
            return self._last_stage_output(batch, seqs, picking, logits=out) if model.spec.is_last \
                else StepOutput(hidden=out)
        hidden = yield from self.forward_steps(inputs, seqs)
        if not model.spec.is_last:
            return StepOutput(hidden=hidden)
        return self._last_stage_output(batch, seqs, picking, hidden=hidden)

    def _last_stage_output(self, batch: Batch, seqs: list[SeqSlice], picking: Picking,
                           hidden: torch.Tensor | None = None, logits: torch.Tensor | None = None) -> StepOutput:
        """What the last stage makes of the chunks that asked for it, from the step's hidden rows or (a graph's)
        logits of every row: sampled tokens, or pooled embeddings; and the log-probabilities asked for."""
        model = self.model
        pairs = list(zip(seqs, batch.chunks, strict=True))
        rows = [s.q_start + s.q_len - 1 for s, c in pairs if c.sample and not c.item.num_draft]
        sampled = [c for c in batch.chunks if c.sample and not c.item.num_draft]
        if not model.config.has_lm_head:    # an embedding model: the prompt's last token, pooled
            vectors = model.pool(hidden[rows]) if rows else []     # [num sampled, hidden]
            return StepOutput(embeddings={c.session_id: vectors[i] for i, c in enumerate(sampled)})
        # the rows whose logits give prompt tokens' log-probabilities: (session, row, the token it predicts)
        targets = [(c.session_id, s.q_start + i, token) for s, c in pairs
                   for i, token in enumerate(picking.prompt_targets.get(c.session_id, ()))]
        # a chunk with drafted tokens: the rows of its last sampled token and of each draft, whose picks verify them
        drafted = [(s, c) for s, c in pairs if c.sample and c.item.num_draft]
        verified = [row for s, c in drafted for row in range(s.q_start + s.q_len - 1 - c.item.num_draft,
                                                             s.q_start + s.q_len)]
        every = rows + [row for _, row, _ in targets] + verified
        if not every:
            return StepOutput(tokens={})
        every_logits = model.logits(hidden[every]) if logits is None else logits[every]   # [rows, vocab]
        logits, prompt_logits = every_logits[:len(rows)], every_logits[len(rows):len(every) - len(verified)]
        tokens = _pick(sampled, logits, picking) if rows else {}
        accepted = _verify([c for _, c in drafted], every_logits[len(every) - len(verified):], picking.params, tokens)
        refused = {**(picking.masks.wait().refused if picking.masks is not None and rows else {}),
                   **_not_finite(sampled, drafted, every_logits, len(every) - len(verified))}
        prompt_logprobs: dict[str, list[Logprobs]] = {}
        if targets:
            k = [picking.params[session_id].prompt_logprobs or 0 for session_id, _, _ in targets]
            for (session_id, _, _), lp in zip(targets, token_logprobs(prompt_logits, [t for _, _, t in targets], k),
                                              strict=True):
                prompt_logprobs.setdefault(session_id, []).append(lp)
        asked = [i for i, c in enumerate(sampled) if picking.params[c.session_id].logprobs is not None]
        logprobs = {} if not asked else dict(zip([sampled[i].session_id for i in asked], token_logprobs(
            logits[asked], [tokens[sampled[i].session_id] for i in asked],
            [picking.params[sampled[i].session_id].logprobs for i in asked]), strict=True))
        return StepOutput(tokens=tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs, refused=refused,
                          accepted=accepted)


NOT_FINITE = ("the model's logits are not finite (NaN or inf) for this session: its weights or its numerics are "
              "broken")


def _not_finite(sampled: Sequence[ScheduledChunk], drafted: Sequence[tuple[object, ScheduledChunk]],
                every_logits: torch.Tensor, verified_from: int) -> dict[str, str]:
    """The sessions whose logits hold a NaN or an infinity, each with why it fails: a broken checkpoint (or a numeric
    overflow) must not hand back tokens picked from garbage (argmax takes a NaN for the largest). every_logits: the
    step's rows, the sampled ones first (in sampled's order), the drafted chunks' from verified_from; read back from
    the device once."""
    finite = torch.isfinite(every_logits).all(dim=-1).tolist()
    broken = [c.session_id for c, ok in zip(sampled, finite) if not ok]
    row = verified_from
    for _, chunk in drafted:
        if not all(finite[row:row + chunk.item.num_draft + 1]):
            broken.append(chunk.session_id)
        row += chunk.item.num_draft + 1
    return dict.fromkeys(broken, NOT_FINITE)


def _load_rank_0(spec: StageSpec, config: ModelConfig, group: list[Collectives]) -> StageModel:
    """The stage, or rank 0's shards of a tensor-parallel one, whose sums go over group[0] once it is up."""
    if spec.tp_degree == 1:
        return load_stage(spec, config)
    return load_tp_stage(spec, 0, lambda t: group[0].all_reduce(t), config)


def _num_blocks(spec: StageSpec, config: ModelConfig, kv_bytes: int) -> int:
    """KV blocks (of spec.kv_block_size tokens, this rank's KV heads) in kv_bytes; at least 2."""
    return max(2, PagedKVCache.blocks_for_bytes(kv_bytes, spec.end_layer - spec.start_layer, spec.kv_block_size,
                                                config.num_kv_heads // spec.tp_degree, config.head_dim,
                                                TORCH_DTYPES[spec.dtype]))


def _verify(chunks: list[ScheduledChunk], logits: torch.Tensor, params: Mapping[str, SamplingParams],
            tokens: dict[str, int]) -> dict[str, tuple[int, ...]]:
    """Verification of each chunk's drafted tokens (its sampling is SamplingParams.verifiable: the pick depends on
    the model's logits alone) from the logits of its last num_draft + 1 rows, in chunk order: each row's pick as a
    step of one token would pick it there (the argmax; or a sampled one's draw keyed by its seed and that
    position), the drafts kept up to the first that differs from its row's pick, and that pick (or the last row's)
    after them; returns the kept drafts by session, the picks go in tokens. So the output is exactly decoding's a
    token a step: a sampled draft is kept with its row's probability of it, and where it is not, the token comes
    from that row's distribution without it (the maximal coupling: rejection sampling with one draw)."""
    accepted, row = {}, 0
    for chunk in chunks:
        drafts = chunk.item.token_ids[-chunk.item.num_draft:]
        rows = logits[row:row + len(drafts) + 1]
        row += len(drafts) + 1
        sampling = params[chunk.session_id]
        if sampling.is_greedy:
            picks = rows.argmax(dim=-1).tolist()
        else:
            first = chunk.start_pos + chunk.num_tokens - len(drafts)        # the first draft's position
            picks = sample_rows(rows, [sampling] * len(rows), list(range(first, first + len(rows))))
        kept = next((i for i, (draft, pick) in enumerate(zip(drafts, picks)) if draft != pick), len(drafts))
        accepted[chunk.session_id], tokens[chunk.session_id] = tuple(drafts[:kept]), picks[kept]
    return accepted


def _pick(chunks: list[ScheduledChunk], logits: torch.Tensor, picking: Picking) -> dict[str, int]:
    """Each chunk's next token from its row of logits [num chunks, vocab], computed where the logits are (only the
    picked ids come back to the host): the rows whose params change their logits processed first (on a copy: the
    logits stay the model's; their histories: what their penalties count) and those of constrained sessions masked
    to what their grammars allow (waiting here for the masks), then the greedy ones by one argmax, the others by one
    sample_rows() keyed by (seed, position), so that every device draws the same token (a session its grammar
    refused gets one too, which means nothing: StepMasks.refused)."""
    sampling, masks = picking.params, picking.masks
    processed = [i for i, c in enumerate(chunks) if sampling[c.session_id].processes_logits]
    constrained = [i for i, c in enumerate(chunks) if masks is not None and c.session_id in masks.rows]
    if processed or constrained:
        logits = logits.float().clone()
    if processed:
        ids = [chunks[i].session_id for i in processed]
        logits[processed] = processed_logits(logits[processed], [sampling[s] for s in ids],
                                             [picking.histories.get(s, NO_HISTORY) for s in ids])
    if constrained:     # structured output: the tokens its grammar does not allow cannot be picked
        bitmask = masks.wait().bitmask[[masks.rows[chunks[i].session_id] for i in constrained]]
        logits[constrained] = masked_logits(logits[constrained], bitmask.to(logits.device),
                                            may_ban=any(sampling[chunks[i].session_id].min_tokens for i in constrained))
    greedy = [i for i, c in enumerate(chunks) if sampling[c.session_id].is_greedy]
    picks = logits[greedy].argmax(dim=-1).tolist() if greedy else []
    tokens = {chunks[i].session_id: token for i, token in zip(greedy, picks, strict=True)}
    sampled = [i for i, c in enumerate(chunks) if c.session_id not in tokens]
    if sampled:
        # the position of each new token: its chunk's end
        positions = [chunks[i].start_pos + chunks[i].end - chunks[i].begin for i in sampled]
        drawn = sample_rows(logits[sampled], [sampling[chunks[i].session_id] for i in sampled], positions)
        tokens.update((chunks[i].session_id, token) for i, token in zip(sampled, drawn, strict=True))
    return tokens
