"""The router: which of a model's ready replicas a request goes to (--router-mode), and where a long prompt
prefills apart from the replica that decodes it (prefill/decode disaggregation). It takes the origin's work in
hand as a value, the routes' readiness and the stages' prefix caches from the control plane's Routes."""

from __future__ import annotations

import random
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from stratamesh.coordinator.control.models import find_model
from stratamesh.coordinator.control.routes import Routes
from stratamesh.coordinator.records import PlanRecord
from stratamesh.fleet.errors import InvalidInput, ModelNotReady
from stratamesh.fleet.prefix import block_hashes
from stratamesh.fleet.states import RouterMode
from stratamesh.fleet.sessions import Hop
from stratamesh.fleet.states import DEFAULT_ROUTER_MODE, ROUTER_MODES

# kv mode weighs a generation decoding on a replica as this many prompt tokens to prefill there: each decode
# step of the batch costs about one token's compute per sequence, and a prefill takes a few such steps.
DECODE_WORK_TOKENS = 32

Route = tuple[PlanRecord, list[Hop]]    # a replica's plan and its hops in pipeline order


@dataclass(frozen=True, slots=True)
class RouteWork:
    """The live generations whose route starts at one stage: the prompt tokens they have still to prefill, and how
    many are decoding."""

    prefill_tokens: int = 0
    num_decoding: int = 0


Work = Mapping[str, RouteWork]      # by the assignment id of a route's first stage


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


