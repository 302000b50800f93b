"""``ConnectionLimits``' accounting of unauthenticated connections: per address, in all, and which one is evicted."""

from __future__ import annotations

from kvpool.services.router.http_connections import (
    EVICTED,
    TOO_MANY_CONNECTIONS,
    TOO_MANY_FROM_CLIENT,
    TOO_MANY_UNAUTHENTICATED,
    Admitted,
    ConnectionLimits,
)


def admitted(limits: ConnectionLimits, address: str) -> Admitted:
    admission = limits.admit(address)
    assert isinstance(admission, Admitted), admission
    return admission


def test_with_keys_the_oldest_idle_keyless_connection_of_the_address_makes_room() -> None:
    refused: list[str] = []
    limits = ConnectionLimits(max_connections=100, max_per_client=3, make_room=True, refused=refused.append)
    first, second, third = (admitted(limits, "10.0.0.1").connection_id for _ in range(3))
    limits.busy(first)  # a request in flight: never evicted
    fourth = admitted(limits, "10.0.0.1")
    assert fourth.evicted == second and refused == [EVICTED]
    assert list(limits.per_client["10.0.0.1"]) == [first, third, fourth.connection_id]
    assert (limits.num_open, limits.num_unauthenticated) == (3, 3)
    limits.release(second)  # its task ends after the eviction: nothing more to count
    assert limits.num_open == 3
    assert admitted(limits, "10.0.0.2").evicted is None  # another address has its own places


def test_a_connection_with_a_valid_key_leaves_its_addresss_bound() -> None:
    limits = ConnectionLimits(max_connections=100, max_per_client=2, make_room=True)
    keyed = admitted(limits, "10.0.0.1").connection_id
    limits.authenticated(keyed)
    others = [admitted(limits, "10.0.0.1") for _ in range(2)]
    assert [a.evicted for a in others] == [None, None]
    assert admitted(limits, "10.0.0.1").evicted == others[0].connection_id  # never the keyed one
    assert (limits.num_open, limits.num_unauthenticated) == (3, 2)
    limits.release(keyed)
    assert (limits.num_open, limits.num_unauthenticated) == (2, 2)


def test_when_every_keyless_connection_of_the_address_is_busy_the_new_one_gets_429() -> None:
    refused: list[str] = []
    limits = ConnectionLimits(max_connections=100, max_per_client=2, make_room=True, refused=refused.append)
    for _ in range(2):
        limits.busy(admitted(limits, "10.0.0.1").connection_id)
    answer = limits.admit("10.0.0.1")
    assert isinstance(answer, bytes) and answer.startswith(b"HTTP/1.1 429 ")
    assert b"10.0.0.1 has 2 connections open without an API key" in answer
    assert refused == [TOO_MANY_FROM_CLIENT]


def test_keyless_connections_hold_at_most_three_quarters_and_the_biggest_address_gives_way() -> None:
    refused: list[str] = []
    limits = ConnectionLimits(max_connections=8, max_per_client=0, make_room=True, refused=refused.append)
    flood = [admitted(limits, "10.0.0.1").connection_id for _ in range(5)]
    lone = admitted(limits, "10.0.0.2").connection_id
    assert limits.max_unauthenticated == 6
    newcomer = admitted(limits, "10.0.0.3")
    assert newcomer.evicted == flood[0] and refused == [EVICTED]  # not the lone address's one
    for connection_id in [*flood[1:], lone, newcomer.connection_id]:
        limits.busy(connection_id)
    answer = limits.admit("10.0.0.4")
    assert isinstance(answer, bytes) and b"without an API key, its most for those" in answer
    assert refused[-1] == TOO_MANY_UNAUTHENTICATED
    limits.authenticated(lone)  # keyed connections fill the rest of the global bound
    assert admitted(limits, "10.0.0.4").evicted is None
    assert limits.num_open == 7


def test_the_global_bound_evicts_a_keyless_connection_before_refusing() -> None:
    refused: list[str] = []
    limits = ConnectionLimits(max_connections=4, max_per_client=0, make_room=True, refused=refused.append)
    keyed = [admitted(limits, "10.0.0.1").connection_id for _ in range(3)]
    for connection_id in keyed:
        limits.authenticated(connection_id)
    keyless = admitted(limits, "10.0.0.9").connection_id
    fourth = admitted(limits, "10.0.0.1")
    assert fourth.evicted == keyless
    limits.authenticated(fourth.connection_id)
    answer = limits.admit("10.0.0.2")  # all four keyed: nothing to evict
    assert isinstance(answer, bytes) and b"(--http-max-connections)" in answer
    assert refused == [EVICTED, TOO_MANY_CONNECTIONS]


def test_without_keys_nothing_is_evicted_past_a_bound() -> None:
    refused: list[str] = []
    limits = ConnectionLimits(max_connections=100, max_per_client=1, refused=refused.append)
    admitted(limits, "10.0.0.1")
    answer = limits.admit("10.0.0.1")
    assert isinstance(answer, bytes) and b"10.0.0.1 has 1 connections open, the most one client may" in answer
    assert refused == [TOO_MANY_FROM_CLIENT] and limits.max_unauthenticated == 100


def test_the_per_address_bound_is_on_by_default() -> None:
    limits = ConnectionLimits()
    assert limits.max_per_client == 256
    for _ in range(256):
        admitted(limits, "10.0.0.1")
    assert isinstance(limits.admit("10.0.0.1"), bytes)
    assert isinstance(limits.admit("10.0.0.2"), Admitted)
