"""The admin JSON API under /admin/api: pages of agents, models and plans, links, live stats, events, requests and
their traces, the operator's actions (deploy, re-plan, drain), and a live stream for the admin UI: a snapshot of the
fleet, then what changed, every second."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response

from stratamesh.coordinator.api import admin_schemas as schemas
from stratamesh.coordinator.api.errors import ApiError, error_response, error_responses
from stratamesh.coordinator.api.sse import SSEResponse, sse_event
from stratamesh.coordinator.fleet_view import AgentQuery, FleetView, fleet_delta
from stratamesh.coordinator.placement import SitePins
from stratamesh.coordinator.records import Autoscale, Rollout
from stratamesh.fleet.errors import CheckpointError, InvalidInput, MeshError, ModelNotFound, PlacementError
from stratamesh.fleet.sessions import Speculation

SNAPSHOT_EVERY_S = 1.0      # how often /admin/api/stream sends what changed
STATS_INTERVAL_S = 1.0      # the stats' resolution (LiveStats keeps one bucket per second)


class Admin(Protocol):
    """What the admin API reads and does; the coordinator's MeshAdmin implements it."""

    async def agents_page(self, query: AgentQuery) -> dict[str, Any]: ...

    def plans(self) -> list[dict[str, Any]]: ...

    def models(self) -> list[dict[str, Any]]: ...

    async def coordinators(self) -> dict[str, Any]: ...

    def deploy(self, path: str, model_id: str | None, num_stages: int, pins: SitePins, quantize: str = "",
               num_replicas: int = 1, speculation: Speculation | None = None,
               autoscale: Autoscale | None = None) -> dict[str, Any]: ...

    def replan(self, model_id: str, num_stages: int | None) -> dict[str, Any]: ...

    def rollout(self, model_id: str, path: str, steps: list[int] | None, step_s: float | None) -> dict[str, Any]: ...

    def roll_back(self, model_id: str) -> dict[str, Any]: ...

    def stats(self, seconds: int) -> list[dict[str, Any]]: ...

    def events(self, limit: int) -> list[dict[str, Any]]: ...

    async def view(self) -> FleetView: ...

    def telemetry(self, agent_id: str, since: float, limit: int) -> list[dict[str, Any]]: ...

    def links(self) -> list[dict[str, Any]]: ...

    def requests(self, limit: int) -> list[dict[str, Any]]: ...

    def request(self, request_id: str) -> dict[str, Any]: ...  # raises a MeshError for an unknown id

    async def request_trace(self, request_id: str) -> dict[str, Any]: ...

    def drain(self, agent_id: str) -> dict[str, Any]: ...  # LookupError: unknown; another MeshError: refused

    def drain_status(self, agent_id: str) -> dict[str, Any]: ...

    def revoke(self, agent_id: str) -> dict[str, Any]: ...  # LookupError: never enrolled; MeshError: insecure


def admin_router(admin: Admin) -> APIRouter:
    """The /admin/api routes over admin."""
    router = APIRouter(prefix="/admin/api", tags=["admin"], responses={
        400: {"description": "a malformed request (OpenAI's error shape)"},
        404: {"description": "no such agent, model or request"}, **error_responses(401, 403, 413)})
    _add_agent_pages(router, admin)
    _add_model_routes(router, admin)
    _add_live_routes(router, admin, SharedView(admin))
    _add_agent_actions(router, admin)
    _add_request_routes(router, admin)
    return router


def _add_agent_pages(router: APIRouter, admin: Admin) -> None:
    @router.get("/agents", response_model=schemas.AgentsPage)
    async def agents(request: Request,
                     limit: int = Query(schemas.DEFAULT_AGENTS_PAGE, ge=1, le=schemas.MAX_AGENTS_PAGE),
                     after: str | None = Query(None, max_length=256, description="the `next_after` of the page before"),
                     site: str | None = Query(None, max_length=128, description='"" for the agents that name none'),
                     state: schemas.AgentStateName | None = None, tier: schemas.Tier | None = None,
                     serving: bool | None = Query(None, description="holding or planned for a stage (false: spares)"),
                     q: str | None = Query(None, max_length=128, description="a part of the id, name, hostname or "
                                           "address, in any case")) -> Any:
        """The agents the registry knows, a page at a time in agent id order: state, capabilities and newest
        telemetry. Follow `next_after` until it is null; `total` counts every agent that passes the filters."""
        if unknown := sorted(set(request.query_params) - _AGENT_PARAMS):
            return error_response(ApiError(400, f"unknown parameter {unknown[0]!r}: the agents API takes "
                                           f"{', '.join(sorted(_AGENT_PARAMS))}", param=f"query.{unknown[0]}"))
        page = await admin.agents_page(AgentQuery(limit, after, site, state, tier, serving, q))
        return JSONResponse(page)   # the shape is AgentsPage's; validating 10,000 agents again would double the cost


