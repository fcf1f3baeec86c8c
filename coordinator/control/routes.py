"""Routes: which models can take requests now, the hops through each ready replica, the codec of each link, and
what the stages' prefix caches hold (the router, serving/router.py, picks among them)."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, Protocol

from stratamesh.coordinator.control.prefix_index import PrefixIndex
from stratamesh.coordinator.records import PlanRecord, StageRecord
from stratamesh.coordinator.registry_store import RegistryStore
from stratamesh.fleet.boxes import Telemetry
from stratamesh.fleet.kv import KvEvents
from stratamesh.fleet.sessions import Hop, wire_dtype
from stratamesh.partitioner.wire_codec import check_policy, choose_codec

log = logging.getLogger(__name__)

MAX_REVISIONS_KEPT = 1 << 16    # stages whose revision routes remember (a fleet's live stages are fewer)


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


class RosterReads(Protocol):
    """What routes read of the agents: the leader's Roster (control/roster.py), from their streams; a standby's
    RegistryRoster (coordinator/standby.py), from the registry the leader writes."""

    telemetry: Mapping[str, Telemetry]      # agent id -> its newest heartbeat telemetry

    def serving(self, stage: StageRecord) -> bool:
        """Whether the stage is loaded on a connected agent."""

    def stage_address(self, agent_id: str) -> str:
        """Where a connected agent's Stage service listens (AgentNotConnected otherwise)."""

    def nat(self, agent_id: str) -> str:
        """The address a connected agent is behind NAT at ("": it is not, or is not connected)."""

    def bandwidth(self, sender: str, receiver: str) -> float | None:
        """The measured bandwidth between two agents (bytes/s), or None."""

    def same_box(self, a: str, b: str) -> bool:
        """Whether two connected agents run on one box."""


class Routes:
    """The models ready to serve and the route through each: a model is ready once every stage of one of its
    replicas' active plans is loaded on a connected agent. It remembers the models that were ever ready (they
    accept requests while recovering) and wakes the callers of changed() when a plan, a stage or an agent changes."""

    def __init__(self, registry: RegistryStore, roster: RosterReads, clock: Callable[[], float] = time.monotonic,
                 codec_policy: str = "auto"):
        self.codec_policy = check_policy(codec_policy)  # "auto": each link's codec as the measured bandwidth allows
        self.registry = registry
        self._roster = roster
        self.prefixes = PrefixIndex(clock)     # what each replica's stages hold in their prefix caches (kv mode)
        self._served: set[str] = set()         # models that were ready since this coordinator started
        self._codecs: dict[tuple[str, int], str] = {}   # (plan id, stage) -> the codec into it routes used last
        # assignment id -> the revision its stage serves, of the routes given newest (a retired plan's are kept: a
        # session may open on a route given just before its plan was replaced)
        self._revisions: OrderedDict[str, str] = OrderedDict()
        self._waiters: list[asyncio.Future[None]] = []

    def serves(self, plan: PlanRecord) -> bool:
        """Whether every stage of the plan is loaded on a connected agent."""
        return all(self._roster.serving(s) for s in plan.stages)

    def ready_plans(self, model_id: str) -> list[PlanRecord]:
        """The active plans of the model's replicas that serve, by replica."""
        return [plan for plan in self.registry.active_plans(model_id) if self.serves(plan)]

    def ready_replicas(self, model_id: str) -> int:
        """The model's serving replicas that serve (a rollout's canary is none of them)."""
        return sum(not plan.canary for plan in self.ready_plans(model_id))

    def is_ready(self, model_id: str) -> bool:
        return bool(self.ready_plans(model_id))

    def accepts(self, model_id: str) -> bool:
        """Ready, or recovering from a lost agent after having been ready, or autoscaled to zero replicas (its
        next request asks for one): requests wait for a route."""
        return model_id in self._served or self.is_ready(model_id) or self.cold(model_id)

    def cold(self, model_id: str) -> bool:
        """Whether the model is autoscaled and has no replica serving: a request waits for one to start."""
        model = self.registry.model(model_id)
        return model is not None and model.autoscale is not None and not self.is_ready(model_id)

    def hops(self, plans: list[PlanRecord], avoid: Collection[str] = ()) -> list[tuple[PlanRecord, list[Hop]]]:
        """Each plan with its hops in pipeline order, less those through an address in avoid."""
        roster = self._roster
        for stage in (s for plan in plans for s in plan.stages):
            self._revisions[stage.assignment_id] = stage.spec.revision
            self._revisions.move_to_end(stage.assignment_id)
        while len(self._revisions) > MAX_REVISIONS_KEPT:
            self._revisions.popitem(last=False)
        routes = [(plan, [Hop(roster.stage_address(s.agent_id), s.assignment_id, s.spec.dtype, codec, s.agent_id,
                              roster.nat(s.agent_id))
                          for s, codec in zip(plan.stages, self.link_codecs(plan), strict=True)])
                  for plan in plans]
        return [(plan, hops) for plan, hops in routes if not any(hop.address in avoid for hop in hops)]

    def revision_of(self, assignment_id: str) -> str:
        """The revision the stage of a route hops() gave serves: what a session opened on that route says."""
        return self._revisions.get(assignment_id, "")

    def link_codecs(self, plan: PlanRecord) -> list[str]:
        """The codec of the link into each stage of plan (hop_codecs); logs each link that narrows or changes codec."""
        codecs = hop_codecs(plan, self.codec_policy, self._roster.bandwidth, self._roster.same_box)
        for k, codec in enumerate(codecs[1:], start=1):
            before = self._codecs.get((plan.plan_id, k), "")
            if codec != before:
                sender, receiver = plan.stages[k - 1].agent_id, plan.stages[k].agent_id
                log.info("the link %s -> %s into stage %d of %s carries %s now (was %s; its measured bandwidth: %s)",
                         sender, receiver, k, plan.model_id, codec or "raw", before or "raw",
                         _rate(self._roster.bandwidth(sender, receiver)))
                self._codecs[plan.plan_id, k] = codec
        return codecs

    def load(self, plan: PlanRecord) -> int:
        """The sequences the plan's busiest stage runs and queues, as its agent's newest heartbeat says."""
        loads = {load.assignment_id: load.num_running + load.num_waiting
                 for s in plan.stages if (telemetry := self._roster.telemetry.get(s.agent_id))
                 for load in telemetry.stages}
        return max((loads.get(s.assignment_id, 0) for s in plan.stages), default=0)

    def kv_events(self, reports: Sequence[KvEvents]) -> None:
        """Stages' prefix-cache changes, each from the agent that holds its stage (the deployer checks)."""
        for report in reports:
            self.prefixes.apply(report)

    def prune(self) -> None:
        """The prefix index keeps only the replicas of live plans (active, and standby: what a standby's stages
        report before it takes over counts once it does) and their stages."""
        plans = [plan for model in self.registry.models() for plan in self.registry.live_plans(model.model_id)]
        self.prefixes.keep({plan.plan_id for plan in plans}, {s.assignment_id for plan in plans for s in plan.stages})

    async def changed(self, timeout_s: float) -> None:
        """Returns at the next notify() (a plan, a stage or an agent changed), or after timeout_s."""
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await asyncio.wait_for(waiter, max(timeout_s, 0.0))
        except asyncio.TimeoutError:
            pass

    def notify(self) -> None:
        """Wakes every changed(): a plan, a stage or an agent changed."""
        for model in self.registry.models():
            if model.model_id not in self._served and self.is_ready(model.model_id):
                self._served.add(model.model_id)
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)
