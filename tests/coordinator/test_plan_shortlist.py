"""The planner's shortlist over fleets of thousands of agents: whom it keeps, and what a plan over it loses."""

from __future__ import annotations

import random

import pytest

from stratamesh.coordinator.placement import PLAN_CANDIDATES, SitePins, plan_stages, shortlist
from stratamesh.fleet.boxes import Capabilities, Speed

GiB = 1 << 30
CONFIG = {"model_type": "llama", "num_hidden_layers": 8, "hidden_size": 256, "intermediate_size": 512,
          "num_attention_heads": 4, "vocab_size": 1024, "max_position_embeddings": 256}


def fleet(num_agents: int, num_sites: int, seed: int = 7) -> dict[str, Capabilities]:
    """CPU boxes, one per host, spread over sites: most of them modest, one in 50 up to ten times faster."""
    rng = random.Random(seed)

    def speed() -> float:
        return rng.uniform(1, 10) if rng.random() < 0.02 else rng.uniform(0.5, 1.5)

    return {f"a{i:05d}": Capabilities(f"host-{i}", "cpu", 4, 8 * GiB, int(rng.uniform(0.5, 8) * GiB),
                                      site=f"site-{rng.randrange(num_sites)}",
                                      speeds=(Speed("torch-cpu", "float32", speed() * 1e10, speed() * 1e9),))
            for i in range(num_agents)}


def test_a_fleet_within_the_limit_is_weighed_whole() -> None:
    agents = fleet(PLAN_CANDIDATES, 10)
    assert shortlist(agents, num_stages=3) is agents


def test_beyond_the_limit_the_fastest_the_roomiest_the_serving_and_the_pinned_site_are_kept() -> None:
    agents = fleet(3000, 200)
    slowest = min(agents, key=lambda a: agents[a].speeds[0].flops)
    agents["fast"] = Capabilities("host-fast", "cpu", 4, 8 * GiB, 1 * GiB, site="site-3",
                                  speeds=(Speed("torch-cpu", "float32", 1e12, 1e11),))
    agents["roomy"] = Capabilities("host-roomy", "cpu", 4, 64 * GiB, 64 * GiB, site="site-4",
                                   speeds=(Speed("torch-cpu", "float32", 1e10, 1e9),))
    pinned = [a for a, caps in agents.items() if caps.site == "site-9"]
    chosen = shortlist(agents, num_stages=2, keep=[slowest], pins=SitePins(first="site-9"))
    assert {"fast", "roomy", slowest} <= set(chosen)
    assert any(a in chosen for a in pinned)
    assert len(chosen) <= PLAN_CANDIDATES + 1 + 3 * 2       # + the kept agent + the pinned site's 2 best at 3 things
    assert all(chosen[a] is agents[a] for a in chosen)


@pytest.mark.parametrize("num_stages", [1, 2, 3])
def test_a_plan_over_the_shortlist_is_as_good_as_one_over_every_agent(num_stages: int) -> None:
    agents = fleet(400, 20, seed=num_stages)
    shortlisted, _ = plan_stages("m", "/m", CONFIG, agents, num_stages)
    whole, _ = plan_stages("m", "/m", CONFIG, agents, num_stages, candidates=len(agents))
    assert shortlisted.tokens_per_s >= 0.99 * whole.tokens_per_s     # (the first 128 agents: 0.37-0.80)
