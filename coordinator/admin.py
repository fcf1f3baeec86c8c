"""What the admin API reads: agents with their newest telemetry, links, recent requests and their traces."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict
from typing import Any

from stratamesh.coordinator.drain import Drainer
from stratamesh.coordinator.origin import Origin, RequestRecord
from stratamesh.coordinator.registry import Registry
from stratamesh.coordinator.traces import request_trace
from stratamesh.fleet.errors import MeshError


class UnknownRequest(MeshError, LookupError):
    """No request with this id is (still) remembered by the origin."""


class MeshAdmin:
    """Read-only views of the mesh as JSON-ready values."""

    def __init__(self, registry: Registry, origin: Origin, metrics_addresses: Mapping[str, str],
                 drainer: Drainer | None = None):
        self._registry = registry
        self._origin = origin
        self._metrics_addresses = metrics_addresses   # agent id -> host:port of its /metrics, last known
        self._drainer = drainer

    def agents(self) -> list[dict[str, Any]]:
        """Every agent the registry knows, with its state, capabilities and newest telemetry."""
        latest = self._registry.latest_telemetry()
        out = []
        for agent in self._registry.agents():
            ts, telemetry = latest.get(agent.agent_id, (None, None))
            out.append({**asdict(agent), "metrics_address": self._metrics_addresses.get(agent.agent_id, ""),
                        "telemetry": asdict(telemetry) | {"received": ts} if telemetry else None})
        return out

    def plans(self) -> list[dict[str, Any]]:
        """Each model's active plan, and the standby one loading beside it if any: which agent serves which
        layers, on how many tensor-parallel ranks, in what state."""
        out = []
        for model in self._registry.models():
            for plan in (self._registry.active_plan(model.model_id), self._registry.standby_plan(model.model_id)):
                if plan is not None:
                    out.append({"plan_id": plan.plan_id, "model_id": plan.model_id, "state": plan.state,
                                "created": plan.created, "reason": plan.reason,
                                "stages": [{"assignment_id": s.assignment_id, "agent_id": s.agent_id,
                                            "start_layer": s.spec.start_layer, "end_layer": s.spec.end_layer,
                                            "tp_degree": s.spec.tp_degree, "state": s.state}
                                           for s in plan.stages]})
        return out

    def telemetry(self, agent_id: str, since: float, limit: int) -> list[dict[str, Any]]:
        """An agent's telemetry history, oldest first."""
        return [asdict(t) | {"received": ts} for ts, t in self._registry.telemetry(agent_id, since, limit)]

    def drain(self, agent_id: str) -> dict[str, Any]:
        """Starts draining an agent (LookupError: not connected; DrainRefused: cannot now)."""
        return self._drains().start(agent_id).as_json()

    def drain_status(self, agent_id: str) -> dict[str, Any]:
        return self._drains().status(agent_id).as_json()

    def _drains(self) -> Drainer:
        if self._drainer is None:
            raise RuntimeError("this admin view was made without a drainer")
        return self._drainer

    def links(self) -> list[dict[str, Any]]:
        return [asdict(link) for link in self._registry.links()]

    def requests(self, limit: int) -> list[dict[str, Any]]:
        """The newest requests, newest first."""
        records = list(self._origin.recent.values())[-limit:] if limit > 0 else []
        return [_record_json(r) for r in reversed(records)]

    def request(self, request_id: str) -> dict[str, Any]:
        return _record_json(self._record(request_id))

    async def request_trace(self, request_id: str) -> dict[str, Any]:
        """The request's timeline, gathered from the origin and every stage of its route."""
        return await request_trace(self._record(request_id), self._origin.spans)

    def _record(self, request_id: str) -> RequestRecord:
        record = self._origin.recent.get(request_id)
        if record is None:
            raise UnknownRequest(f"no request {request_id!r}: unknown, or older than the newest "
                                 f"{len(self._origin.recent)} requests")
        return record


def _record_json(record: RequestRecord) -> dict[str, Any]:
    return {**asdict(record), "state": record.state,
            "route": [{"address": h.address, "assignment_id": h.assignment_id} for h in record.route]}
