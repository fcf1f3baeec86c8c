"""A local mesh on a slow or shared box: its coordinator's lease and route wait are stretched by the box's patience
(STRATAMESH_PATIENCE), as every limit the launcher waits under is; at patience 1 (`stratamesh up`) they are the
coordinator's defaults, and a mesh's own arguments win over them."""

from __future__ import annotations

import pytest

from stratamesh.cli import _parser
from stratamesh.launcher import AGENT_LEASE_S, PATIENCE_ENV, ROUTE_WAIT_S, LaunchError, patient_coordinator_args


def test_the_launchers_defaults_are_the_coordinators() -> None:
    from stratamesh.coordinator.liveness import LivenessConfig
    from stratamesh.coordinator.serving import origin

    args = _parser().parse_args(["coordinator"])
    assert (args.agent_lease, args.route_wait) == (AGENT_LEASE_S, ROUTE_WAIT_S)
    assert (LivenessConfig().lease_s, origin.ROUTE_WAIT_S) == (AGENT_LEASE_S, ROUTE_WAIT_S)


def test_a_patient_box_stretches_the_lease_and_the_route_wait() -> None:
    assert patient_coordinator_args({}) == [] == patient_coordinator_args({PATIENCE_ENV: "1"})
    stretched = patient_coordinator_args({PATIENCE_ENV: "2.5"})
    assert stretched == ["--agent-lease", "5", "--route-wait", "75"]
    args = _parser().parse_args(["coordinator", *stretched, "--agent-lease", "0.5"])    # the mesh's own win
    assert (args.agent_lease, args.route_wait) == (0.5, 75.0)
    with pytest.raises(LaunchError, match="not a number"):
        patient_coordinator_args({PATIENCE_ENV: "slow"})


@pytest.mark.parametrize("value", ["0", "-3", "soon"])
def test_a_route_wait_that_is_no_duration_is_refused(value: str, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        _parser().parse_args(["coordinator", "--route-wait", value])
    assert "--route-wait" in capsys.readouterr().err
