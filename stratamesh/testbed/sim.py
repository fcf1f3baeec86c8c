"""Seeded synthetic fleets (edge sites and cloud regions) and model configs, for planner tests and benchmarks.

Pure: a fleet is built from random.Random(seed) alone and returned as the JSON form that
stratamesh.partitioner.fleet_snapshot.fleet_from_dict accepts (this package may not import the partitioner):

    fleet = fleet_from_dict(sim.random_fleet(seed=3))

Links. Fleets of up to ALL_LINKS_UP_TO devices list a link for every pair (and every device to "origin").
Larger ones list only what a real mesh would have measured and what differs most from the planner's
defaults: every pair inside a node and inside an edge site, the origin to every device of its site and to
one device of every other site, and a sample between nodes of a region and between sites. Every pair not
listed falls to the planner's defaults (NODE_LINK, SITE_LINK, WAN_LINK in partitioner/fleet_snapshot.py), so a
10,000-device fleet has tens of thousands of links, not fifty million.
"""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import dataclass
from typing import Any

GiB = 1 << 30
ORIGIN = "origin"
ALL_LINKS_UP_TO = 64        # devices; larger fleets list links compactly (see the module docstring)
FLOPS_DERATE = 0.6          # achievable share of spec-sheet dense FLOP/s in a large matmul
BANDWIDTH_DERATE = 0.8      # achievable share of spec-sheet memory bandwidth in a large copy


@dataclass(frozen=True, slots=True)
class Kind:
    """A device model at spec-sheet numbers; a device of this kind measures them derated."""

    name: str
    tier: str
    backend: str
    memory_gib: float
    reserved_gib: float             # never usable: the OS on shared-memory boxes, the CUDA context on GPUs
    half_flops: float               # dense fp16/bf16 FLOP/s: tensor cores (fp32 accumulate); CPUs: bf16
    fp32_flops: float
    mem_bandwidth: float            # bytes/s
    overhead_s: tuple[float, float]
    fabric_bandwidth: float = 25e9  # bytes/s to a GPU of the same node: PCIe 4.0 x16, or NVLink per direction

    @property
    def dtypes(self) -> tuple[str, ...]:
        return ("float16", "bfloat16", "float32") if self.backend == "torch-cuda" else ("bfloat16", "float32")


