"""``kvpool replay --compare sched=``: the session side's queue bounds reach stage 0 and the router alike."""

from __future__ import annotations

import pytest

from kvpool.tools.replay.topology import TopologySettings, side_topology


def test_the_session_sides_bounds_reach_every_stage_0_and_the_router() -> None:
    topology = side_topology(TopologySettings(servers=2, stages=2, sched="session", sched_max_wait_s=10.0,
                                              sched_max_bypass_s=0.2, sched_reorder_below_s=12.0))
    bounds = ("--sched-max-wait-s", "10.0", "--sched-max-bypass-s", "0.2", "--sched-reorder-below-s", "12.0")
    router = topology.router
    assert router is not None and " ".join(bounds) in " ".join(router.args)
    for server in topology.servers:
        assert " ".join(bounds) in " ".join(server.pipelines[0].args)
    unset = side_topology(TopologySettings(sched="session"))
    assert unset.router is not None and "--sched-reorder-below-s" not in unset.router.args  # theirs: none


def test_a_gate_that_is_not_positive_is_refused() -> None:
    with pytest.raises(ValueError, match="sched_reorder_below_s must be positive"):
        TopologySettings(sched_reorder_below_s=0.0)
