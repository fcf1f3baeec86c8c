"""The admin JSON API under /admin/api: agents, telemetry, links, requests and their traces."""

from __future__ import annotations

from typing import Any, Protocol

from fastapi import APIRouter, Query
from fastapi.responses import JSONResponse, Response

from stratamesh.coordinator.api.errors import ApiError, error_response
from stratamesh.fleet.errors import MeshError


class Admin(Protocol):
    """What the admin API reads; the coordinator's MeshAdmin implements it."""

    def agents(self) -> list[dict[str, Any]]: ...

    def telemetry(self, agent_id: str, since: float, limit: int) -> list[dict[str, Any]]: ...

    def links(self) -> list[dict[str, Any]]: ...

    def requests(self, limit: int) -> list[dict[str, Any]]: ...

    def request(self, request_id: str) -> dict[str, Any]: ...  # raises a MeshError for an unknown id

    async def request_trace(self, request_id: str) -> dict[str, Any]: ...

    def drain(self, agent_id: str) -> dict[str, Any]: ...  # LookupError: unknown; another MeshError: refused

    def drain_status(self, agent_id: str) -> dict[str, Any]: ...


def admin_router(admin: Admin) -> APIRouter:
    """The /admin/api routes over admin."""
    router = APIRouter(prefix="/admin/api", tags=["admin"])

    @router.get("/agents")
    async def agents() -> Response:
        return JSONResponse({"agents": admin.agents()})

    @router.get("/plans")
    async def plans() -> Response:
        return JSONResponse({"plans": admin.plans()})

    @router.get("/agents/{agent_id}/telemetry")
    async def telemetry(agent_id: str, since: float = 0.0, limit: int = Query(300, ge=1, le=10_000)) -> Response:
        return JSONResponse({"agent_id": agent_id, "telemetry": admin.telemetry(agent_id, since, limit)})

    @router.post("/agents/{agent_id}/drain", status_code=202)
    async def drain(agent_id: str) -> Response:
        """Moves the agent's stages to spares and its live sessions with their KV, then lets it exit."""
        try:
            return JSONResponse({"drain": admin.drain(agent_id)}, status_code=202)
        except LookupError as exc:
            return error_response(ApiError(404, str(exc), code="agent_not_found"))
        except MeshError as exc:
            return error_response(ApiError(409, str(exc), code="drain_refused"))

    @router.get("/agents/{agent_id}/drain")
    async def drain_status(agent_id: str) -> Response:
        try:
            return JSONResponse({"drain": admin.drain_status(agent_id)})
        except LookupError as exc:
            return error_response(ApiError(404, str(exc), code="drain_not_found"))

    @router.get("/links")
    async def links() -> Response:
        return JSONResponse({"links": admin.links()})

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

    return router


def _or_404(read) -> Response:
    try:
        return JSONResponse(read())
    except LookupError as exc:
        return error_response(ApiError(404, str(exc), code="request_not_found"))
