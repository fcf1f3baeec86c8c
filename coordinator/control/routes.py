"""Routes: which models can take requests now, and the hops a request for one goes through: the router picks one
of a model's ready replicas (--router-mode)."""

from __future__ import annotations

import asyncio
from collections.abc import Collection

from stratamesh.coordinator.control.models import find_model
from stratamesh.coordinator.control.roster import Roster
from stratamesh.coordinator.registry import PlanRecord, Registry
from stratamesh.fleet.errors import InvalidInput, ModelNotReady
from stratamesh.fleet.types import ROUTER_MODES, Hop


class Routes:
    """The models ready to serve and the route through each: a model is ready once every stage of one of its
    replicas' active plans is loaded on a connected agent. It remembers the models that were ever ready (they
    accept requests while recovering) and the callers of wait_route() to wake when a plan, a stage or an agent
    changes."""

    def __init__(self, registry: Registry, roster: Roster, mode: str = "round-robin"):
        if mode not in ROUTER_MODES:
            raise InvalidInput(f"router mode {mode!r} is not one of {', '.join(ROUTER_MODES)}")
        self._registry = registry
        self._roster = roster
        self.mode = mode
        self._served: set[str] = set()         # models that were ready since this coordinator started
        self._turns: dict[str, int] = {}       # model id -> routes handed out (whose turn is next)
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

    def route(self, model_id: str, avoid: Collection[str] = ()) -> tuple[list[Hop], int]:
        """The hops of a ready replica of the model in pipeline order, and its KV block size.

        avoid: Stage addresses just found unreachable; a route through one of them is not ready."""
        find_model(self._registry, model_id)
        ready = self.ready_plans(model_id)
        if not ready:
            raise ModelNotReady(f"the model '{model_id}' is not ready yet: its stages are loading")
        routes = [(plan, [Hop(self._roster.stage_address(s.agent_id), s.assignment_id, s.spec.dtype)
                          for s in plan.stages]) for plan in ready]
        routes = [(plan, hops) for plan, hops in routes if not any(hop.address in avoid for hop in hops)]
        if not routes:
            raise ModelNotReady(f"the model '{model_id}' is recovering: its route lost a stage")
        plan, hops = self._choose(model_id, routes)
        return hops, plan.stages[0].spec.kv_block_size

    def _choose(self, model_id: str, routes: list[tuple[PlanRecord, list[Hop]]]) -> tuple[PlanRecord, list[Hop]]:
        """The router's pick of the ready routes (by replica): the next in turn (round-robin), or the one whose
        busiest stage runs and queues the fewest sequences as its agents' newest heartbeats say, ties in turn
        (least-load)."""
        turn = self._turns.get(model_id, 0)
        self._turns[model_id] = turn + 1
        in_turn = routes[turn % len(routes):] + routes[:turn % len(routes)]
        if self.mode == "least-load":
            return min(in_turn, key=lambda route: self._load(route[0]))
        return in_turn[0]

    def _load(self, plan: PlanRecord) -> int:
        """The sequences the plan's busiest stage runs and queues, as its agent's newest heartbeat says."""
        loads = {load.assignment_id: load.num_running + load.num_waiting
                 for s in plan.stages if (telemetry := self._roster.telemetry.get(s.agent_id))
                 for load in telemetry.stages}
        return max((loads.get(s.assignment_id, 0) for s in plan.stages), default=0)

    async def wait_route(self, model_id: str, timeout_s: float,
                         avoid: Collection[str] = ()) -> tuple[list[Hop], int]:
        """route(), waiting up to timeout_s while the model loads or recovers (ModelNotReady after).

        The addresses in avoid are trusted again after an agent's lease: if nobody declared their agent
        dead by then, the failure was the link's, and the route through them is the one there is."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        trust_at = loop.time() + self._roster.liveness.config.lease_s + 1.0
        while True:
            now = loop.time()
            try:
                return self.route(model_id, avoid if now < trust_at else ())
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
