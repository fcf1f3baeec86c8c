"""Seeded random small models, fleets and requests for the planner's property tests."""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

from stratamesh.partitioner.fleet_snapshot import ORIGIN, Device, FleetSnapshot, Link
from stratamesh.fleet.boxes import Speed
from stratamesh.partitioner.plan import PlanRequest
from stratamesh.partitioner.profile import ModelProfile, profile_from_hf_config

DTYPES = ("float16", "bfloat16", "float32")


@dataclass(frozen=True, slots=True)
class Case:
    """One random planning problem."""

    profile: ModelProfile
    fleet: FleetSnapshot
    request: PlanRequest


def random_config(rng: random.Random, num_layers: int, kv_divisors: tuple[int, ...] = (1, 2, 4)) -> dict:
    """A small Llama-style config.json dict."""
    heads = rng.choice([4, 8, 12])
    return {
        "model_type": rng.choice(["llama", "qwen2"]),
        "hidden_size": heads * rng.choice([8, 16, 32]),
        "num_attention_heads": heads,
        "num_key_value_heads": rng.choice([k for k in (*kv_divisors, heads) if heads % k == 0]),
        "num_hidden_layers": num_layers,
        "intermediate_size": rng.choice([64, 128, 384]),
        "vocab_size": rng.randint(100, 4000),
        "tie_word_embeddings": rng.random() < 0.3,
        "torch_dtype": rng.choice(DTYPES),
    }


def need_bytes(profile: ModelProfile, request: PlanRequest) -> int:
    """Weights (every parameter once) and the KV reserve of the whole model."""
    kv = sum(profile.layer_kv_bytes_per_token) * request.concurrency * request.context_len
    return profile.total_bytes + kv


def random_request(rng: random.Random, sites: list[str], device_ids: list[str], tensor_parallel: bool,
                   constrained: bool = True) -> PlanRequest:
    def pin(p: float) -> str | None:          # now and then a site with no device
        if not constrained or rng.random() >= p:
            return None
        return "nowhere" if rng.random() < 0.1 else rng.choice(sites)

    exclude = frozenset(i for i in device_ids if constrained and rng.random() < 0.08)
    return PlanRequest(
        objective=rng.choice(["throughput", "latency"]),
        context_len=rng.choice([64, 512, 2048]),
        concurrency=rng.randint(1, 16),
        first_site=pin(0.25), last_site=pin(0.2), exclude=exclude,
        max_stages=rng.randint(1, 4) if constrained and rng.random() < 0.3 else None,
        tensor_parallel=tensor_parallel)


def random_case(seed: int, max_devices: int = 8, max_layers: int = 16, tensor_parallel: bool = True,
                constrained: bool = True, multi_gpu: bool = False, device_dtypes: bool = False) -> Case:
    """2..max_devices devices on 1..3 sites and nodes, random explicit links, and a model of n..max_layers layers.

    multi_gpu: most devices share a node per site, small memory, KV heads that 2 and 4 divide: TP groups.
    device_dtypes: the same case, but devices compute in dtypes of their own (with_device_dtypes)."""
    rng = random.Random(seed)
    n = rng.randint(2, max_devices)
    config = random_config(rng, rng.randint(n, max_layers), (2, 4) if multi_gpu else (1, 2, 4))
    profile = profile_from_hf_config(config, name=f"m{seed}")
    sites = [f"s{k}" for k in range(rng.randint(1, 2 if multi_gpu else 3))]
    ids = [f"d{k}" for k in range(n)]
    request = random_request(rng, sites, ids, tensor_parallel, constrained)
    need = need_bytes(profile, request)
    devices = [_random_device(rng, i, sites, profile.dtype, need, multi_gpu) for i in ids]
    links = _random_links(rng, devices, multi_gpu)
    fleet = FleetSnapshot(tuple(devices), tuple(links), rng.choice(sites + [""]))
    return Case(profile, with_device_dtypes(fleet, seed) if device_dtypes else fleet, request)


