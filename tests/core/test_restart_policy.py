"""The supervisor's restart policy: exact delays, ordering and giving up."""

from __future__ import annotations

import pytest

from kvpool.core.supervision.restart_policy import RestartPolicy, Supervision

RANKS = {"master": 0, "store0": 1, "p0-stage1": 2, "p0-stage0": 3, "router": 4}


def test_backoff_doubles_per_death_in_the_window_up_to_the_cap() -> None:
    s = Supervision(RestartPolicy(base_s=0.5, max_s=2.0, burst=10, window_s=100.0), RANKS)
    delays = []
    now = 0.0
    for _ in range(4):
        due = s.died("master", now)
        assert due is not None
        delays.append(due - now)
        s.restarting("master")
        now = due + 1.0
    assert delays == [0.5, 1.0, 2.0, 2.0]
    assert s.summary()["master"] == {"restarts": 4, "gave_up": False, "restart_due": False}


def test_deaths_outside_the_window_are_forgotten() -> None:
    s = Supervision(RestartPolicy(base_s=1.0, max_s=8.0, burst=2, window_s=10.0), RANKS)
    assert s.died("router", 0.0) == 1.0
    assert s.died("router", 5.0) == 7.0  # second death within 10 s: 2 s
    assert s.died("router", 14.0) == 16.0  # the first fell out of the window: 2 in it
    assert s.died("router", 40.0) == 41.0  # alone again


def test_more_than_burst_deaths_in_the_window_gives_up_for_good() -> None:
    s = Supervision(RestartPolicy(base_s=0.5, max_s=8.0, burst=2, window_s=60.0), RANKS)
    assert s.died("store0", 0.0) is not None
    s.restarting("store0")
    assert s.died("store0", 1.0) is not None
    s.restarting("store0")
    assert s.died("store0", 2.0) is None
    assert s.summary()["store0"] == {"restarts": 2, "gave_up": True, "restart_due": False}
    assert s.due(100.0) == []
    assert s.died("store0", 500.0) is None  # given up stays given up


def test_due_services_restart_master_first_then_by_rank() -> None:
    s = Supervision(RestartPolicy(base_s=0.5), RANKS)
    for name in ("router", "p0-stage0", "p0-stage1", "master"):
        s.died(name, 0.0)
    assert s.due(0.4) == []
    assert s.due(0.5) == ["master", "p0-stage1", "p0-stage0", "router"]
    s.restarting("master")
    assert s.due(0.5) == ["p0-stage1", "p0-stage0", "router"]


@pytest.mark.parametrize("kwargs", [{"base_s": 0.0}, {"base_s": 3.0, "max_s": 2.0}, {"burst": 0}, {"window_s": 0.0}])
def test_bad_policies_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="restart policy"):
        RestartPolicy(**kwargs)  # type: ignore[arg-type]
