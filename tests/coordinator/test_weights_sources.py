"""What the coordinator tells an agent that fetches weights (peers to ask first, nearest first) and what it keeps
of the agents' fetch progress."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from stratamesh.coordinator.control.deployer import Deployer
from stratamesh.coordinator.mesh_admin import MeshAdmin
from stratamesh.coordinator.registry import Registry
from stratamesh.fleet.weights import WeightsProgress
from tests.coordinator.test_deployer import Agent, connect_all, model_dir, report_ready  # noqa: F401  (fixture)


def on_site(agent: Agent, site: str) -> Agent:
    agent.caps = replace(agent.caps, site=site)
    agent.link.capabilities = agent.caps
    return agent


def test_an_agent_is_told_to_fetch_from_peers_serving_the_model_on_its_own_site_first(model_dir: Path) -> None:
    registry = Registry(":memory:")
    deployer = Deployer(registry, clock=lambda: 100.0)
    deployer.plans.add_model("m", str(model_dir), num_stages=1, num_replicas=3)
    agents = [on_site(Agent(f"a{i}", 8), site) for i, site in enumerate(("cloud", "cloud", "lab"), start=1)]
    connect_all(deployer, agents)
    assert deployer.weight_sources("m", "a3") == []         # nobody serves it yet: the coordinator alone
    report_ready(deployer, agents[:2])
    assert deployer.weight_sources("m", "a3") == ["127.0.0.1:5001", "127.0.0.1:5002"]
    report_ready(deployer, agents[2:])
    newcomer = on_site(Agent("a4", 8), "lab")
    connect_all(deployer, [newcomer])
    assert deployer.weight_sources("m", "a4")[0] == "127.0.0.1:5003"     # the one on its site
    assert "127.0.0.1:5003" not in deployer.weight_sources("m", "a3")     # never itself
    assert deployer.weight_sources("other", "a4") == []
    assert deployer.model_path("m") == str(model_dir) and deployer.model_path("other") is None


def test_fetch_progress_is_kept_for_planned_stages_and_shown_in_the_admin_api(model_dir: Path) -> None:
    registry = Registry(":memory:")
    deployer = Deployer(registry, clock=lambda: 100.0)
    deployer.plans.add_model("m", str(model_dir), num_stages=2)
    agents = [Agent("a1", 8), Agent("a2", 8)]
    connect_all(deployer, agents)
    mine = agents[0].assignments()[0].assignment_id
    deployer.weights_progress("a2", WeightsProgress(mine, 10, 0, 100, 90))      # not a2's stage: dropped
    assert deployer.weights == {}
    deployer.weights_progress("a1", WeightsProgress(mine, 40, 0, 100, 90, source="coordinator"))
    done = WeightsProgress(mine, 95, 5, 100, 90, True, "127.0.0.1:5002", 1)
    deployer.weights_progress("a1", done)
    assert deployer.weights == {mine: done}
    assert any(e.kind == "weights_fetched" and "95 bytes fetched" in e.detail for e in registry.events())
    stages = {s["assignment_id"]: s for p in MeshAdmin(registry, None, {}, deployer=deployer).plans() for s in p["stages"]}
    assert stages[mine]["weights"] == {"fetched_bytes": 95, "reused_bytes": 5, "total_bytes": 100,
                                       "tensor_bytes": 90, "done": True, "source": "127.0.0.1:5002", "num_corrupt": 1}
    assert [s["weights"] for a, s in stages.items() if a != mine] == [None]
    deployer.plans.replan("m", 1)          # its stage is no longer planned: its progress goes with it on the next tick
    report_ready(deployer, agents)
    deployer.tick()
    assert mine not in deployer.weights