# Sources: vendor spec sheets (NVIDIA datasheets, Jetson Orin module data sheets, Raspberry Pi 5 product
# brief); CPU peaks are cores x clock x FMA lanes. torch-cpu has no native bf16 matmul on these CPUs: half
# the fp32 rate. GeForce tensor cores run fp16 with fp32 accumulate at half rate; the numbers below are that
# rate. A10G: the A10 datasheet (AWS does not publish one). Apple M2: the AMX unit torch reaches through
# Accelerate, ~1.5 TFLOP/s fp32 in public measurements.
EDGE_KINDS = (
    # Cortex-A76 4 x 2.4 GHz x 16 FLOP/cycle; LPDDR4X-4267 x 32 bit
    Kind("pi5", "edge", "torch-cpu", 8, 1.0, 77e9, 154e9, 17.1e9, (2e-3, 3e-3)),
    # Intel NUC 13 (i7-1360P): 4 P-cores x 32 + 8 E-cores x 16 FLOP/cycle, ~3 GHz; DDR4-3200 dual channel
    Kind("nuc", "edge", "torch-cpu", 32, 3.0, 400e9, 800e9, 51.2e9, (1e-3, 2e-3)),
    # Mac mini M2 16 GB, unified LPDDR5-6400 x 128 bit
    Kind("m2", "edge", "torch-cpu", 16, 4.0, 750e9, 1.5e12, 100e9, (1e-3, 2e-3)),
    # Orin Nano 8 GB: 32 tensor cores x 625 MHz (40 sparse INT8 TOPS); 1024 CUDA cores; 68 GB/s
    Kind("orin-nano", "edge", "torch-cuda", 8, 1.5, 10.2e12, 1.28e12, 68e9, (0.6e-3, 1e-3)),
    # AGX Orin 32 GB: 56 tensor cores x 930 MHz; 1792 CUDA cores; 204.8 GB/s
    Kind("agx-orin-32", "edge", "torch-cuda", 32, 2.0, 26.7e12, 3.33e12, 204.8e9, (0.6e-3, 1e-3)),
    # AGX Orin 64 GB: 64 tensor cores x 1.3 GHz; 2048 CUDA cores; 204.8 GB/s
    Kind("agx-orin-64", "edge", "torch-cuda", 64, 2.0, 42.6e12, 5.32e12, 204.8e9, (0.6e-3, 1e-3)),
    Kind("rtx3060", "edge", "torch-cuda", 12, 0.5, 25.5e12, 12.7e12, 360e9, (0.3e-3, 0.6e-3)),
    Kind("rtx4090", "edge", "torch-cuda", 24, 0.5, 165.2e12, 82.6e12, 1008e9, (0.3e-3, 0.6e-3)),
)
EDGE_WEIGHTS = tuple(itertools.accumulate((20, 14, 14, 12, 6, 6, 16, 12)))    # cumulative
CLOUD_KINDS = (
    Kind("a10g", "cloud", "torch-cuda", 24, 0.5, 125e12, 31.2e12, 600e9, (0.2e-3, 0.4e-3)),
    Kind("l4", "cloud", "torch-cuda", 24, 0.5, 121e12, 30.3e12, 300e9, (0.2e-3, 0.4e-3)),
    # SXM parts: NVLink 600 / 900 GB/s both ways together
    Kind("a100", "cloud", "torch-cuda", 80, 0.5, 312e12, 19.5e12, 2039e9, (0.2e-3, 0.4e-3), 300e9),
    Kind("h100", "cloud", "torch-cuda", 80, 0.5, 989e12, 67e12, 3350e9, (0.2e-3, 0.4e-3), 450e9),
)
CLOUD_WEIGHTS = tuple(itertools.accumulate((30, 30, 25, 15)))


@dataclass(frozen=True, slots=True)
class _Site:
    """A home, office or cloud region: a point on a map (distance is round-trip time) and its uplink."""

    name: str
    tier: str
    x: float
    y: float
    uplink: float               # bytes/s of one flow to another site


@dataclass(frozen=True, slots=True)
class _Box:
    """A device (or the origin) and how it reaches others: its LAN path and its node's GPU fabric."""

    device: dict[str, Any]
    site: _Site
    lan_bandwidth: float        # edge: its Ethernet or Wi-Fi; cloud: the region's network
    lan_rtt_s: float            # its share of a round trip inside the site
    fabric_bandwidth: float     # to GPUs of its own node

    @property
    def id(self) -> str:
        return self.device["id"]


# ------------------------------------------------------------------ fleets
def random_fleet(seed: int, num_devices: int | None = None, num_edge_sites: int | None = None,
                 num_cloud_nodes: int | None = None, num_cloud_regions: int | None = None,
                 cloud_share: float = 0.4, all_links: bool | None = None) -> dict[str, Any]:
    """num_devices devices (cloud_share of them cloud GPUs), else sites and nodes as counted (None: random)."""
    rng = random.Random(seed)
    if num_devices is not None:
        site_sizes, node_sizes = _layout(rng, num_devices, cloud_share)
    else:
        num_edge_sites = rng.randint(1, 3) if num_edge_sites is None else num_edge_sites
        num_cloud_nodes = rng.choice((0, 0, 1, 1, 2)) if num_cloud_nodes is None else num_cloud_nodes
        site_sizes = [rng.randint(1, 4) for _ in range(num_edge_sites)]
        node_sizes = [rng.choice((4, 8)) for _ in range(num_cloud_nodes)]
    if num_cloud_regions is None:
        num_cloud_regions = _num_regions(rng, node_sizes, large=num_devices is not None)
    boxes = [b for i, size in enumerate(site_sizes) for b in _edge_site(rng, i, size)]
    regions = [_cloud_region(rng, r) for r in range(max(1, num_cloud_regions) if node_sizes else 0)]
    for k, size in enumerate(node_sizes):
        boxes += _cloud_node(rng, regions[rng.randrange(len(regions))], k, size)
    return _assemble(rng, boxes, all_links)


