"""Synthetic fleets: deterministic per seed, well-formed, plausible links, accepted by the planner's reader."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from typing import Any

import pytest

from stratamesh.testbed import sim
from stratamesh.partitioner.fleet_snapshot import fleet_from_dict
from stratamesh.partitioner.profile import profile_from_hf_config

BUILDERS: dict[str, Callable[[int], dict[str, Any]]] = {
    "random": sim.random_fleet,
    "random-300": lambda seed: sim.random_fleet(seed, num_devices=300),
    "small": sim.small_fleet,
    "large-2000": lambda seed: sim.large_fleet(seed, num_devices=2000),
}
KINDS = {k.name: k for k in (*sim.EDGE_KINDS, *sim.CLOUD_KINDS)}
SEEDS = range(12)


def kind_of(device_id: str) -> sim.Kind:
    (kind,) = [k for name, k in KINDS.items() if device_id.endswith("-" + name)]
    return kind


def fleets() -> list[tuple[str, int, dict[str, Any]]]:
    return [(name, seed, build(seed)) for name, build in BUILDERS.items() for seed in SEEDS]


@pytest.fixture(scope="module")
def all_fleets() -> list[tuple[str, int, dict[str, Any]]]:
    return fleets()


@pytest.mark.parametrize("name", BUILDERS)
def test_the_same_seed_gives_the_same_fleet_and_others_differ(name: str) -> None:
    build = BUILDERS[name]
    assert build(7) == build(7)
    assert len({repr(build(seed)) for seed in SEEDS}) == len(SEEDS)


def test_ids_are_unique_and_never_origin(all_fleets) -> None:
    for name, seed, fleet in all_fleets:
        ids = [d["id"] for d in fleet["devices"]]
        assert len(ids) == len(set(ids)) and sim.ORIGIN not in ids, (name, seed)


def test_devices_measure_positive_speeds_and_plausible_memory(all_fleets) -> None:
    for _, _, fleet in all_fleets:
        for d in fleet["devices"]:
            kind = kind_of(d["id"])
            dtypes = [s["dtype"] for s in d["speeds"]]
            assert dtypes == list(kind.dtypes) and d["tier"] == kind.tier
            assert all(s["flops"] > 0 and s["mem_bandwidth"] > 0 and s["backend"] == kind.backend
                       for s in d["speeds"])
            usable = (kind.memory_gib - kind.reserved_gib) * sim.GiB
            assert 0.80 * usable <= d["memory_bytes"] <= 0.95 * usable
            assert 0.1e-3 <= d["step_overhead_s"] <= 3e-3


def test_gpus_of_a_node_are_one_kind_in_one_site(all_fleets) -> None:
    for name, seed, fleet in all_fleets:
        nodes: dict[str, list[dict]] = {}
        for d in fleet["devices"]:
            nodes.setdefault(d["node"], []).append(d)
        for node, members in nodes.items():
            assert len({d["site"] for d in members}) == 1, (name, seed, node)
            assert len({kind_of(d["id"]) for d in members}) == 1, (name, seed, node)
            assert len(members) == 1 or (members[0]["tier"] == "cloud" and len(members) <= 8)


def test_links_join_known_devices_or_the_origin_once(all_fleets) -> None:
    for name, seed, fleet in all_fleets:
        ids = {d["id"] for d in fleet["devices"]} | {sim.ORIGIN}
        pairs = [frozenset((link["a"], link["b"])) for link in fleet["links"]]
        assert all(len(p) == 2 and p <= ids for p in pairs), (name, seed)
        assert len(pairs) == len(set(pairs)), (name, seed)
        assert fleet["origin_site"] in {d["site"] for d in fleet["devices"]}


# (lowest bandwidth, highest, lowest rtt, highest) for each kind of link, jitter included
LINK_RANGES = {
    "node": (21e9, 450e9, 10e-6, 24e-6),
    "edge lan": (34e6, 118e6, 0.8e-3, 6e-3),
    "region": (2.5e9, 12.5e9, 0.1e-3, 0.6e-3),
    "wan": (2.1e6, 62.5e6, 10e-3, 80e-3),
}


def link_classes(fleet: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """Each link with what it crosses: a node, an edge site's LAN, a cloud region, or the WAN."""
    ends = {d["id"]: d for d in fleet["devices"]}
    tier = {d["site"]: d["tier"] for d in fleet["devices"]}
    ends[sim.ORIGIN] = {"node": sim.ORIGIN, "site": fleet["origin_site"], "tier": tier[fleet["origin_site"]]}
    classes = []
    for link in fleet["links"]:
        a, b = ends[link["a"]], ends[link["b"]]
        if a["node"] == b["node"]:
            classes.append(("node", link))
        elif a["site"] != b["site"]:
            classes.append(("wan", link))
        else:
            classes.append(("edge lan" if a["tier"] == "edge" else "region", link))
    return classes


