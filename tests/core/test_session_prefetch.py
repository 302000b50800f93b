"""The session prefetch policy (stage 0's and the simulator's): lead, room, hold, give-back (exact), and a
Hypothesis state machine re-checking its invariants after every random step."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvpool.core.prefill.block_manager import BlockManager
from kvpool.core.chunk_hash import ChunkHash
from kvpool.core.errors import InvalidArgument
from kvpool.core.prefill.request import PrefillRequest, try_admit
from kvpool.core.sessions.prefetch import (
    ARMED,
    CANCELLED,
    ON_DEVICE,
    POOL_MISS,
    PRESSURE,
    SESSION_END,
    STAGED,
    TURN_CAME,
    UNKNOWN,
    PrefetchSettings,
    SessionPrefetch,
)
from kvpool.core.sessions.table import SessionId

A, C, D = SessionId("t", "a"), SessionId("t", "c"), SessionId("t", "d")
CHUNK = 4
CHUNK_BYTES = 100


def H(prefix: str, n: int) -> list[ChunkHash]:
    return [ChunkHash(f"{prefix}{i}") for i in range(n)]


def policy(num_blocks: int = 10) -> SessionPrefetch:
    return SessionPrefetch(BlockManager(num_blocks, CHUNK), CHUNK_BYTES)


def turn(p: SessionPrefetch, session: SessionId, hashes: list[ChunkHash], now: float,
         request_id: str) -> PrefillRequest:
    """A real turn: starts, is admitted (held stagings yield), computes what the device lacks, frees, ends."""
    p.turn_started(session, now)
    request = PrefillRequest(request_id, len(hashes) * CHUNK + 1, CHUNK, hashes, tenant=session.tenant, session=session)
    if not try_admit(request, p.blocks, now, now + 1.0):
        assert p.unpin_all()
        assert try_admit(request, p.blocks, now, now + 1.0)
    p.admitted(request)
    p.blocks.commit_chunks(request_id, request.num_device_chunks, hashes[request.num_device_chunks:])
    p.blocks.free(request_id)
    p.turn_ended(session, now, hashes)
    return request


def read(request: PrefillRequest, p: SessionPrefetch, num_in_pool: int) -> None:
    """The shell's restore: a lookup finding ``num_in_pool`` leading groups, every stage reading them."""
    plan = request.plan_lookup(num_in_pool)
    request.apply_restore([plan.num_pool_chunks], p.blocks)


def test_the_lead_is_the_measured_restore_plus_the_margin_and_a_new_hint_cancels_the_old() -> None:
    p = policy()
    turn(p, A, H("a", 3), 100.0, "r1")
    first = p.hint(A, 100.0, False, 10.0)
    assert first.outcome == ARMED and first.armed is not None
    assert first.armed.at == pytest.approx(100.0 + 10.0 - (0.1 + 3 * 0.02))
    p.observe_restore(2, 1.0)  # 0.5 s a chunk: the moving mean moves a fifth of the way
    assert p.restore_s_per_chunk == pytest.approx(0.02 + 0.2 * 0.48)
    second = p.hint(A, 101.0, False, 10.0)
    assert second.armed is not None and second.armed.at == pytest.approx(111.0 - 0.1 - 3 * 0.116)
    assert p.begin(A, first.armed.ticket, 110.0) == CANCELLED  # re-armed since
    assert p.num_armed == 1
    late = p.hint(A, 102.0, False, 0.05)  # due sooner than its lead: at once
    assert late.armed is not None and late.armed.at == 102.0
    no_hint = p.hint(A, 103.0, False, None)  # no expected time: at once
    assert no_hint.armed is not None and no_hint.armed.at == 103.0
    with pytest.raises(InvalidArgument, match="expected_next_s"):
        p.hint(A, 103.0, False, -1.0)
    assert p.hint(C, 103.0, False, 1.0).outcome == UNKNOWN and not p.hint(C, 103.0, False, 1.0).known
    with pytest.raises(InvalidArgument, match="reserve_share"):
        PrefetchSettings(reserve_share=2.0)


