"""What the admin API reads and does: pages of agents with their newest telemetry, the fleet view its live stream
sends, models and plans, links, live stats, events, recent requests and their traces; deploying a model, re-planning
one, draining an agent."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from dataclasses import asdict
from typing import Any

from stratamesh.coordinator.autoscaler import Autoscaler
from stratamesh.coordinator.rollouts import Rollouts
from stratamesh.coordinator.control.deployer import Deployer
from stratamesh.coordinator.control.drainer import Drainer
from stratamesh.coordinator.control.models import ModelInfo, find_model, model_infos
from stratamesh.coordinator.enrollment import Revoker
from stratamesh.coordinator.fleet_view import (AgentQuery, FleetView, agent_json, agents_that_matter, page_of,
                                               site_links, site_summaries)
from stratamesh.coordinator.live_stats import LiveStats
from stratamesh.coordinator.placement import SitePins
from stratamesh.coordinator.records import CANARY_REPLICA, DRAIN_RUNNING, AgentRecord, Autoscale
from stratamesh.coordinator.registry import ModelRecord, Registry
from stratamesh.coordinator.serving.records import RequestLog, RequestRecord
from stratamesh.coordinator.serving.router import Disaggregation
from stratamesh.coordinator.traces import request_trace
from stratamesh.fleet.control_messages import LinkMeasurement
from stratamesh.fleet.model_folder import default_model_id
from stratamesh.fleet.sessions import Speculation
from stratamesh.fleet.errors import MeshError
from stratamesh.fleet.states import ModelState
from stratamesh.fleet.boxes import StageLoad, Telemetry
from stratamesh.partitioner.fleet_snapshot import ORIGIN

SNAPSHOT_EVENTS = 20        # the newest events a live snapshot carries
LINKS_EVERY_S = 10.0        # a view reads the links again this often: agents measure theirs every few minutes, and
                            # a fleet of 10,000 has 80,000 of them (a third of a second to read)
HISTORY_READS_UP_TO = 500   # agents whose last telemetry is read one by one (16 us each); for more, all at once


class UnknownRequest(MeshError, LookupError):
    """No request with this id is (still) remembered by the origin."""


class InsecureMesh(MeshError):
    """The mesh runs in insecure development mode: it has no certificates to revoke."""


class MeshAdmin:
    """Views of the mesh as JSON-ready values, and the operator's actions on it."""

    def __init__(self, registry: Registry, requests: RequestLog, metrics_addresses: Mapping[str, str],
                 drainer: Drainer | None = None, deployer: Deployer | None = None, live: LiveStats | None = None,
                 clock: Callable[[], float] = time.time, revoker: Revoker | None = None,
                 disaggregation: Disaggregation = Disaggregation(), autoscaler: Autoscaler | None = None,
                 rollouts: Rollouts | None = None,
                 coordinators: Callable[[], Awaitable[dict[str, Any]]] | None = None):
        """Without a deployer (a standby coordinator's view) it answers only what the registry and its own request
        log hold; coordinators: the mesh's coordinators and their lease, as /admin/api/coordinators shows them."""
        self._registry = registry
        self._coordinators = coordinators
        self._requests = requests
        self._disaggregation = disaggregation
        self._metrics_addresses = metrics_addresses   # agent id -> host:port of its /metrics, last known
        self._drainer = drainer
        self._deployer = deployer
        self._autoscaler = autoscaler
        self._rollouts = rollouts
        self._live = live if live is not None else LiveStats()
        self._clock = clock
        self._revoker = revoker
        # (when, links, their sums per pair of sites)
        self._links_read: tuple[float, list[LinkMeasurement], list[dict[str, Any]]] | None = None

    def lead(self, deployer: Deployer, drainer: Drainer, metrics_addresses: Mapping[str, str],
             revoker: Revoker | None, autoscaler: Autoscaler, rollouts: Rollouts) -> None:
        """A standby's view becomes the leader's: what it forwarded to the leader, it answers and does itself."""
        self._deployer, self._drainer, self._metrics_addresses = deployer, drainer, metrics_addresses
        self._revoker, self._autoscaler, self._rollouts = revoker, autoscaler, rollouts

    async def coordinators(self) -> dict[str, Any]:
        """The mesh's coordinators, the leader first, and their lease (None: one coordinator, no lease)."""
        if self._coordinators is None:
            return {"coordinators": [], "lease": None}
        return await self._coordinators()

    async def agents_page(self, query: AgentQuery) -> dict[str, Any]:
        """One page of the agents the registry knows, in id order: each with its state, capabilities and newest
        telemetry; the cursor of the next page (None after the last) and how many pass the query's filters."""
        agents = await asyncio.to_thread(self._registry.agents)     # a fleet of 10,000: a tenth of a second
        serving = _planned(self.plans()) if query.serving is not None else ()
        page, next_after, total = page_of(agents, query, serving)
        return {"agents": self._agents_json(page), "next_after": next_after, "total": total}

    def _agents_json(self, agents: Sequence[AgentRecord]) -> list[dict[str, Any]]:
        latest = self._newest_telemetry([a.agent_id for a in agents])
        versions = self._deployer.roster.versions if self._deployer is not None else {}
        return [agent_json(a, self._metrics_addresses.get(a.agent_id, ""), latest.get(a.agent_id),
                           versions.get(a.agent_id, ("", 0))) for a in agents]

    def _newest_telemetry(self, agent_ids: Sequence[str]) -> dict[str, tuple[float, Telemetry]]:
        """The newest telemetry of these agents and when it came: the deployer's in memory (connected agents; the
        registry's history gets it only every few seconds), else the last the registry recorded."""
        latest = {}
        if self._deployer is not None:
            telemetry, received = self._deployer.roster.telemetry, self._deployer.roster.telemetry_at
            latest = {a: (received[a], telemetry[a]) for a in agent_ids if a in telemetry and a in received}
        missing = [a for a in agent_ids if a not in latest]
        if len(missing) > HISTORY_READS_UP_TO:
            history = self._registry.latest_telemetry()
            return latest | {a: history[a] for a in missing if a in history}
        for agent_id in missing:
            if newest := self._registry.telemetry(agent_id, 0.0, 1):
                latest[agent_id] = newest[-1]
        return latest

    def plans(self) -> list[dict[str, Any]]:
        """Each model replica's active plan, and the standby one loading beside it if any: which agent serves which
        layers, on how many tensor-parallel ranks, in what state."""
        out = []
        for model in self._registry.models():
            for plan in self._registry.live_plans(model.model_id):
                codecs = (self._deployer.routes.link_codecs(plan) if self._deployer is not None
                          else [""] * len(plan.stages))
                out.append({"plan_id": plan.plan_id, "model_id": plan.model_id, "state": plan.state,
                            "created": plan.created, "reason": plan.reason, "num_layers": model.num_layers,
                            "replica": plan.replica, "canary": plan.canary,
                            "revision": plan.stages[0].spec.revision,
                            "role": self._disaggregation.role(plan),
                            "predicted": _predicted(plan.prediction),
                            "stages": [{"assignment_id": s.assignment_id, "agent_id": s.agent_id,
                                        "start_layer": s.spec.start_layer, "end_layer": s.spec.end_layer,
                                        "tp_degree": s.spec.tp_degree, "device": s.spec.device,
                                        "dtype": s.spec.dtype, "runtime": s.spec.runtime,
                                        "quantize": s.spec.quantize, "kv_cache_bytes": s.spec.kv_cache_bytes,
                                        "state": s.state,
                                        "cached_blocks": self._cached_blocks(s.assignment_id),
                                        "weights": self._weights(s.assignment_id),
                                        "predicted_step_s": _stage_step(plan.prediction, i),
                                        "link_codec": codecs[i],
                                        "experts": self._experts(s.agent_id, s.assignment_id, s.spec.tp_degree)}
                                       for i, s in enumerate(plan.stages)]})
        return out

    def _experts(self, agent_id: str, assignment_id: str, num_ranks: int) -> dict[str, Any] | None:
        telemetry = self._deployer.roster.telemetry.get(agent_id) if self._deployer is not None else None
        load = next((s for s in telemetry.stages if s.assignment_id == assignment_id), None) if telemetry else None
        return expert_view(load, num_ranks) if load is not None else None

    def _cached_blocks(self, assignment_id: str) -> int:
        return self._deployer.routes.prefixes.num_cached(assignment_id) if self._deployer is not None else 0

    def _weights(self, assignment_id: str) -> dict[str, Any] | None:
        progress = self._deployer.weights.get(assignment_id) if self._deployer is not None else None
        return None if progress is None else {f: getattr(progress, f) for f in (
            "fetched_bytes", "reused_bytes", "total_bytes", "tensor_bytes", "done", "source", "num_corrupt")}

    def models(self) -> list[dict[str, Any]]:
        """Every deployed model, its state and its stage count."""
        infos = {info.model_id: info for info in model_infos(self._registry)}
        return [self._model_json(model, infos[model.model_id]) for model in self._registry.models()]

    def deploy(self, path: str, model_id: str | None, num_stages: int, pins: SitePins,
               quantize: str = "", num_replicas: int = 1, speculation: Speculation | None = None,
               autoscale: Autoscale | None = None) -> dict[str, Any]:
        """Deploys a model folder (CheckpointError, InvalidInput); it loads as soon as enough agents can take it."""
        served_id = model_id or default_model_id(path)
        self._planner().plans.add_model(served_id, path, num_stages, pins, quantize, num_replicas, speculation,
                                        autoscale)
        return self._model_json(self._registry.model(served_id), find_model(self._registry, served_id))

    def rollout(self, model_id: str, path: str, steps: Sequence[int] | None, step_s: float | None) -> dict[str, Any]:
        """Starts rolling out another revision of a model (ModelNotFound; InvalidInput, CheckpointError)."""
        if self._rollouts is None:
            raise RuntimeError("this admin view was made without rollouts")
        self._rollouts.start(model_id, path, steps, step_s)
        return self._model_json(self._registry.model(model_id), find_model(self._registry, model_id))

    def roll_back(self, model_id: str) -> dict[str, Any]:
        """An operator's roll-back of a model's running rollout (ModelNotFound; InvalidInput if none runs)."""
        if self._rollouts is None:
            raise RuntimeError("this admin view was made without rollouts")
        self._rollouts.roll_back(model_id, "rolled back by an operator")
        return self._model_json(self._registry.model(model_id), find_model(self._registry, model_id))

    def replan(self, model_id: str, num_stages: int | None) -> dict[str, Any]:
        """Re-plans a model over the agents there are now (ModelNotFound; PlacementError if no plan fits)."""
        outcome, reason = self._planner().plans.replan(model_id, num_stages)
        return {"model_id": model_id, "outcome": outcome, "reason": reason}

    def _model_json(self, model: ModelRecord, info: ModelInfo) -> dict[str, Any]:
        deployer, model_id = self._planner(), model.model_id
        routes = deployer.routes
        state = (ModelState.READY if routes.is_ready(model_id)
                 else ModelState.SCALED_TO_ZERO if deployer.plans.scaled_to_zero(model_id)
                 else ModelState.RECOVERING if routes.accepts(model_id)
                 else ModelState.LOADING if self._registry.active_plan(model_id) else ModelState.WAITING)
        return {"model_id": model_id, "path": model.path, "num_layers": model.num_layers,
                "max_context": info.max_context, "state": state, "num_stages": deployer.plans.num_stages(model_id),
                "first_site": model.first_site, "last_site": model.last_site, "quantize": model.quantize,
                "num_replicas": model.num_replicas,
                "ready_replicas": routes.ready_replicas(model_id),
                "created": model.created, "speculation": self._speculation(model_id),
                "speculative_config": model.speculation.config() if model.speculation else None,
                "autoscale": self._autoscale(model), "revision": model.revision,
                "rollout": self._rollout(model),
                "load_errors": [asdict(e) for e in deployer.load_errors.of_model(self._registry, model_id)]}

    def _rollout(self, model: ModelRecord) -> dict[str, Any] | None:
        """The model's newest rollout: its revision, steps and state, the share its canary takes now, and whether the
        canary serves."""
        rollout = model.rollout
        if rollout is None:
            return None
        canary = self._registry.active_plan(model.model_id, CANARY_REPLICA)
        return {**asdict(rollout), "share": rollout.share,
                "canary_ready": canary is not None and self._planner().routes.serves(canary)}

    def _autoscale(self, model: ModelRecord) -> dict[str, Any] | None:
        """An autoscaled model's bounds and targets, its replicas over time and the autoscaler's last decision."""
        if model.autoscale is None:
            return None
        scaler, model_id = self._autoscaler, model.model_id
        return {**asdict(model.autoscale),
                "history": [asdict(p) for p in scaler.history(model_id)] if scaler else [],
                "last_decision": scaler.last_reason(model_id) if scaler else "",
                "last_cold_start_s": scaler.last_cold_start_s(model_id) if scaler else None}

    def _speculation(self, model_id: str) -> dict[str, Any]:
        """What the last stages of the model's live plans kept of the tokens drafted for them (speculative decoding),
        since they loaded, as their agents' newest heartbeats say; acceptance_rate None before any draft."""
        ids = {s.assignment_id for plan in self._registry.live_plans(model_id) for s in plan.stages}
        loads = [s for t in self._planner().roster.telemetry.values() for s in t.stages if s.assignment_id in ids]
        drafted, kept = sum(s.spec_draft_tokens for s in loads), sum(s.spec_accepted_tokens for s in loads)
        return {"draft_tokens": drafted, "accepted_tokens": kept,
                "acceptance_rate": kept / drafted if drafted else None}

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

    async def view(self) -> FleetView:
        """The fleet as the admin UI draws it now (see FleetView): what its live stream sends."""
        now, plans, drains = self._clock(), self.plans(), self.drains()
        planned = _planned(plans)
        draining = {d["agent_id"] for d in drains if d["state"] in DRAIN_RUNNING}
        telemetry = dict(self._deployer.roster.telemetry) if self._deployer is not None else {}
        # The registry's every agent is read and summed up off the event loop: at 10,000 agents that takes a tenth
        # of a second, which the control streams' heartbeats must not wait for.
        agents, sites = await asyncio.to_thread(self._fleet, telemetry, planned)
        held = agents_that_matter(agents, planned, draining, now)
        records = self._agents_json([a for a in agents if a.agent_id in held])
        links, between_sites = await self._links_now(agents)
        ends = held | {ORIGIN}
        latest = self.stats(1)
        return FleetView(now, len(agents), sites, {a["agent_id"]: a for a in records}, plans,
                         [link_json(k) for k in links if k.agent_id in ends and k.peer_agent_id in held], between_sites,
                         self.models(), drains, latest[-1] if latest else None, self.events(SNAPSHOT_EVENTS))

    def _fleet(self, telemetry: Mapping[str, Telemetry],
               planned: Collection[str]) -> tuple[list[AgentRecord], dict[str, dict[str, Any]]]:
        agents = self._registry.agents()
        return agents, site_summaries(agents, telemetry, planned)

    async def _links_now(self, agents: Sequence[AgentRecord]) -> tuple[list[LinkMeasurement], list[dict[str, Any]]]:
        """Every measured link and their sums per pair of sites, read again at most every LINKS_EVERY_S."""
        now = self._clock()
        if self._links_read is None or now >= self._links_read[0] + LINKS_EVERY_S:
            site_of = {a.agent_id: a.capabilities.site for a in agents}
            self._links_read = (now, *await asyncio.to_thread(self._read_links, site_of))
        return self._links_read[1], self._links_read[2]

    def _read_links(self, site_of: Mapping[str, str]) -> tuple[list[LinkMeasurement], list[dict[str, Any]]]:
        links = self._registry.links()
        return links, site_links(links, site_of)

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
        return [link_json(link) for link in self._registry.links()]

    def requests(self, limit: int) -> list[dict[str, Any]]:
        """The newest requests, newest first."""
        records = list(self._requests.recent.values())[-limit:] if limit > 0 else []
        return [_record_json(r) for r in reversed(records)]

    def request(self, request_id: str) -> dict[str, Any]:
        return _record_json(self._record(request_id))

    async def request_trace(self, request_id: str) -> dict[str, Any]:
        """The request's timeline, gathered from the origin and every stage of its route."""
        return await request_trace(self._record(request_id), self._requests.spans)

    def _record(self, request_id: str) -> RequestRecord:
        record = self._requests.recent.get(request_id)
        if record is None:
            raise UnknownRequest(f"no request {request_id!r}: unknown, or older than the newest "
                                 f"{len(self._requests.recent)} requests")
        return record


