"""The data plane's vocabulary: how a session samples, the hops of its route, and the messages its stages and its
origin exchange (StageMessage between stages, TokenEvent back to the origin)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from stratamesh.fleet.errors import InvalidInput
from stratamesh.fleet.stages import DTYPES, check_revision

HOP_CODECS = ("", *DTYPES, "int8")
MAX_LOGPROBS = 20       # the likeliest tokens a pick may return with it (OpenAI's limit)
SPECULATIVE_METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 16     # drafted tokens a step may verify
MAX_PROMPT_LOOKUP = 32          # the longest n-gram the ngram proposer matches


def wire_dtype(sender: str, receiver: str) -> str:
    """The dtype activations travel in from a stage computing in sender to one computing in receiver: the
    receiver's, so it converts nothing, except that a float32 receiver gets the sender's narrower dtype (the
    upcast it does then is exact, and the link carries half the bytes). "" (unknown) on either side: sender's."""
    if not receiver or not sender or receiver == "float32":
        return sender or receiver or "float32"
    return receiver


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How the last stage picks a token, in vLLM's order and with its meanings: the logits get logit_bias, and
    min_tokens' ban of the stop tokens, then the penalties (repetition over the prompt and the output so far,
    frequency and presence over the output); then temperature (0 is greedy: the argmax of those logits), min_p,
    top_k and top_p, and a draw keyed by (seed, position)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    min_p: float = 0.0                  # tokens less likely than min_p x the likeliest are dropped (0: off)
    presence_penalty: float = 0.0       # subtracted from a token's logit once it is in the output
    frequency_penalty: float = 0.0      # ... times the times it is
    repetition_penalty: float = 1.0     # a seen token's logit divided by it (positive) or times it (negative)
    logit_bias: tuple[tuple[int, float], ...] = ()      # (token id, added to its logit)
    min_tokens: int = 0                 # the stop tokens cannot be picked before the output has this many
    stop_token_ids: tuple[int, ...] = ()    # ... which min_tokens holds back: EOS and the request's stop ids
    # What comes back with the picks, the model's log-probabilities (before the settings above): each picked token's
    # and this many of the likeliest (None: none); each prompt token's likewise (prompt_logprobs, for echo)
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # Structured output: the tokens that keep the output within this grammar (llguidance's JSON form: a JSON schema,
    # a regex or a Lark grammar, as the API compiled it) are the only ones the pick may take; "": any
    grammar: str = ""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise InvalidInput(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise InvalidInput(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise InvalidInput(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise InvalidInput(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise InvalidInput(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise InvalidInput(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty}")
        if any(not (token >= 0 and -100 <= bias <= 100) for token, bias in self.logit_bias):
            raise InvalidInput("logit_bias maps token ids >= 0 to biases in [-100, 100]")
        if self.min_tokens < 0 or any(token < 0 for token in self.stop_token_ids):
            raise InvalidInput("min_tokens and stop_token_ids must be >= 0")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise InvalidInput(f"{name} must be in [0, {MAX_LOGPROBS}], got {value}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def verifiable(self) -> bool:
        """Whether drafted tokens can be verified for it exactly: its pick depends on the model's logits alone (no
        bias, ban or penalty, no grammar), greedy (the argmax) or sampled (rejection sampling), and no
        log-probabilities are asked for (speculative decoding serves such generations; the others decode a token a
        step)."""
        return (not self.processes_logits and not self.counts_output and self.logprobs is None
                and self.prompt_logprobs is None)

    @property
    def processes_logits(self) -> bool:
        """Whether its logits change before the pick: a bias, a ban or a penalty."""
        return bool(self.logit_bias or self.min_tokens or self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0)

    @property
    def counts_output(self) -> bool:
        """Whether its pick depends on the tokens before it (the stage must pass them: kernels.ops.sampler.History)."""
        return bool(self.min_tokens or self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0 or self.grammar)


@dataclass(frozen=True, slots=True)
class Speculation:
    """Speculative decoding, as vLLM's speculative_config says it: each decode step of a generation carries up to
    num_speculative_tokens drafted tokens that its last stage verifies at once, keeping those the model agrees with
    (so a trip around the pipeline yields up to num_speculative_tokens + 1 tokens, the output unchanged). method
    "ngram" drafts by prompt lookup (agent.engine.proposers): the tokens that followed the first earlier occurrence
    of the longest n-gram, of prompt_lookup_min to prompt_lookup_max tokens, that ends the session's tokens;
    "draft_model" has the model in the folder `model` (sharing the target's tokenizer) guess them, where the
    generation's decode loop runs (agent.engine.draft_model)."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 5
    prompt_lookup_max: int = 5
    model: str = ""             # draft_model: the draft's Hugging Face folder, as the agents see it

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise InvalidInput(f"speculative method {self.method!r} is not one of {SPECULATIVE_METHODS}")
        if (self.method == "draft_model") != bool(self.model):
            raise InvalidInput("a draft_model speculative config names its draft's folder as its model (and only it)")
        if not 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise InvalidInput(f"num_speculative_tokens must be in [1, {MAX_SPECULATIVE_TOKENS}], got "
                               f"{self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max <= MAX_PROMPT_LOOKUP:
            raise InvalidInput(f"prompt_lookup_min and prompt_lookup_max must satisfy 1 <= min <= max <= "
                               f"{MAX_PROMPT_LOOKUP}, got {self.prompt_lookup_min} and {self.prompt_lookup_max}")

    def config(self) -> dict[str, Any]:
        """As vLLM's speculative_config keys (of() reads them back): a draft_model's model, ngram's lookup sizes."""
        if self.method == "draft_model":
            return {"method": self.method, "num_speculative_tokens": self.num_speculative_tokens, "model": self.model}
        return {"method": self.method, "num_speculative_tokens": self.num_speculative_tokens,
                "prompt_lookup_min": self.prompt_lookup_min, "prompt_lookup_max": self.prompt_lookup_max}

    @classmethod
    def of(cls, config: dict[str, Any]) -> Speculation:
        """From vLLM's speculative_config keys (method, num_speculative_tokens, prompt_lookup_min and _max: either
        alone sets both, neither gives 5; model, draft_model's folder); InvalidInput names what is wrong."""
        if not isinstance(config, dict):
            raise InvalidInput("a speculative config is a JSON object")
        known = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "model")
        if unknown := sorted(set(config) - set(known)):
            raise InvalidInput(f"speculative config keys {unknown} are not among {list(known)}")
        if "method" not in config or "num_speculative_tokens" not in config:
            raise InvalidInput("a speculative config names its method and num_speculative_tokens")
        values = {key: config[key] for key in known[1:4] if config.get(key) is not None}
        if any(not isinstance(v, int) or isinstance(v, bool) for v in values.values()):
            raise InvalidInput("num_speculative_tokens, prompt_lookup_min and prompt_lookup_max are integers")
        low, high = values.get("prompt_lookup_min"), values.get("prompt_lookup_max")
        low, high = low or high or 5, high or low or 5
        if not isinstance(model := config.get("model") or "", str):
            raise InvalidInput("a speculative config's model is a folder's path")
        return cls(str(config["method"]), values["num_speculative_tokens"], low, high, model)


@dataclass(frozen=True, slots=True)
class TensorBlob:
    """A tensor as bytes: what the wire carries and kernels' codecs produce and consume."""

    dtype: str
    shape: tuple[int, ...]
    data: bytes
    codec: str = "raw"
    scales: TensorBlob | None = field(default=None)


@dataclass(frozen=True, slots=True)
class Hop:
    """One stage of a route: where it listens, which assignment serves it there, the dtype it computes in
    (activations for it travel in that dtype; "" when unknown: the sender's own), and the codec of the link into it
    (HOP_CODECS: "" raw in that dtype; a dtype: raw in that one; "int8": int8 with per-token scales); the agent
    serving it ("" when unknown), and, when that agent sits behind NAT, the address its connections come from (a
    sender outside that NAT cannot dial it, and reaches it over WebRTC instead: fleet/wire/rtc.py)."""

    address: str
    assignment_id: str
    dtype: str = ""
    codec: str = ""
    agent_id: str = ""
    nat: str = ""


@dataclass(frozen=True, slots=True)
class SessionOpen:
    """Opens a session on a stage; `route` holds the hops after the receiving stage."""

    session_id: str
    assignment_id: str
    route: tuple[Hop, ...]
    origin: str
    sampling: SamplingParams
    traceparent: str = ""       # W3C trace context of the request; "" when it is not traced
    prompt_token_ids: tuple[int, ...] = ()
    max_cached_tokens: int = 0   # the fewest prompt tokens any stage so far holds in its prefix cache
    resume_from: str = ""        # a moving session: stages that hold it under this id keep its KV
    # The decode loop: the last stage feeds each sampled token to this first stage (None: to nobody) until
    # max_new_tokens are sampled (0: no limit) or one of stop_token_ids is.
    feed: Hop | None = None
    max_new_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    # Where the generation's output starts in prompt_token_ids (a replay sends the output so far after the prompt):
    # what its penalties and min_tokens count from; 0: after all of prompt_token_ids
    output_start: int = 0
    # The decode loop's steps carry drafted tokens its last stage verifies (None: a token a step); only for sampling
    # that is SamplingParams.verifiable
    speculation: Speculation | None = None
    revision: str = ""          # the revision of the model its route serves: each stage refuses another
    # Set by the origin of a speculating session and kept only by stages that can take runs following one another
    # into the pipeline before the first is verified (StepChunk.pending_from, SessionRewind; an older build drops
    # it on the way): the last stage sends such runs only where it reaches it set.
    follow_runs: bool = False

    def __post_init__(self) -> None:
        check_revision(self.revision, "open.revision")
        if self.speculation is not None and not self.sampling.verifiable:
            raise InvalidInput("open.speculation is for sampling whose pick depends on the logits alone (no "
                               "penalties, bias, grammar or logprobs)")

    @property
    def output_position(self) -> int:
        """Where the generation's output starts in prompt_token_ids (output_start, or after all of them)."""
        return self.output_start or len(self.prompt_token_ids)

    def forwarded(self, cached_tokens: int) -> SessionOpen:
        """The open as the next hop must receive it, carrying this stage's cached-token count."""
        head, *rest = self.route
        return replace(self, assignment_id=head.assignment_id, route=tuple(rest),
                       max_cached_tokens=min(cached_tokens, self.max_cached_tokens))


@dataclass(frozen=True, slots=True)
class StepChunk:
    """One step of a session: its token ids at positions start_pos.. (every stage gets them)."""

    session_id: str
    step: int
    start_pos: int
    token_ids: tuple[int, ...] = ()
    sample: bool = False
    trace_id: str = ""          # 32 hex digits; "" when the request is not traced
    sent_unix_ns: int = 0       # when the origin sent it (0 on chunks inside a StepBatch)
    # Its last num_draft token ids are drafted, not sampled (speculative decoding): the last stage verifies them,
    # and every stage forgets those it rejects when the session's next step starts before their end.
    num_draft: int = 0
    # A run following another into the pipeline before the last stage verified it (PipeInfer's; its first token is
    # a guess too): where the session's unverified tokens start, before this chunk; 0 for any other chunk.
    pending_from: int = 0


@dataclass(frozen=True, slots=True)
class StepBatch:
    """A stage's step for the next one: chunks, and their hidden states as rows in chunk order."""

    chunks: tuple[StepChunk, ...]
    hidden: TensorBlob
    sent_unix_ns: int = 0       # when the sending stage finished computing it


@dataclass(frozen=True, slots=True)
class StepChunks:
    """The next decode step of several sessions, token ids only, fed by the last stage to the first in one message."""

    chunks: tuple[StepChunk, ...]


@dataclass(frozen=True, slots=True)
class SessionClose:
    session_id: str


@dataclass(frozen=True, slots=True)
class SessionRewind:
    """Sent by the last stage to the first, and on along the route up to the stage before the last: the session's
    tokens from position on were drafted and rejected, and so were the runs that followed them into the pipeline:
    each stage drops those it holds queued and forgets the positions (the next step of the session starts there;
    the last stage, which sent it, has dropped its own)."""

    session_id: str
    position: int


@dataclass(frozen=True, slots=True)
class SessionHold:
    """Stops a session's decode loop after the token the pipeline is on (to move it while it is quiet)."""

    session_id: str


@dataclass(frozen=True, slots=True)
class Logprobs:
    """A token's log-probability under the model and the likeliest tokens' (id, log-probability), likeliest first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """What the last stage returns to the origin: a sampled token (or an embedding model's pooled vector), or the
    error that ended the session."""

    session_id: str
    step: int
    token_id: int = -1
    error: str = ""
    error_stage: str = ""
    opened: bool = False        # the answer to an open: every stage opened the session ...
    cached_tokens: int = 0      # ... and holds this many leading prompt tokens in its cache
    preempted: bool = False     # a stage ran out of KV blocks: the origin replays the session
    sent_unix_ns: int = 0       # when the last stage finished the step that produced it
    unreachable: str = ""       # with error: the address of the hop a stage lost (the origin replays)
    embedding: tuple[float, ...] = ()   # instead of a token (embedding models): the prompt's normalized vector
    held: bool = False          # the last token before a hold: the session is quiet on every stage now
    logprobs: Logprobs | None = None    # the token's, where its sampling asks for them
    # with a generation's first token, where its sampling asks for prompt_logprobs: those of its prompt's tokens
    # from the second on (the first has none)
    prompt_logprobs: tuple[Logprobs, ...] = ()


# What one stage sends another (or the origin its route's first stage) on a session's stream.
StageMessage = SessionOpen | StepChunk | StepChunks | SessionClose | SessionHold | SessionRewind | StepBatch
