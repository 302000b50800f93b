"""Session keys are scoped per tenant."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.core.tenancy.tenants import TenantLabels, TenantRates, scoped_session_key


def test_session_keys_of_two_tenants_never_meet() -> None:
    assert scoped_session_key("alice", "s1") == "alice\0s1"
    assert scoped_session_key("alice", "s1") != scoped_session_key("bob", "s1")
    # a key that spells another tenant's prefix stays apart: tenant names hold no NUL
    assert scoped_session_key("alice", "bob\0s1") != scoped_session_key("bob", "s1")


def test_the_default_tenant_and_no_session_are_unchanged() -> None:
    assert scoped_session_key("default", "s1") == scoped_session_key("", "s1") == "s1"
    assert scoped_session_key("alice", "") == ""


def test_a_tenant_gets_its_burst_then_its_rate() -> None:
    rates = TenantRates(rate=2.0, burst=3)
    assert [rates.take("alice", 0.0) for _ in range(3)] == [0.0, 0.0, 0.0]
    assert rates.take("alice", 0.0) == 0.5  # one token at 2/s
    assert rates.take("alice", 0.25) == 0.25
    assert rates.take("alice", 0.5) == 0.0
    # bob's bucket is his own: alice's flood took nothing from it
    assert [rates.take("bob", 0.5) for _ in range(3)] == [0.0, 0.0, 0.0]
    # idle time refills up to the burst, no further
    assert [rates.take("alice", 100.0) for _ in range(4)] == [0.0, 0.0, 0.0, 0.5]


def test_no_rate_admits_everything() -> None:
    rates = TenantRates(rate=0.0, burst=0)
    assert all(rates.take("alice", 0.0) == 0.0 for _ in range(1000))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["a", "b"]), st.floats(0, 5)), max_size=60))
def test_tokens_stay_within_the_burst_and_tenants_apart(steps: list[tuple[str, float]]) -> None:
    rates, alone = TenantRates(rate=1.5, burst=4), TenantRates(rate=1.5, burst=4)
    now = 0.0
    for tenant, dt in steps:
        now += dt
        wait = rates.take(tenant, now)
        if tenant == "a":  # a's answers do not depend on b's traffic
            assert wait == alone.take("a", now)
        assert all(0.0 <= t <= 4 for t in rates._tokens.values())
        assert wait >= 0.0


def test_tenant_labels_are_bounded_and_never_change() -> None:
    labels = TenantLabels(limit=2)
    assert labels.totals({"b": 5, "a": 1, "c": 2, "d": 3}) == {"b": 5, "a": 1, "other": 5}
    assert labels.totals({"c": 7}) == {"b": 0, "a": 0, "other": 7}  # "c" stays other; b and a stay at 0
    assert [labels.label(t) for t in ("a", "c", "other")] == ["a", "other", "other"]
    fresh = TenantLabels(limit=2)
    assert fresh.totals({}) == {} and fresh.label("other") == "other"  # no tenant takes the bucket's name
