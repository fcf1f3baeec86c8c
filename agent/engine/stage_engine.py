"""One stage's engine, nano-vllm's loop across sessions: schedule() -> run() -> postprocess()."""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Generator
from dataclasses import dataclass, field, replace

import torch

from stratamesh.agent.engine.block_manager import BlockManager
from stratamesh.agent.engine.grammars import Grammars
from stratamesh.agent.engine.micro_batches import MicroBatches
from stratamesh.agent.engine.proposers import Proposers
from stratamesh.agent.engine.scheduler import Batch, ScheduledChunk, Scheduler, WorkItem
from stratamesh.agent.engine.stage_runner import Picking, StageRunner, StepOutput
from stratamesh.fleet.errors import InvalidInput
from stratamesh.fleet.kv import KvLayout
from stratamesh.fleet.sessions import (Hop, Logprobs, SessionClose, SessionHold, SessionOpen, SessionRewind,
                                       Speculation, StepBatch, StepChunk, StepChunks, TokenEvent, wire_dtype)
from stratamesh.fleet.stages import Assignment
from stratamesh.kernels import codec
from stratamesh.kernels.models.decoder import run_through
from stratamesh.kernels.ops.moe import ExpertLoad
from stratamesh.kernels.ops.sampler import History

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """How a stage batches: the KV cache budget, the per-step limits, prefix caching."""

    kv_cache_bytes: int = 0                 # a CPU stage's KV cache; 0: what its plan reserved (memory.cpu_kv_bytes)
    gpu_memory_utilization: float = 0.9     # a GPU stage's weights, workspace and KV cache take this share of it
    cuda_graphs: bool = True                # a GPU stage replays its decode steps as CUDA graphs (else eager)
    max_batch_tokens: int = 512
    max_batch_seqs: int = 64
    enable_prefix_cache: bool = True
    # An ONNX Runtime stage's threads, which spin through its runs: an agent whose stages all run in ONNX Runtime
    # gives them its threads and torch one (agent.daemon); 0: torch's threads, sleeping when idle.
    onnx_threads: int = 0
    # The first stage waits up to this long for the tokens of a step's other sessions, so that decodes
    # arriving one message per session from the origin still run as one batch.
    coalesce_s: float = 0.004

    def __post_init__(self) -> None:
        if not 0 < self.gpu_memory_utilization <= 1:
            raise InvalidInput(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")


@dataclass(slots=True)
class Outbox:
    """What a step or a message asks the data plane to send, in order."""

    # each to the stage its hop names: the address it listens on and the assignment it serves there
    stage_messages: list[tuple[Hop, StepBatch | StepChunks | SessionOpen | SessionClose | SessionHold
                               | SessionRewind]] = field(default_factory=list)
    events: list[tuple[str, TokenEvent]] = field(default_factory=list)


# How many tokens a speculating session drafts: by the session's recent acceptance a (the n-th drafted token is kept
# with probability about a^n), as many as give the most tokens a second once its cycles say what a drafted token
# costs, each more only while it is likely enough to be kept before; none on a busy last stage, where a wider step
# costs more than the trips it saves.
ACCEPTANCE_DECAY = 0.9      # each step, the weight left to what the steps before said of a session's drafts
DRAFT_WORTH = 0.25          # the n-th token is drafted while a^n is at least this
BUSY_SESSIONS = 8           # a last stage holding more sessions than this (decoding or prefilling) drafts none
# Keeping the ring full (PipeInfer's continuous speculation): while a session's run is on its way around the
# pipeline, the last stage sends the next one behind it, drafted on as if the run were kept whole (its first token
# the draft's guess at the pick after it), while that guess is likely enough to be right (a^(its unverified tokens
# ahead + 1) >= DRAFT_WORTH), up to MAX_RUNS in the pipeline, on a last stage holding at most FOLLOW_SESSIONS
# sessions (the stages would otherwise idle through the trip), never on a pipeline of one stage. A run whose guess
# was wrong is dropped wherever it has got to (SessionRewind, sent ahead of the next run).
FOLLOW_SESSIONS = 2
MAX_RUNS = 4
CYCLE_DECAY = 0.95          # each cycle, the weight left to the cycles before in a session's CycleFit
MIN_DRAFT_SPREAD = 0.5      # a CycleFit says what a drafted token costs once its counts vary this much (variance)


@dataclass(slots=True)
class CycleFit:
    """A session's decode cycles (from one of its chunks reaching the last stage to the next one: the last stage's
    step, the drafting, and the trip around the ring) as base + per_token x the drafted tokens the next one carries,
    by least squares over its recent cycles (decayed by CYCLE_DECAY a cycle)."""

    weight: float = 0.0
    sum_x: float = 0.0
    sum_y: float = 0.0
    sum_xx: float = 0.0
    sum_xy: float = 0.0

    def add(self, num_draft: int, seconds: float) -> None:
        d = CYCLE_DECAY
        self.weight, self.sum_x, self.sum_y = self.weight * d + 1, self.sum_x * d + num_draft, self.sum_y * d + seconds
        self.sum_xx, self.sum_xy = self.sum_xx * d + num_draft ** 2, self.sum_xy * d + num_draft * seconds

    def line(self) -> tuple[float, float] | None:
        """(base seconds, seconds a drafted token adds); None until the drafted counts varied enough to tell."""
        if self.weight < 2:
            return None
        mean_x, mean_y = self.sum_x / self.weight, self.sum_y / self.weight
        spread = self.sum_xx / self.weight - mean_x ** 2
        if spread < MIN_DRAFT_SPREAD:
            return None
        per_token = max(0.0, (self.sum_xy / self.weight - mean_x * mean_y) / spread)
        return max(mean_y - per_token * mean_x, 1e-6), per_token


@dataclass(frozen=True, slots=True)
class Run:
    """A step a decode loop fed the first stage and has not verified yet."""

    step: int
    start_pos: int
    token_ids: tuple[int, ...]
    after_ns: int = 0           # a verification's answer: when the chunk verified reached the last stage (else 0)
    follows: bool = False       # it followed an unverified run in (its first token a guess too)

    @property
    def end_pos(self) -> int:
        return self.start_pos + len(self.token_ids)


@dataclass(slots=True)
class DecodeLoop:
    """A generation's decode loop as its last stage runs it: each sampled token goes on to the first stage (feed)
    as the next step, until the generation's last token or a hold."""

    feed: Hop
    tokens_left: int | None             # tokens it may still sample; None: no limit
    stop_token_ids: frozenset[int]
    held: bool = False                  # the origin asked for a hold: the next token is the last one fed nowhere
    speculation: Speculation | None = None      # each step it feeds carries tokens drafted so
    follow: bool = False        # every stage of its route takes runs following unverified ones (open.follow_runs)
    kept: float = 0.0           # drafted tokens kept, and steps whose drafts were not all kept, decayed by
    missed: float = 0.0         # ACCEPTANCE_DECAY a step
    cycles: CycleFit = field(default_factory=CycleFit)
    runs: deque[Run] = field(default_factory=deque)     # fed and not verified yet, oldest first
    next_step: int = 0
    valid_from: int = 0         # chunks of earlier steps followed drafts that were rejected: dropped on arrival
    over: bool = False          # its last token is sampled (kept only to drop the runs still on their way)

    @classmethod
    def of(cls, message: SessionOpen) -> DecodeLoop | None:
        if message.feed is None:
            return None
        return cls(message.feed, message.max_new_tokens or None, frozenset(message.stop_token_ids),
                   speculation=message.speculation, follow=message.follow_runs)

    def fed(self, run: Run) -> None:
        """It sent run to the first stage."""
        self.runs.append(run)
        self.next_step = run.step + 1

    def drops(self, step: int) -> bool:
        """Whether its chunk of step, arriving at the last stage, is dropped: a run that followed one whose drafts
        were rejected, or one still on its way when the loop ended."""
        return self.over or step < self.valid_from

    def verifying(self, step: int) -> Run | None:
        """The run of step is being verified: it leaves the runs in flight (None: a chunk the loop did not feed)."""
        if self.runs and self.runs[0].step == step:
            return self.runs.popleft()
        return None

    def goes_on(self, num_draft: int, num_kept: int, token: int) -> bool:
        """After a verification that kept num_kept of num_draft drafted tokens and picked token: whether the next
        run in flight goes on from there (all kept, and its first token is that pick)."""
        return bool(self.runs) and num_kept == num_draft and self.runs[0].token_ids[0] == token

    def abandon(self) -> bool:
        """The runs in flight will never be verified (a rejection before them, or the loop's end): their chunks are
        dropped as they arrive (every step fed so far); whether there were any."""
        self.valid_from = self.next_step
        abandoned = bool(self.runs)
        self.runs.clear()
        return abandoned

    def num_to_follow(self, most: int) -> int:
        """How many tokens the next run following those in flight carries (its guessed first token and at least one
        drafted after it; 0: none follows): while the guess is likely enough to be right, within MAX_RUNS, before
        any stop token, and none past the generation's end."""
        if not self.follow or self.held or self.over or not self.runs or len(self.runs) >= MAX_RUNS:
            return 0
        ahead = sum(len(run.token_ids) for run in self.runs) - 1    # (the first run's first token is verified)
        if self.acceptance ** (ahead + 1) < DRAFT_WORTH:
            return 0
        if any(token in self.stop_token_ids for run in self.runs for token in run.token_ids):
            return 0
        room = most if self.tokens_left is None else self.tokens_left - ahead - 2
        drafts = min(self.num_to_draft(most), room)
        return 1 + drafts if drafts > 0 else 0

    def frontier(self, known: list[int]) -> list[int]:
        """Its tokens as if every run in flight were kept whole: the known ones up to the first run's start (whose
        first token, the pick after them, is verified), then the runs'."""
        tokens = known[:self.runs[0].start_pos] if self.runs else list(known)
        for run in self.runs:
            tokens.extend(run.token_ids)
        return tokens

    @property
    def unverified_from(self) -> int:
        """Where its tokens the last stage has not verified start (it has runs in flight)."""
        return self.runs[0].start_pos + 1

    def verified(self, num_draft: int, num_kept: int) -> None:
        """Its last step carried num_draft drafted tokens, of which num_kept were kept."""
        self.kept, self.missed = self.kept * ACCEPTANCE_DECAY, self.missed * ACCEPTANCE_DECAY
        if num_draft:
            self.kept += num_kept
            self.missed += num_kept < num_draft

    def arrived(self, run: Run | None, arrived_ns: int, num_draft: int) -> None:
        """Its run, carrying num_draft drafted tokens, reached this stage at arrived_ns: where the run was sent as a
        verification's answer (not following another), a cycle ended (that chunk's arrival to this one's)."""
        if run is not None and 0 < run.after_ns < arrived_ns:
            self.cycles.add(num_draft, (arrived_ns - run.after_ns) / 1e9)

    @property
    def acceptance(self) -> float:
        """The chance that a drafted token is kept, given the one before it was: its recent drafts' (a prior of 3 in
        4 while they say little; steps without drafts let it drift back there, so a session tries again)."""
        return (self.kept + 3) / (self.kept + self.missed + 4)

    def num_to_draft(self, most: int) -> int:
        """How many tokens to draft next: at most `most` and num_speculative_tokens, and none that the loop would
        not go on to sample; where its cycles tell what a drafted token costs, the count that gives the most tokens
        a second (the kept tokens expected, plus one, over the cycle's time), else as many as its acceptance makes
        worth it (DRAFT_WORTH)."""
        spec = self.speculation
        if spec is None or self.held:
            return 0
        a = self.acceptance
        most = min(most, spec.num_speculative_tokens, (self.tokens_left or most + 1) - 1)
        if most <= 0:
            return 0
        if (line := self.cycles.line()) is None:
            return min(most, math.floor(math.log(DRAFT_WORTH) / math.log(a)))
        base, per_token = line
        return max(range(most + 1), key=lambda n: (1 - a ** (n + 1)) / (1 - a) / (base + per_token * n))

    def sampled(self, token: int) -> bool:
        """Counts a sampled token; whether the loop goes on with it (the loop is over otherwise)."""
        if self.tokens_left is not None:
            self.tokens_left -= 1
        return not (self.held or self.tokens_left == 0 or token in self.stop_token_ids)


@dataclass(slots=True)
class SpeculationCounts:
    """A last stage's speculative decoding so far (vLLM's spec_decode counters): steps that carried drafted tokens,
    the tokens drafted, and those the model agreed with."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_followers: int = 0              # runs sent following an unverified one into the pipeline
    num_followers_verified: int = 0     # ... that were verified (the others were dropped where they had got to)

    def counted(self, num_draft: int, num_accepted: int) -> None:
        if num_draft:
            self.num_drafts += 1
            self.num_draft_tokens += num_draft
            self.num_accepted_tokens += num_accepted


@dataclass(frozen=True, slots=True)
class SessionKv:
    """A quiet session as it moves between stages of one layer range: its state and the KV of its computed positions."""

    session_id: str
    token_ids: tuple[int, ...]
    prompt_len: int
    num_computed: int
    kv: torch.Tensor            # [2, layers, num_computed, kv heads, head dim]: K then V


class StageEngine:
    """Serves one assignment: sessions, their queued chunks, batching, and where the results go."""

    def __init__(self, assignment: Assignment, runner: StageRunner, config: EngineConfig):
        self.assignment = assignment
        self.runner = runner
        block_manager = BlockManager(runner.num_blocks, assignment.stage.kv_block_size,
                                     config.enable_prefix_cache)
        self.scheduler = Scheduler(block_manager, config.max_batch_tokens, config.max_batch_seqs)
        self.sessions: dict[str, SessionOpen] = {}
        self.parked: set[str] = set()   # imported sessions waiting for the SessionOpen that resumes them
        self.loops: dict[str, DecodeLoop] = {}   # last stage: the decode loop of each generating session
        # last stage: the log-probabilities of a session's prompt tokens so far, sent with its first token
        self._prompt_logprobs: dict[str, list[Logprobs]] = {}
        config = runner.model.config
        self.grammars = Grammars(assignment.stage.model_path, config.vocab_size, config.eos_token_ids)
        self.micro_batching = MicroBatches()     # first stage: how many micro-batches its decodes circulate in
        self._left_ns: dict[str, tuple[int, int]] = {}   # first stage: session -> (batch size, end ns) of its step
        self.speculation = SpeculationCounts()   # last stage: what its verifications of drafted tokens kept
        self._to_follow: list[str] = []         # last stage: sessions whose loops went on in its last step
        stage = assignment.stage
        self.proposers = Proposers(stage.model_path, config.vocab_size, stage.device,   # last stage: drafts
                                   stage.dtype if stage.device != "cpu" else "float32")

    @property
    def is_first(self) -> bool:
        return self.assignment.stage.is_first

    @property
    def expert_load(self) -> ExpertLoad | None:
        """A mixture of experts' stage: where its routers sent tokens (None for a dense one, or a runtime that
        does not count them)."""
        return getattr(self.runner.model, "expert_load", None)

    @property
    def is_last(self) -> bool:
        return self.assignment.stage.is_last

    # ------------------------------------------------------------ messages
    def open(self, message: SessionOpen, outbox: Outbox) -> None:
        """Opens a session; passes the open on, or (last stage) answers the origin."""
        if message.session_id in self.sessions:
            raise InvalidInput(f"open.session_id {message.session_id!r} is already open")
        if message.revision != self.assignment.stage.revision:
            raise InvalidInput(f"open.revision {message.revision!r} is not this stage's revision "
                               f"{self.assignment.stage.revision!r}: a pipeline never mixes revisions of a model")
        if self.is_last != (not message.route):
            raise InvalidInput("open.route must be empty exactly when this is the last stage")
        self._check_ids(message.prompt_token_ids, "open.prompt_token_ids")
        if not 0 <= message.output_start <= len(message.prompt_token_ids):
            raise InvalidInput(f"open.output_start {message.output_start} lies outside its "
                               f"{len(message.prompt_token_ids)} prompt_token_ids")
        if self.is_last and message.feed is not None and message.speculation is not None:
            self.proposers.open(message.session_id, message.speculation)    # (its draft model loaded, if new)
        cached = self._resume(message) if message.resume_from else None
        if cached is None:
            cached = self.scheduler.open(message.session_id, list(message.prompt_token_ids),
                                         message.max_cached_tokens)
        self.sessions[message.session_id] = message
        loop = DecodeLoop.of(message) if self.is_last and self.runner.model.config.has_lm_head else None
        if loop is not None:
            self.loops[message.session_id] = loop
        if self.is_first:
            self.scheduler.pipeline_depth = len(message.route) + 1
        if message.route:
            outbox.stage_messages.append((message.route[0], message.forwarded(cached)))
        else:
            event = TokenEvent(message.session_id, -1, opened=True,
                               cached_tokens=min(cached, message.max_cached_tokens))
            outbox.events.append((message.origin, event))

    def add(self, chunk: StepChunk, rows: torch.Tensor | None, arrived_ns: int = 0) -> None:
        """Queues a chunk; rows are its input hidden states on stages after the first."""
        if chunk.session_id not in self.sessions:
            raise InvalidInput(f"chunk.session_id {chunk.session_id!r} is not open here")
        self._check_ids(chunk.token_ids, "chunk.token_ids")
        if not self.is_first and rows is None:
            raise InvalidInput("chunk without hidden states on a stage after the first")
        if (loop := self.loops.get(chunk.session_id)) is not None and loop.drops(chunk.step):
            log.debug("session %s: run %d dropped (it followed drafts that were rejected)", chunk.session_id,
                      chunk.step)
            return
        self.scheduler.add(WorkItem(chunk.session_id, chunk.start_pos, chunk.token_ids, chunk.sample,
                                    chunk.step, rows, arrived_ns, chunk.trace_id, chunk.num_draft,
                                    chunk.pending_from))
        # (a run that followed another in came right behind it, not around the pipeline: it says nothing of a trip)
        left = self._left_ns.pop(chunk.session_id, None) if self.is_first and not chunk.pending_from else None
        if left is not None and arrived_ns > left[1]:       # its token came back around the pipeline
            self.micro_batching.returned(left[0], (arrived_ns - left[1]) / 1e9)

    def close(self, session_id: str, outbox: Outbox) -> SessionOpen | None:
        """Ends a session here and passes the close on."""
        message = self.sessions.pop(session_id, None)
        if message is None:
            return None
        self.loops.pop(session_id, None)
        self.proposers.close(session_id)
        self._left_ns.pop(session_id, None)
        self._prompt_logprobs.pop(session_id, None)
        self.grammars.close(session_id)
        self.scheduler.close(session_id)
        if message.route:
            outbox.stage_messages.append((message.route[0], SessionClose(session_id)))
        return message

    def rewind(self, message: SessionRewind, outbox: Outbox) -> None:
        """Drops the session's rejected drafts and the runs that followed them here, and passes the rewind on up to the
        stage before the last (which sent it, having dropped its own)."""
        opened = self.sessions.get(message.session_id)
        if opened is None:
            return                      # it ended already
        self.scheduler.reject(message.session_id, message.position)
        if len(opened.route) > 1:
            outbox.stage_messages.append((opened.route[0], message))

    def hold(self, session_id: str, outbox: Outbox) -> None:
        """Passes a hold on to the last stage, which feeds the first stage no further token of the session."""
        message = self.sessions.get(session_id)
        if message is None:
            return                      # it ended already: nothing to hold
        if message.route:
            outbox.stage_messages.append((message.route[0], SessionHold(session_id)))
        elif session_id in self.loops:
            self.loops[session_id].held = True

    def _resume(self, message: SessionOpen) -> int | None:
        """Adopts the session the open resumes, if it is here (live or imported); its cached tokens, else None."""
        old = message.resume_from
        if old in self.sessions:       # (open() refused a session_id that is open already)
            del self.sessions[old]
            self.loops.pop(old, None)
            self.proposers.close(old)
            self.grammars.close(old)    # its new id's matcher is built from the output it is given
        elif old in self.parked:
            self.parked.discard(old)
        else:
            return None
        return self.scheduler.resume(old, message.session_id, message.prompt_token_ids, message.max_cached_tokens)

    # ------------------------------------------------------------ KV migration
    def kv_layout(self) -> KvLayout:
        spec, cache = self.assignment.stage, self.runner.cache
        # every KV head, whether one process holds them or the ranks of a group split them: read_kv gathers them
        return KvLayout(spec.model_id, spec.start_layer, spec.end_layer, codec.DTYPE_NAMES[cache.dtype],
                        cache.block_size, self.runner.model.config.num_kv_heads, cache.head_dim)

    def prefilled(self, session_id: str) -> bool:
        """Whether the session is open here with its whole prompt computed and nothing queued (it can be exported)."""
        session = self.scheduler.sessions.get(session_id)
        return session is not None and session.num_computed >= session.prompt_len and not session.queue

    def export_session(self, session_id: str) -> SessionKv:
        """A quiet session's state and KV (InvalidInput if it is not open here or has work queued)."""
        if session_id not in self.sessions:
            raise InvalidInput(f"session_id {session_id!r} is not open on {self.assignment.assignment_id}")
        self.scheduler.drop_unverified(session_id)     # runs that followed the loop's last verified one
        session = self.scheduler.quiet(session_id)
        table = self.scheduler.block_manager.block_table(session_id)
        tokens, num_computed = session.token_ids, session.num_computed
        if session.drafted_from is not None:    # verified positions only: drafts past them may have been rejected
            num_computed = min(num_computed, session.drafted_from)      # (their next step, which says, never came)
            tokens = tokens[:num_computed]
        return SessionKv(session_id, tuple(tokens), session.prompt_len, num_computed,
                         self.runner.read_kv(table, num_computed))

    def drop(self, session_id: str) -> None:
        """Forgets a session that moved away; unlike close(), nothing is sent on."""
        if self.sessions.pop(session_id, None) is not None:
            self.loops.pop(session_id, None)
            self.proposers.close(session_id)
            self._left_ns.pop(session_id, None)
            self.grammars.close(session_id)
            self.scheduler.close(session_id)

    def import_session(self, kv: SessionKv) -> None:
        """Holds an exported session, KV written to blocks of its own, until an open resumes it."""
        if kv.session_id in self.sessions or kv.session_id in self.parked:
            raise InvalidInput(f"session_id {kv.session_id!r} is already here")
        self._check_ids(kv.token_ids, "kv header.token_ids")
        self.scheduler.import_session(kv.session_id, kv.token_ids, kv.prompt_len, kv.num_computed,
                                      lambda table: self.runner.write_kv(table, kv.kv))
        self.parked.add(kv.session_id)

    def unpark(self, session_id: str) -> bool:
        """Frees an imported session nobody resumed; False if it was resumed (or never here)."""
        if session_id not in self.parked:
            return False
        self.parked.discard(session_id)
        self.scheduler.close(session_id)
        return True

    def _check_ids(self, token_ids: tuple[int, ...], field_name: str) -> None:
        vocab = self.runner.model.config.vocab_size
        if token_ids and not 0 <= min(token_ids) <= max(token_ids) < vocab:
            raise InvalidInput(f"{field_name} must lie in [0, {vocab})")

    # ------------------------------------------------------------ steps
    def wants_more_decodes(self) -> bool:
        """First stage only: more of this step's decodes are on their way from the origin (never for an
        embedding model: its sessions end after the prompt, so none is on its way)."""
        return self.is_first and self.runner.model.config.has_lm_head and self.scheduler.wants_more_decodes()

    def schedule(self) -> Batch | None:
        if not self.scheduler.has_work:
            return None
        if self.is_first:
            scheduler = self.scheduler
            self._set_micro_batches(self.micro_batching.choose(scheduler.num_decoding, scheduler.pipeline_depth,
                                                               scheduler.micro_batches))
        return self.scheduler.schedule()

    def _set_micro_batches(self, count: int) -> None:
        if count != self.scheduler.micro_batches and self.scheduler.micro_batches:     # a change, not the first
            fixed, per_seq = self.micro_batching.step_cost()
            log.info("%s: %d decoding sessions now circulate in %d micro-batches (a step here: %.1f ms + %.1f ms "
                     "per session; the pipeline's latency beyond its steps: %.1f ms)", self.assignment.assignment_id,
                     self.scheduler.num_decoding, count, 1e3 * fixed, 1e3 * per_seq,
                     1e3 * self.micro_batching.latency_s(self.scheduler.pipeline_depth))
        self.scheduler.micro_batches = count

    def timed(self, batch: Batch, seconds: float, end_ns: int) -> None:
        """First stage: a step of batch took seconds and ended at end_ns (what micro-batching measures by)."""
        if not self.is_first or not batch.chunks or not all(c.is_decode for c in batch.chunks):
            return
        self.micro_batching.stepped(len(batch.chunks), seconds)
        for chunk in batch.chunks:
            self._left_ns[chunk.session_id] = (len(batch.chunks), end_ns)

    @torch.inference_mode()
    def run(self, batch: Batch) -> StepOutput:
        """The forward pass (the only call that touches the device)."""
        return run_through(self.run_steps(batch))

    def run_steps(self, batch: Batch) -> Generator[None, None, StepOutput]:
        """run(), suspended after each layer (StageRunner.run_steps; run it under torch.inference_mode())."""
        payloads = [c.item.payload[c.begin:c.end] if c.item.payload is not None else None
                    for c in batch.chunks]
        return (yield from self.runner.run_steps(batch, payloads, self._picking(batch) if self.is_last else Picking()))

    def _picking(self, batch: Batch) -> Picking:
        """What the runner needs to pick this step's tokens (StageRunner's Picking)."""
        params = {c.session_id: self.sessions[c.session_id].sampling for c in batch.chunks}
        histories = {c.session_id: self._history(c) for c in batch.chunks
                     if c.sample and params[c.session_id].counts_output}
        targets = {c.session_id: self._prompt_targets(c) for c in batch.chunks
                   if params[c.session_id].prompt_logprobs is not None}
        # the grammars compute their masks while the step runs; the pick waits for them
        constrained = {session_id: (params[session_id].grammar, histories[session_id].output)
                       for session_id in histories if params[session_id].grammar}
        return Picking(params, histories, {session_id: t for session_id, t in targets.items() if t},
                       self.grammars.start(constrained) if constrained else None)

    def _prompt_targets(self, chunk: ScheduledChunk) -> tuple[int, ...]:
        """The prompt tokens the chunk's rows predict (the row at position p predicts p + 1), up to the prompt's last
        (the output's first is the chunk's pick)."""
        prompt_end, tokens = self.sessions[chunk.session_id].output_position, self._token_ids(chunk)
        return tuple(tokens[chunk.start_pos + 1:min(chunk.start_pos + chunk.num_tokens + 1, prompt_end)])

    def _history(self, chunk: ScheduledChunk) -> History:
        """What the pick after chunk counts: the request's prompt, and its output up to the chunk's end (a replayed
        session's open names where that output starts in what it prefilled)."""
        start, tokens = self.sessions[chunk.session_id].output_position, self._token_ids(chunk)
        return History(tokens[:start], tokens[start:chunk.start_pos + chunk.num_tokens])

    def _token_ids(self, chunk: ScheduledChunk) -> list[int]:
        """Every token id of the chunk's session this stage knows (its prompt, then what its chunks brought)."""
        return self.scheduler.sessions[chunk.session_id].token_ids

    def postprocess(self, batch: Batch, output: StepOutput | None, outbox: Outbox) -> None:
        """Advances the scheduler and turns the step's output into messages for the next hops."""
        if output is not None:
            self.scheduler.postprocess(batch)
            if self.is_last:
                self._deliver_tokens(batch, output, outbox)
            else:
                self._forward_hidden(batch, output, outbox)
        for session_id in batch.preempted:
            log.info("session %s preempted: out of KV blocks; its origin replays it", session_id)
            message = self.close(session_id, outbox)
            if message is not None:
                outbox.events.append((message.origin, TokenEvent(session_id, -1, preempted=True)))

    def _deliver_tokens(self, batch: Batch, output: StepOutput, outbox: Outbox) -> None:
        """Each sampled token to its origin and, while its decode loop goes on, as the next step to the first stage
        (one message per first stage), with the tokens drafted after it where the loop speculates; where the next
        run in flight already goes on from it (it followed this one in), nothing: that run is next."""
        going_on: list[tuple[ScheduledChunk, DecodeLoop, int, int]] = []   # (chunk, loop, token, its position)
        for session_id, logprobs in output.prompt_logprobs.items():
            if session_id in self.sessions:
                self._prompt_logprobs.setdefault(session_id, []).extend(logprobs)
        for chunk in batch.chunks:
            if not chunk.sample or chunk.session_id not in self.sessions:     # (closed while the step ran)
                continue
            if chunk.session_id in output.refused:
                self._refuse(chunk.session_id, output.refused[chunk.session_id], outbox)
                continue
            event = replace(_event(chunk, output), logprobs=output.logprobs.get(chunk.session_id),
                            prompt_logprobs=tuple(self._prompt_logprobs.pop(chunk.session_id, ())))
            origin = self.sessions[chunk.session_id].origin
            accepted = output.accepted.get(chunk.session_id, ())    # drafted tokens the model agreed with, in order
            tokens, loop = (*accepted, event.token_id), self.loops.get(chunk.session_id)
            if loop is None:
                outbox.events.extend((origin, replace(event, token_id=t)) for t in tokens)
                continue
            num_draft = chunk.item.num_draft
            run = loop.verifying(chunk.item.step)
            self.speculation.num_followers_verified += run is not None and run.follows
            if chunk.is_decode:
                loop.arrived(run, chunk.item.arrived_ns, num_draft)
            goes_on = loop.goes_on(num_draft, len(accepted), event.token_id)
            # each token the loop samples goes to the origin, up to the one that ends it (those after are dropped)
            for token in tokens:
                if not loop.sampled(token):                             # over: its last token, or held
                    self._end(chunk.session_id, loop)
                    outbox.events.append((origin, replace(event, token_id=token, held=loop.held)))
                    break
                outbox.events.append((origin, replace(event, token_id=token)))
            else:
                loop.verified(num_draft, len(accepted))
                # the next step starts at the token just sampled, after the accepted drafts (the rejected ones'
                # positions are rewritten: each stage forgets them as this step reaches it)
                position = chunk.start_pos + chunk.num_tokens - num_draft + len(accepted)
                if not goes_on:
                    if loop.abandon():          # runs followed the rejected drafts in: dropped where they are
                        self._reject(chunk.session_id, loop, position, outbox)
                    going_on.append((chunk, loop, event.token_id, position))
                self._to_follow.append(chunk.session_id)
            self.speculation.counted(num_draft, len(accepted))
        drafts = self._drafts(going_on)
        feeds: dict[Hop, list[StepChunk]] = {}
        sent_ns = time.time_ns()
        for chunk, loop, token, position in going_on:
            drafted = drafts.get(chunk.session_id, ())
            step = max(loop.next_step, chunk.item.step + 1)
            loop.fed(Run(step, position, (token, *drafted), chunk.item.arrived_ns))
            feeds.setdefault(loop.feed, []).append(StepChunk(
                chunk.session_id, step, position, (token, *drafted), True, chunk.item.trace_id, sent_ns,
                len(drafted)))
        for feed, chunks in feeds.items():
            outbox.stage_messages.append((feed, StepChunks(tuple(chunks))))

    def _drafts(self, going_on: list[tuple[ScheduledChunk, DecodeLoop, int, int]]) -> dict[str, tuple[int, ...]]:
        """The tokens drafted after each going-on session's new token, as many as its loop says (none on a busy
        stage), by its proposer."""
        if self.scheduler.num_sessions > BUSY_SESSIONS:
            return {}
        requests: dict[str, tuple[Speculation, list[int], int]] = {}
        for chunk, loop, token, position in going_on:
            session = self.scheduler.sessions.get(chunk.session_id)
            count = loop.num_to_draft(self.scheduler.max_batch_tokens - 1) if session is not None else 0
            if count and loop.speculation is not None:
                requests[chunk.session_id] = (loop.speculation, [*session.token_ids[:position], token], count)
        return self.proposers.propose(requests) if requests else {}

    def _end(self, session_id: str, loop: DecodeLoop) -> None:
        """The loop sampled its last token: it is forgotten, or, where runs followed it in, kept over until the
        session closes, to drop them (here if queued, else as they arrive)."""
        loop.over = True
        if loop.abandon():
            self.scheduler.drop_unverified(session_id)
        else:
            del self.loops[session_id]

    def _reject(self, session_id: str, loop: DecodeLoop, position: int, outbox: Outbox) -> None:
        """Runs followed drafts rejected from position on: those queued here are dropped, and a rewind goes around
        the ring ahead of the next run to drop the others where they are."""
        self.scheduler.reject(session_id, position)
        outbox.stage_messages.append((loop.feed, SessionRewind(session_id, position)))

    def follow(self, outbox: Outbox) -> None:
        """Keeps the ring full: behind the runs this stage's last step sent, the runs that follow them in, drafted on
        from their tokens (after the step's results are out: drafting them does not hold those back)."""
        sessions, self._to_follow = self._to_follow, []
        if self.is_first or self.scheduler.num_sessions > FOLLOW_SESSIONS:
            return
        feeds: dict[Hop, list[StepChunk]] = {}
        while sessions:             # a run more each round, for the sessions that took one the round before
            requests: dict[str, tuple[Speculation, list[int], int]] = {}
            for session_id in sessions:
                loop, session = self.loops.get(session_id), self.scheduler.sessions.get(session_id)
                if loop is not None and session is not None and loop.speculation is not None and (
                        count := loop.num_to_follow(self.scheduler.max_batch_tokens - 1)):
                    requests[session_id] = (loop.speculation, loop.frontier(session.token_ids), count)
            drafts = self.proposers.propose(requests) if requests else {}
            sessions = [session_id for session_id, drafted in drafts.items() if len(drafted) >= 2]  # a guess, a draft
            sent_ns = time.time_ns()
            for session_id in sessions:
                loop, drafted = self.loops[session_id], drafts[session_id]
                run = Run(loop.next_step, loop.runs[-1].end_pos, drafted, follows=True)
                self.speculation.num_followers += 1
                feeds.setdefault(loop.feed, []).append(StepChunk(
                    session_id, run.step, run.start_pos, drafted, True, "", sent_ns, len(drafted) - 1,
                    loop.unverified_from))
                loop.fed(run)
        for feed, chunks in feeds.items():
            outbox.stage_messages.append((feed, StepChunks(tuple(chunks))))

    def _refuse(self, session_id: str, why: str, outbox: Outbox) -> None:
        """Ends a session its grammar gave no token (the rest of its step goes on), telling its origin why."""
        log.warning("session %s failed on %s: %s", session_id, self.assignment.assignment_id, why)
        message = self.close(session_id, outbox)
        if message is not None:
            outbox.events.append((message.origin, TokenEvent(session_id, -1, error=why,
                                                             error_stage=self.assignment.assignment_id)))

    def _forward_hidden(self, batch: Batch, output: StepOutput, outbox: Outbox) -> None:
        """The step's hidden rows to each session's next stage, one message per next stage, in the hop's codec: raw in
        the dtype that stage computes in (wire_dtype) or the one the hop names, or int8 with per-token scales (cast
        here, on this stage's device, before the copy to the host)."""
        groups: dict[Hop, tuple[list[StepChunk], list[torch.Tensor]]] = {}
        row = 0
        for chunk in batch.chunks:
            length = chunk.end - chunk.begin
            session = self.sessions.get(chunk.session_id)
            if session is None:             # closed while the step ran: its rows go nowhere
                row += length
                continue
            chunks, rows = groups.setdefault(session.route[0], ([], []))
            chunks.append(StepChunk(chunk.session_id, chunk.item.step, chunk.start_pos,
                                    chunk.item.token_ids[chunk.begin:chunk.end], chunk.sample, chunk.item.trace_id,
                                    num_draft=chunk.item.num_draft, pending_from=chunk.item.pending_from))
            rows.append(output.hidden[row:row + length])
            row += length
        for hop, (chunks, rows) in groups.items():
            hidden = rows[0] if len(rows) == 1 else torch.cat(rows)
            travels = codec.TORCH_DTYPES[hop.codec if hop.codec in codec.TORCH_DTYPES
                                         else wire_dtype(self.assignment.stage.dtype, hop.dtype)]
            hidden = codec.encode(hidden if hidden.dtype == travels else hidden.to(travels),
                                  "int8" if hop.codec == "int8" else "raw")
            outbox.stage_messages.append((hop, StepBatch(tuple(chunks), hidden)))


def _event(chunk: ScheduledChunk, output: StepOutput) -> TokenEvent:
    """The origin's answer to a chunk that asked for one: its sampled token, or its embedding."""
    if output.embeddings is not None:
        vector = output.embeddings[chunk.session_id]
        return TokenEvent(chunk.session_id, chunk.item.step, embedding=tuple(vector.tolist()))
    return TokenEvent(chunk.session_id, chunk.item.step, output.tokens[chunk.session_id])
