"""The origin and the deployer wired as the daemon wires them: the session table first, the deployer given it as its
sessions, the origin given the deployer; no other channel between them."""

from __future__ import annotations

from pathlib import Path

from stratamesh.coordinator.control.deployer import Deployer
from stratamesh.coordinator.liveness import LivenessConfig
from stratamesh.coordinator.registry import Registry
from stratamesh.coordinator.serving.origin import Origin
from stratamesh.coordinator.serving.records import RequestLog
from stratamesh.coordinator.serving.router import Router
from stratamesh.coordinator.serving.sessions import SessionTable
from tests.coordinator.test_deployer import Agent, connect_all, model_dir, report_ready  # noqa: F401 (a fixture)


async def test_an_unreachable_stage_reaches_the_deployer_and_its_dead_agent_reaches_the_sessions(
        model_dir: Path) -> None:
    sessions, registry = SessionTable(), Registry(":memory:")
    deployer = Deployer(registry, clock=lambda: 100.0, liveness=LivenessConfig(lease_s=2.0), sessions=sessions)
    origin = Origin("127.0.0.1:1", deployer, Router(deployer.routes), sessions, RequestLog())
    agents = [Agent("a1", 8), Agent("a2", 8), Agent("a3", 8)]
    deployer.plans.add_model("m", str(model_dir), num_stages=2)
    connect_all(deployer, agents)
    report_ready(deployer, agents)
    route, _ = await origin.route("m", avoid=(), token_ids=())
    lost = route[-1].address                # not the first hop: the session's stream goes to that one
    victim = next(a for a in agents if a.link.stage_address == lost)
    try:
        with sessions.session("s1", route) as session:
            assert sessions.assignments_in_use() == {hop.assignment_id for hop in route}
            deployer.agent_disconnected(victim.link)        # one sign of death: the deployer waits for the lease
            assert not deployer.roster.liveness.is_dead(victim.link.agent_id) and session.events.empty()
            deployer.report_unreachable(lost)               # what a generation that lost the stage reports
            assert deployer.roster.liveness.is_dead(victim.link.agent_id)
            event = session.events.get_nowait()
            assert (event.error, event.unreachable) == ("its agent was declared dead", lost)
        assert victim.link.agent_id not in {s.agent_id for s in registry.active_plan("m").stages}
    finally:
        await sessions.close()