def small_fleet(seed: int, max_devices: int = 8) -> dict[str, Any]:
    """2..max_devices devices over 1-3 sites (edge sites, or a cloud region with one node), every link listed."""
    if max_devices < 2:
        raise ValueError(f"max_devices must be at least 2, got {max_devices}")
    rng = random.Random(seed)
    num_devices = rng.randint(2, max_devices)
    num_sites = rng.randint(1, min(3, num_devices))
    cuts = sorted(rng.sample(range(1, num_devices), num_sites - 1))
    sizes = [b - a for a, b in zip([0, *cuts], [*cuts, num_devices], strict=True)]
    boxes: list[_Box] = []
    for i, size in enumerate(sizes):
        if rng.random() < 0.3:
            boxes += _cloud_node(rng, _cloud_region(rng, i), i, size)
        else:
            boxes += _edge_site(rng, i, size)
    return _assemble(rng, boxes, all_links=True)


def large_fleet(seed: int, num_devices: int = 10_000) -> dict[str, Any]:
    """num_devices over many edge sites and a few cloud regions (one per ~1,000 cloud GPUs), links compact."""
    return random_fleet(seed, num_devices=num_devices, all_links=False)


def _layout(rng: random.Random, num_devices: int, cloud_share: float) -> tuple[list[int], list[int]]:
    """Edge site sizes (1-4 boxes) and cloud node sizes (4 or 8 GPUs) adding up to num_devices."""
    if num_devices < 1 or not 0 <= cloud_share <= 1:
        raise ValueError(f"need num_devices >= 1 and cloud_share in [0, 1], got {num_devices}, {cloud_share}")
    # mean group sizes 2.5 (edge site) and 6 (node): pick nodes so that cloud_share of devices are GPUs
    node_chance = 2.5 * cloud_share / (6 * (1 - cloud_share) + 2.5 * cloud_share)
    sites, nodes, total = [], [], 0
    while total < num_devices:
        if rng.random() < node_chance:
            nodes.append(min(rng.choice((4, 8)), num_devices - total))
            total += nodes[-1]
        else:
            sites.append(min(rng.randint(1, 4), num_devices - total))
            total += sites[-1]
    return sites, nodes


def _num_regions(rng: random.Random, node_sizes: list[int], large: bool) -> int:
    """Regions for the nodes: one per ~1,000 GPUs in a sized fleet, else 1 or 2."""
    if not node_sizes:
        return 0
    if large:
        return max(1, round(sum(node_sizes) / 1000))
    return rng.randint(1, min(2, len(node_sizes)))


def _edge_site(rng: random.Random, index: int, num_boxes: int) -> list[_Box]:
    """A home or office: boxes of mixed kinds, each its own node, on Ethernet or Wi-Fi."""
    uplink = math.exp(rng.uniform(math.log(2.5e6), math.log(62.5e6)))     # 20-500 Mbit/s, mostly low
    site = _Site(f"edge{index}", "edge", rng.random(), rng.random(), uplink)
    boxes = []
    for b in range(num_boxes):
        kind = rng.choices(EDGE_KINDS, cum_weights=EDGE_WEIGHTS)[0]
        device_id = f"{site.name}-b{b}-{kind.name}"
        wired = rng.random() < 0.6
        lan_bandwidth = rng.uniform(100e6, 118e6) if wired else rng.uniform(40e6, 90e6)   # 1 GbE or Wi-Fi
        lan_rtt_s = rng.uniform(0.5e-3, 1e-3) if wired else rng.uniform(1e-3, 2.5e-3)
        device = _device(rng, device_id, kind, site.name, device_id, rng.uniform(0.92, 1.0))
        boxes.append(_Box(device, site, lan_bandwidth, lan_rtt_s, kind.fabric_bandwidth))
    return boxes