def _add_model_routes(router: APIRouter, admin: Admin) -> None:
    """Models and their plans: read, deploy, re-plan."""
    @router.get("/plans", response_model=schemas.Plans)
    async def plans() -> dict[str, Any]:
        """Each model's active plan and its standby: which agent serves which layers."""
        return {"plans": admin.plans()}

    @router.get("/models", response_model=schemas.Models)
    async def models() -> dict[str, Any]:
        return {"models": admin.models()}

    @router.post("/models", status_code=202, response_model=schemas.DeployedModel)
    async def deploy(body: schemas.DeployModel) -> Any:
        """Deploys a Hugging Face folder; it loads as soon as enough agents can take its stages."""
        try:
            speculation = Speculation.of(body.speculative_config) if body.speculative_config is not None else None
        except InvalidInput as exc:
            return error_response(ApiError(400, str(exc), param="speculative_config", code="bad_speculative_config"))
        try:
            autoscale = Autoscale.of(body.min_replicas, body.max_replicas, body.slo_ttft_ms, body.slo_itl_ms,
                                     body.scale_down_after_s)
        except InvalidInput as exc:
            return error_response(ApiError(400, str(exc), param="max_replicas", code="bad_autoscale"))
        try:
            return {"model": admin.deploy(body.path, body.model_id, body.num_stages,
                                          SitePins(body.first_site or "", body.last_site or ""), body.quantize,
                                          body.num_replicas, speculation, autoscale)}
        except (CheckpointError, InvalidInput) as exc:
            return error_response(ApiError(400, str(exc), param="path", code="bad_model"))

    @router.post("/models/{model_id:path}/rollout", status_code=202, response_model=schemas.DeployedModel,
                 responses={409: {"description": "a rollout runs already, or the folder is the serving revision"}})
    async def rollout(model_id: str, body: schemas.StartRollout) -> Any:
        """Rolls out another revision of the model: a canary replica of it takes a share of the requests that steps
        up while it does as well as the serving revision, and is rolled back by itself when it does not."""
        if body.steps is not None:
            try:
                Rollout.check_steps(body.steps)
            except InvalidInput as exc:
                return error_response(ApiError(400, str(exc), param="steps", code="bad_rollout"))
        try:
            return {"model": admin.rollout(model_id, body.path, body.steps, body.step_s)}
        except ModelNotFound as exc:
            return error_response(ApiError(404, str(exc), param="model_id", code="model_not_found"))
        except CheckpointError as exc:
            return error_response(ApiError(400, str(exc), param="path", code="bad_model"))
        except InvalidInput as exc:
            return error_response(ApiError(409, str(exc), code="rollout_refused"))

    @router.delete("/models/{model_id:path}/rollout", response_model=schemas.DeployedModel,
                   responses={409: {"description": "no rollout of the model runs"}})
    async def roll_back(model_id: str) -> Any:
        """Rolls the model's running rollout back: its canary is given back, the serving revision serves on."""
        try:
            return {"model": admin.roll_back(model_id)}
        except ModelNotFound as exc:
            return error_response(ApiError(404, str(exc), param="model_id", code="model_not_found"))
        except InvalidInput as exc:
            return error_response(ApiError(409, str(exc), code="no_rollout"))

    @router.post("/models/{model_id:path}/replan", status_code=202, response_model=schemas.ReplanResult,
                 responses={409: {"description": "no plan fits the agents there are"}})
    async def replan(model_id: str, body: schemas.Replan | None = None) -> Any:
        """Re-plans a model over the agents there are now: a better plan loads beside the serving one and
        takes over once ready; the serving one is kept if it is still the best."""
        try:
            return {"replan": admin.replan(model_id, body.num_stages if body else None)}
        except ModelNotFound as exc:
            return error_response(ApiError(404, str(exc), param="model_id", code="model_not_found"))
        except (PlacementError, InvalidInput) as exc:
            return error_response(ApiError(409, str(exc), code="replan_refused"))


def _add_live_routes(router: APIRouter, admin: Admin, views: SharedView) -> None:
    """What the admin UI watches: live stats, events, the fleet's snapshot and its stream, an agent's telemetry."""
    @router.get("/stats", response_model=schemas.Stats)
    async def stats(seconds: int = Query(300, ge=1, le=600)) -> dict[str, Any]:
        """Tokens/s, requests/s, TTFT and ITL p50/p99 (over 10 s) and the queue, one point per second."""
        return {"interval_s": STATS_INTERVAL_S, "points": admin.stats(seconds)}

    @router.get("/coordinators", response_model=schemas.Coordinators)
    async def coordinators() -> dict[str, Any]:
        """The mesh's coordinators (on a PostgreSQL registry: the leader, and its standbys) and their lease."""
        return await admin.coordinators()

    @router.get("/events", response_model=schemas.Events)
    async def events(limit: int = Query(100, ge=1, le=1000)) -> dict[str, Any]:
        """The newest events: plans, placement failures, drains, stage moves, agents seen; newest first."""
        return {"events": admin.events(limit)}

    @router.get("/snapshot", response_model=schemas.Snapshot)
    async def snapshot() -> Response:
        """The fleet as the admin UI draws it, at any size: what the live stream sends first (the UI polls it while
        the stream is down)."""
        return JSONResponse((await admin.view()).snapshot())

    @router.get("/stream", response_class=Response, responses={200: {
        "content": {"text/event-stream": {}},
        "description": "server-sent events: first `event: snapshot` (a Snapshot), then about every second "
                       "`event: delta` (a SnapshotDelta: what changed since the event before). A client that "
                       "reconnects gets a snapshot again"}})
    async def stream(request: Request) -> Response:
        """The admin UI's live view of the fleet (server-sent events)."""
        return SSEResponse(_events(views, request), _nothing)

    @router.get("/agents/{agent_id}/telemetry")
    async def telemetry(agent_id: str, since: float = 0.0, limit: int = Query(300, ge=1, le=10_000)) -> Response:
        return JSONResponse({"agent_id": agent_id, "telemetry": admin.telemetry(agent_id, since, limit)})


