"""The origin: the coordinator's serving front. It lists the models, keeps their tokenizers, and runs each request
over the mesh (a Generation or an Embedding), on the routes the router picks; the HTTP API calls nothing else."""

from __future__ import annotations

import asyncio
from collections.abc import Collection, Sequence
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any, Protocol

from stratamesh.coordinator.control.load_errors import LoadErrors
from stratamesh.coordinator.control.models import find_model, model_infos
from stratamesh.coordinator.control.routes import Routes, RosterReads
from stratamesh.coordinator.registry_store import RegistryStore
from stratamesh.coordinator.serving.attempt import Run, chunk_tokens
from stratamesh.coordinator.serving.generation import Embedding, Generation
from stratamesh.coordinator.serving.records import RequestLog, RequestRecord
from stratamesh.coordinator.serving.request import Request
from stratamesh.coordinator.serving.router import Router
from stratamesh.coordinator.serving.sessions import SessionTable
from stratamesh.coordinator.text import Tokenizer
from stratamesh.fleet.errors import ModelNotReady
from stratamesh.fleet.logs import trace_id_var
from stratamesh.fleet.states import ModelState
from stratamesh.fleet.sessions import Hop, SamplingParams, Speculation

# How long a request waits for a route: while its model recovers from a lost agent, or mid-generation.
ROUTE_WAIT_S = 30.0
# ... and for an autoscaled model with no replica serving, while one starts (a cold start loads its stages)
COLD_START_WAIT_S = 300.0


class AgentsView(RosterReads, Protocol):
    """The agents, as the origin reads them (beyond the routes' reads): how many serve, and how long an agent may
    go unheard of before it is declared dead (liveness.lease_s)."""

    liveness: Any
    num_agents: int


class Serving(Protocol):
    """What the origin serves from: the leader's Deployer (control/deployer.py), or a standby's view of the
    registry the leader writes (coordinator/standby.py)."""

    registry: RegistryStore
    routes: Routes
    roster: AgentsView
    load_errors: LoadErrors

    def report_unreachable(self, address: str) -> None:
        """The data plane could not reach this Stage address."""


@dataclass(frozen=True, slots=True)
class ModelCard:
    """A model as /v1/models lists it; task "generate" (completions and chat) or "embed" (embeddings)."""

    id: str
    created: int
    max_context: int
    ready: bool
    task: str = "generate"


