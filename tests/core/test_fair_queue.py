"""The fair queue between tenants (``kvpool.core.prefill.fair_queue``): start-time fair queuing by weight over
estimated work, composed with each tenant's own order, aging and budget."""

from __future__ import annotations

import copy
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvpool.core.errors import InvalidArgument
from kvpool.core.prefill.fair_queue import FairQueue
from kvpool.core.prefill.queue import PrefillQueue, QueueOrder
from kvpool.core.tenancy.shares import TenantShares


def drain(queue: FairQueue, now: float = 0.0) -> list[str]:
    return [queue.pop(now) for _ in range(len(queue))]


def test_a_turn_waits_behind_one_flood_request_not_the_flood() -> None:
    q = FairQueue()
    for i in range(10):
        q.push(f"flood{i}", 10.0, 0.0, tenant="bob")
    q.push("turn", 0.1, 1.0, tenant="alice")
    # both tags start at 0: the tie goes to bob, whose oldest came first; then alice's tag (0) is bob's least
    assert drain(q)[:3] == ["flood0", "turn", "flood1"]


def test_a_flood_alone_moves_virtual_time_so_a_newcomer_goes_next_and_the_flood_owes_nothing() -> None:
    q = FairQueue()
    for i in range(5):
        q.push(f"b{i}", 2.0, 0.0, tenant="bob")
    assert q.pop(0.0) == "b0" and q.pop(0.0) == "b1"  # bob alone: every pop is his (work-conserving)
    assert q.virtual_time == 2.0 and q.tag("bob") == 4.0
    q.push("a0", 1.0, 0.0, tenant="alice")
    assert q.tag("alice") == 2.0  # starts now: no credit for having been idle
    q.push("a1", 1.0, 0.0, tenant="alice")
    # alice 2 -> 3 -> 4; bob at 4: the tie goes to bob, whose oldest waiting came first
    assert drain(q) == ["a0", "a1", "b2", "b3", "b4"]


def test_weights_share_pops_in_proportion_while_both_wait() -> None:
    q = FairQueue(shares=TenantShares({"alice": 3.0}))
    for i in range(30):
        q.push(f"a{i}", 1.0, 0.0, tenant="alice")
        q.push(f"b{i}", 1.0, 0.0, tenant="bob")
    first = drain(q)[:40]
    assert sum(r.startswith("a") for r in first) == 30 and sum(r.startswith("b") for r in first) == 10
    for k in range(4, 41, 4):  # in every prefix: three of alice's per one of bob's, within one request
        window = first[:k]
        assert abs(sum(r.startswith("a") for r in window) - 3 * sum(r.startswith("b") for r in window)) <= 3


def test_shares_are_of_work_not_of_requests() -> None:
    q = FairQueue()
    for i in range(4):
        q.push(f"big{i}", 4.0, 0.0, tenant="bob")
    for i in range(16):
        q.push(f"small{i}", 1.0, 0.0, tenant="alice")
    order = drain(q)
    # after bob's first big one (tie to the earlier push), alice's four small ones match it
    assert order[:6] == ["big0", "small0", "small1", "small2", "small3", "big1"]


def test_aging_and_the_work_order_act_within_a_tenant() -> None:
    q = FairQueue(QueueOrder.WORK, max_wait_s=5.0)
    q.push("b-old", 9.0, 0.0, tenant="bob")
    q.push("b-small", 1.0, 0.0, tenant="bob")
    q.push("a0", 3.0, 6.0, tenant="alice")
    q.push("a1", 2.0, 6.0, tenant="alice")
    # at 10 bob's are overdue (within bob the oldest first), alice's not (least work first)
    assert q.pop(10.0) == "b-old"  # (tie at tag 0: bob's oldest came first)
    assert q.pop(10.0) == "a1" and q.pop(10.0) == "a0"  # bob's overdue one waits for his share
    assert q.pop(10.0) == "b-small"
    assert q.num_overdue_pops == 2  # both of bob's


def test_overdue_flood_requests_do_not_pass_a_waiting_turn() -> None:
    q = FairQueue(QueueOrder.WORK, max_wait_s=1.0)
    for i in range(6):
        q.push(f"flood{i}", 5.0, 0.0, tenant="bob")
    assert q.pop(100.0) == "flood0"
    q.push("turn", 0.1, 100.0, tenant="alice")
    assert q.pop(100.0) == "turn"  # every flood request is overdue, and bob's tag is ahead


