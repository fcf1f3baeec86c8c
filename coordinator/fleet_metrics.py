"""The mesh's load as vLLM's gauges, from the agents' newest heartbeat telemetry, and the origin's inbound hop."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Protocol

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from stratamesh.coordinator.liveness import Liveness
from stratamesh.coordinator.serving.records import OriginStats
from stratamesh.coordinator.registry_store import PlanStore, RegistryStore
from stratamesh.fleet.boxes import Telemetry

HOP_BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)

class ReadyReplicas(Protocol):
    def ready_replicas(self, model_id: str) -> int:
        """The model's serving replicas that serve."""


# assignment id -> (model id, stage index) of every stage of an active plan
StageIndex = Callable[[], Mapping[str, tuple[str, int]]]


class FleetCollector(Collector):
    """Per model: sessions waiting at its first stage, sessions running, and the fullest stage's KV use."""

    def __init__(self, telemetry: Mapping[str, Telemetry], stages: StageIndex):
        self._telemetry = telemetry
        self._stages = stages

    def collect(self) -> Iterator[GaugeMetricFamily]:
        stages = self._stages()
        waiting: dict[str, float] = {}
        kv_usage: dict[str, float] = {}
        for telemetry in list(self._telemetry.values()):
            for load in telemetry.stages:
                if load.assignment_id not in stages:
                    continue
                model, index = stages[load.assignment_id]
                waiting[model] = waiting.get(model, 0) + (load.num_waiting if index == 0 else 0)
                kv_usage[model] = max(kv_usage.get(model, 0.0), load.kv_usage)
        for model, _ in sorted(set(stages.values())):
            waiting.setdefault(model, 0)
            kv_usage.setdefault(model, 0.0)
        yield _gauge("vllm:num_requests_waiting", "Sessions waiting at the first stage of the model's pipeline.",
                     waiting)
        yield _gauge("vllm:kv_cache_usage_perc", "KV-cache usage of the model's fullest stage. 1 means 100 percent.",
                     kv_usage)


class OriginCollector(Collector):
    """What the origin's generations went through: moves off drained agents, failovers, tokens computed again."""

    def __init__(self, stats: OriginStats):
        self._stats = stats

    def collect(self) -> Iterator[CounterMetricFamily]:
        s = self._stats
        for name, doc, value in (
                ("stratamesh:session_moves", "Sessions moved with their KV off a draining agent.", s.num_moves),
                ("stratamesh:session_failovers", "Sessions resumed on a new route after losing a stage.",
                 s.num_failovers),
                ("stratamesh:replayed_tokens", "Tokens computed again because a session changed route or was "
                 "preempted (a clean move adds none).", s.num_replayed_tokens),
                ("stratamesh:kv_moved_bytes", "Bytes of KV that moving sessions pulled to their new stages.",
                 s.kv_moved_bytes),
                ("stratamesh:prefill_handoffs", "Prompts prefilled on a prefill replica whose KV then moved to the "
                 "replica that decodes them.", s.num_handoffs),
                ("stratamesh:handoff_kv_bytes", "Bytes of KV those hand-offs moved.", s.handoff_kv_bytes)):
            yield CounterMetricFamily(name, doc, value=value)


# (model id, sending agent id, receiving agent id, codec) of every link between two stages of an active plan
LinkCodecs = Callable[[], Iterable[tuple[str, str, str, str]]]


class LinkCodecCollector(Collector):
    """Which codec each link between two stages carries activations in, as an info gauge (1 per link and codec)."""

    def __init__(self, links: LinkCodecs):
        self._links = links

    def collect(self) -> Iterator[GaugeMetricFamily]:
        gauge = GaugeMetricFamily("stratamesh:link_codec", "The codec of a link between two stages: 1 for the one "
                                  "it carries activations in (\"\" in codec: raw in the receiver's dtype).",
                                  labels=("model_name", "sender", "receiver", "codec"))
        for labels in sorted(set(self._links())):
            gauge.add_metric(list(labels), 1)
        yield gauge