def _add_agent_actions(router: APIRouter, admin: Admin) -> None:
    """The operator's actions on an agent: drain it, revoke it."""
    @router.post("/agents/{agent_id}/drain", status_code=202, response_model=schemas.Drain,
                 responses={409: {"description": "no spare agent can take a stage, or it is being drained"}})
    async def drain(agent_id: str) -> Any:
        """Moves the agent's stages to spares and its live sessions with their KV, then lets it exit."""
        try:
            return JSONResponse({"drain": admin.drain(agent_id)}, status_code=202)
        except LookupError as exc:
            return error_response(ApiError(404, str(exc), code="agent_not_found"))
        except MeshError as exc:
            return error_response(ApiError(409, str(exc), code="drain_refused"))

    @router.get("/agents/{agent_id}/drain", response_model=schemas.Drain)
    async def drain_status(agent_id: str) -> Any:
        try:
            return {"drain": admin.drain_status(agent_id)}
        except LookupError as exc:
            return error_response(ApiError(404, str(exc), code="drain_not_found"))

    @router.post("/agents/{agent_id}/revoke", response_model=schemas.Revocation,
                 responses={409: {"description": "the mesh runs --insecure: there are no certificates"}})
    async def revoke(agent_id: str) -> Any:
        """Revokes the agent's certificates: its calls are cut at once, and neither the coordinator nor any
        agent takes one from it again. Its stages are re-planned onto the others."""
        try:
            return {"revocation": admin.revoke(agent_id)}
        except LookupError as exc:
            return error_response(ApiError(404, str(exc), code="agent_not_found"))
        except MeshError as exc:
            return error_response(ApiError(409, str(exc), code="revoke_refused"))


def _add_request_routes(router: APIRouter, admin: Admin) -> None:
    """The links measured, and the requests served with their traces."""
    @router.get("/links", response_model=schemas.Links)
    async def links() -> dict[str, Any]:
        """The newest measurement of each link (round trip and bulk rate), between agents and to the origin."""
        return {"links": admin.links()}

    @router.get("/requests")
    async def requests(limit: int = Query(100, ge=1, le=1000)) -> Response:
        return JSONResponse({"requests": admin.requests(limit)})

    @router.get("/requests/{request_id}")
    async def request(request_id: str) -> Response:
        return _or_404(lambda: admin.request(request_id))

    @router.get("/requests/{request_id}/trace")
    async def request_trace(request_id: str) -> Response:
        try:
            return JSONResponse(await admin.request_trace(request_id))
        except LookupError as exc:
            return error_response(ApiError(404, str(exc), code="request_not_found"))


_AGENT_PARAMS = frozenset({"limit", "after", "site", "state", "tier", "serving", "q"})


class SharedView:
    """The newest FleetView for every stream at once: built at most once per half a SNAPSHOT_EVERY_S however many
    browsers watch, since each build reads every agent of the fleet."""

    def __init__(self, admin: Admin, clock: Callable[[], float] = time.monotonic) -> None:
        self._admin = admin
        self._clock = clock
        self._lock = asyncio.Lock()
        self._view: FleetView | None = None
        self._built = -math.inf

    async def latest(self) -> FleetView:
        async with self._lock:
            if self._view is None or self._clock() >= self._built + SNAPSHOT_EVERY_S / 2:
                self._view = await self._admin.view()
                self._built = self._clock()
            return self._view


async def _events(views: SharedView, request: Request) -> AsyncIterator[bytes]:
    """A snapshot, then every SNAPSHOT_EVERY_S what changed since the event before, until the client goes."""
    sent: FleetView | None = None
    while not await request.is_disconnected():
        view = await views.latest()
        yield (sse_event(view.snapshot(), event="snapshot") if sent is None
               else sse_event(fleet_delta(sent, view), event="delta"))
        sent = view
        await asyncio.sleep(SNAPSHOT_EVERY_S)


async def _nothing() -> None:
    return None


def _or_404(read) -> Response:
    try:
        return JSONResponse(read())
    except LookupError as exc:
        return error_response(ApiError(404, str(exc), code="request_not_found"))