def test_a_lost_history_is_staged_into_uncached_blocks_held_then_used_by_its_turn() -> None:
    p = policy()
    turn(p, A, H("a", 3), 0.0, "r1")  # blocks 0-2 cache a0-a2, block 3 the partial
    turn(p, D, H("d", 8), 1.0, "r2")  # 9 blocks: 7 uncached, then a2 and a1 (the tail first)
    assert p.blocks.match_prefix(H("a", 3)) == 1
    end = p.hint(D, 2.0, True, None)
    assert (end.outcome, end.released, end.demote) == (SESSION_END, 8, tuple(H("d", 8)))
    armed = p.hint(A, 2.0, False, 10.0).armed
    assert armed is not None
    request = p.begin(A, armed.ticket, armed.at)
    assert isinstance(request, PrefillRequest)
    assert (request.request_id, request.num_tokens, request.num_device_chunks) == ("prefetch/2", 13, 1)
    read(request, p, 3)
    result = p.staged(A, request, 0.3)
    assert (result.outcome, result.hold, result.prefetched_bytes) == (STAGED, True, 200)
    assert p.pinned == {A: "prefetch/2"} and p.blocks.has_holder("prefetch/2")
    assert p.restore_s_per_chunk == pytest.approx(0.02 + 0.2 * (0.15 - 0.02))
    next_turn = turn(p, A, H("a", 4), 12.0, "r3")  # its arrival lets the staging go to it
    assert next_turn.num_device_chunks == 3 and p.pinned == {}
    assert (p.ledger.prefetched_bytes, p.ledger.used_bytes, p.ledger.wasted_bytes) == (200, 200, 0)


def test_room_comes_from_donors_expected_later_their_tail_first_never_from_an_unhinted_session() -> None:
    p = policy()
    turn(p, A, H("a", 3), 0.0, "r1")
    turn(p, D, H("d", 8), 1.0, "r2")  # a1, a2 evicted; D caches 8 blocks; 1 block (D's partial) uncached
    assert p.blocks.num_uncached_free_blocks == 1
    no_room = p.hint(A, 2.0, False, 10.0).armed
    assert no_room is not None
    assert p.begin(A, no_room.ticket, 11.0) == PRESSURE  # D has no hint: it may be back any moment
    p.hint(D, 2.5, False, 100.0)  # D is due at 102.5, after A
    armed = p.hint(A, 3.0, False, 10.0).armed
    assert armed is not None
    request = p.begin(A, armed.ticket, 12.0)
    assert isinstance(request, PrefillRequest) and len(request.block_table) == 4
    assert p.blocks.match_prefix(H("d", 8)) == 6  # D gave its last two chunks, no more


def test_a_real_request_short_of_blocks_takes_every_held_staging_back() -> None:
    p = policy()
    turn(p, A, H("a", 3), 0.0, "r1")
    turn(p, D, H("d", 8), 1.0, "r2")
    p.hint(D, 2.0, True, None)
    armed = p.hint(A, 2.0, False, 10.0).armed
    assert armed is not None
    request = p.begin(A, armed.ticket, armed.at)
    assert isinstance(request, PrefillRequest)
    read(request, p, 3)
    assert p.staged(A, request, 0.1).hold
    big = PrefillRequest("r3", 9 * CHUNK + 1, CHUNK, H("c", 9), session=C)  # all 10 blocks
    assert not try_admit(big, p.blocks, 5.0, 6.0)
    assert p.unpin_all() == [request.request_id] and p.num_unpinned == 1 and p.pinned == {}
    assert try_admit(big, p.blocks, 5.0, 6.0)
    assert p.unpin_all() == []
    # A's turn finds nothing of its staging: the staged chunks are wasted
    p.blocks.free("r3")
    again = turn(p, A, H("a", 3), 12.0, "r4")
    assert again.num_device_chunks == 0 and (p.ledger.used_bytes, p.ledger.wasted_bytes) == (0, 200)