class ControlPlaneCollector(Collector):
    """What the fleet costs the control plane: transactions the registry committed (each a write), plans the
    planner computed; and how it keeps time for the fleet: the heartbeat interval and lease it gives agents, and the
    time its event loop stalled (given back to every lease: an agent is declared dead after its lease plus that)."""

    def __init__(self, registry: RegistryStore, plans_computed: Callable[[], int], liveness: Liveness | None = None):
        self._registry = registry
        self._plans_computed = plans_computed
        self._liveness = liveness

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        yield CounterMetricFamily("stratamesh:registry_commits", "Transactions the coordinator's registry committed.",
                                  value=self._registry.commits)
        yield CounterMetricFamily("stratamesh:plans_computed", "Plans the coordinator's planner computed.",
                                  value=self._plans_computed())
        if self._liveness is not None:
            yield GaugeMetricFamily("stratamesh:heartbeat_interval_seconds", "The heartbeat interval agents are told.",
                                    value=self._liveness.interval_s)
            yield GaugeMetricFamily("stratamesh:agent_lease_seconds", "How long an agent may go unheard before it "
                                    "is declared dead (plus any stall).", value=self._liveness.lease_s)
            yield CounterMetricFamily("stratamesh:coordinator_stalled_seconds", "Time the coordinator's event loop "
                                      "could not check leases on time, given back to every lease.",
                                      value=self._liveness.stalled_s)
            yield CounterMetricFamily("stratamesh:agents_declared_dead", "Agents declared dead (a lease that ran "
                                      "out, or a lost stream and an unreachable Stage service at once).",
                                      value=self._liveness.num_declared_dead)


class LeadershipCollector(Collector):
    """Whether this coordinator leads its mesh (1) or stands by (0), and the epoch of the lease it leads in (on a
    PostgreSQL registry; a lone coordinator leads, with no lease)."""

    def __init__(self, leading: Callable[[], bool], epoch: Callable[[], int | None]) -> None:
        self._leading, self._epoch = leading, epoch

    def collect(self) -> Iterator[GaugeMetricFamily]:
        yield GaugeMetricFamily("stratamesh:coordinator_leader", "1 while this coordinator leads its mesh, 0 while it "
                                "stands by.", value=float(self._leading()))
        if (epoch := self._epoch()) is not None:
            yield GaugeMetricFamily("stratamesh:coordinator_lease_epoch", "The epoch of the lease this coordinator "
                                    "leads in (one more at each takeover).", value=epoch)


class ReplicaCollector(Collector):
    """Per model: the replicas it wants (the operator's count, or the autoscaler's) and those ready to serve."""

    def __init__(self, registry: PlanStore, routes: ReadyReplicas):
        self._registry = registry
        self._routes = routes

    def collect(self) -> Iterator[GaugeMetricFamily]:
        models = self._registry.models()
        yield _gauge("stratamesh:desired_replicas", "The replicas the model wants: its operator's count, or what its "
                     "autoscaler decided.", {m.model_id: m.num_replicas for m in models})
        yield _gauge("stratamesh:ready_replicas", "The model's replicas whose every stage is loaded.",
                     {m.model_id: self._routes.ready_replicas(m.model_id) for m in models})


def _gauge(name: str, doc: str, values: Mapping[str, float]) -> GaugeMetricFamily:
    gauge = GaugeMetricFamily(name, doc, labels=("model_name",))
    for model, value in sorted(values.items()):
        gauge.add_metric([model], value)
    return gauge


def hop_histogram(registry: CollectorRegistry) -> Histogram:
    """The last hop's time, from the last stage finishing a step to its token reaching the origin."""
    return Histogram("stratamesh:hop_transfer_seconds",
                     "Time from the previous hop finishing a step to its message arriving (here: at the origin).",
                     ("stage",), buckets=HOP_BUCKETS_S, registry=registry)


def active_stages(registry: PlanStore) -> dict[str, tuple[str, int]]:
    """assignment id -> (model id, stage index) of every stage of each model replica's active plan."""
    return {stage.assignment_id: (model.model_id, stage.stage_index)
            for model in registry.models() for plan in registry.active_plans(model.model_id)
            for stage in plan.stages}