def link_json(link: LinkMeasurement) -> dict[str, Any]:
    """A link as the admin API shows it, under its schema's names (peer_id, ts)."""
    return {"agent_id": link.agent_id, "peer_id": link.peer_agent_id, "rtt_s": link.rtt_s,
            "bandwidth_bytes_per_s": link.bandwidth_bytes_per_s, "error": link.error, "ts": link.measured_at_s}


def _planned(plans: list[dict[str, Any]]) -> set[str]:
    """The agents holding or planned for a stage of these plans."""
    return {stage["agent_id"] for plan in plans for stage in plan["stages"]}


def _record_json(record: RequestRecord) -> dict[str, Any]:
    return {**asdict(record), "state": record.state,
            "route": [{"address": h.address, "assignment_id": h.assignment_id} for h in record.route]}


def expert_view(load: StageLoad, num_ranks: int) -> dict[str, Any] | None:
    """Where a mixture of experts' stage sent its tokens since it loaded, as its agent's newest heartbeat says:
    each expert's tokens, the last step's imbalance, and, split over an expert-parallel group's num_ranks ranks
    (rank r holds the r-th equal run of experts), each rank's tokens and the straggler: the rank whose experts got
    the most, which every step waits for (None while the ranks' loads are even). None for a dense stage."""
    tokens = load.expert_tokens
    if not tokens:
        return None
    ranks = num_ranks if num_ranks > 1 and len(tokens) % num_ranks == 0 else 1
    per_rank = len(tokens) // ranks
    rank_tokens = [sum(tokens[r * per_rank:(r + 1) * per_rank]) for r in range(ranks)]
    busiest = max(range(ranks), key=rank_tokens.__getitem__)
    uneven = ranks > 1 and rank_tokens[busiest] * ranks > sum(rank_tokens)
    return {"tokens": list(tokens), "imbalance": load.expert_imbalance, "rank_tokens": rank_tokens,
            "straggler_rank": busiest if uneven else None}


def _predicted(prediction: dict[str, Any]) -> dict[str, Any] | None:
    """The plan's predicted tokens/s, at what concurrency, its step and bottleneck (None for a plan stored before
    predictions were)."""
    keys = ("tokens_per_s", "concurrency", "step_s", "bottleneck_s", "bottleneck")
    return {k: prediction[k] for k in keys} if prediction else None


def _stage_step(prediction: dict[str, Any], index: int) -> float | None:
    steps = prediction.get("stage_step_s", [])
    return steps[index] if index < len(steps) else None