def test_what_begin_and_staged_decline() -> None:
    p = policy()
    turn(p, A, H("a", 2), 0.0, "r1")
    armed = p.hint(A, 0.0, False, 5.0).armed
    assert armed is not None
    assert p.begin(A, armed.ticket, 4.0) == ON_DEVICE  # nothing lost
    armed = p.hint(A, 4.0, False, 5.0).armed
    assert armed is not None
    p.turn_started(A, 5.0)  # the turn came first: disarmed
    assert p.begin(A, armed.ticket, 8.0) == CANCELLED
    p.turn_ended(A, 6.0, H("a", 3))  # a longer history now, a2 not on the device
    armed = p.hint(A, 6.0, False, 5.0).armed
    assert armed is not None
    assert p.begin(A, armed.ticket, 10.0, has_pool=False) == PRESSURE
    armed = p.hint(A, 10.0, False, 5.0).armed
    assert armed is not None
    p.sessions.turn_started(A, 12.0)  # a turn in flight the policy did not see start (a stale timer)
    assert p.begin(A, armed.ticket, 14.0) == TURN_CAME


def test_a_staging_whose_turn_came_during_its_read_or_that_the_pool_missed_is_not_held() -> None:
    p = policy()
    turn(p, A, H("a", 3), 0.0, "r1")
    p.blocks.end_session(A)  # its history left the device
    armed = p.hint(A, 1.0, False, 5.0).armed
    assert armed is not None
    request = p.begin(A, armed.ticket, 5.0)
    assert isinstance(request, PrefillRequest)
    read(request, p, 0)  # the pool lost it
    assert (p.staged(A, request, 0.0).outcome, p.pinned) == (POOL_MISS, {})
    p.blocks.free(request.request_id)
    armed = p.hint(A, 6.0, False, 5.0).armed
    assert armed is not None
    request = p.begin(A, armed.ticket, 10.0)
    assert isinstance(request, PrefillRequest)
    p.turn_started(A, 10.5)  # during the read
    read(request, p, 3)
    result = p.staged(A, request, 0.2)
    assert (result.outcome, result.hold, result.prefetched_bytes) == (STAGED, False, 300)


def test_session_end_lets_its_held_staging_go_and_wastes_its_pending_bytes() -> None:
    p = policy()
    turn(p, A, H("a", 3), 0.0, "r1")
    p.blocks.end_session(A)
    armed = p.hint(A, 1.0, False, 5.0).armed
    assert armed is not None
    request = p.begin(A, armed.ticket, 5.0)
    assert isinstance(request, PrefillRequest)
    read(request, p, 3)
    assert p.staged(A, request, 0.1).hold
    end = p.hint(A, 6.0, True, None)
    assert (end.outcome, end.released, end.wasted_bytes) == (SESSION_END, 3, 300)
    assert p.pinned == {} and not p.blocks.has_holder(request.request_id) and p.sessions.get(A) is None
    assert p.blocks.num_uncached_free_blocks == 10


