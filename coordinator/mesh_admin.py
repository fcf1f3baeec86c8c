"""What the admin API reads and does: agents with their newest telemetry, models and plans, links, live stats,
events, recent requests and their traces; deploying a model, re-planning one, draining an agent."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

from stratamesh.coordinator.control.deployer import Deployer
from stratamesh.coordinator.control.drainer import Drainer
from stratamesh.coordinator.control.models import ModelInfo
from stratamesh.coordinator.enrollment import Revoker
from stratamesh.coordinator.live_stats import LiveStats
from stratamesh.coordinator.origin import Origin, RequestRecord
from stratamesh.coordinator.placement import SitePins
from stratamesh.coordinator.registry import ModelRecord, Registry
from stratamesh.coordinator.traces import request_trace
from stratamesh.fleet.errors import MeshError

SNAPSHOT_EVENTS = 20        # the newest events a live snapshot carries


class UnknownRequest(MeshError, LookupError):
    """No request with this id is (still) remembered by the origin."""


class InsecureMesh(MeshError):
    """The mesh runs in insecure development mode: it has no certificates to revoke."""


class MeshAdmin:
    """Views of the mesh as JSON-ready values, and the operator's actions on it."""

    def __init__(self, registry: Registry, origin: Origin, metrics_addresses: Mapping[str, str],
                 drainer: Drainer | None = None, deployer: Deployer | None = None, live: LiveStats | None = None,
                 clock: Callable[[], float] = time.time, revoker: Revoker | None = None):
        self._registry = registry
        self._origin = origin
        self._metrics_addresses = metrics_addresses   # agent id -> host:port of its /metrics, last known
        self._drainer = drainer
        self._deployer = deployer
        self._live = live if live is not None else LiveStats()
        self._clock = clock
        self._revoker = revoker

    def agents(self) -> list[dict[str, Any]]:
        """Every agent the registry knows, with its state, capabilities and newest telemetry."""
        latest = self._registry.latest_telemetry()
        if self._deployer is not None:      # the newest, which the registry's history gets only every few seconds
            received = self._deployer.telemetry_at
            latest |= {a: (received[a], t) for a, t in list(self._deployer.telemetry.items()) if a in received}
        out = []
        for agent in self._registry.agents():
            ts, telemetry = latest.get(agent.agent_id, (None, None))
            out.append({**asdict(agent), "metrics_address": self._metrics_addresses.get(agent.agent_id, ""),
                        "telemetry": asdict(telemetry) | {"received": ts} if telemetry else None})
        return out

    def plans(self) -> list[dict[str, Any]]:
        """Each model replica's active plan, and the standby one loading beside it if any: which agent serves which
        layers, on how many tensor-parallel ranks, in what state."""
        out = []
        for model in self._registry.models():
            for plan in self._registry.live_plans(model.model_id):
                codecs = self._deployer.link_codecs(plan) if self._deployer is not None else [""] * len(plan.stages)
                out.append({"plan_id": plan.plan_id, "model_id": plan.model_id, "state": plan.state,
                            "created": plan.created, "reason": plan.reason, "num_layers": model.num_layers,
                            "replica": plan.replica,
                            "role": self._deployer.role(plan) if self._deployer is not None else "",
                            "predicted": _predicted(plan.prediction),
                            "stages": [{"assignment_id": s.assignment_id, "agent_id": s.agent_id,
                                        "start_layer": s.spec.start_layer, "end_layer": s.spec.end_layer,
                                        "tp_degree": s.spec.tp_degree, "device": s.spec.device,
                                        "dtype": s.spec.dtype, "runtime": s.spec.runtime,
                                        "quantize": s.spec.quantize, "state": s.state,
                                        "cached_blocks": self._cached_blocks(s.assignment_id),
                                        "weights": self._weights(s.assignment_id),
                                        "predicted_step_s": _stage_step(plan.prediction, i),
                                        "link_codec": codecs[i]}
                                       for i, s in enumerate(plan.stages)]})
        return out

    def _cached_blocks(self, assignment_id: str) -> int:
        return self._deployer.cached_blocks(assignment_id) if self._deployer is not None else 0

    def _weights(self, assignment_id: str) -> dict[str, Any] | None:
        progress = self._deployer.weights.get(assignment_id) if self._deployer is not None else None
        return None if progress is None else {f: getattr(progress, f) for f in (
            "fetched_bytes", "reused_bytes", "total_bytes", "tensor_bytes", "done", "source", "num_corrupt")}

    def models(self) -> list[dict[str, Any]]:
        """Every deployed model, its state and its stage count."""
        infos = {info.model_id: info for info in self._planner().models()}
        return [self._model_json(model, infos[model.model_id]) for model in self._registry.models()]

    def deploy(self, path: str, model_id: str | None, num_stages: int, pins: SitePins,
               quantize: str = "", num_replicas: int = 1) -> dict[str, Any]:
        """Deploys a model folder (CheckpointError, InvalidInput); it loads as soon as enough agents can take it."""
        served_id = model_id or Path(path).resolve().name
        self._planner().add_model(served_id, path, num_stages, pins, quantize, num_replicas)
        return self._model_json(self._registry.model(served_id), self._planner().model(served_id))

    def replan(self, model_id: str, num_stages: int | None) -> dict[str, Any]:
        """Re-plans a model over the agents there are now (ModelNotFound; PlacementError if no plan fits)."""
        outcome, reason = self._planner().replan(model_id, num_stages)
        return {"model_id": model_id, "outcome": outcome, "reason": reason}

    def _model_json(self, model: ModelRecord, info: ModelInfo) -> dict[str, Any]:
        deployer, model_id = self._planner(), model.model_id
        state = ("ready" if deployer.is_ready(model_id) else "recovering" if deployer.accepts(model_id)
                 else "loading" if self._registry.active_plan(model_id) else "waiting")
        return {"model_id": model_id, "path": model.path, "num_layers": model.num_layers,
                "max_context": info.max_context, "state": state, "num_stages": deployer.num_stages(model_id),
                "first_site": model.first_site, "last_site": model.last_site, "quantize": model.quantize,
                "num_replicas": model.num_replicas, "ready_replicas": deployer.ready_replicas(model_id),
                "created": model.created}

    def _planner(self) -> Deployer:
        if self._deployer is None:
            raise RuntimeError("this admin view was made without a deployer")
        return self._deployer

    def stats(self, seconds: int) -> list[dict[str, Any]]:
        """The API's tokens/s, requests/s, TTFT and ITL p50/p99 and queue, one point per second, oldest first."""
        return self._live.points(self._clock(), seconds)

    def events(self, limit: int) -> list[dict[str, Any]]:
        """The newest registry events (plans, placement failures, drains, agents seen), newest first."""
        return [asdict(e) for e in self._registry.events(limit)]

    def drains(self) -> list[dict[str, Any]]:
        return [d.as_json() for d in self._drainer.all()] if self._drainer else []

    def snapshot(self) -> dict[str, Any]:
        """Everything the admin UI draws, at once: what its live stream sends every second."""
        latest = self.stats(1)
        return {"ts": self._clock(), "agents": self.agents(), "plans": self.plans(), "links": self.links(),
                "models": self.models(), "drains": self.drains(), "stats": latest[-1] if latest else None,
                "events": self.events(SNAPSHOT_EVENTS)}

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

    def revoke(self, agent_id: str) -> dict[str, Any]:
        """Revokes the agent's certificates: it is cut off now and refused from then on (LookupError: none;
        InsecureMesh: the mesh has no certificates)."""
        if self._revoker is None:
            raise InsecureMesh("this mesh runs --insecure: it has no certificates to revoke")
        serials = self._revoker.revoke_agent(agent_id)
        self._registry.log_event("agent_revoked", f"certificates revoked: {', '.join(serials) or 'none new'}",
                                 self._clock(), agent_id)
        return {"agent_id": agent_id, "revoked_serials": serials}

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


def _predicted(prediction: dict[str, Any]) -> dict[str, Any] | None:
    """The plan's predicted tokens/s, at what concurrency, its step and bottleneck (None for a plan stored before
    predictions were)."""
    keys = ("tokens_per_s", "concurrency", "step_s", "bottleneck_s", "bottleneck")
    return {k: prediction[k] for k in keys} if prediction else None


def _stage_step(prediction: dict[str, Any], index: int) -> float | None:
    steps = prediction.get("stage_step_s", [])
    return steps[index] if index < len(steps) else None