class Origin:
    """Runs requests from this coordinator: tokens go to each route's first stage, and come back from its last to
    the session table (address: where the last stages deliver). A request waits up to route_wait_s for a route
    while its model loads or recovers."""

    def __init__(self, address: str, serving: Serving, router: Router, sessions: SessionTable, log: RequestLog,
                 route_wait_s: float = ROUTE_WAIT_S, speculation: Speculation | None = None) -> None:
        """speculation: the generations whose sampling is verifiable (the pick depends on the logits alone) decode
        speculatively so (fleet.sessions.Speculation), where their model has none of its own; None: a token a
        step."""
        self.address = address
        self.speculation = speculation
        self.sessions = sessions
        self.log = log
        self._serving = serving
        self._router = router
        self._route_wait_s = route_wait_s
        self._tokenizers: dict[tuple[str, str], Tokenizer] = {}

    def serve_from(self, serving: Serving) -> None:
        """Routes every request from now on, and every attempt of the generations running, from serving: a
        standby that became the leader serves on from its Deployer."""
        self._serving = serving
        self._router.use(serving.routes)

    def list_models(self) -> list[ModelCard]:
        routes = self._serving.routes
        return [ModelCard(m.model_id, m.created, m.max_context, routes.accepts(m.model_id), m.task)
                for m in model_infos(self._serving.registry)]

    def text(self, model_id: str) -> Tokenizer:
        """The model's tokenizer and chat template (ModelNotFound)."""
        model = find_model(self._serving.registry, model_id)
        key = (model.model_id, model.path)
        if key not in self._tokenizers:
            self._tokenizers[key] = Tokenizer.from_dir(model.path)
        return self._tokenizers[key]

    def generate(self, request: Request) -> Generation:
        """The request's generation: iterate it for token ids, aclose() it to stop (it stops by itself as its stops
        say). The rest of this request's log records carry its trace id."""
        model = find_model(self._serving.registry, request.model_id)
        run = self._run(request.request_id, request.prompt_ids, request.params, model.hidden_size,
                        model.speculation or self.speculation)
        trace_id_var.set(run.record.trace_id)
        return Generation(run, partial(self.route, request.model_id, record=run.record), request.prompt_ids,
                          request.stops,
                          partial(self._prefill_route, request.model_id), self._report_unreachable)

    async def embed(self, model_id: str, prompt_ids: Sequence[int], request_id: str) -> tuple[float, ...]:
        """The embedding model's pooled, L2-normalized vector of the prompt."""
        model = find_model(self._serving.registry, model_id)
        run = self._run(request_id, prompt_ids, SamplingParams(), model.hidden_size)
        trace_id_var.set(run.record.trace_id)
        embedding = Embedding(run, partial(self.route, model_id, record=run.record), prompt_ids,
                              self._report_unreachable)
        return await embedding.vector()

    def health(self) -> dict[str, Any]:
        models = {m.model_id: self._state(m.model_id) for m in model_infos(self._serving.registry)}
        ready = bool(models) and all(state in (ModelState.READY, ModelState.SCALED_TO_ZERO)
                                     for state in models.values())
        serving = bool(models) and all(state in (ModelState.READY, ModelState.RECOVERING, ModelState.SCALED_TO_ZERO)
                                       for state in models.values())
        health = {"status": "ok" if ready else "degraded" if serving else "starting", "models": models,
                  "num_agents": self._serving.roster.num_agents, "num_sessions": self.sessions.num_sessions}
        errors = [asdict(e) for model_id in models
                  for e in self._serving.load_errors.of_model(self._serving.registry, model_id)]
        return {**health, "load_errors": errors} if errors else health

    def _state(self, model_id: str) -> ModelState:
        """READY; RECOVERING (it lost an agent and requests wait for its new route); SCALED_TO_ZERO (autoscaled to
        no replica: a request starts one); or STARTING."""
        routes = self._serving.routes
        if routes.is_ready(model_id):
            return ModelState.READY
        model = self._serving.registry.model(model_id)
        if model is not None and model.scaled_to_zero:
            return ModelState.SCALED_TO_ZERO
        return ModelState.RECOVERING if routes.accepts(model_id) else ModelState.STARTING

    def _run(self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams, hidden_size: int,
             speculation: Speculation | None = None) -> Run:
        """A request's run: its generation speculates so (its model's, or the coordinator's) where its sampling is
        verifiable."""
        return Run(self.sessions, self.log, self.address, self.log.begin(request_id, len(prompt_ids)), params,
                   chunk_tokens(hidden_size), speculation=speculation if params.verifiable else None,
                   revision_of=lambda assignment_id: self._serving.routes.revision_of(assignment_id))

    async def route(self, model_id: str, avoid: Collection[str], token_ids: Sequence[int],
                    record: RequestRecord | None = None) -> tuple[list[Hop], int]:
        """The router's pick for an attempt, waiting up to route_wait_s while the model loads or recovers, and up to
        COLD_START_WAIT_S while an autoscaled one starts a replica (ModelNotReady after). The addresses in avoid are
        trusted again after an agent's lease: if nobody declared their agent dead by then, the failure was the
        link's, and the route through them is the one there is. record: the request's, which keeps the revision of
        the model its first route served, for every route after (a pipeline never mixes revisions, and a request
        keeps its own through failover)."""
        loop = asyncio.get_running_loop()
        start, cold = loop.time(), None
        deadline = start + self._route_wait_s
        trust_at = start + self._serving.roster.liveness.lease_s + 1.0
        while True:
            now, kept = loop.time(), (record.revision or None) if record is not None else None
            try:
                hops, block_size = self._router.route(model_id, avoid if now < trust_at else (), token_ids,
                                                      self.sessions.work(), kept)
            except ModelNotReady:
                if cold is None:    # (asked once, and only of a model with no route: no registry read per request)
                    cold = self._serving.routes.cold(model_id)
                    deadline = start + max(self._route_wait_s, COLD_START_WAIT_S) if cold else deadline
                if now >= deadline:
                    raise
                await self._serving.routes.changed((min(deadline, trust_at) if now < trust_at else deadline) - now)
                continue
            if record is not None:
                record.revision = self._serving.routes.revision_of(hops[0].assignment_id)
            return hops, block_size

    def _report_unreachable(self, address: str) -> None:
        self._serving.report_unreachable(address)      # (to whichever the origin serves from now)

    def _prefill_route(self, model_id: str, decode: Sequence[Hop], token_ids: Sequence[int],
                       avoid: Collection[str]) -> list[Hop] | None:
        return self._router.prefill_route(model_id, decode, token_ids, avoid, self.sessions.work())
