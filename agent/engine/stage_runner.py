"""The only part of the agent that touches the device: loaded stages, session KV caches, forward passes."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from stratamesh.fleet.errors import InvalidInput
from stratamesh.fleet.types import Assignment, SessionOpen, StepChunk, TensorBlob
from stratamesh.kernels import codec
from stratamesh.kernels.models.decoder import StageModel, load_stage
from stratamesh.kernels.ops.sampler import sample

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Session:
    """One generation as this stage sees it: where it goes next and its KV cache."""

    open: SessionOpen
    cache: Any
    next_pos: int = 0


@dataclass(frozen=True, slots=True)
class StepResult:
    """A step's output: hidden states for the next stage, or the token the last stage sampled."""

    hidden: TensorBlob | None = None
    token_id: int | None = None


@dataclass(slots=True)
class _Loaded:
    assignment: Assignment
    model: StageModel
    sessions: set[str] = field(default_factory=set)


class StageRunner:
    """Runs the stages assigned to this agent; call it from one thread only."""

    def __init__(self) -> None:
        self._stages: dict[str, _Loaded] = {}
        self._sessions: dict[str, Session] = {}

    # ------------------------------------------------------------ stages
    def load(self, assignment: Assignment) -> int:
        """Loads the stage's own tensors (idempotent per assignment id); returns its parameter bytes."""
        loaded = self._stages.get(assignment.assignment_id)
        if loaded is None:
            model = load_stage(assignment.stage)
            loaded = self._stages[assignment.assignment_id] = _Loaded(assignment, model)
            log.info("loaded %s layers [%d, %d) of %s: %.1f MB", assignment.assignment_id,
                     assignment.stage.start_layer, assignment.stage.end_layer,
                     assignment.stage.model_id, model.param_bytes / 1e6)
        return loaded.model.param_bytes

    def release(self, assignment_id: str) -> None:
        """Drops a stage and every session on it."""
        loaded = self._stages.pop(assignment_id, None)
        if loaded is not None:
            for session_id in loaded.sessions:
                self._sessions.pop(session_id, None)

    def assignments(self) -> list[Assignment]:
        return [loaded.assignment for loaded in self._stages.values()]

    def tensor_names(self) -> list[str]:
        return sorted({name for loaded in self._stages.values() for name in loaded.model.tensor_names})

    def param_bytes(self) -> int:
        return sum(loaded.model.param_bytes for loaded in self._stages.values())

    # ------------------------------------------------------------ sessions
    @property
    def num_sessions(self) -> int:
        return len(self._sessions)

    def session(self, session_id: str) -> Session | None:
        return self._sessions.get(session_id)

    def sessions_via(self, address: str) -> list[str]:
        """Sessions whose next hop is address."""
        return [sid for sid, s in self._sessions.items() if s.open.route and s.open.route[0].address == address]

    def open(self, message: SessionOpen) -> Session:
        """Starts a session on one of this agent's stages."""
        loaded = self._stages.get(message.assignment_id)
        if loaded is None:
            raise InvalidInput(f"open.assignment_id {message.assignment_id!r} is not served here")
        if message.session_id in self._sessions:
            raise InvalidInput(f"open.session_id {message.session_id!r} is already open")
        if loaded.model.spec.is_last != (not message.route):
            raise InvalidInput("open.route must be empty exactly when this is the last stage")
        session = self._sessions[message.session_id] = Session(message, loaded.model.new_cache())
        loaded.sessions.add(message.session_id)
        return session

    def close(self, session_id: str) -> Session | None:
        """Ends a session and frees its cache; returns it if it was open."""
        session = self._sessions.pop(session_id, None)
        if session is not None:
            loaded = self._stages.get(session.open.assignment_id)
            if loaded is not None:
                loaded.sessions.discard(session_id)
        return session

    # ------------------------------------------------------------ compute
    def run(self, chunk: StepChunk) -> StepResult:
        """Runs one chunk through this stage's layers; samples on the last stage when asked."""
        session = self._sessions.get(chunk.session_id)
        if session is None:
            raise InvalidInput(f"chunk.session_id {chunk.session_id!r} is not open here")
        model = self._stages[session.open.assignment_id].model
        if chunk.start_pos != session.next_pos:
            raise InvalidInput(f"chunk.start_pos is {chunk.start_pos}, expected {session.next_pos}")
        inputs = self._inputs(model, chunk)
        num_tokens = inputs.shape[0]
        if chunk.start_pos + num_tokens > model.config.max_position_embeddings:
            raise InvalidInput(f"session exceeds the context of {model.config.max_position_embeddings}")
        positions = torch.arange(chunk.start_pos, chunk.start_pos + num_tokens)
        with torch.inference_mode():
            hidden = model.forward(inputs, positions, session.cache)  # [T, hidden]
            session.next_pos += num_tokens
            if not model.spec.is_last:
                return StepResult(hidden=codec.encode(hidden))
            if not chunk.sample:
                return StepResult()
            logits = model.logits(hidden[-1:])[0]  # [vocab]
        token = sample(logits, session.open.sampling, position=session.next_pos)
        return StepResult(token_id=token)

    @staticmethod
    def _inputs(model: StageModel, chunk: StepChunk) -> torch.Tensor:
        config = model.config
        if model.spec.is_first:
            if not chunk.token_ids:
                raise InvalidInput("chunk.token_ids is empty on a first stage")
            if min(chunk.token_ids) < 0 or max(chunk.token_ids) >= config.vocab_size:
                raise InvalidInput(f"chunk.token_ids must lie in [0, {config.vocab_size})")
            return torch.tensor(chunk.token_ids, dtype=torch.long)
        if chunk.hidden is None:
            raise InvalidInput("chunk.hidden is missing on a stage after the first")
        hidden = codec.decode(chunk.hidden)
        if hidden.dim() != 2 or hidden.shape[1] != config.hidden_size or hidden.shape[0] == 0:
            raise InvalidInput(f"chunk.hidden has shape {tuple(hidden.shape)}, "
                               f"expected [tokens, {config.hidden_size}]")
        return hidden.to(model.dtype)