class Router:
    """Picks a ready replica for each request: the next in turn (round-robin), the least loaded (least-load), or the
    one with the least work ahead of the prompt (kv). Its only state is whose turn is next and what the prefix index
    expects a pick to cache."""

    def __init__(self, routes: Routes, mode: str = DEFAULT_ROUTER_MODE,
                 disaggregation: Disaggregation = Disaggregation()) -> None:
        if mode not in ROUTER_MODES:
            raise InvalidInput(f"router mode {mode!r} is not one of {', '.join(ROUTER_MODES)}")
        self.mode = mode
        self.disaggregation = disaggregation
        self._routes = routes
        self._turns: dict[str, int] = {}       # model id -> routes handed out (whose turn is next)
        self._rng = random.Random()             # which new requests a rollout's canary takes

    def use(self, routes: Routes) -> None:
        """Picks among these routes from now on (a standby's, then its Deployer's once it leads)."""
        self._routes = routes

    def route(self, model_id: str, avoid: Collection[str] = (), token_ids: Sequence[int] = (),
              work: Work | None = None, revision: str | None = None) -> tuple[list[Hop], int]:
        """The hops of a ready replica of the model in pipeline order, and its KV block size; ModelNotReady while
        none is (or every one runs through an address in avoid: Stage addresses just found unreachable).

        token_ids: what the route will prefill; work: the origin's work in hand (kv mode weighs both). revision:
        the one the request started on, which it keeps (None: a new request, which a rollout's canary takes its
        share of)."""
        find_model(self._routes.registry, model_id)
        ready = self._lane(model_id, self._routes.ready_plans(model_id), revision)
        if not ready:
            raise ModelNotReady(f"the model '{model_id}' is not ready yet: its stages are loading")
        decoding = [plan for plan in ready if not self.disaggregation.prefills(plan)]
        routes = self._routes.hops(decoding or ready, avoid)      # prefill replicas serve whole requests only alone
        if not routes:
            raise ModelNotReady(f"the model '{model_id}' is recovering: its route lost a stage")
        plan, hops = self._choose(model_id, routes, token_ids, work or {})
        return hops, plan.stages[0].spec.kv_block_size

    def prefill_route(self, model_id: str, decode: Sequence[Hop], token_ids: Sequence[int],
                      avoid: Collection[str] = (), work: Work | None = None) -> list[Hop] | None:
        """Where to prefill a prompt whose generation decodes on the route decode (whose KV then moves there): the
        ready prefill replica with the least prefill queued (in work) whose stages split the layers as decode's do;
        None to prefill on decode itself (disaggregation off, too few uncached tokens there, or every prefill
        replica's queue too long)."""
        rules = self.disaggregation
        plans = {plan.stages[0].assignment_id: plan for plan in self._routes.ready_plans(model_id)}
        target = plans.get(decode[0].assignment_id) if decode else None
        if not rules.prefill_replicas or target is None or rules.prefills(target):
            return None
        size = target.stages[0].spec.kv_block_size
        # what its stages report holding: the router just counted this very prompt as about to be cached there
        cached = self._routes.prefixes.cached_blocks(target.plan_id, [s.assignment_id for s in target.stages],
                                                     block_hashes(token_ids, size), expected=False)
        if len(token_ids) - cached * size < rules.min_prompt_tokens:
            return None
        work = work or {}
        candidates = [(work.get(plan.stages[0].assignment_id, RouteWork()).prefill_tokens, plan.replica, hops)
                      for plan, hops in self._routes.hops([p for p in plans.values() if rules.prefills(p)], avoid)
                      if _layout(plan) == _layout(target)]
        if not candidates:
            return None
        queued, _, hops = min(candidates, key=lambda c: c[:2])
        return hops if queued <= rules.max_queue_tokens else None

    def _lane(self, model_id: str, ready: list[PlanRecord], revision: str | None) -> list[PlanRecord]:
        """The ready plans a request may take: those of the revision it started on (while any plan of the model
        serves it: a rolled-back canary's request goes on with the serving revision); a new request, the canary's
        with the rollout's share of the chance, else the serving replicas'."""
        registry = self._routes.registry
        if revision is not None:
            kept = [plan for plan in ready if plan.stages[0].spec.revision == revision]
            # (the registry is read only when no ready plan serves it: whether one still loads or recovers)
            if kept or any(plan.stages[0].spec.revision == revision for plan in registry.live_plans(model_id)):
                return kept
        canary = [plan for plan in ready if plan.canary]
        if canary:      # (a rollout runs: the registry is read for its share only then)
            model = registry.model(model_id)
            rollout = model.rollout if model is not None else None
            if rollout is not None and rollout.active and self._rng.random() * 100 < rollout.share:
                return canary
        return [plan for plan in ready if not plan.canary]

    def _choose(self, model_id: str, routes: list[Route], token_ids: Sequence[int], work: Work) -> Route:
        """The pick among the ready routes (by replica); ties go to the next in turn."""
        turn = self._turns.get(model_id, 0)
        self._turns[model_id] = turn + 1
        in_turn = routes[turn % len(routes):] + routes[:turn % len(routes)]
        if self.mode == RouterMode.LEAST_LOAD:     # the busiest stage runs and queues the fewest sequences
            return min(in_turn, key=lambda route: self._routes.load(route[0]))
        if self.mode == RouterMode.KV and token_ids:
            return self._by_prefix(in_turn, token_ids, work)
        return in_turn[0]

    def _by_prefix(self, routes: list[Route], token_ids: Sequence[int], work: Work) -> Route:
        """kv mode: the route whose replica has the least work ahead of the prompt, in prompt tokens: those of its
        own that no stage there holds, those of generations routed there still to prefill, and DECODE_WORK_TOKENS
        per generation decoding there. The prompt then counts as cached there (PrefixIndex.expect)."""
        prefixes, hashes = self._routes.prefixes, {}

        def prompt_hashes(plan: PlanRecord) -> list[bytes]:     # once per block size (replicas share theirs)
            size = plan.stages[0].spec.kv_block_size
            if size not in hashes:
                hashes[size] = block_hashes(token_ids, size)
            return hashes[size]

        def cost(route: Route) -> int:
            plan = route[0]
            cached = prefixes.cached_blocks(plan.plan_id, [s.assignment_id for s in plan.stages], prompt_hashes(plan))
            there = work.get(plan.stages[0].assignment_id, RouteWork())
            return (len(token_ids) - cached * plan.stages[0].spec.kv_block_size + there.prefill_tokens
                    + DECODE_WORK_TOKENS * there.num_decoding)

        chosen = min(routes, key=cost)
        plan = chosen[0]
        prefixes.expect(plan.plan_id, [s.assignment_id for s in plan.stages], prompt_hashes(plan))
        return chosen


def _layout(plan: PlanRecord) -> list[tuple[int, int, str, int, str]]:
    """How a plan's stages split and keep the KV, and of which revision: a session's KV moves between two plans
    only where they agree (KV one revision computed means nothing to another's weights)."""
    return [(s.spec.start_layer, s.spec.end_layer, s.spec.dtype, s.spec.kv_block_size, s.spec.revision)
            for s in plan.stages]
