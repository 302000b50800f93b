"""A backend goes out of rotation at once when it says so or is gone, and only after repeated late answers."""

from __future__ import annotations

import pytest

from kvpool.core.supervision.health_checks import Check, HealthVerdicts

S, D, L = Check.SERVING, Check.DOWN, Check.LATE


def standings(checks: list[Check], misses: int = 2) -> list[bool]:
    verdicts = HealthVerdicts(misses)
    return [verdicts.record("p0", check) for check in checks]


def test_never_checked_or_only_late_is_unhealthy() -> None:
    assert standings([L]) == [False]
    assert standings([L, L, L]) == [False, False, False]


def test_down_is_out_at_once_and_serving_is_back_at_once() -> None:
    assert standings([S, D, S]) == [True, False, True]


def test_one_late_answer_keeps_a_healthy_backend_in_and_two_in_a_row_take_it_out() -> None:
    assert standings([S, L, S, L, L, S]) == [True, True, True, True, False, True]


def test_late_keeps_a_down_backend_out() -> None:
    assert standings([S, D, L, S]) == [True, False, False, True]


def test_a_timely_answer_clears_the_count() -> None:
    verdicts = HealthVerdicts(3)
    for check in (S, L, L):
        verdicts.record("p0", check)
    assert verdicts.late_in_a_row("p0") == 2
    assert verdicts.record("p0", S) is True and verdicts.late_in_a_row("p0") == 0
    assert [verdicts.record("p0", L) for _ in range(3)] == [True, True, False]


def test_backends_are_judged_apart() -> None:
    verdicts = HealthVerdicts(2)
    verdicts.record("p0", S)
    verdicts.record("s0", S)
    assert (verdicts.record("p0", L), verdicts.record("s0", D)) == (True, False)
    assert verdicts.record("p0", L) is False and verdicts.record("s0", S) is True


def test_misses_must_be_positive() -> None:
    with pytest.raises(ValueError, match="misses"):
        HealthVerdicts(0)
