"""The master circuit breaker: exact states, waits and refusals, and its invariants under random steps."""

from __future__ import annotations

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvpool.core.pool.master_breaker import BreakerState, MasterBreaker


def test_closed_allows_every_call() -> None:
    b = MasterBreaker()
    assert [b.allow(t) for t in (0.0, 0.0, 1.0)] == [True, True, True]
    assert b.num_refused == 0 and not b.known_down


def test_a_failure_refuses_until_the_wait_then_lets_one_probe() -> None:
    b = MasterBreaker(min_wait_s=0.25, max_wait_s=4.0)
    b.failure(now=10.0)
    assert b.state is BreakerState.OPEN and b.retry_at == 10.25
    assert b.allow(10.0) is False
    assert b.allow(10.24) is False
    assert b.allow(10.25) is True  # the probe
    assert b.state is BreakerState.HALF_OPEN
    assert b.allow(10.26) is False  # one probe at a time
    assert b.num_refused == 3
    b.success()
    assert b.state is BreakerState.CLOSED and b.allow(10.27) is True


def test_waits_double_per_consecutive_failure_up_to_the_cap() -> None:
    b = MasterBreaker(min_wait_s=0.25, max_wait_s=1.0)
    waits = []
    now = 0.0
    for _ in range(5):
        b.failure(now)
        waits.append(b.retry_at - now)
        now = b.retry_at
        assert b.allow(now) is True  # the probe, which fails again
    assert waits == [0.25, 0.5, 1.0, 1.0, 1.0]
    b.success()
    b.failure(now)
    assert b.retry_at - now == 0.25  # success reset the count


def test_success_while_open_closes_at_once() -> None:
    # the channel reports the master ready again before the wait ends
    b = MasterBreaker()
    b.failure(0.0)
    b.success()
    assert b.allow(0.01) is True and b.consecutive_failures == 0


def test_an_abandoned_probe_lets_the_next_call_probe() -> None:
    b = MasterBreaker(min_wait_s=1.0, max_wait_s=1.0)
    b.failure(0.0)
    assert b.allow(1.0) is True
    b.abandoned()
    assert b.allow(1.0) is True


@pytest.mark.parametrize("lo, hi", [(0.0, 1.0), (2.0, 1.0), (-1.0, 1.0)])
def test_bad_waits_are_refused(lo: float, hi: float) -> None:
    with pytest.raises(ValueError, match="min_wait_s"):
        MasterBreaker(min_wait_s=lo, max_wait_s=hi)


class BreakerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.b = MasterBreaker(min_wait_s=0.5, max_wait_s=2.0)
        self.now = 0.0
        self.in_flight = 0  # allowed calls not yet reported

    @rule(dt=st.floats(min_value=0.0, max_value=3.0))
    def tick(self, dt: float) -> None:
        self.now += dt

    @rule()
    def call(self) -> None:
        state_before = self.b.state
        probing = self.b.probe_in_flight
        allowed = self.b.allow(self.now)
        if state_before is BreakerState.CLOSED:
            assert allowed
        if state_before is BreakerState.OPEN and self.now < self.b.retry_at:
            assert not allowed
        if probing and state_before is BreakerState.HALF_OPEN:
            assert not allowed
        if allowed:
            self.in_flight += 1

    @rule()
    def fail(self) -> None:
        if self.in_flight:
            self.in_flight -= 1
            self.b.failure(self.now)
            assert self.b.state is BreakerState.OPEN and self.b.retry_at > self.now

    @rule()
    def succeed(self) -> None:
        if self.in_flight:
            self.in_flight -= 1
            self.b.success()
            assert self.b.state is BreakerState.CLOSED

    @invariant()
    def wait_is_bounded(self) -> None:
        if self.b.state is BreakerState.OPEN:
            assert self.b.retry_at - self.now <= 2.0 + 1e-9  # float sums

    @invariant()
    def probe_only_when_half_open(self) -> None:
        if self.b.probe_in_flight:
            assert self.b.state is BreakerState.HALF_OPEN


TestBreakerMachine = BreakerMachine.TestCase
