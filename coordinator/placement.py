"""From connected agents and a model's config to the planner's inputs, and from its Plan to stage specs."""

from __future__ import annotations

import itertools
import logging
import statistics
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from stratamesh.fleet.control_messages import LinkMeasurement
from stratamesh.fleet.errors import CheckpointError, InvalidInput, PlacementError
from stratamesh.fleet.states import Runtime
from stratamesh.fleet.boxes import Capabilities, GpuInfo, Speed, Telemetry
from stratamesh.fleet.stages import (AUTO_RUNTIME, DTYPES, ONNX_MODEL_TYPES, ORT_DTYPES, QUANTIZED_BYTES, StageSpec,
                                     served_context, windowed)
from stratamesh.partitioner import describe
from stratamesh.partitioner.fleet_snapshot import NODE_LINK, ORIGIN, Device, FleetSnapshot, Link
from stratamesh.partitioner.plan import Pipeline, Plan, PlannedStage, PlanRequest
from stratamesh.partitioner.planner import evaluate, plan_pipeline
from stratamesh.partitioner.profile import ModelProfile, profile_from_hf_config
from stratamesh.partitioner.replan import stay_close

# A placement as the registry keeps it: (agent id, start layer, end layer, tp degree) per stage, in pipeline order.
Placement = Sequence[tuple[str, int, int, int]]

log = logging.getLogger(__name__)

# An agent too old to measure its speed is planned as a modest float32 CPU box.
UNMEASURED = Speed("torch-cpu", "float32", flops=50e9, mem_bandwidth=10e9)
BF16_COMPUTE_CAPABILITY = (8, 0)   # Ampere: the first GPUs that compute bfloat16
KV_CONTEXT_TOKENS = 4096         # the KV reserve a stage must hold: this context ...
KV_SEQUENCES = 8                 # ... for this many sequences
# The serving path's CPU seconds per token of a step (receiving, scheduling, sending) on a host none of whose agents
# has measured its own yet (Telemetry.serving_cpu_per_token_s): what agents with one torch thread each measured on
# the 2-core reference VM under `stratamesh bench plan` load, 0.11-0.15 ms.
DEFAULT_SERVING_CPU_PER_TOKEN_S = 0.13e-3
# Past this many agents the planner weighs a shortlist of them (shortlist): its search grows faster than the fleet
# (one 2-stage plan over 1,000 CPU agents took 0.4 s on the 2-core reference VM, over 3,000 2.5 s, all of it on the
# coordinator's event loop), and a fleet of thousands of boxes has far more than one pipeline can use.
PLAN_CANDIDATES = 128


@dataclass(frozen=True, slots=True)
class SitePins:
    """Data residency: the site the first stage (it sees token ids) and the last (it produces them) run at."""

    first: str = ""             # "" for any site
    last: str = ""


@dataclass(frozen=True, slots=True)
class Hosts:
    """What the coordinator knows of the hosts beyond their agents' capabilities."""

    origin: str = ""     # the coordinator's host: its origin shares the cores there with the agents (cpu_shares)
    # host -> the serving path's CPU seconds per token its agents measured (serving_cpu_of); a host not in it is
    # priced at DEFAULT_SERVING_CPU_PER_TOKEN_S
    serving_cpu: Mapping[str, float] = field(default_factory=dict)

    def serving_cpu_s(self, host: str) -> float:
        return self.serving_cpu.get(host, DEFAULT_SERVING_CPU_PER_TOKEN_S)


def checkpoint_dtype(config: Mapping[str, Any]) -> str:
    """The dtype a checkpoint stores, from its config.json (dtype, else torch_dtype); float32 when it names none a
    stage computes in."""
    dtype = str(config.get("dtype") or config.get("torch_dtype") or "float32")
    return dtype if dtype in DTYPES else "float32"


def stage_dtype(checkpoint: str, caps: Capabilities, gpu: GpuInfo | None) -> str:
    """The dtype an agent's GPU (None: its CPU) computes a model stored in checkpoint in: the operator's --dtype
    when set; float32 where the operator chose ONNX Runtime; on a GPU the checkpoint's, but float16 for bfloat16
    before Ampere; on a CPU float32, but bfloat16 for a bfloat16 checkpoint where the CPU computes it natively."""
    if caps.dtype:
        return caps.dtype
    if caps.runtime == Runtime.ONNXRUNTIME:
        return "float32"             # (kernels.models.onnx_stage.ORT_DTYPES)
    if gpu is not None:
        return "float16" if checkpoint == "bfloat16" and not _has_bf16(gpu) else checkpoint
    return "bfloat16" if checkpoint == "bfloat16" and caps.cpu_bf16 else "float32"


