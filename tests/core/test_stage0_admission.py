"""Stage 0's admission steps and a session staging's restore (the core pieces stage 0 and the simulator both
run): exact transitions, and a Hypothesis state machine over the order of arrivals, stagings, reads,
failures, cancels and frees: after each request's and each staging's end nothing of it is held."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvpool.core.chunk_hash import ChunkHash
from kvpool.core.errors import RestoreFellShort
from kvpool.core.prefill.block_manager import BlockManager
from kvpool.core.prefill.driver import (
    Admitted,
    Forward,
    Freed,
    Lookup,
    PrefillDriver,
    Prefilled,
    ReleaseLease,
    RestoreOnStages,
    SavesThenFree,
    WaitForBlocks,
    save_holder,
)
from kvpool.core.prefill.stage0_admission import Stage0Admission, waits_for_blocks
from kvpool.core.sessions.prefetch import CANCELLED, ON_DEVICE, POOL_MISS, STAGED, TURN_CAME, SessionPrefetch
from kvpool.core.sessions.staging import FAILED, Staged, Staging
from kvpool.core.sessions.table import SessionId

A, B, D = SessionId("t", "a"), SessionId("t", "b"), SessionId("t", "d")
CHUNK = 4


def H(prefix: str, n: int) -> list[ChunkHash]:
    return [ChunkHash(f"{prefix}{i}") for i in range(n)]


def driver(blocks: BlockManager, request_id: str, hashes: list[ChunkHash], session: SessionId | None,
           pool: bool = False) -> PrefillDriver:
    return PrefillDriver(request_id, len(hashes) * CHUNK + 1, CHUNK, hashes, blocks, 10.0, session=session, pool=pool)


def served(admission: Stage0Admission, session: SessionId, hashes: list[ChunkHash], now: float,
           request_id: str) -> PrefillDriver:
    """A turn through stage 0 without a pool: arrives, is admitted (stagings yield), computes, ends."""
    admission.arrived(session, now)
    d = driver(admission.blocks, request_id, hashes, session)
    effects = admission.admit(d, now)
    if waits_for_blocks(effects):
        assert admission.short_of_blocks()
        effects = admission.admit(d, now)
    assert isinstance(effects[0], Admitted)
    admission.admitted(d.request)
    assert isinstance(effects[-1], Forward)
    effects = d.forward_ended(now)
    assert any(isinstance(e, Prefilled) for e in effects)
    assert isinstance(d.release()[0], Freed)
    if admission.prefetch is not None:
        admission.prefetch.turn_ended(session, now, hashes)
    return d


def lost_history() -> tuple[Stage0Admission, int]:
    """A's 3 chunks lost to D's 8 on a 10-block table, D ended: A armed for t=10 (its ticket)."""
    blocks = BlockManager(10, CHUNK)
    admission = Stage0Admission(blocks, SessionPrefetch(blocks, 100))
    served(admission, A, H("a", 3), 0.0, "r1")
    served(admission, D, H("d", 8), 1.0, "r2")
    assert admission.prefetch is not None
    admission.prefetch.hint(D, 2.0, True, None)
    armed = admission.prefetch.hint(A, 2.0, False, 10.0).armed
    assert armed is not None and blocks.match_prefix(H("a", 3)) == 1
    return admission, armed.ticket


# ---- the work estimate -------------------------------------------------------------


def test_the_work_estimate_counts_the_device_prefix_free_and_the_known_history_restored() -> None:
    from kvpool.core.prefill.queue import WorkWeights

    admission, _ = lost_history()  # A's 3 chunks known, 1 still on the device
    policy = admission.prefetch
    assert policy is not None
    weights = WorkWeights(chunk_tokens=CHUNK, chunk_base_s=1.0, per_context_token_s=0.0, restore_per_token_s=9.0)
    hashes = H("a", 4)
    # 17 tokens: 12 cached (3 chunks: 1 on the device, 2 restored at the measured 0.02 s a chunk), 5 computed at
    # a chunk-second per 4 tokens, times the host's factor 2
    assert admission.work_s(hashes, 17, A, weights, 2.0) == 2 * 5 / 4 + 2 * 0.02
    policy.observe_restore(2, 1.0)  # restores measured slower: the estimate follows (0.02 + 0.2 x (0.5 - 0.02))
    assert admission.work_s(hashes, 17, A, weights, 2.0) == 2 * 5 / 4 + 2 * (0.02 + 0.2 * (0.5 - 0.02))
    # no session (or one not known): only the device's prefix is free, nothing restored
    assert admission.work_s(hashes, 17, None, weights) == 13 / 4
    assert admission.work_s(hashes, 17, B, weights) == 13 / 4
    # no prefetch policy (the simulator's sched=fifo): no history known
    assert Stage0Admission(admission.blocks).work_s(hashes, 17, A, weights) == 13 / 4
    # a history that leaves off the prompt's prefix counts only as far as they agree
    assert admission.work_s(H("a", 2) + H("x", 2), 17, A, weights) == 9 / 4 + (0.02 + 0.2 * (0.5 - 0.02))


# ---- the staging ----------------------------------------------------------------


def test_a_staging_looks_up_reads_releases_its_lease_and_is_held_for_its_turn() -> None:
    admission, ticket = lost_history()
    policy, blocks = admission.prefetch, admission.blocks
    assert policy is not None
    staging = Staging(policy, A, ticket)
    [lookup] = staging.start(9.0)
    assert lookup == Lookup(tuple(H("a", 3)), 1)
    assert staging.looked_up(3, "7") == [RestoreOnStages()]
    effects = staging.read([2, 2], 0.4, corrupt_chunk_indexes=[2])
    assert effects == [ReleaseLease("7", (2,)), Staged(STAGED, True, 200)]
    assert policy.pinned == {A: "prefetch/2"} and blocks.has_holder("prefetch/2")
    assert staging.failed() == []  # over: nothing more to give back
    # the turn comes: the staging goes to it, its chunks are device hits
    d = served(admission, A, H("a", 4), 12.0, "r3")
    assert d.request.num_device_chunks == 3 and policy.pinned == {} and not blocks.has_holder("prefetch/2")


def test_a_pool_miss_frees_at_once_and_a_stale_ticket_or_a_turn_first_stages_nothing() -> None:
    admission, ticket = lost_history()
    policy, blocks = admission.prefetch, admission.blocks
    assert policy is not None
    assert Staging(policy, A, ticket + 1).start(9.0) == [Staged(CANCELLED)]
    staging = Staging(policy, A, ticket)
    assert isinstance(staging.start(9.0)[0], Lookup)
    assert staging.looked_up(0, "") == [Freed(("prefetch/2",)), Staged(POOL_MISS)]  # no lease, nothing read
    assert not blocks.has_holder("prefetch/2") and staging.outcome == POOL_MISS
    armed = policy.hint(A, 9.5, False, 1.0).armed
    assert armed is not None
    admission.arrived(A, 9.6)  # its turn first
    assert Staging(policy, A, armed.ticket).start(10.0) == [Staged(CANCELLED)]
    policy.turn_ended(A, 10.0, H("a", 3))
    armed = policy.hint(A, 10.0, False, 1.0).armed
    assert armed is not None
    admission.arrived(A, 10.1)
    assert policy.begin(A, armed.ticket, 10.2) == CANCELLED  # disarmed by its arrival
    assert TURN_CAME and ON_DEVICE  # (the policy's other outcomes: tests/core/test_session_prefetch.py)


def test_a_turn_arriving_during_the_read_gets_the_blocks_as_hits_and_the_staging_is_not_held() -> None:
    admission, ticket = lost_history()
    policy = admission.prefetch
    assert policy is not None
    staging = Staging(policy, A, ticket)
    staging.start(9.0)
    staging.looked_up(3, "7")
    admission.arrived(A, 9.2)
    effects = staging.read([2, 2], 0.3)
    assert effects == [ReleaseLease("7", ()), Freed(("prefetch/2",)), Staged(STAGED, False, 200)]
    assert policy.pinned == {}


def test_a_failed_read_releases_the_lease_once_and_frees_the_staging() -> None:
    admission, ticket = lost_history()
    policy, blocks = admission.prefetch, admission.blocks
    assert policy is not None
    staging = Staging(policy, A, ticket)
    staging.start(9.0)
    staging.looked_up(3, "7")
    assert staging.failed() == [ReleaseLease("7", ()), Freed(("prefetch/2",)), Staged(FAILED)]
    assert staging.failed() == [] and not blocks.has_holder("prefetch/2") and policy.pinned == {}
    failed_lookup = Staging(policy, A, ticket)  # the ticket is spent
    assert failed_lookup.start(9.0) == [Staged(CANCELLED)]


def test_without_a_pool_a_staging_stages_nothing() -> None:
    admission, ticket = lost_history()
    assert admission.prefetch is not None
    assert Staging(admission.prefetch, A, ticket).start(9.0, has_pool=False)[-1].outcome == "pressure"


# ---- the admission steps ------------------------------------------------------------


def test_the_gated_admission_touches_the_waiting_histories_in_serving_order_the_next_served_last_evicted() -> None:
    blocks = BlockManager(6, CHUNK)
    admission = Stage0Admission(blocks)
    served(admission, A, H("a", 2), 0.0, "ra")  # 3 blocks each: 2 cached + the partial
    served(admission, B, H("b", 2), 1.0, "rb")
    head = driver(blocks, "rd", H("d", 3), D)  # needs 4: two cached blocks are evicted
    effects = admission.admit(head, 2.0, serving=[D, B, A])  # A is served after B: A's are evicted first
    assert isinstance(effects[0], Admitted)
    assert blocks.match_prefix(H("b", 2)) == 2 and blocks.match_prefix(H("a", 2)) == 0


def test_a_request_short_of_blocks_takes_back_the_held_stagings_then_is_admitted() -> None:
    admission, ticket = lost_history()
    policy, blocks = admission.prefetch, admission.blocks
    assert policy is not None
    staging = Staging(policy, A, ticket)
    staging.start(9.0)
    staging.looked_up(3, "7")
    assert staging.read([2, 2], 0.1)[-1].held
    big = driver(blocks, "r9", H("c", 9), B)  # every block
    assert waits_for_blocks(admission.admit(big, 11.0))
    assert admission.short_of_blocks() == ["prefetch/2"]
    assert isinstance(admission.admit(big, 11.0)[0], Admitted)
    assert admission.short_of_blocks() == []  # nothing held: the next one waits for a free


def test_without_prefetch_the_admission_steps_are_the_drivers() -> None:
    blocks = BlockManager(4, CHUNK)
    admission = Stage0Admission(blocks)
    assert admission.arrived(A, 0.0) is None and admission.short_of_blocks() == []
    first = driver(blocks, "r1", H("a", 3), A)
    assert isinstance(admission.admit(first, 0.0)[0], Admitted)
    assert admission.admitted(first.request) == (0, 0)
    second = driver(blocks, "r2", H("b", 3), B)
    assert admission.admit(second, 0.5) == [WaitForBlocks(10.5)]
    first.forward_ended(1.0)
    first.release()
    assert isinstance(admission.admit(second, 1.0)[0], Admitted)


# ---- every order of events: nothing held after an end ----------------------------------------


class _First:
    """A draw that takes the first choice (the machine's own set-up)."""

    def __init__(self, machine: Stage0Machine) -> None:
        self.machine = machine

    def draw(self, strategy: object) -> str:
        return sorted(self.machine.requests)[0] if self.machine.requests else sorted(self.machine.saves)[0]


class Stage0Machine(RuleBasedStateMachine):
    """Requests (with a pool, saving) and stagings on one 10-block table; each rule feeds one event, its
    effects carried out at once except the ones that wait for an answer."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = BlockManager(10, CHUNK)
        self.policy = SessionPrefetch(self.blocks, 100)
        self.admission = Stage0Admission(self.blocks, self.policy)
        self.sessions = [SessionId("t", f"s{i}") for i in range(3)]
        self.now = 0.0
        self.n = 0
        self.requests: dict[str, PrefillDriver] = {}  # not ended
        self.ended: list[PrefillDriver] = []
        self.saves: set[str] = set()  # SavesThenFree not answered
        self.stagings: list[Staging] = []  # not ended
        self.staged: list[Staging] = []

    def _carry(self, d: PrefillDriver, effects: list) -> None:
        self.saves |= {e.holder for e in effects if isinstance(e, SavesThenFree)}
        if d.ended and self.requests.pop(d.request_id, None) is not None:
            self.ended.append(d)
            self.policy.turn_ended(d.session, self.now, d.chunk_hashes)  # its session may be staged now

    @initialize()
    def a_lost_history(self) -> None:
        """Session 0's 3 chunks are evicted by session 2's 8, which ended: a staging of session 0 finds room."""
        for i, n in ((0, 3), (2, 8)):
            self.arrive(i, n, 0.0)
            self.served_through(_First(self), 0)
            self.save_ends(_First(self))
        self.session_end(2)
        assert self.blocks.match_prefix(H("h0-", 3)) < 3 and not self.requests

    @staticmethod
    def _read(d: PrefillDriver) -> list[int]:
        """Every stage (two) read the planned pool chunks on the chain."""
        plan = d.request.restore_plan
        return [plan.num_pool_chunks] * 2 if plan is not None else []

    @rule(i=st.integers(0, 3), n=st.integers(1, 9), dt=st.floats(0.0, 2.0))
    def arrive(self, i: int, n: int, dt: float) -> None:
        """A turn of session ``i`` (3: none, whose prompt evicts others' histories) of ``n`` chunks."""
        session = self.sessions[i] if i < 3 else None
        if session is not None and any(d.session == session for d in self.requests.values()):
            return  # a session has one turn in flight
        self.now += dt
        self.n += 1
        self.admission.arrived(session, self.now)
        d = driver(self.blocks, f"r{self.n}", H(f"h{i}-", n), session, pool=True)
        self.requests[d.request_id] = d
        effects = self.admission.admit(d, self.now, serving=[session] if session else [])
        if waits_for_blocks(effects) and self.admission.short_of_blocks():
            effects += self.admission.admit(d, self.now)
        self._carry(d, effects)

    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        """The next answer a request waits for: blocks, its lookup, its forward's end or failure, its release."""
        if not self.requests:
            return
        d = self.requests[data.draw(st.sampled_from(sorted(self.requests)))]
        kind = d.step.value
        if kind == "waiting_blocks":
            effects = self.admission.admit(d, self.now)
        elif kind == "looking_up":
            effects = d.looked_up(data.draw(st.integers(0, 2)), data.draw(st.sampled_from(["", "9"])))
        elif kind == "forwarding":
            if data.draw(st.booleans()):
                effects = d.forward_ended(self.now, self._read(d))
            else:
                effects = d.forward_failed(RestoreFellShort("short"), self.now)
        elif kind == "prefilled":
            effects = d.release()
        else:
            return
        self._carry(d, effects)

    @rule(data=st.data(), found=st.integers(0, 9))
    def served_through(self, data: st.DataObject, found: int) -> None:
        """A request's answers all come at once: its lookup (``found`` groups), its forward, its release."""
        if not self.requests:
            return
        d = self.requests[data.draw(st.sampled_from(sorted(self.requests)))]
        for _ in range(4):
            step = d.step.value
            effects = (d.looked_up(found, "9") if step == "looking_up" else d.forward_ended(self.now, self._read(d))
                       if step == "forwarding" else d.release() if step == "prefilled" else None)
            if effects is None:
                break
            self._carry(d, effects)

    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        if self.requests:
            d = self.requests[data.draw(st.sampled_from(sorted(self.requests)))]
            self._carry(d, d.cancel())

    @rule(data=st.data())
    def save_ends(self, data: st.DataObject) -> None:
        if self.saves:
            holder = data.draw(st.sampled_from(sorted(self.saves)))
            self.saves.discard(holder)
            d = self.requests.get(holder.removesuffix("/save")) or next(
                e for e in self.ended if save_holder(e.request_id) == holder)
            self._carry(d, d.saves_ended(holder, self.now))

    @rule(i=st.integers(0, 2), expected=st.floats(0.0, 3.0), end_others=st.booleans())
    def hint_and_stage(self, i: int, expected: float, end_others: bool) -> None:
        """A hint for idle session ``i`` and its staging's start (``end_others``: the other idle sessions end
        first, their blocks uncached: room for it)."""
        busy = {d.session for d in self.requests.values()}
        if self.sessions[i] in busy:
            return  # hints come after a turn's end
        for other in self.sessions if end_others else ():
            if other != self.sessions[i] and other not in busy:
                self.policy.hint(other, self.now, True, None)
        result = self.policy.hint(self.sessions[i], self.now, False, expected)
        if result.armed is not None:
            staging = Staging(self.policy, self.sessions[i], result.armed.ticket)
            effects = staging.start(result.armed.at)
            (self.staged if staging.ended else self.stagings).append(staging)
            assert staging.ended or isinstance(effects[0], Lookup)

    @rule(i=st.integers(0, 2))
    def session_end(self, i: int) -> None:
        """The client ends session ``i``: its cached blocks are uncached (room for others' stagings)."""
        if not any(d.session == self.sessions[i] for d in self.requests.values()):
            self.policy.hint(self.sessions[i], self.now, True, None)

    @rule(data=st.data())
    def staging_step(self, data: st.DataObject) -> None:
        if not self.stagings:
            return
        staging = data.draw(st.sampled_from(self.stagings))
        how = data.draw(st.sampled_from(["answer", "fail"]))
        if how == "fail":
            staging.failed()
        elif staging.lease_id == "" and staging.request is not None and staging.request.restore_plan is None:
            staging.looked_up(data.draw(st.integers(0, 3)), data.draw(st.sampled_from(["", "5"])))
        else:
            n = data.draw(st.integers(0, 3))
            staging.read([n, n], 0.1)
        if staging.ended:
            self.stagings.remove(staging)
            self.staged.append(staging)

    @invariant()
    def nothing_held_after_an_end(self) -> None:
        for d in self.ended:
            if save_holder(d.request_id) not in self.saves:
                assert not self.blocks.has_holder(d.request_id) and not self.blocks.has_holder(
                    save_holder(d.request_id)), d.request_id
        held = set(self.policy.pinned.values())
        for staging in self.staged:
            assert staging.lease_id == ""  # a lease it got went back
            if staging.request is not None and staging.request.request_id not in held:
                assert not self.blocks.has_holder(staging.request.request_id)


TestStage0Machine = Stage0Machine.TestCase
TestStage0Machine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