def _cloud_region(rng: random.Random, index: int) -> _Site:
    """A cloud region: its uplink is the top of the WAN range (the edge end is the narrow one)."""
    return _Site(f"cloud{index}", "cloud", rng.random(), rng.random(), 62.5e6)


def _cloud_node(rng: random.Random, region: _Site, index: int, num_gpus: int) -> list[_Box]:
    """num_gpus identical GPUs of one kind on one node in region, with 25-100 Gbit/s to other nodes."""
    kind = rng.choices(CLOUD_KINDS, cum_weights=CLOUD_WEIGHTS)[0]
    node = f"{region.name}-n{index}"
    network, rtt_s, speed = rng.uniform(3e9, 12.5e9), rng.uniform(0.1e-3, 0.5e-3), rng.uniform(0.95, 1.0)
    return [_Box(_device(rng, f"{node}-g{g}-{kind.name}", kind, region.name, node, speed), region, network,
                 rtt_s / 2, kind.fabric_bandwidth) for g in range(num_gpus)]


def _device(rng: random.Random, device_id: str, kind: Kind, site: str, node: str, speed: float) -> dict[str, Any]:
    """One device in FleetSnapshot.to_dict() form: speeds derated (times speed), 5-20% of memory in use."""
    usable = (kind.memory_gib - kind.reserved_gib) * GiB * (1 - rng.uniform(0.05, 0.20))
    speeds = [{"backend": kind.backend, "dtype": dtype,
               "flops": (kind.fp32_flops if dtype == "float32" else kind.half_flops) * FLOPS_DERATE * speed,
               "mem_bandwidth": kind.mem_bandwidth * BANDWIDTH_DERATE * speed} for dtype in kind.dtypes]
    return {"id": device_id, "memory_bytes": int(usable), "speeds": speeds, "tier": kind.tier, "site": site,
            "node": node, "step_overhead_s": rng.uniform(*kind.overhead_s)}


# ------------------------------------------------------------------ links
SAMPLED_PEERS = 3           # compact links: each node or edge site to this many others


def _assemble(rng: random.Random, boxes: list[_Box], all_links: bool | None) -> dict[str, Any]:
    """The fleet dict: devices, an origin site, and links (every pair, or compact for large fleets)."""
    if not boxes:
        raise ValueError("a fleet needs at least one device")
    origin = _origin(rng, list(dict.fromkeys(b.site for b in boxes)))
    if all_links is None:
        all_links = len(boxes) <= ALL_LINKS_UP_TO
    pairs = itertools.combinations([origin, *boxes], 2) if all_links else _compact_pairs(rng, origin, boxes)
    return {"origin_site": origin.site.name, "devices": [b.device for b in boxes],
            "links": [_link(rng, a, b) for a, b in pairs]}


def _origin(rng: random.Random, sites: list[_Site]) -> _Box:
    """Where requests enter: mostly a home or office (its wired gateway), else a region's API front end."""
    edge, cloud = [s for s in sites if s.tier == "edge"], [s for s in sites if s.tier == "cloud"]
    site = rng.choice(edge) if edge and (not cloud or rng.random() < 0.75) else rng.choice(cloud)
    if site.tier == "edge":
        bandwidth, rtt_s = rng.uniform(100e6, 118e6), rng.uniform(0.3e-3, 0.5e-3)
    else:
        bandwidth, rtt_s = rng.uniform(3e9, 12.5e9), rng.uniform(0.05e-3, 0.25e-3)
    return _Box({"id": ORIGIN, "node": ORIGIN}, site, bandwidth, rtt_s, 0.0)


