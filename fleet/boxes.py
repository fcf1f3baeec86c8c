"""What an agent's box is and reports: its GPUs, the speeds it measured, its capabilities, its registration, and the
telemetry of its heartbeats."""

from __future__ import annotations

from dataclasses import dataclass

from stratamesh.fleet.stages import Assignment


@dataclass(frozen=True, slots=True)
class GpuInfo:
    """One NVIDIA GPU as the probe saw it; None where NVML could not say."""

    index: int
    name: str
    mem_total_bytes: int
    mem_free_bytes: int
    uuid: str = ""
    compute_capability: str = ""            # "9.0"
    utilization_pct: float | None = None
    temperature_c: float | None = None
    power_w: float | None = None
    power_limit_w: float | None = None


@dataclass(frozen=True, slots=True)
class Speed:
    """What a box measured for one backend and dtype: a large matmul and its memory's bandwidth, and what a decode step
    of this code costs beyond its FLOPs and bytes (the framework: Python, op dispatch, kernel launches). The planner
    prices a device by the same fields (placement.py derives them from what its box measured)."""

    backend: str              # "torch-cuda", "torch-cpu", "onnxruntime-cpu"
    dtype: str
    flops: float              # FLOP/s of a large matmul
    mem_bandwidth: float      # bytes/s of a large copy (a GPU) or a streaming read (a CPU: agent.speed)
    step_overhead_s: float | None = None     # per step, whatever its layers; None: not measured apart (the device's)
    layer_overhead_s: float | None = None    # per layer of a step; None: likewise
    decode_flops: float = 0.0        # FLOP/s of the layers of a decode step (small matmuls); 0: not measured
    decode_bandwidth: float = 0.0    # bytes/s a decode step of one sequence reads its weights at; 0: not measured


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What an agent's box offers, as it reports it on registration."""

    hostname: str
    cpu_model: str
    num_cpus: int
    ram_total_bytes: int
    ram_available_bytes: int
    gpus: tuple[GpuInfo, ...] = ()
    backends: tuple[str, ...] = ("torch-cpu",)
    speeds: tuple[Speed, ...] = ()
    site: str = ""              # where the box is (a building, a cloud region): the operator says
    tier: str = "edge"          # "edge" or "cloud"
    num_ranks: int = 1          # the most ranks a tensor-parallel stage here may have (its GPUs, or CPU ranks)
    dtype: str = ""             # the operator's choice for this agent's stages (--dtype); "" lets the planner pick
    cpu_bf16: bool = False      # the CPU computes bfloat16 natively (AMX or AVX512-BF16)
    num_threads: int = 0        # CPU threads this agent computes with (agents of one host share its num_cpus)
    runtime: str = ""           # the operator's choice of RUNTIMES for this agent's stages (--runtime): "" is torch;
                                # AUTO_RUNTIME lets the planner pick per stage, by the speeds measured of each

    @property
    def usable_mem_bytes(self) -> int:
        """Memory a stage may fill: free GPU memory if the box has GPUs, else available RAM."""
        if self.gpus:
            return sum(g.mem_free_bytes for g in self.gpus)
        return self.ram_available_bytes


@dataclass(frozen=True, slots=True)
class Registration:
    """An agent's first message on its control stream."""

    agent_id: str
    name: str
    stage_address: str
    capabilities: Capabilities
    held: tuple[Assignment, ...] = ()
    mesh: str = "default"
    metrics_address: str = ""   # host:port of the agent's Prometheus /metrics; "" if it serves none
    software_version: str = ""      # its build's (fleet/versions.py)
    protocol_version: int = 0       # the protocol its data plane speaks (fleet/versions.py); 0: not reported


@dataclass(frozen=True, slots=True)
class StageLoad:
    """How busy one stage of an agent is."""

    assignment_id: str
    num_running: int            # sessions holding KV blocks
    num_waiting: int            # sessions with chunks queued
    kv_blocks_used: int
    kv_blocks_total: int
    prefix_query_tokens: int = 0    # prompt tokens looked up in the prefix cache since the stage loaded
    prefix_hit_tokens: int = 0      # ... and found there
    decode_step_s: float = 0.0      # its recent decode steps' seconds (a moving average); 0: none yet
    # their bandwidth roofline over their time: the weights and KV they read at the box's streaming read, where
    # the box measured one (a CPU's), over what they took (1: at the memory's speed); 0: not known
    decode_roofline: float = 0.0
    spec_draft_tokens: int = 0      # a last stage's drafted tokens verified since it loaded (speculative decoding)
    spec_accepted_tokens: int = 0   # ... and kept
    # a mixture of experts' stage since it loaded: the tokens its routers sent each expert, over its sparse layers
    # (an expert-parallel group's rank r holds the r-th of tp_degree equal runs of them)
    expert_tokens: tuple[int, ...] = ()
    expert_imbalance: float = 0.0   # its last step's most tokens an expert got over the mean (1: even; 0: no step)

    @property
    def kv_usage(self) -> float:
        """Fraction of the stage's KV blocks in use (0 with no blocks)."""
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0


@dataclass(frozen=True, slots=True)
class Telemetry:
    """What an agent reports with each heartbeat."""

    unix_s: float
    queue_depth: int = 0        # messages and chunks waiting for a step, all stages
    tokens_per_s: float = 0.0   # tokens its stages computed per second since the last heartbeat
    stages: tuple[StageLoad, ...] = ()
    gpus: tuple[GpuInfo, ...] = ()
    # CPU seconds the agent spends per token of a step beyond its layers: the serving path (messages in and out,
    # scheduling), measured over the last window of enough tokens; 0 until then
    serving_cpu_per_token_s: float = 0.0
    resting: str = ""           # why the owner's limits rest this agent (agent/owner_limits.py); "" = it serves
    # how near the box is to its owner's limits: the largest reading over its limit (temperature, power, the
    # owner's load), and quiet hours from 0 an hour before they begin to 1 when they do; 0 without limits
    limits_near: float = 0.0


@dataclass(frozen=True, slots=True)
class Peer:
    """Another agent whose link this agent should measure."""

    agent_id: str
    address: str                # its Stage and Link services