def with_device_dtypes(fleet: FleetSnapshot, seed: int) -> FleetSnapshot:
    """The fleet with each device computing in a dtype of its own ("" now and then: the model's), mostly one per
    node (a node's GPUs may still form groups), its first speed relabelled to that dtype."""
    rng = random.Random(f"dtypes-{seed}")
    per_node = {d.node_id: rng.choice(DTYPES) for d in fleet.devices}
    devices = []
    for d in fleet.devices:
        dtype = per_node[d.node_id] if rng.random() < 0.8 else rng.choice((*DTYPES, ""))
        speeds = tuple(replace(s, dtype=dtype) if k == 0 and dtype else s for k, s in enumerate(d.speeds))
        devices.append(replace(d, speeds=speeds, dtype=dtype))
    return FleetSnapshot(tuple(devices), fleet.links, fleet.origin_site)


def _random_device(rng: random.Random, device_id: str, sites: list[str], dtype: str, need: int,
                   multi_gpu: bool) -> Device:
    site = rng.choice(sites)
    nodes = [f"{site}-n0"] * 4 + ["", f"{site}-n1"] if multi_gpu else ["", f"{site}-n0", f"{site}-n1"]
    speeds = []
    if multi_gpu:                                   # GPUs of one kind, slow enough that sharding pays
        speeds.append(Speed("torch-cuda", dtype, 10 ** rng.uniform(11, 11.3), 10 ** rng.uniform(9, 9.2)))
    elif rng.random() < 0.93:                       # now and then a device that cannot run the dtype
        speeds.append(Speed("torch-cuda", dtype, 10 ** rng.uniform(9, 14), 10 ** rng.uniform(9, 12.5)))
    if rng.random() < 0.4:                          # a second backend, or another dtype
        cpu = Speed("torch-cpu", rng.choice(DTYPES), 10 ** rng.uniform(9, 14), 10 ** rng.uniform(9, 12.5))
        if multi_gpu:       # the node's CPU, slower than its GPUs (else it would serve their ranges alone)
            cpu = replace(cpu, flops=min(cpu.flops, speeds[0].flops / 10),
                          mem_bandwidth=min(cpu.mem_bandwidth, speeds[0].mem_bandwidth / 10))
        speeds.append(cpu)
    return Device(
        id=device_id, memory_bytes=int(need * rng.uniform(0.12, 0.8 if multi_gpu else 1.3)), speeds=tuple(speeds),
        tier=rng.choice(["edge", "cloud"]), site=site,
        node=rng.choice(nodes),
        step_overhead_s=rng.choice([0.0, rng.uniform(0, 2e-3)]))


def _random_links(rng: random.Random, devices: list[Device], multi_gpu: bool) -> list[Link]:
    """Measured links for a random subset of pairs (origin included); multi_gpu: same-node pairs mostly fast."""
    links = []
    node = {d.id: d.node_id for d in devices}
    ends = [d.id for d in devices] + [ORIGIN]
    for i, a in enumerate(ends):
        for b in ends[i + 1:]:
            if rng.random() < 0.35:
                bandwidth, rtt_s = 10 ** rng.uniform(6, 11.6), rng.uniform(0, 0.05)
                if multi_gpu and a != ORIGIN and b != ORIGIN and node[a] == node[b] and rng.random() < 0.9:
                    bandwidth, rtt_s = 10 ** rng.uniform(10.4, 11.6), rng.uniform(1e-6, 3e-5)   # 25-400 GB/s
                links.append(Link(a, b, bandwidth, rtt_s))
    rng.shuffle(links)
    return links


def shuffled(fleet: FleetSnapshot, seed: int) -> FleetSnapshot:
    """The same fleet with devices and links in another order, and each link's ends maybe swapped."""
    rng = random.Random(seed)
    devices, links = list(fleet.devices), [
        replace(link, a=link.b, b=link.a) if rng.random() < 0.5 else link for link in fleet.links]
    rng.shuffle(devices)
    rng.shuffle(links)
    return FleetSnapshot(tuple(devices), tuple(links), fleet.origin_site)


def speed_of(device: Device, dtype: str) -> tuple[float, float] | None:
    """(FLOP/s, bytes/s) of the device's fastest backend for dtype."""
    matches = [(s.flops, s.mem_bandwidth, s.backend) for s in device.speeds if s.dtype == dtype]
    return max(matches)[:2] if matches else None


def speeds_of(device: Device, dtype: str) -> list[tuple[float, float]]:
    """(FLOP/s, bytes/s) of each of the device's backends for dtype: a stage is priced at the fastest for it."""
    return [(s.flops, s.mem_bandwidth) for s in device.speeds if s.dtype == dtype]