def _link(rng: random.Random, a: _Box, b: _Box) -> dict[str, Any]:
    """The measured link of a pair: node fabric, the site's LAN, or the WAN between sites; jittered per pair."""
    if a.device["node"] == b.device["node"]:
        bandwidth, rtt_s = min(a.fabric_bandwidth, b.fabric_bandwidth), rng.uniform(10e-6, 20e-6)
    elif a.site is b.site:
        bandwidth, rtt_s = min(a.lan_bandwidth, b.lan_bandwidth), a.lan_rtt_s + b.lan_rtt_s
    else:
        # 10 ms across town to ~66 ms across the map (x 1.2 jitter: under 80 ms)
        distance = math.hypot(a.site.x - b.site.x, a.site.y - b.site.y) / math.sqrt(2)
        bandwidth, rtt_s = min(a.site.uplink, b.site.uplink), 10e-3 + 56e-3 * distance
    return {"a": a.id, "b": b.id, "bandwidth": bandwidth * rng.uniform(0.85, 1.0),
            "rtt_s": rtt_s * rng.uniform(1.0, 1.2)}


def _compact_pairs(rng: random.Random, origin: _Box, boxes: list[_Box]) -> list[tuple[_Box, _Box]]:
    """Every pair in a node or edge site; the origin to its site and to one box of each other group;
    each group's first box to SAMPLED_PEERS others' (inside a region or across the WAN)."""
    groups: dict[str, list[_Box]] = {}
    for box in boxes:
        groups.setdefault(box.device["node"] if box.site.tier == "cloud" else box.site.name, []).append(box)
    pairs = [p for members in groups.values() for p in itertools.combinations(members, 2)]
    heads = [members[0] for members in groups.values()]
    pairs += [(origin, b) for b in boxes if b.site is origin.site]
    pairs += [(origin, h) for h in heads if h.site is not origin.site]
    for head in heads:
        pairs += [(head, peer) for peer in rng.sample(heads, min(SAMPLED_PEERS, len(heads))) if peer is not head]
    unique = {tuple(sorted((a.id, b.id))): (a, b) for a, b in pairs}
    return list(unique.values())


# ------------------------------------------------------------------ models
_LLAMA3 = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256,
           "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
           "max_position_embeddings": 131072, "torch_dtype": "bfloat16", "bos_token_id": 128000,
           "eos_token_id": 128001, "attention_bias": False}
_MODELS: dict[str, dict[str, Any]] = {
    "llama-3.2-1b": {**_LLAMA3, "_name_or_path": "meta-llama/Llama-3.2-1B", "hidden_size": 2048,
                     "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
                     "num_key_value_heads": 8, "head_dim": 64, "tie_word_embeddings": True},
    "llama-3.1-8b": {**_LLAMA3, "_name_or_path": "meta-llama/Llama-3.1-8B", "hidden_size": 4096,
                     "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
                     "num_key_value_heads": 8, "head_dim": 128, "tie_word_embeddings": False},
    "llama-3.1-70b": {**_LLAMA3, "_name_or_path": "meta-llama/Llama-3.1-70B", "hidden_size": 8192,
                      "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64,
                      "num_key_value_heads": 8, "head_dim": 128, "tie_word_embeddings": False},
    "qwen2.5-7b": {"_name_or_path": "Qwen/Qwen2.5-7B", "architectures": ["Qwen2ForCausalLM"],
                   "model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944,
                   "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
                   "vocab_size": 152064, "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
                   "max_position_embeddings": 131072, "tie_word_embeddings": False, "torch_dtype": "bfloat16"},
    "mistral-7b": {"_name_or_path": "mistralai/Mistral-7B-v0.3", "architectures": ["MistralForCausalLM"],
                   "model_type": "mistral", "hidden_size": 4096, "intermediate_size": 14336,
                   "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                   "vocab_size": 32768, "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 1000000.0,
                   "max_position_embeddings": 32768, "sliding_window": None, "tie_word_embeddings": False,
                   "torch_dtype": "bfloat16"},
}
MODEL_NAMES = tuple(_MODELS)


def model_config(name: str) -> dict[str, Any]:
    """A copy of a Hugging Face config.json dict (real sizes) for one of MODEL_NAMES; KeyError otherwise."""
    if name not in _MODELS:
        raise KeyError(f"no model config {name!r}; known: {', '.join(MODEL_NAMES)}")
    return {k: list(v) if isinstance(v, list) else v for k, v in _MODELS[name].items()}