def _has_bf16(gpu: GpuInfo) -> bool:
    """Whether the GPU computes bfloat16 (compute capability 8.0 or later); an unknown capability is taken to."""
    major, _, minor = gpu.compute_capability.partition(".")
    try:
        return (int(major), int(minor or 0)) >= BF16_COMPUTE_CAPABILITY
    except ValueError:
        return True


def fleet_of(agents: Mapping[str, Capabilities], links: Sequence[LinkMeasurement] = (),
             checkpoint: str = "float32", hosts: Hosts = Hosts(), onnx: bool = True) -> FleetSnapshot:
    """One device per rank of each agent (rank_ids), the agent its node, computing in stage_dtype for a model
    stored in checkpoint; measured links between agents apply to all their devices, and agents of one host that
    never measured theirs talk over loopback (NODE_LINK).

    A GPU agent (one whose host measured torch-cuda) runs rank r on its GPU r: that GPU's free memory and the
    host's torch-cuda speeds. A rank of any other agent has a share of the RAM and of the CPU speeds (the
    ranks split the cores): torch's, ONNX Runtime's where its operator chose it, or both where it let the planner
    pick (AUTO_RUNTIME) and the model's layers can be ONNX Runtime stages (onnx: onnx_servable). Agents on one host
    share its best speeds: their probes overlapped. CPU agents of one host also share its cores and RAM
    (cpu_shares): where their threads outnumber the cores, each computes at its share of its measured speed, and
    each has its share of the RAM.

    Each device pays its host's serving path per token of a step (Hosts.serving_cpu_s): a CPU agent at its share
    of the cores, a GPU agent in full (its dataplane runs on the host's CPU, with the cores it needs)."""
    best: dict[tuple[str, str, str], Speed] = {}
    for caps in agents.values():
        for s in caps.speeds:
            key = (caps.hostname, s.backend, s.dtype)
            if key not in best or s.flops > best[key].flops:
                best[key] = s
    shares = cpu_shares(agents, hosts.origin)
    devices = []
    for agent_id, caps in agents.items():
        speeds = tuple(v for (host, _, _), v in sorted(best.items()) if host == caps.hostname)
        devices += _rank_devices(agent_id, caps, speeds, checkpoint, hosts.serving_cpu_s(caps.hostname), onnx,
                                 *shares.get(agent_id, (1.0, 1)))
    return FleetSnapshot(tuple(devices), _links(agents, links))


def onnx_servable(config: Mapping[str, Any]) -> bool:
    """Whether ONNX Runtime stages can serve the model's layers (kernels.models.onnx_stage.check_exportable): its
    family's, none of them attending over a sliding window."""
    try:
        return config.get("model_type") in ONNX_MODEL_TYPES and not windowed(config)
    except (CheckpointError, TypeError, ValueError):    # (a model no stage serves: the planner says so, not this)
        return False


def cpu_shares(agents: Mapping[str, Capabilities], origin_host: str = "") -> dict[str, tuple[float, int]]:
    """(share of its measured CPU speed, agents its host's RAM is split between) of each CPU agent: agents of one
    host whose threads (num_threads, or all the cores where unknown) outnumber its cores get cores / threads each.
    The origin (the coordinator streaming every token out) counts as one more thread on origin_host."""
    by_host: dict[str, list[str]] = {}
    for agent_id, caps in agents.items():
        if not _on_gpus(caps, caps.speeds):
            by_host.setdefault(caps.hostname, []).append(agent_id)
    out = {}
    for ids in by_host.values():
        cores = max(max(agents[a].num_cpus for a in ids), 1)
        threads = sum(min(agents[a].num_threads or cores, cores) for a in ids)
        threads += agents[ids[0]].hostname == origin_host
        for agent_id in ids:
            out[agent_id] = (min(1.0, cores / threads), len(ids))
    return out


