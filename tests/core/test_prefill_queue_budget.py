"""The prefill queue's bypass budget: exact pops and debits, and its bound on every wait (a state machine and
a single-server replay against FIFO)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvpool.core.errors import InvalidArgument
from kvpool.core.prefill.queue import PrefillQueue, QueueOrder


def budgeted(order: QueueOrder, works: list[float], max_bypass_s: float, max_wait_s: float = math.inf) -> PrefillQueue:
    queue = PrefillQueue(order, max_wait_s, max_bypass_s)
    for i, work in enumerate(works):
        queue.push(f"r{i}", work, now=float(i))
    return queue


def test_overtaking_debits_every_older_request_and_an_exhausted_one_goes_next() -> None:
    queue = budgeted(QueueOrder.WORK, [5.0, 1.0, 1.0, 1.0], max_bypass_s=2.0)
    assert queue.pop(4.0) == "r1"  # least work; r0 is overtaken
    assert [queue.credit_s(r) for r in ("r0", "r2", "r3")] == [1.0, 2.0, 2.0]  # only the older is debited
    assert queue.pop(4.0) == "r2"
    assert queue.credit_s("r0") == 0.0
    assert queue.serving_order(4.0) == ["r0", "r3"]
    assert queue.pop(4.0) == "r0"  # r3 would overdraw r0: the budget holds it back
    assert (queue.num_budget_pops, queue.num_overdue_pops) == (1, 0)
    assert queue.pop(4.0) == "r3" and queue.num_budget_pops == 1


def test_a_request_may_overtake_only_if_every_older_credit_covers_its_work() -> None:
    queue = budgeted(QueueOrder.WORK, [10.0, 1.0, 2.5, 0.5], max_bypass_s=3.0)
    assert queue.serving_order(4.0) == ["r3", "r1", "r0", "r2"]
    assert queue.pop(4.0) == "r3"  # every older (r0, r1, r2) debited 0.5
    assert [queue.credit_s(r) for r in ("r0", "r1", "r2")] == [2.5, 2.5, 2.5]
    assert queue.pop(4.0) == "r1"  # r0 debited 1: 1.5 left, r2 not (younger)
    assert [queue.credit_s(r) for r in ("r0", "r2")] == [1.5, 2.5]
    assert queue.pop(4.0) == "r0"  # r2's 2.5 > r0's 1.5
    assert queue.pop(4.0) == "r2"
    assert queue.num_budget_pops == 1


def test_a_zero_budget_is_arrival_order_but_for_requests_with_no_work() -> None:
    queue = budgeted(QueueOrder.WORK, [3.0, 2.0, 0.0, 1.0], max_bypass_s=0.0)
    assert [queue.pop(5.0) for _ in range(4)] == ["r2", "r0", "r1", "r3"]
    assert queue.num_budget_pops == 2  # r1 and r3 were each the least work when r0, then r1 went


def test_ratio_order_within_the_budget() -> None:
    queue = budgeted(QueueOrder.RATIO, [5.0, 1.0, 3.0, 1.0], max_bypass_s=1.5)  # pushed at 0, 1, 2, 3
    # at 4 s ratios: r0 1.8, r1 4.0, r2 1.67, r3 2.0 (test_prefill_queue); r1 overtakes r0 (credit 0.5 left),
    # then r3 (work 1) would overdraw r0: r0 goes, and then r3 before r2
    assert queue.serving_order(4.0) == ["r1", "r0", "r3", "r2"]
    assert [queue.pop(4.0) for _ in range(4)] == ["r1", "r0", "r3", "r2"]
    assert queue.num_budget_pops == 1


def test_aging_still_puts_the_overdue_first_and_they_overtake_nobody() -> None:
    queue = budgeted(QueueOrder.WORK, [9.0, 8.0, 1.0], max_bypass_s=100.0, max_wait_s=10.0)  # pushed at 0, 1, 2
    assert queue.pop(10.0) == "r0" and queue.num_overdue_pops == 1  # overdue: oldest first
    assert [queue.credit_s(r) for r in ("r1", "r2")] == [100.0, 100.0]
    assert queue.pop(10.5) == "r2" and queue.credit_s("r1") == 99.0


def test_an_infinite_budget_is_the_order_alone_and_fifo_ignores_the_budget() -> None:
    free = budgeted(QueueOrder.WORK, [5.0, 1.0, 3.0, 1.0], max_bypass_s=math.inf)
    assert [free.pop(4.0) for _ in range(4)] == ["r1", "r3", "r2", "r0"]
    fifo = budgeted(QueueOrder.FIFO, [5.0, 1.0, 3.0], max_bypass_s=0.0)
    assert [fifo.pop(3.0) for _ in range(3)] == ["r0", "r1", "r2"] and fifo.num_budget_pops == 0


def test_a_newcomer_leads_only_where_its_pop_would_come_first() -> None:
    queue = budgeted(QueueOrder.WORK, [5.0, 1.0], max_bypass_s=2.0, max_wait_s=10.0)  # pushed at 0 and 1
    # less work than the head (r1) and within every credit; as much as the head (the earlier wins); more
    # than a credit
    assert [queue.leads(w, now=2.0) for w in (0.5, 1.0)] == [True, False]
    assert queue.pop(2.0) == "r1" and queue.credit_s("r0") == 1.0
    assert [queue.leads(w, now=2.0) for w in (1.0, 1.5)] == [True, False]
    assert not queue.leads(0.0, now=10.0)  # r0 is overdue: it goes first
    assert budgeted(QueueOrder.WORK, [5.0], max_bypass_s=math.inf).leads(4.0, now=1.0)
    assert budgeted(QueueOrder.WORK, [], max_bypass_s=0.0).leads(9.0, now=0.0)  # empty: anyone
    # FIFO and RATIO: a newcomer's ratio is 1 at most, a waiting request's more: neither lets it lead
    for order in (QueueOrder.FIFO, QueueOrder.RATIO):
        assert not budgeted(order, [5.0], max_bypass_s=math.inf).leads(0.0, now=1.0)
    queue.push("x", 1.0, 2.0)
    assert queue.pop(2.0) == "x" and queue.credit_s("r0") == 0.0  # what ``leads`` said: its pop comes first


def test_bad_budget_and_work() -> None:
    with pytest.raises(InvalidArgument, match="max_bypass_s"):
        PrefillQueue(QueueOrder.WORK, 4.0, -1.0)
    with pytest.raises(InvalidArgument, match="max_bypass_s"):
        PrefillQueue(QueueOrder.WORK, 4.0, math.nan)
    with pytest.raises(InvalidArgument, match="work"):
        PrefillQueue(QueueOrder.WORK, 4.0, 2.0).push("x", math.inf, 0.0)


def replay_waits(queue: PrefillQueue, arrivals: list[tuple[float, float]]) -> list[float]:
    """One server that serves each popped request for exactly its work, never idle while one waits: each
    request's wait, by arrival index."""
    waits = [0.0] * len(arrivals)
    free_at = clock = 0.0
    i = 0
    while i < len(arrivals) or len(queue):
        if i < len(arrivals) and (not len(queue) or arrivals[i][0] <= free_at):
            clock = arrivals[i][0]
            queue.push(str(i), arrivals[i][1], clock)
            i += 1
            continue
        now = max(free_at, clock)
        j = int(queue.pop(now))
        waits[j] = now - arrivals[j][0]
        free_at = now + arrivals[j][1]
    return waits


