"""What the HTTP API calls: models, their text codecs, generations and embeddings through the origin, health."""

from __future__ import annotations

from functools import partial

from stratamesh.coordinator.api.openai import ModelCard
from stratamesh.coordinator.control.deployer import Deployer
from stratamesh.coordinator.origin import Generation, Origin
from stratamesh.coordinator.text import TextCodec
from stratamesh.fleet.logs import trace_id_var
from stratamesh.fleet.types import SamplingParams

# How long a request waits for a route: while its model recovers from a lost agent, or mid-generation.
ROUTE_WAIT_S = 30.0


class MeshGenerator:
    """The coordinator's Generator: routes each request to a ready replica and runs it from the origin."""

    def __init__(self, deployer: Deployer, origin: Origin, route_wait_s: float = ROUTE_WAIT_S):
        self._deployer = deployer
        self._route_wait_s = route_wait_s
        self._origin = origin
        self._codecs: dict[tuple[str, str], TextCodec] = {}

    def list_models(self) -> list[ModelCard]:
        return [ModelCard(m.model_id, m.created, m.max_context, self._deployer.accepts(m.model_id), m.task)
                for m in self._deployer.models()]

    def text(self, model_id: str) -> TextCodec:
        model = self._deployer.model(model_id)
        key = (model.model_id, model.path)
        if key not in self._codecs:
            self._codecs[key] = TextCodec.from_dir(model.path)
        return self._codecs[key]

    def generate(self, model_id: str, prompt_ids: list[int], params: SamplingParams, request_id: str,
                 max_tokens: int | None = None, stop_token_ids: frozenset[int] = frozenset()) -> Generation:
        model = self._deployer.model(model_id)
        routes = partial(self._deployer.wait_route, model_id, self._route_wait_s)
        generation = self._origin.generate(routes, prompt_ids, params, request_id, model.hidden_size, max_tokens,
                                           stop_token_ids, partial(self._deployer.prefill_route, model_id))
        trace_id_var.set(generation.record.trace_id)   # the rest of this request's log records carry it
        return generation

    async def embed(self, model_id: str, prompt_ids: list[int], request_id: str) -> tuple[float, ...]:
        """The embedding model's pooled, L2-normalized vector of the prompt."""
        model = self._deployer.model(model_id)
        routes = partial(self._deployer.wait_route, model_id, self._route_wait_s)
        embedding = self._origin.embed(routes, prompt_ids, request_id, model.hidden_size)
        trace_id_var.set(embedding.record.trace_id)
        return await embedding.vector()

    def health(self) -> dict:
        models = {m.model_id: _state(self._deployer, m.model_id) for m in self._deployer.models()}
        ready = bool(models) and all(state == "ready" for state in models.values())
        serving = bool(models) and all(state in ("ready", "recovering") for state in models.values())
        return {"status": "ok" if ready else "degraded" if serving else "starting", "models": models,
                "num_agents": self._deployer.num_agents, "num_sessions": self._origin.num_sessions}


def _state(deployer: Deployer, model_id: str) -> str:
    """ready; recovering (it lost an agent and requests wait for its new route); or starting."""
    if deployer.is_ready(model_id):
        return "ready"
    return "recovering" if deployer.accepts(model_id) else "starting"