def serving_cpu_of(agents: Mapping[str, Capabilities], telemetry: Mapping[str, Telemetry]) -> dict[str, float]:
    """host -> the serving path's CPU seconds per token, the median of what its agents measured (their newest
    telemetry; an agent that has not served yet measured nothing)."""
    by_host: dict[str, list[float]] = {}
    for agent_id, caps in agents.items():
        measured = telemetry[agent_id].serving_cpu_per_token_s if agent_id in telemetry else 0.0
        if measured > 0:
            by_host.setdefault(caps.hostname, []).append(measured)
    return {host: statistics.median(values) for host, values in by_host.items()}


def num_ranks(caps: Capabilities) -> int:
    """The most ranks one stage may have on the agent: what it reports, no more than its GPUs if it has any."""
    return max(1, min(caps.num_ranks, len(caps.gpus)) if caps.gpus else caps.num_ranks)


def rank_ids(agent_id: str, ranks: int) -> list[str]:
    """The planner's device ids of an agent's ranks: the agent id itself when it has one rank."""
    return [agent_id] if ranks == 1 else [f"{agent_id}#{rank}" for rank in range(ranks)]


def _on_gpus(caps: Capabilities, speeds: Sequence[Speed]) -> bool:
    """Whether the agent's stages run on its GPUs: it has some, its host measured torch-cuda, and its operator did
    not choose ONNX Runtime (whose stages run on the CPU here)."""
    return bool(caps.gpus) and caps.runtime != Runtime.ONNXRUNTIME and any(s.backend == "torch-cuda" for s in speeds)


def _rank_devices(agent_id: str, caps: Capabilities, measured: tuple[Speed, ...], checkpoint: str,
                  serving_cpu_s: float, onnx: bool, share: float = 1.0, ram_split: int = 1) -> list[Device]:
    ranks = num_ranks(caps)
    ids = rank_ids(agent_id, ranks)
    speeds = tuple(Speed(s.backend, s.dtype, decode_rate(s), decode_bandwidth(s)) for s in measured)
    if _on_gpus(caps, speeds):
        gpus = caps.gpus[:ranks]
        dtypes = [stage_dtype(checkpoint, caps, gpu) for gpu in gpus]
        return [Device(i, gpu.mem_free_bytes, _speeds_for(i, speeds, "torch-cuda", dtype), caps.tier or "edge",
                       caps.site, node=agent_id, dtype=dtype, token_overhead_s=serving_cpu_s,
                       **_overheads(measured, "torch-cuda", dtype))
                for i, gpu, dtype in zip(ids, gpus, dtypes, strict=True)]
    dtype = stage_dtype(checkpoint, caps, None)
    backends = _cpu_backends(caps, measured, dtype, onnx)
    cpu: list[Speed] = []
    for backend in backends:
        # what the host measured of that backend: an agent told to run ONNX Runtime, on a host that measured only
        # torch, is priced at torch's speeds and overheads (float32 and int8 weights: StageSpec.quantize)
        priced_as = backend if any(s.backend == backend for s in measured) else "torch-cpu"
        own = tuple(Speed(backend, s.dtype, s.flops * share / ranks, s.mem_bandwidth * share / ranks)
                    for s in speeds if s.backend == priced_as) or (replace(UNMEASURED, backend=backend),)
        overheads = {k: v / share for k, v in _overheads(measured, priced_as, dtype).items()}
        if backend == backends[0]:      # the device's overheads are its first backend's; the others carry their own
            device_overheads = overheads
        else:
            own = tuple(replace(s, **overheads) for s in own)
        cpu += _speeds_for(agent_id, own, backend, dtype)
    overheads = {**device_overheads, "token_overhead_s": serving_cpu_s / share}
    return [Device(i, caps.ram_available_bytes // (ranks * ram_split), tuple(cpu), caps.tier or "edge", caps.site,
                   node=agent_id, dtype=dtype, **overheads) for i in ids]


def _cpu_backends(caps: Capabilities, measured: Sequence[Speed], dtype: str, onnx: bool) -> tuple[str, ...]:
    """What may compute a CPU agent's stages: ONNX Runtime where its operator chose it (--runtime onnxruntime);
    torch, and ONNX Runtime beside it where the operator let the planner pick (AUTO_RUNTIME), the host measured it,
    the stages compute in one of its dtypes and the model's layers export (onnx); else torch."""
    if caps.runtime == Runtime.ONNXRUNTIME:
        return ("onnxruntime-cpu",)
    if (caps.runtime == AUTO_RUNTIME and onnx and dtype in ORT_DTYPES
            and any(s.backend == "onnxruntime-cpu" for s in measured)):
        return ("torch-cpu", "onnxruntime-cpu")
    return ("torch-cpu",)