class SessionPrefetchMachine(RuleBasedStateMachine):
    """Random turns, hints, stagings (begin, a read, staged), give-backs of four sessions on 12 blocks."""

    SESSIONS = [SessionId("t", k) for k in "abcd"]

    def __init__(self) -> None:
        super().__init__()
        self.p = SessionPrefetch(BlockManager(12, CHUNK), CHUNK_BYTES)
        self.now = 0.0
        self.turns: dict[SessionId, PrefillRequest] = {}  # running real turns
        self.lengths: dict[SessionId, int] = {}
        self.armed: dict[SessionId, int] = {}  # the latest ticket the machine saw armed
        self.reading: dict[SessionId, PrefillRequest] = {}  # stagings between begin and staged
        self.serial = 0

    @rule(i=st.integers(0, 3), grow=st.integers(0, 3), dt=st.floats(0.0, 5.0))
    def start_turn(self, i: int, grow: int, dt: float) -> None:
        session = self.SESSIONS[i]
        if session in self.turns:
            return
        self.now += dt
        n = min(8, self.lengths.get(session, 0) + grow)
        held = self.p.pinned.get(session)
        assert self.p.turn_started(session, self.now) == held  # its staging, released to it
        assert session not in self.p.pinned
        self.serial += 1
        request = PrefillRequest(f"r{self.serial}", n * CHUNK + 1, CHUNK, H(session.key, n), session=session)
        if not try_admit(request, self.p.blocks, self.now, self.now + 1.0):
            self.p.unpin_all()
            assert self.p.pinned == {}
            if not try_admit(request, self.p.blocks, self.now, self.now + 1.0):
                self.p.turn_ended(session, self.now, H(session.key, self.lengths.get(session, 0)))
                return  # real turns and reads in flight hold the blocks: it waits (dropped here)
        self.p.admitted(request)
        first = request.num_device_chunks
        self.p.blocks.commit_chunks(request.request_id, first, request.chunk_hashes[first:])
        self.turns[session] = request
        self.lengths[session] = n

    @precondition(lambda self: bool(self.turns))
    @rule(data=st.data())
    def end_turn(self, data: st.DataObject) -> None:
        session = data.draw(st.sampled_from(sorted(self.turns)))
        request = self.turns.pop(session)
        self.p.blocks.free(request.request_id)
        self.p.turn_ended(session, self.now, request.chunk_hashes)

    @rule(i=st.integers(0, 3), end=st.booleans(), expected=st.none() | st.floats(0.0, 20.0))
    def hint(self, i: int, end: bool, expected: float | None) -> None:
        session = self.SESSIONS[i]
        known = self.p.sessions.get(session) is not None
        result = self.p.hint(session, self.now, end, expected)
        assert result.known == known
        self.armed.pop(session, None)
        if result.armed is not None:
            assert result.armed.at >= self.now
            self.armed[session] = result.armed.ticket
        if end and known:
            assert session not in self.p.pinned and self.p.blocks.session_blocks(session) == []

    @precondition(lambda self: bool(self.armed))
    @rule(data=st.data(), dt=st.floats(0.0, 5.0))
    def begin(self, data: st.DataObject, dt: float) -> None:
        session = data.draw(st.sampled_from(sorted(self.armed)))
        self.now += dt
        request = self.p.begin(session, self.armed.pop(session), self.now)
        if isinstance(request, PrefillRequest):
            assert session not in self.reading  # one armed ticket per session: one read at a time
            self.reading[session] = request

    @precondition(lambda self: bool(self.reading))
    @rule(data=st.data(), in_pool=st.integers(0, 8))
    def staged(self, data: st.DataObject, in_pool: int) -> None:
        session = data.draw(st.sampled_from(sorted(self.reading)))
        request = self.reading.pop(session)
        plan = request.plan_lookup(min(in_pool, len(request.chunk_hashes)))
        request.apply_restore([plan.num_pool_chunks], self.p.blocks)
        result = self.p.staged(session, request, 0.1)
        state = self.p.sessions.get(session)
        assert result.hold == (request.num_restored_chunks > 0 and state is not None and not state.turns_in_flight)
        if not result.hold:
            self.p.blocks.free(request.request_id)

    @rule()
    def unpin_all(self) -> None:
        held = sorted(self.p.pinned.values())
        assert sorted(self.p.unpin_all()) == held and self.p.pinned == {}

    @invariant()
    def held_stagings_are_held_blocks_of_idle_sessions(self) -> None:
        for session, holder in self.p.pinned.items():
            state = self.p.sessions.get(session)
            assert self.p.blocks.has_holder(holder) and state is not None and not state.turns_in_flight
        assert len(set(self.p.pinned.values())) == len(self.p.pinned)

    @invariant()
    def the_ledger_adds_up_and_blocks_are_conserved(self) -> None:
        ledger = self.p.ledger
        assert ledger.used_bytes + ledger.wasted_bytes + ledger.pending_bytes == ledger.prefetched_bytes
        blocks = self.p.blocks
        assert sum(1 for b in blocks.blocks if b.ref_count == 0) == blocks.num_free_blocks
        assert self.p.num_armed <= len(self.p.sessions)


TestSessionPrefetchMachine = SessionPrefetchMachine.TestCase
TestSessionPrefetchMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
