"""Session keys are scoped per tenant."""

from __future__ import annotations

from kvpool.core.tenancy import scoped_session_key


def test_session_keys_of_two_tenants_never_meet() -> None:
    assert scoped_session_key("alice", "s1") == "alice\0s1"
    assert scoped_session_key("alice", "s1") != scoped_session_key("bob", "s1")
    # a key that spells another tenant's prefix stays apart: tenant names hold no NUL
    assert scoped_session_key("alice", "bob\0s1") != scoped_session_key("bob", "s1")


def test_the_default_tenant_and_no_session_are_unchanged() -> None:
    assert scoped_session_key("default", "s1") == scoped_session_key("", "s1") == "s1"
    assert scoped_session_key("alice", "") == ""