def decode_rate(speed: Speed) -> float:
    """The FLOP/s the planner prices a step at: it prices decode steps, whose matmuls are small, so the rate the
    host measured for those where it did, else its large matmul's."""
    return min(speed.flops, speed.decode_flops) if speed.decode_flops > 0 else speed.flops


def decode_bandwidth(speed: Speed) -> float:
    """The bytes/s the planner prices a step's reads at: a decode step's where the host measured one (small
    products read their weights slower than a large copy), else its large copy's."""
    return min(speed.mem_bandwidth, speed.decode_bandwidth) if speed.decode_bandwidth > 0 else speed.mem_bandwidth


def _overheads(measured: Sequence[Speed], backend: str, dtype: str) -> dict[str, float]:
    """The step and layer overheads the host measured for backend (in dtype, else float32: they are the
    framework's, nearly the same in any dtype); 0 for one it did not measure."""
    own = sorted((s for s in measured if s.backend == backend), key=lambda s: (s.dtype != dtype, s.dtype != "float32"))
    if not own:
        return {}
    return {"step_overhead_s": own[0].step_overhead_s or 0.0, "layer_overhead_s": own[0].layer_overhead_s or 0.0}


def _speeds_for(device_id: str, speeds: Sequence[Speed], backend: str, dtype: str) -> tuple[Speed, ...]:
    """The backend's speeds, with its float32 speed standing in for dtype where it measured none for it."""
    own = tuple(s for s in speeds if s.backend == backend)
    if any(s.dtype == dtype for s in own):
        return own
    float32 = next((s for s in own if s.dtype == "float32"), None)
    if float32 is None:
        log.info("%s measured no %s speed for %s or float32: it is not planned on", device_id, backend, dtype)
        return own
    log.info("%s measured no %s speed for %s: planned at its float32 speed", device_id, backend, dtype)
    return (*own, Speed(backend, dtype, float32.flops, float32.mem_bandwidth))


def _links(agents: Mapping[str, Capabilities], links: Sequence[LinkMeasurement]) -> tuple[Link, ...]:
    """Measured links between agents (or an agent and ORIGIN) as links between their devices, and loopback
    between the devices of two agents on one host that measured no link (each agent is its own node)."""
    ids = {a: rank_ids(a, num_ranks(caps)) for a, caps in agents.items()} | {ORIGIN: [ORIGIN]}
    measured = measured_links(agents.keys(), links)
    out = [Link(x, y, m.bandwidth, m.rtt_s) for m in measured for x in ids[m.a] for y in ids[m.b]]
    seen = {frozenset((m.a, m.b)) for m in measured}
    for a, b in itertools.combinations(agents, 2):
        if agents[a].hostname == agents[b].hostname and frozenset((a, b)) not in seen:
            out += [Link(x, y, NODE_LINK.bandwidth, NODE_LINK.rtt_s) for x in ids[a] for y in ids[b]]
    return tuple(out)


def measured_links(agent_ids: Iterable[str], links: Sequence[LinkMeasurement]) -> tuple[Link, ...]:
    """The planner's links from measured ones: between two of these agents, or one of them and ORIGIN."""
    ends = {*agent_ids, ORIGIN}
    return tuple(Link(r.agent_id, r.peer_agent_id, r.bandwidth_bytes_per_s, r.rtt_s) for r in links
                 if r.agent_id in ends and r.peer_agent_id in ends and r.agent_id != r.peer_agent_id
                 and r.bandwidth_bytes_per_s > 0 and r.rtt_s > 0)


