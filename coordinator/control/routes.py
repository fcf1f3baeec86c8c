"""Routes: which models can take requests now, and the hops a request for one goes through: the router picks one
of a model's ready replicas (--router-mode)."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

from stratamesh.coordinator.control.events import NoSessions, RouteWork, Sessions
from stratamesh.coordinator.control.models import find_model
from stratamesh.coordinator.control.prefix_index import PrefixIndex
from stratamesh.coordinator.control.roster import Roster
from stratamesh.coordinator.records import PlanRecord
from stratamesh.coordinator.registry_store import RegistryStore
from stratamesh.fleet.errors import InvalidInput, ModelNotReady
from stratamesh.fleet.prefix import block_hashes
from stratamesh.fleet.states import RouterMode
from stratamesh.fleet.types import DEFAULT_ROUTER_MODE, ROUTER_MODES, Hop, KvEvents, wire_dtype
from stratamesh.partitioner.wire_codec import check_policy, choose_codec

log = logging.getLogger(__name__)

# kv mode weighs a generation decoding on a replica as this many prompt tokens to prefill there: each decode
# step of the batch costs about one token's compute per sequence, and a prefill takes a few such steps.
DECODE_WORK_TOKENS = 32


@dataclass(frozen=True, slots=True)
class Disaggregation:
    """Prefill/decode disaggregation: a model's first prefill_replicas replicas prefill long prompts (and nothing
    else), whose KV then moves to the decode replica the router picked. Only for a prompt of which at least
    min_prompt_tokens are not cached on that decode replica, and while the prefill replica has at most
    max_queue_tokens still to prefill; any other request runs whole on a decode replica."""

    prefill_replicas: int = 0           # 0: off
    min_prompt_tokens: int = 512
    max_queue_tokens: int = 2048

    def __post_init__(self) -> None:
        if self.prefill_replicas < 0 or self.min_prompt_tokens < 1 or self.max_queue_tokens < 0:
            raise InvalidInput("disaggregation needs prefill_replicas >= 0, min_prompt_tokens >= 1 and "
                               "max_queue_tokens >= 0")

    def prefills(self, plan: PlanRecord) -> bool:
        return plan.replica < self.prefill_replicas

    def role(self, plan: PlanRecord) -> str:
        """What the plan's replica serves: "prefill" or "decode"; "" when disaggregation is off."""
        return ("prefill" if self.prefills(plan) else "decode") if self.prefill_replicas else ""


def hop_codecs(plan: PlanRecord, policy: str, bandwidth: Callable[[str, str], float | None],
               same_box: Callable[[str, str], bool]) -> list[str]:
    """The codec of the link into each stage of plan: none into the first (token ids); into each other, policy where
    it names one; else raw between two agents of one box (same_box: no network to spare, and a lossy codec would
    change the model's output), and otherwise the most exact that keeps the link within its share of the sending
    stage's predicted step (partitioner/wire_codec.py) at the link's measured bandwidth (Roster.bandwidth: the better
    of its two newest readings); unmeasured, what the planner chose.

    Loopback is why same_box comes first: its probe times how soon the receiving agent's event loop answers, so a
    busy box reads as a slow link. Streams of a float32 test mesh that left the model's greedy tokens in CI, with two
    meshes side by side on 2 cores, are, token for token, what int8 on its link after layer 2 gives."""
    num_links = len(plan.stages) - 1
    if policy != "auto":
        return ["", *[policy] * num_links]
    codecs = [""]
    for k, (sender, receiver) in enumerate(itertools.pairwise(plan.stages)):
        if same_box(sender.agent_id, receiver.agent_id):
            codecs.append("")
            continue
        measured = bandwidth(sender.agent_id, receiver.agent_id)
        step_s, send_bytes = (_predicted(plan, name, k) for name in ("stage_step_s", "stage_send_bytes"))
        if measured and step_s and send_bytes:
            wire = wire_dtype(sender.spec.dtype, receiver.spec.dtype)
            codecs.append(choose_codec(wire, send_bytes / measured, step_s))
        else:
            codecs.append(_predicted(plan, "stage_codecs", k) or "")
    return codecs