def test_the_backlog_gate_is_each_tenants_own() -> None:
    q = FairQueue(QueueOrder.WORK, max_wait_s=math.inf, reorder_below_s=10.0)
    for i in range(5):
        q.push(f"flood{i}", 5.0, 0.0, tenant="bob")  # bob's backlog is past the gate: his go in order
    q.push("a-big", 3.0, 0.0, tenant="alice")
    q.push("a-small", 1.0, 0.0, tenant="alice")  # alice's is under it: least work first
    assert drain(q)[:3] == ["flood0", "a-small", "a-big"]


def test_with_fair_off_tenants_share_one_order() -> None:
    q = FairQueue(fair=False)
    for i in range(3):
        q.push(f"b{i}", 10.0, 0.0, tenant="bob")
    q.push("a", 0.1, 0.0, tenant="alice")
    assert drain(q) == ["b0", "b1", "b2", "a"]


def test_leads_says_whether_a_push_would_be_the_next_pop() -> None:
    q = FairQueue()
    assert q.leads(5.0, 0.0, "alice")  # empty
    q.push("b0", 5.0, 0.0, tenant="bob")
    assert not q.leads(1.0, 0.0, "alice")  # tie at tag 0: bob's came first
    assert q.pop(0.0) == "b0"
    q.push("b1", 5.0, 0.0, tenant="bob")
    assert q.leads(1.0, 0.0, "alice")  # bob is at 5, alice would start at V = 0
    assert not q.leads(1.0, 0.0, "bob")  # FIFO within bob: behind b1


def test_undo_right_after_a_pop_restores_everything_and_a_later_one_loses_nothing() -> None:
    q = FairQueue()
    q.push("b0", 4.0, 0.0, tenant="bob")
    q.push("a0", 1.0, 0.0, tenant="alice")
    before = (q.tag("bob"), q.tag("alice"), q.virtual_time)
    assert q.pop(0.0, undoable=True) == "b0"
    assert q.undo("b0") and not q.undo("b0")
    assert (q.tag("bob"), q.tag("alice"), q.virtual_time) == before and q.ids() == ["b0", "a0"]
    assert q.pop(0.0, undoable=True) == "b0"
    assert q.pop(0.0) == "a0"  # a pop since: b0's undo takes its work back from bob's tag only
    assert q.undo("b0") and q.ids() == ["b0"] and q.tag("bob") == 0.0  # its tag before, V not passed
    assert q.pop(0.0) == "b0" and not len(q)
    q.settle("b0")  # nothing to settle: no error


def test_push_refuses_a_duplicate_and_a_bad_work_and_pop_an_empty_queue() -> None:
    q = FairQueue()
    q.push("r", 1.0, 0.0, tenant="alice")
    with pytest.raises(InvalidArgument):
        q.push("r", 1.0, 0.0, tenant="bob")
    with pytest.raises(InvalidArgument):
        q.push("s", -1.0, 0.0)
    assert q.ids() == ["r"] and q.remove("r") and not q.remove("r")
    with pytest.raises(InvalidArgument):
        q.pop(0.0)
    with pytest.raises(InvalidArgument):
        FairQueue(QueueOrder.WORK, max_wait_s=0.0)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 5), st.floats(0, 3), st.booleans()), max_size=30),
       st.sampled_from([(QueueOrder.FIFO, 30.0, math.inf), (QueueOrder.WORK, 4.0, math.inf),
                        (QueueOrder.WORK, 4.0, 2.0), (QueueOrder.RATIO, 4.0, math.inf)]))
def test_one_tenant_pops_exactly_as_its_prefill_queue(steps: list[tuple[float, float, bool]],
                                                       order: tuple[QueueOrder, float, float]) -> None:
    fair, plain = FairQueue(*order), PrefillQueue(*order)
    now = 0.0
    for i, (work, gap, pop) in enumerate(steps):
        now += gap
        fair.push(f"r{i}", work, now, tenant="alice")
        plain.push(f"r{i}", work, now)
        if pop:
            assert fair.pop(now) == plain.pop(now)
    assert drain(fair, now) == [plain.pop(now) for _ in range(len(plain))]


WEIGHTS = {"a": 1.0, "b": 2.0, "c": 3.0}


