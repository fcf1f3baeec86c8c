"""Speculative decoding's draft_model proposer: a small model sharing the target's tokenizer guesses each
generation's next tokens where its decode loop runs (the last stage's agent, which feeds the first stage), for
the pipeline to verify in one trip (fleet.sessions.Speculation).

The draft is served as a stage is: the whole model as one stage, its own paged KV cache (agent.engine.scheduler's
sessions and blocks) and batched steps: the sessions that draft after one step of the target draft together, their
catch-up chunks in one pass, then a token a pass. A session's draft KV follows what the target kept: at its next
turn the positions past the longest prefix its tokens share with the draft's are forgotten and recomputed (the
rejected guesses, and the token the target picked instead)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from stratamesh.agent.engine.block_manager import BlockManager
from stratamesh.agent.engine.scheduler import Scheduler
from stratamesh.agent.engine.sequence import WorkItem, shared_prefix
from stratamesh.agent.engine.stage_runner import Picking, StageRunner
from stratamesh.fleet.errors import CheckpointError, InvalidInput
from stratamesh.fleet.sessions import SamplingParams
from stratamesh.fleet.stages import StageSpec
from stratamesh.kernels.models.config import read_config
from stratamesh.kernels.models.decoder import load_stage

DRAFT_KV_TOKENS = 16384         # the draft's KV cache, in tokens across its sessions (past it, the newest wait)
DRAFT_BATCH_TOKENS = 2048       # tokens in one pass of the draft (catch-up chunks longer than it take several)
_GREEDY = SamplingParams()


class DraftModel:
    """A draft model on this agent: propose() guesses, for a batch of sessions, each one's next tokens (greedy)."""

    def __init__(self, model_dir: str | Path, device: str = "cpu", dtype: str = "float32",
                 kv_tokens: int = DRAFT_KV_TOKENS) -> None:
        """Loads the model in model_dir (a Hugging Face folder with an LM head) onto device, with KV for
        kv_tokens tokens; InvalidInput says why it cannot be a draft."""
        try:
            config = read_config(model_dir)
        except (OSError, ValueError, CheckpointError) as e:
            raise InvalidInput(f"draft model {str(model_dir)!r} cannot be read: {e}") from e
        if not config.has_lm_head:
            raise InvalidInput(f"draft model {str(model_dir)!r} has no LM head")
        spec = StageSpec(model_id=Path(model_dir).name, model_path=str(model_dir), start_layer=0,
                         end_layer=config.num_layers, num_layers=config.num_layers, dtype=dtype, device=device)
        self.vocab_size = config.vocab_size
        self.runner = StageRunner(load_stage(spec, config), max(2, kv_tokens // spec.kv_block_size))
        self.scheduler = Scheduler(BlockManager(self.runner.num_blocks, spec.kv_block_size, enable_prefix_cache=False),
                                   DRAFT_BATCH_TOKENS)

    @torch.inference_mode()
    def propose(self, requests: Mapping[str, tuple[Sequence[int], int]]) -> dict[str, tuple[int, ...]]:
        """session id -> (its tokens so far, how many to guess after them): the guesses, by session. The draft's KV
        cache holds the sessions between their turns; where it cannot take a session's catch-up, the sessions not
        drafting now leave it, and a session it cannot hold even so gets fewer guesses (or none) this turn."""
        wanted: dict[str, int] = {}
        for session_id, (tokens, most) in requests.items():
            if most > 0 and tokens:
                self._catch_up(session_id, tokens)
                wanted[session_id] = most
        drafts: dict[str, list[int]] = {session_id: [] for session_id in wanted}
        while wanted:
            if (batch := self.scheduler.schedule()) is None:     # a catch-up waits for blocks others hold
                if not self._evict_idle(requests):
                    break
                continue
            output = self.runner.run(batch, [None] * len(batch.chunks),
                                     Picking({c.session_id: _GREEDY for c in batch.chunks}))
            self.scheduler.postprocess(batch)
            for session_id in batch.preempted:          # out of blocks: it starts afresh at its next turn
                self.scheduler.close(session_id)
                wanted.pop(session_id, None)
            for chunk in batch.chunks:
                if not chunk.sample or chunk.session_id not in wanted:
                    continue
                guesses = drafts[chunk.session_id]
                guesses.append(output.tokens[chunk.session_id])
                if len(guesses) < wanted[chunk.session_id]:
                    self.scheduler.add(WorkItem(chunk.session_id, chunk.start_pos + chunk.num_tokens,
                                                (guesses[-1],), True))
                else:
                    del wanted[chunk.session_id]
        for session_id in wanted:       # it could not run even alone: it starts afresh at its next turn
            self.scheduler.close(session_id)
        return {session_id: tuple(guesses) for session_id, guesses in drafts.items()}

    def _evict_idle(self, requests: Mapping[str, object]) -> bool:
        """Frees the KV of the sessions not drafting now (a cache: each catches up at its next turn); whether any."""
        idle = [session_id for session_id in self.scheduler.sessions if session_id not in requests]
        for session_id in idle:
            self.scheduler.close(session_id)
        return bool(idle)

    def _catch_up(self, session_id: str, tokens: Sequence[int]) -> None:
        """Queues the session's tokens the draft has not computed: past the longest prefix they share with those it
        has (its guesses the target rejected are forgotten), at least the last one (whose pick is the first guess)."""
        session = self.scheduler.sessions.get(session_id)
        if session is None:
            self.scheduler.open(session_id, tokens, 0)
            start = 0
        else:
            start = min(shared_prefix(tokens, session.token_ids), session.num_computed, len(tokens) - 1)
            self.scheduler.rewind(session_id, start)
        self.scheduler.add(WorkItem(session_id, start, tuple(tokens[start:]), True))

    def forget(self, session_id: str) -> None:
        """The session ended: its draft KV goes."""
        self.scheduler.close(session_id)