def _rate(bytes_per_s: float | None) -> str:
    """bytes/s as "0.25 MB/s" or "1250 MB/s" (no exponent); "none" when unmeasured."""
    if not bytes_per_s:
        return "none"
    mb = bytes_per_s / 1e6
    return f"{mb:.3g} MB/s" if mb < 1000 else f"{mb:.0f} MB/s"


def _predicted(plan: PlanRecord, name: str, index: int) -> Any:
    """One stage's figure of the plan's prediction; None where it has none (a plan stored before it had them)."""
    values = plan.prediction.get(name) or ()
    return values[index] if index < len(values) else None


class Routes:
    """The models ready to serve and the route through each: a model is ready once every stage of one of its
    replicas' active plans is loaded on a connected agent. It remembers the models that were ever ready (they
    accept requests while recovering) and the callers of wait_route() to wake when a plan, a stage or an agent
    changes."""

    def __init__(self, registry: RegistryStore, roster: Roster, mode: str = DEFAULT_ROUTER_MODE,
                 sessions: Sessions = NoSessions(), clock: Callable[[], float] = time.monotonic,
                 disaggregation: Disaggregation = Disaggregation(), wire_codec: str = "auto"):
        if mode not in ROUTER_MODES:
            raise InvalidInput(f"router mode {mode!r} is not one of {', '.join(ROUTER_MODES)}")
        self.wire_codec = check_policy(wire_codec)  # "auto": each link's codec as its plan chose it
        self._registry = registry
        self._roster = roster
        self._sessions = sessions
        self.mode = mode
        self.disaggregation = disaggregation
        self.prefixes = PrefixIndex(clock)     # kv mode: what each replica's stages hold in their prefix caches
        self._served: set[str] = set()         # models that were ready since this coordinator started
        self._turns: dict[str, int] = {}       # model id -> routes handed out (whose turn is next)
        self._codecs: dict[tuple[str, int], str] = {}   # (plan id, stage) -> the codec into it routes used last
        self._waiters: list[asyncio.Future[None]] = []

    def serves(self, plan: PlanRecord) -> bool:
        """Whether every stage of the plan is loaded on a connected agent."""
        return all(self._roster.serving(s) for s in plan.stages)

    def ready_plans(self, model_id: str) -> list[PlanRecord]:
        """The active plans of the model's replicas that serve, by replica."""
        return [plan for plan in self._registry.active_plans(model_id) if self.serves(plan)]

    def is_ready(self, model_id: str) -> bool:
        return bool(self.ready_plans(model_id))

    def accepts(self, model_id: str) -> bool:
        """Ready, or recovering from a lost agent after having been ready: requests wait for a route."""
        return model_id in self._served or self.is_ready(model_id)

    def route(self, model_id: str, avoid: Collection[str] = (), token_ids: Sequence[int] = ()) -> tuple[list[Hop], int]:
        """The hops of a ready replica of the model in pipeline order, and its KV block size.

        avoid: Stage addresses just found unreachable; a route through one of them is not ready.
        token_ids: what the route will prefill (kv mode routes by it)."""
        find_model(self._registry, model_id)
        ready = self.ready_plans(model_id)
        if not ready:
            raise ModelNotReady(f"the model '{model_id}' is not ready yet: its stages are loading")
        decoding = [plan for plan in ready if not self.disaggregation.prefills(plan)]
        routes = self._hops(decoding or ready, avoid)      # prefill replicas serve whole requests only alone
        if not routes:
            raise ModelNotReady(f"the model '{model_id}' is recovering: its route lost a stage")
        plan, hops = self._choose(model_id, routes, token_ids)
        return hops, plan.stages[0].spec.kv_block_size

    def _hops(self, plans: list[PlanRecord], avoid: Collection[str]) -> list[tuple[PlanRecord, list[Hop]]]:
        """Each plan with its hops in pipeline order, less those through an address in avoid."""
        roster = self._roster
        routes = [(plan, [Hop(roster.stage_address(s.agent_id), s.assignment_id, s.spec.dtype, codec, s.agent_id,
                              roster.nat(s.agent_id))
                          for s, codec in zip(plan.stages, self.link_codecs(plan), strict=True)])
                  for plan in plans]
        return [(plan, hops) for plan, hops in routes if not any(hop.address in avoid for hop in hops)]

    def link_codecs(self, plan: PlanRecord) -> list[str]:
        """The codec of the link into each stage of plan (hop_codecs); logs each link that narrows or changes codec."""
        codecs = hop_codecs(plan, self.wire_codec, self._roster.bandwidth, self._roster.same_box)
        for k, codec in enumerate(codecs[1:], start=1):
            before = self._codecs.get((plan.plan_id, k), "")
            if codec != before:
                sender, receiver = plan.stages[k - 1].agent_id, plan.stages[k].agent_id
                log.info("the link %s -> %s into stage %d of %s carries %s now (was %s; its measured bandwidth: %s)",
                         sender, receiver, k, plan.model_id, codec or "raw", before or "raw",
                         _rate(self._roster.bandwidth(sender, receiver)))
                self._codecs[plan.plan_id, k] = codec
        return codecs

    def prefill_route(self, model_id: str, decode: Sequence[Hop], token_ids: Sequence[int],
                      avoid: Collection[str] = ()) -> list[Hop] | None:
        """Where to prefill a prompt whose generation decodes on the route decode (whose KV then moves there): the
        ready prefill replica with the least prefill queued whose stages split the layers as decode's do; None to
        prefill on decode itself (disaggregation off, too few uncached tokens there, or every prefill replica's
        queue too long)."""
        rules = self.disaggregation
        plans = {plan.stages[0].assignment_id: plan for plan in self.ready_plans(model_id)}
        target = plans.get(decode[0].assignment_id) if decode else None
        if not rules.prefill_replicas or target is None or rules.prefills(target):
            return None
        size = target.stages[0].spec.kv_block_size
        # what its stages report holding: the router just counted this very prompt as about to be cached there
        cached = self.prefixes.cached_blocks(target.plan_id, [s.assignment_id for s in target.stages],
                                             block_hashes(token_ids, size), expected=False)
        if len(token_ids) - cached * size < rules.min_prompt_tokens:
            return None
        work = self._sessions.work()
        candidates = [(work.get(plan.stages[0].assignment_id, RouteWork()).prefill_tokens, plan.replica, hops)
                      for plan, hops in self._hops([p for p in plans.values() if rules.prefills(p)], avoid)
                      if _layout(plan) == _layout(target)]
        if not candidates:
            return None
        queued, _, hops = min(candidates, key=lambda c: c[:2])
        return hops if queued <= rules.max_queue_tokens else None

    def _choose(self, model_id: str, routes: list[tuple[PlanRecord, list[Hop]]],
                token_ids: Sequence[int]) -> tuple[PlanRecord, list[Hop]]:
        """The router's pick of the ready routes (by replica): the next in turn (round-robin); the one whose
        busiest stage runs and queues the fewest sequences as its agents' newest heartbeats say (least-load); or
        the one with the least work ahead of this prompt (kv, see _by_prefix). Ties go to the next in turn."""
        turn = self._turns.get(model_id, 0)
        self._turns[model_id] = turn + 1
        in_turn = routes[turn % len(routes):] + routes[:turn % len(routes)]
        if self.mode == RouterMode.LEAST_LOAD:
            return min(in_turn, key=lambda route: self._load(route[0]))
        if self.mode == RouterMode.KV and token_ids:
            return self._by_prefix(in_turn, token_ids)
        return in_turn[0]

    def _by_prefix(self, routes: list[tuple[PlanRecord, list[Hop]]],
                   token_ids: Sequence[int]) -> tuple[PlanRecord, list[Hop]]:
        """kv mode: the route whose replica has the least work ahead of the prompt, in prompt tokens: those of its
        own that no stage there holds, those of generations routed there still to prefill, and DECODE_WORK_TOKENS
        per generation decoding there. The prompt then counts as cached there (PrefixIndex.expect)."""
        work, hashes = self._sessions.work(), {}

        def prompt_hashes(plan: PlanRecord) -> list[bytes]:     # once per block size (replicas share theirs)
            size = plan.stages[0].spec.kv_block_size
            if size not in hashes:
                hashes[size] = block_hashes(token_ids, size)
            return hashes[size]

        def cost(route: tuple[PlanRecord, list[Hop]]) -> int:
            plan = route[0]
            cached = self.prefixes.cached_blocks(plan.plan_id, [s.assignment_id for s in plan.stages],
                                                 prompt_hashes(plan))
            there = work.get(plan.stages[0].assignment_id, RouteWork())
            return (len(token_ids) - cached * plan.stages[0].spec.kv_block_size + there.prefill_tokens
                    + DECODE_WORK_TOKENS * there.num_decoding)

        chosen = min(routes, key=cost)
        plan = chosen[0]
        self.prefixes.expect(plan.plan_id, [s.assignment_id for s in plan.stages], prompt_hashes(plan))
        return chosen

    def kv_events(self, reports: Sequence[KvEvents]) -> None:
        """Stages' prefix-cache changes, each from the agent that holds its stage (the deployer checks)."""
        for report in reports:
            self.prefixes.apply(report)

    def prune(self) -> None:
        """The prefix index keeps only the replicas of live plans (active, and standby: what a standby's stages
        report before it takes over counts once it does) and their stages."""
        plans = [plan for model in self._registry.models() for plan in self._registry.live_plans(model.model_id)]
        self.prefixes.keep({plan.plan_id for plan in plans}, {s.assignment_id for plan in plans for s in plan.stages})

    def _load(self, plan: PlanRecord) -> int:
        """The sequences the plan's busiest stage runs and queues, as its agent's newest heartbeat says."""
        loads = {load.assignment_id: load.num_running + load.num_waiting
                 for s in plan.stages if (telemetry := self._roster.telemetry.get(s.agent_id))
                 for load in telemetry.stages}
        return max((loads.get(s.assignment_id, 0) for s in plan.stages), default=0)

    async def wait_route(self, model_id: str, timeout_s: float, avoid: Collection[str] = (),
                         token_ids: Sequence[int] = ()) -> tuple[list[Hop], int]:
        """route(), waiting up to timeout_s while the model loads or recovers (ModelNotReady after).

        The addresses in avoid are trusted again after an agent's lease: if nobody declared their agent
        dead by then, the failure was the link's, and the route through them is the one there is."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        trust_at = loop.time() + self._roster.liveness.lease_s + 1.0
        while True:
            now = loop.time()
            try:
                return self.route(model_id, avoid if now < trust_at else (), token_ids)
            except ModelNotReady:
                if now >= deadline:
                    raise
            waiter: asyncio.Future[None] = loop.create_future()
            self._waiters.append(waiter)
            wake = min(deadline, trust_at) if now < trust_at else deadline
            try:
                await asyncio.wait_for(waiter, max(wake - now, 0.0))
            except asyncio.TimeoutError:
                pass

    def notify(self) -> None:
        """Wakes every wait_route(): a plan, a stage or an agent changed."""
        for model in self._registry.models():
            if model.model_id not in self._served and self.is_ready(model.model_id):
                self._served.add(model.model_id)
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)


def _layout(plan: PlanRecord) -> list[tuple[int, int, str, int]]:
    """How a plan's stages split and keep the KV: a session's KV moves between two plans only where they agree."""
    return [(s.spec.start_layer, s.spec.end_layer, s.spec.dtype, s.spec.kv_block_size) for s in plan.stages]
