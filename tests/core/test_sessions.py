"""Sessions: tenant-scoped keys, idle order, the hints, prefetch planning and its byte ledger (exact)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpool.core.chunk_hash import ChunkHash
from kvpool.core.errors import InvalidArgument
from kvpool.core.pool.index import PoolIndex
from kvpool.core.sessions.table import (
    PrefetchLedger,
    SessionId,
    SessionTable,
    check_expected_next_s,
    prefetch_budget,
    prefetch_lead_s,
)
from kvpool.core.pool.records import PutRequestItem
from tests.core.fixtures import KB, make_index

A, B, C = SessionId("t", "a"), SessionId("t", "b"), SessionId("u", "a")


def H(*names: str) -> list[ChunkHash]:
    return [ChunkHash(n) for n in names]


def test_idle_order_ended_first_then_idle_longest() -> None:
    table = SessionTable()
    for session, t in ((A, 0.0), (B, 1.0), (C, 2.0)):
        table.turn_started(session, t)
    table.turn_ended(B, 3.0)
    table.turn_ended(A, 4.0)
    assert table.idle_order() == [B, A]  # C still has a turn in flight
    table.turn_ended(C, 5.0, end=True)
    assert table.idle_order() == [C, B, A]
    table.turn_started(B, 6.0)
    table.turn_ended(B, 7.0, expected_next_s=2.5)
    assert table.idle_order() == [C, A, B]
    assert table.get(B).expected_at == 9.5 and table.get(A).expected_at is None
    assert C != SessionId("t", "a")  # one key, two tenants: two sessions
    assert len(table) == 3


def test_two_turns_in_flight_end_one_at_a_time_and_the_table_is_bounded() -> None:
    table = SessionTable(max_sessions=2)
    table.turn_started(A, 0.0)
    table.turn_started(A, 1.0)
    table.turn_ended(A, 2.0)
    assert table.idle_order() == [] and table.get(A).turns_in_flight == 1
    table.turn_ended(A, 3.0, H("x", "y"))
    table.turn_started(B, 4.0)
    table.turn_ended(B, 5.0)
    table.turn_started(C, 6.0)  # a third session: A, idle longest, is forgotten
    assert table.get(A) is None and table.idle_order() == [B]
    with pytest.raises(InvalidArgument, match="session_key"):
        table.turn_ended(A, 7.0)


@pytest.mark.parametrize("value", [-1.0, 86_400.5, float("nan"), float("inf"), True, "3"])
def test_expected_next_s_is_checked_naming_the_field(value: object) -> None:
    with pytest.raises(InvalidArgument) as exc:
        check_expected_next_s(value)  # type: ignore[arg-type]
    assert exc.value.field == "expected_next_s"


def test_a_budget_leaves_what_is_wanted_and_a_reserve() -> None:
    assert prefetch_budget(10, 4, 2) == 4 and prefetch_budget(3, 4, 2) == 0


def test_donors_are_idle_sessions_wanted_after_the_staged_one_the_last_wanted_first() -> None:
    table = SessionTable()
    D, E = SessionId("t", "d"), SessionId("t", "e")
    for session in (A, B, C, D, E):
        table.turn_started(session, 0.0)
    table.turn_ended(A, 1.0, expected_next_s=5.0)  # due at 6
    table.turn_ended(B, 2.0, expected_next_s=20.0)  # due at 22
    table.turn_ended(C, 3.0)  # no hint yet
    table.expect(C, 3.5, 40.0)  # the router's hint after the turn: due at 43.5
    table.turn_ended(D, 4.0)  # no hint at all
    # E still has a turn in flight: never a donor; a hint for it is ignored
    table.expect(E, 4.0, 1.0)
    assert table.get(E).expected_at is None
    assert table.donors(A, 6.0) == [C, B]  # the latest expected first; D (no hint) keeps its blocks
    assert table.donors(B, 22.0) == [C]  # A is due before B: it keeps its blocks
    assert table.donors(D, 4.0) == [C, B, A]
    assert table.donors(D, 4.0, keep=lambda s: s == B) == [C, A]  # B's own staging waits on the device
    with pytest.raises(InvalidArgument):
        table.expect(A, 0.0, -1.0)


def test_prefetch_lead_and_a_budget_with_donors() -> None:
    assert prefetch_lead_s(0, 0.02, 0.1) == 0.1
    assert prefetch_lead_s(10, 0.02, 0.1) == pytest.approx(0.3)
    with pytest.raises(InvalidArgument):
        prefetch_lead_s(-1, 0.02, 0.1)
    # 3 uncached free blocks, 1 wanted, 1 kept: 1 block; donors' 6 cached blocks make it 7
    assert prefetch_budget(3, 1, 1) == 1 and prefetch_budget(3, 1, 1, num_donor_blocks=6) == 7
    assert prefetch_budget(0, 1, 1, num_donor_blocks=1) == 0


def test_ledger_counts_prefetched_used_and_wasted_bytes() -> None:
    ledger = PrefetchLedger(chunk_bytes=100)
    assert ledger.staged(A, H("1", "2", "3")) == 3
    assert ledger.staged(A, H("3", "4")) == 1  # "3" is pending already
    assert ledger.is_pending(A) and not ledger.is_pending(B)
    # "3" was evicted before the turn; "4" is still cached but this turn did not reach it: pending
    assert ledger.turn_started(A, H("1", "2", "9"), lambda h: h != "3") == (200, 100)
    assert ledger.pending_bytes == 100
    assert ledger.turn_started(A, H("1", "2", "4"), lambda h: True) == (100, 0)
    ledger.staged(B, H("5"))
    assert ledger.dropped(B) == 100 and ledger.dropped(B) == 0
    assert (ledger.prefetched_bytes, ledger.used_bytes, ledger.wasted_bytes, ledger.pending_bytes) == (500, 300, 200, 0)
    assert ledger.wasted_share == 200 / 500
    assert ledger.turn_started(C, H("1"), lambda h: True) == (0, 0)


@given(st.lists(st.tuples(st.sampled_from([A, B, C]), st.sampled_from(["stage", "turn", "drop"]),
                          st.sets(st.sampled_from("abcdef"))), max_size=30))
def test_ledger_bytes_always_add_up(steps: list[tuple[SessionId, str, set[str]]]) -> None:
    ledger = PrefetchLedger(chunk_bytes=7)
    for session, op, names in steps:
        hashes = H(*sorted(names))
        if op == "stage":
            ledger.staged(session, hashes)
        elif op == "turn":
            ledger.turn_started(session, hashes[:1], lambda h: h < "d")
        else:
            ledger.dropped(session)
        assert ledger.used_bytes + ledger.wasted_bytes + ledger.pending_bytes == ledger.prefetched_bytes


def put_group(index: PoolIndex, group_id: str) -> None:
    index.put_start("host0", [PutRequestItem(f"{group_id}/0", group_id, 1, KB)])
    index.put_end([(f"{group_id}/0", 7)])


def test_pool_demote_puts_an_ended_sessions_groups_first_for_eviction() -> None:
    index: PoolIndex
    index, _ = make_index()
    for name in ("a", "b", "c", "d"):
        put_group(index, name)
    assert index.demote(["c", "d", "missing"]) == 2
    assert list(index.groups) == ["d", "c", "a", "b"]  # the tail of the ended prefix goes first
    assert list(index.tenant_groups("default")) == ["d", "c", "a", "b"]