def test_links_are_in_the_range_of_their_kind(all_fleets) -> None:
    seen = set()
    for name, seed, fleet in all_fleets:
        for kind, link in link_classes(fleet):
            low_bw, high_bw, low_rtt, high_rtt = LINK_RANGES[kind]
            assert low_bw <= link["bandwidth"] <= high_bw and low_rtt <= link["rtt_s"] <= high_rtt, (name, seed, link)
            seen.add(kind)
    assert seen == set(LINK_RANGES)


def test_the_planners_reader_accepts_every_fleet_unchanged(all_fleets) -> None:
    for name, seed, fleet in all_fleets:
        assert json.loads(json.dumps(fleet_from_dict(fleet).to_dict())) == fleet, (name, seed)


@pytest.mark.parametrize("seed", SEEDS)
def test_small_fleets_list_every_pair_on_up_to_three_sites(seed: int) -> None:
    fleet = sim.small_fleet(seed, max_devices=6)
    num = len(fleet["devices"])
    assert 2 <= num <= 6 and 1 <= len({d["site"] for d in fleet["devices"]}) <= 3
    assert len(fleet["links"]) == len(list(itertools.combinations(range(num + 1), 2)))


def test_small_fleet_needs_two_devices() -> None:
    with pytest.raises(ValueError):
        sim.small_fleet(0, max_devices=1)


@pytest.mark.parametrize("num_devices", [1, 5, 37, 1000])
def test_random_fleet_has_exactly_the_devices_asked_for(num_devices: int) -> None:
    assert len(sim.random_fleet(3, num_devices=num_devices)["devices"]) == num_devices


def test_random_fleet_builds_what_the_counts_say() -> None:
    fleet = sim.random_fleet(5, num_edge_sites=2, num_cloud_nodes=3, num_cloud_regions=1)
    edge_sites = {d["site"] for d in fleet["devices"] if d["tier"] == "edge"}
    cloud_nodes = {d["node"] for d in fleet["devices"] if d["tier"] == "cloud"}
    assert len(edge_sites) == 2 and len(cloud_nodes) == 3
    assert len({d["site"] for d in fleet["devices"] if d["tier"] == "cloud"}) == 1


def test_a_large_fleet_has_ten_thousand_devices_and_compact_links() -> None:
    fleet = sim.large_fleet(0)
    assert len(fleet["devices"]) == 10_000
    assert {d["tier"] for d in fleet["devices"]} == {"edge", "cloud"}
    assert len({d["site"] for d in fleet["devices"]}) > 100
    assert len(fleet["links"]) < 5 * 10_000
    assert len(fleet_from_dict(fleet).devices) == 10_000


@pytest.mark.parametrize("name, billions", [
    ("llama-3.2-1b", 1.236), ("llama-3.1-8b", 8.030), ("llama-3.1-70b", 70.554),
    ("qwen2.5-7b", 7.616), ("mistral-7b", 7.248),
])
def test_model_configs_have_the_published_parameter_counts(name: str, billions: float) -> None:
    profile = profile_from_hf_config(sim.model_config(name))
    assert profile.total_bytes / profile.bytes_per_param / 1e9 == pytest.approx(billions, rel=0.005)
    assert profile.dtype == "bfloat16"


def test_model_config_returns_a_copy_and_names_unknown_models() -> None:
    sim.model_config("llama-3.1-8b")["architectures"].append("mutated")
    assert sim.model_config("llama-3.1-8b")["architectures"] == ["LlamaForCausalLM"]
    with pytest.raises(KeyError, match="llama-3.1-8b"):
        sim.model_config("gpt-5")