@settings(max_examples=200, deadline=None)
@given(gaps=st.lists(st.floats(0, 3), min_size=1, max_size=40), data=st.data(),
       order=st.sampled_from([QueueOrder.WORK, QueueOrder.RATIO]), max_bypass_s=st.floats(0, 20),
       max_wait_s=st.sampled_from([math.inf, 5.0, 15.0]))
def test_no_request_waits_more_than_under_fifo_plus_the_budget(gaps: list[float], data: st.DataObject,
                                                                order: QueueOrder, max_bypass_s: float,
                                                                max_wait_s: float) -> None:
    works = data.draw(st.lists(st.floats(0, 10), min_size=len(gaps), max_size=len(gaps)))
    times = [sum(gaps[: k + 1]) for k in range(len(gaps))]
    arrivals = list(zip(times, works))
    fifo = replay_waits(PrefillQueue(QueueOrder.FIFO), arrivals)
    ordered = replay_waits(PrefillQueue(order, max_wait_s, max_bypass_s), arrivals)
    for k in range(len(arrivals)):
        assert ordered[k] <= fifo[k] + max_bypass_s + 1e-6 * (1 + fifo[k])


class BudgetMachine(RuleBasedStateMachine):
    """Random pushes, pops and removals: every pop is the least work the credits allow, no credit goes
    negative, and the work popped while a request waits is at most the work queued at its push plus the budget."""

    BUDGET = 4.0

    def __init__(self) -> None:
        super().__init__()
        self.queue = PrefillQueue(QueueOrder.WORK, math.inf, self.BUDGET)
        # id -> [work, push index, work queued at its push, work popped since, of it by younger requests,
        # its credit debited as the queue does it]
        self.model: dict[str, list[float]] = {}
        self.pushes = 0

    @rule(work=st.floats(0, 5))
    def push(self, work: float) -> None:
        request_id = f"r{self.pushes}"
        ahead = sum(m[0] for m in self.model.values())
        self.queue.push(request_id, work, 0.0)
        self.model[request_id] = [work, self.pushes, ahead, 0.0, 0.0, self.BUDGET]
        self.pushes += 1

    @precondition(lambda self: self.model)
    @rule()
    def pop(self) -> None:
        queued = sorted(self.model.items(), key=lambda kv: kv[1][1])
        allowed = [(m[0], m[1], r) for k, (r, m) in enumerate(queued)
                   if all(m[0] <= older[5] for _, older in queued[:k])]
        got = self.queue.pop(0.0)
        assert got == min(allowed)[2]
        work, index, ahead, served, overtaken, _ = self.model.pop(got)
        assert served <= ahead + self.BUDGET + 1e-9 and overtaken <= self.BUDGET + 1e-9
        for m in self.model.values():
            m[3] += work
            if m[1] < index:
                m[4] += work
                m[5] -= work

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def remove(self, data: st.DataObject) -> None:
        request_id = data.draw(st.sampled_from(sorted(self.model)))
        assert self.queue.remove(request_id)
        del self.model[request_id]

    @invariant()
    def credits_are_the_budget_less_what_overtook(self) -> None:
        for request_id, m in self.model.items():
            assert self.queue.credit_s(request_id) == m[5] >= 0
            assert m[5] == pytest.approx(self.BUDGET - m[4], abs=1e-9)

    @invariant()
    def serving_order_is_the_pops_to_come(self) -> None:
        order = self.queue.serving_order(0.0)
        assert sorted(order) == sorted(self.model)
        assert (order[0] if order else None) == self.queue.peek(0.0)


TestBudgetMachine = BudgetMachine.TestCase