def plan_stages(model_id: str, model_path: str, config: dict[str, Any], agents: Mapping[str, Capabilities],
                num_stages: int, links: Sequence[LinkMeasurement] = (), previous: Placement = (),
                pins: SitePins = SitePins(), hosts: Hosts = Hosts(), quantize: str = "",
                candidates: int = PLAN_CANDIDATES) -> tuple[Plan, list[tuple[str, StageSpec]]]:
    """The planner's best num_stages-stage pipeline over the agents and measured links (PlacementError if none);
    a stage may be a tensor-parallel group of one agent's ranks.

    previous: the placement serving now; the plan keeps it (search "kept") unless moving is clearly better.
    hosts: where the origin computes, and what each host's serving path costs (fleet_of). quantize: the
    operator's choice of int8 weights for the model: a single-process stage on an agent that measured its speed
    with them holds them so (partitioner.cost.single_unit). candidates: past this many agents, the planner weighs
    a shortlist of them."""
    agents = shortlist(agents, num_stages, keep=[agent for agent, *_ in previous], pins=pins, limit=candidates)
    profile, request = _profile(model_id, config, quantize), _request(config, num_stages, pins)
    fleet, ranks = fleet_of(agents, links, profile.dtype, hosts, onnx_servable(config)), _ranks(agents)
    plan = _in_rank_order(plan_pipeline(profile, fleet, request), profile, fleet, request, ranks)
    previous_plan = _as_plan(profile, fleet, request, previous, ranks)
    if previous_plan is not None:
        plan = stay_close(plan, previous_plan, profile, fleet, request)
    return plan, stage_specs(plan, fleet, agents, model_id, model_path, profile.num_layers)