class FairMachine(RuleBasedStateMachine):
    """Random pushes by three tenants of weights 1, 2 and 3, pops (some undone at once), removals and time
    passing, in each tenant's work order with aging and a budget.

    Checked: every pushed id leaves exactly once (popped or removed); at every pop of a request r of
    tenant A, for every other tenant B, B's work popped while r waited is at most
    (φ_B/φ_A)·(W_A + w_A) + w_B (the module doc's bound); ``leads`` is what a push then a peek says;
    ``serving_order`` is the pops to come."""

    def __init__(self) -> None:
        super().__init__()
        self.queue = FairQueue(QueueOrder.WORK, max_wait_s=5.0, max_bypass_s=3.0, shares=TenantShares(WEIGHTS))
        self.now = 0.0
        self.pushes = 0
        self.queued: dict[str, tuple[str, float]] = {}  # id -> (tenant, work)
        self.left: set[str] = set()
        self.events: list[tuple[str, str, str, float]] = []  # ("push" | "pop", id, tenant, work)

    @rule(tenant=st.sampled_from(sorted(WEIGHTS)), work=st.floats(0, 4))
    def push(self, tenant: str, work: float) -> None:
        request_id = f"r{self.pushes}"
        self.pushes += 1
        self.queue.push(request_id, work, self.now, tenant)
        self.queued[request_id] = (tenant, work)
        self.events.append(("push", request_id, tenant, work))

    @rule(seconds=st.floats(0, 3))
    def wait(self, seconds: float) -> None:
        self.now += seconds

    @precondition(lambda self: self.queued)
    @rule()
    def pop(self) -> None:
        request_id = self.queue.pop(self.now)
        assert request_id in self.queued and request_id not in self.left  # no id twice, none invented
        tenant, work = self.queued.pop(request_id)
        self.left.add(request_id)
        self.check_bound(request_id, tenant)
        self.events.append(("pop", request_id, tenant, work))

    @precondition(lambda self: self.queued)
    @rule()
    def pop_undone(self) -> None:
        before = (copy.deepcopy(self.queue.ids()), {t: self.queue.tag(t) for t in WEIGHTS}, self.queue.virtual_time)
        request_id = self.queue.pop(self.now, undoable=True)
        assert self.queue.undo(request_id)
        assert (self.queue.ids(), {t: self.queue.tag(t) for t in WEIGHTS}, self.queue.virtual_time) == before
        assert self.queue.peek(self.now) == request_id

    @precondition(lambda self: self.queued)
    @rule(data=st.data())
    def remove(self, data: st.DataObject) -> None:
        request_id = data.draw(st.sampled_from(sorted(self.queued)))
        assert self.queue.remove(request_id)
        del self.queued[request_id]
        self.left.add(request_id)

    def check_bound(self, request_id: str, tenant: str) -> None:
        pushed = next(i for i, e in enumerate(self.events) if e[0] == "push" and e[1] == request_id)
        earlier = [e for e in self.events[:pushed] if e[0] == "pop" and e[2] == tenant]
        w_a = earlier[-1][3] if earlier else 0.0
        during = [e for e in self.events[pushed:] if e[0] == "pop"]
        own = math.fsum(e[3] for e in during if e[2] == tenant)
        for other in WEIGHTS:
            if other == tenant:
                continue
            theirs = [e[3] for e in during if e[2] == other]
            if theirs:
                bound = WEIGHTS[other] / WEIGHTS[tenant] * (own + w_a) + max(theirs)
                assert math.fsum(theirs) <= bound + 1e-9, (request_id, tenant, other, theirs, own, w_a)

    @invariant()
    def nothing_lost(self) -> None:
        assert sorted(self.queue.ids()) == sorted(self.queued) and len(self.queue) == len(self.queued)
        assert not set(self.queued) & self.left

    @rule(tenant=st.sampled_from(sorted(WEIGHTS)), work=st.sampled_from([0.0, 1.0, 4.0]) | st.floats(0, 4))
    def leads_is_a_push_then_a_peek(self, tenant: str, work: float) -> None:
        """(A rule, not an invariant: one tenant and work a step, where checking every pair each step made
        this machine a quarter of the fast tier's time.)"""
        trial = copy.deepcopy(self.queue)
        trial.push("probe", work, self.now, tenant)
        assert self.queue.leads(work, self.now, tenant) == (trial.peek(self.now) == "probe")

    @invariant()
    def serving_order_is_the_pops_to_come(self) -> None:
        trial = copy.deepcopy(self.queue)
        assert self.queue.serving_order(self.now) == drain(trial, self.now)


FairMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestFairMachine = FairMachine.TestCase