def shortlist(agents: Mapping[str, Capabilities], num_stages: int, keep: Iterable[str] = (),
              pins: SitePins = SitePins(), limit: int = PLAN_CANDIDATES) -> Mapping[str, Capabilities]:
    """The agents the planner weighs for a num_stages-stage pipeline: every one while there are at most limit.

    Beyond, of each site the num_stages best by each of compute, memory bandwidth and memory (one pipeline uses
    no more of a site: the rest of it are boxes no better placed and no better at anything), and of those the
    limit // 3 best by each over all sites; always the agents in keep (the placement serving now, so that keeping
    it stays possible) and the pinned sites' shortlists. An agent's speeds are its host's best (as fleet_of gives
    them)."""
    if len(agents) <= limit:
        return agents
    best: dict[str, tuple[float, float]] = {}     # host -> its best decode FLOP/s and bytes/s
    for caps in agents.values():
        for speed in caps.speeds:
            flops, bandwidth = best.get(caps.hostname, (0.0, 0.0))
            best[caps.hostname] = (max(flops, decode_rate(speed)), max(bandwidth, decode_bandwidth(speed)))
    measures = [lambda a: best.get(agents[a].hostname, (0.0, 0.0))[0],
                lambda a: best.get(agents[a].hostname, (0.0, 0.0))[1],
                lambda a: agents[a].usable_mem_bytes]

    def top(ids: Collection[str], n: int) -> set[str]:
        return {a for measure in measures for a in sorted(ids, key=lambda a: (-measure(a), a))[:n]}

    by_site: dict[str, list[str]] = {}
    for agent_id, caps in agents.items():
        by_site.setdefault(caps.site, []).append(agent_id)
    per_site = {site: top(ids, num_stages) for site, ids in by_site.items()}
    chosen = top(set().union(*per_site.values()), limit // len(measures))
    chosen |= {a for a in keep if a in agents}
    for site in {pins.first, pins.last} - {""}:
        chosen |= per_site.get(site, set())
    return {a: agents[a] for a in agents if a in chosen}


def prediction(plan: Plan) -> dict[str, Any]:
    """What the planner predicts of a plan's pipeline, as stored with it and shown by the admin API: tokens/s with
    `concurrency` sequences in flight (micro_batches of KV_SEQUENCES), the step (one token through every stage and
    hop), the bottleneck, and each stage's step time and the send of its output."""
    (pipeline,) = plan.pipelines
    return {"tokens_per_s": round(pipeline.tokens_per_s, 1), "concurrency": KV_SEQUENCES * pipeline.micro_batches,
            "micro_batches": pipeline.micro_batches, "step_s": pipeline.step_s, "bottleneck_s": pipeline.bottleneck_s,
            "bottleneck": pipeline.bottleneck, "stage_step_s": [s.compute_s for s in pipeline.stages],
            "stage_send_s": [s.send_s for s in pipeline.stages], "stage_codecs": [s.codec for s in pipeline.stages],
            "stage_send_bytes": [s.send_bytes for s in pipeline.stages]}


def _in_rank_order(plan: Plan, profile: ModelProfile, fleet: FleetSnapshot, request: PlanRequest,
                   ranks: Mapping[str, int]) -> Plan:
    """The plan with each agent's stages on its ranks in pipeline order where that prices no worse: how a stored
    placement is read back (_on_ranks), so that keeping it keeps each stage's GPUs."""
    (pipeline,) = plan.pipelines
    placement = [(_agent_of(fleet, s), s.start_layer, s.end_layer, s.tp_degree) for s in pipeline.stages]
    try:
        ordered = evaluate(profile, fleet, request, _on_ranks(placement, ranks))
    except (PlacementError, InvalidInput):
        return plan
    goal = request.objective
    if ordered.devices == pipeline.devices or ordered.objective_s(goal) > pipeline.objective_s(goal):
        return plan
    ordered_plan = replace(plan, pipelines=(ordered,), tokens_per_s=ordered.tokens_per_s)
    return replace(ordered_plan, reason=describe.reason(ordered_plan, request))


def repair_stages(model_id: str, model_path: str, config: dict[str, Any], agents: Mapping[str, Capabilities],
                  placement: Placement, links: Sequence[LinkMeasurement] = (),
                  pins: SitePins = SitePins(), hosts: Hosts = Hosts(), quantize: str = "") -> list[tuple[str, StageSpec]]:
    """(agent id, spec) of each stage after the stages of agents not among these go to the spares that price best,
    layer ranges and TP degrees unchanged (what lets a drained stage's sessions move with their KV); a spare's spec
    has its own device, dtype and quantization. PlacementError if none fit."""
    agents = shortlist(agents, len(placement), keep=[agent for agent, *_ in placement], pins=pins)
    profile = _profile(model_id, config, quantize)
    fleet = fleet_of(agents, links, profile.dtype, hosts, onnx_servable(config))
    plan = _as_plan(profile, fleet, _request(config, len(placement), pins), placement, _ranks(agents))
    if plan is None:
        missing = [f"[{start}, {end})" for agent, start, end, _ in placement if agent not in agents]
        raise PlacementError(f"no spare agent can take the stages {', '.join(missing)} of {model_id}")
    return stage_specs(plan, fleet, agents, model_id, model_path, profile.num_layers)


def smallest_stage_bytes(config: dict[str, Any], quantize: str = "") -> int:
    """The least memory any stage of the model needs: its smallest layer at the fewest bytes a parameter could take
    (quantized: QUANTIZED_BYTES, else 2). An agent with less can hold no stage of it: planning need not weigh it."""
    profile = profile_from_hf_config(config, dtype="bfloat16")
    fewest = min(profile.layer_params)
    return int(fewest * QUANTIZED_BYTES.get(quantize, 2))


def _profile(model_id: str, config: dict[str, Any], quantize: str = "") -> ModelProfile:
    """The model's profile in the checkpoint's dtype (each device prices it in its own: fleet_of), its weights
    quantized where the operator asked for it and a device measured it."""
    return replace(profile_from_hf_config(config, dtype=checkpoint_dtype(config), name=model_id), weights=quantize)


def _request(config: dict[str, Any], num_stages: int, pins: SitePins) -> PlanRequest:
    context = min(served_context(config) if "max_position_embeddings" in config else KV_CONTEXT_TOKENS,
                  KV_CONTEXT_TOKENS)
    return PlanRequest(objective="throughput", num_stages=num_stages, context_len=context,
                       concurrency=KV_SEQUENCES, tensor_parallel=True, first_site=pins.first or None,
                       last_site=pins.last or None)


def _ranks(agents: Mapping[str, Capabilities]) -> dict[str, int]:
    return {agent_id: num_ranks(caps) for agent_id, caps in agents.items()}


def _as_plan(profile: ModelProfile, fleet: FleetSnapshot, request: PlanRequest, placement: Placement,
             ranks: Mapping[str, int]) -> Plan | None:
    """A placement as the planner's Plan, priced on this fleet; None if there is none or nothing fits.

    A stage whose agent left goes, layer range and all, to the spare that prices best: after a death the
    planner then keeps every surviving stage where it is (loaded, nothing to move) unless moving is clearly
    better."""
    pipelines = []
    for candidate in _repairs(placement, ranks):
        try:
            pipeline = evaluate(profile, fleet, request, _on_ranks(candidate, ranks))
        except (PlacementError, InvalidInput):
            continue
        if _keeps_pins(pipeline, fleet, request):
            pipelines.append(pipeline)
    if not pipelines:
        return None
    best = min(pipelines, key=lambda p: p.objective_s(request.objective))
    return Plan(profile.name, request.objective, (best,), best.tokens_per_s, "")


def _keeps_pins(pipeline: Pipeline, fleet: FleetSnapshot, request: PlanRequest) -> bool:
    """Whether the first and last stages run at the sites the request pins them to."""
    first, last = (fleet.device(s.devices[0]).site for s in (pipeline.stages[0], pipeline.stages[-1]))
    return request.first_site in (None, first) and request.last_site in (None, last)


def _repairs(placement: Placement, ranks: Mapping[str, int], limit: int = 64) -> list[list[tuple[str, int, int, int]]]:
    """The placement with each stage of a missing agent given to a spare (every way, up to limit).

    A spare takes one stage, as a group of the same degree: it needs at least that many ranks (a TP stage is
    never narrowed, so its KV moves to a group of the same shape)."""
    if not placement:
        return []
    spares = sorted(set(ranks) - {stage[0] for stage in placement})
    missing = [i for i, stage in enumerate(placement) if stage[0] not in ranks]
    options = [[a for a in spares if ranks[a] >= placement[i][3]] for i in missing]
    distinct = (chosen for chosen in itertools.product(*options) if len(set(chosen)) == len(chosen))
    out = []
    for chosen in itertools.islice(distinct, limit):
        repaired = list(placement)
        for i, agent in zip(missing, chosen, strict=True):
            repaired[i] = (agent, *repaired[i][1:])
        out.append(repaired)
    return out


def _on_ranks(placement: Placement, ranks: Mapping[str, int]) -> list[tuple[tuple[str, ...], int, int]]:
    """The placement on the planner's devices: each stage takes the next free ranks of its agent in pipeline
    order; InvalidInput if an agent has too few."""
    taken: dict[str, int] = {}
    out = []
    for agent, start, end, degree in placement:
        first = taken.get(agent, 0)
        taken[agent] = first + degree
        if taken[agent] > ranks[agent]:
            raise InvalidInput(f"agent {agent!r} has {ranks[agent]} rank(s), fewer than its stages need")
        out.append((tuple(rank_ids(agent, ranks[agent])[first:first + degree]), start, end))
    return out


def _agent_of(fleet: FleetSnapshot, stage: PlannedStage) -> str:
    """The one agent whose ranks serve the stage (fleet_of makes each agent the node of its devices)."""
    agents = sorted({fleet.device(d).node_id for d in stage.devices})
    if len(agents) != 1:
        raise PlacementError(f"stage [{stage.start_layer}, {stage.end_layer}) spans agents {', '.join(agents)}")
    return agents[0]


def stage_specs(plan: Plan, fleet: FleetSnapshot, agents: Mapping[str, Capabilities], model_id: str,
                model_path: str, num_layers: int) -> list[tuple[str, StageSpec]]:
    """(agent id, spec) of each stage of the plan's first pipeline, in order, as the plan chose it: its dtype, its
    device (stage_device), tp_degree its ranks, its runtime (onnxruntime for an onnxruntime backend), its
    weights' quantization and its KV cache: the reserve of each micro-batch the plan's throughput counts on."""
    out = []
    pipeline = plan.pipelines[0]
    for s in pipeline.stages:
        agent = _agent_of(fleet, s)
        runtime = "onnxruntime" if s.backend.startswith("onnxruntime") else "torch"
        out.append((agent, StageSpec(model_id, model_path, s.start_layer, s.end_layer, num_layers, s.dtype,
                                     stage_device(s, agent, agents[agent]), tp_degree=len(s.devices),
                                     runtime=runtime, quantize=s.weights,
                                     kv_cache_bytes=s.kv_budget_bytes * pipeline.micro_batches)))
    return out


def stage_device(stage: PlannedStage, agent_id: str, caps: Capabilities) -> str:
    """Where the agent runs the stage: "cuda:N", N the index of its rank 0's GPU, for a torch-cuda stage (the
    agent puts rank r on cuda:N+r), else "cpu". PlacementError if its ranks' GPUs are not consecutive."""
    if stage.backend != "torch-cuda":
        return "cpu"
    ids = rank_ids(agent_id, num_ranks(caps))
    indices = [caps.gpus[ids.index(d)].index for d in stage.devices]
    if indices != list(range(indices[0], indices[0] + len(indices))):
        raise PlacementError(f"stage [{stage.start_layer}, {stage.end_layer}) on {agent_id} would run on GPUs "
                             f"{indices}, but a tensor-parallel group runs on consecutive GPUs")
    return f"cuda:{indices[0]}"
