"""The router's admission queue with a bypass budget (``--sched-max-bypass-s``): exact tickets and credits,
queued or taken at once, against the same scenarios without a budget."""

from __future__ import annotations

import math

import pytest

from kvpool.core.admission.admission import QueueOrder
from kvpool.core.admission.queue import AdmissionQueue, admission_work_s
from kvpool.core.errors import InvalidArgument
from tests.core.test_admission_order import admission, full, req

TURN_WORK = admission_work_s(120, 100)  # session s's next turn: 20 tokens beyond its 100
NEW_WORK = admission_work_s(150, 0)  # a newcomer's 150 tokens, all computed


def test_a_queued_turn_passes_an_older_newcomer_only_within_its_credit() -> None:
    assert TURN_WORK < NEW_WORK
    for max_bypass_s in (math.inf, 2 * TURN_WORK, TURN_WORK / 2):
        a = admission(QueueOrder.WORK, max_bypass_s=max_bypass_s)
        full(a)
        assert a.admit(req("new", prompt=150, base=9000), now=0.0) is None
        assert a.admit(req("turn", prompt=120, session="s"), now=1.0) is None
        assert a.queue.credit_s("new") == a.queue.credit_s("turn") == max_bypass_s
        # d1 frees its second region: room for the 120-token turn, not the 150-token newcomer
        admitted = [t.request_id for t in a.release("r3", now=2.0).tickets]
        if max_bypass_s >= TURN_WORK:  # no budget, or one that covers the turn: it passes, the newcomer pays
            assert admitted == ["turn"]
            assert a.queue.credit_s("new") == max_bypass_s - TURN_WORK
            assert a.queue.num_budget_pops == 0
            continue
        # the turn would overdraw the newcomer's credit: the newcomer is the head and holds it back
        assert admitted == [] and a.queue.head(2.0).request.request_id == "new"
        assert a.queue.credit_s("new") == TURN_WORK / 2
        assert [(t.request_id, t.shard) for t in a.release("r1", now=3.0).tickets] == [("new", "d1")]
        assert a.queue.num_budget_pops == 1  # the work order's first choice, the turn, was held back
        assert [(t.request_id, t.shard) for t in a.release("r2", now=4.0).tickets] == [("turn", "d0")]
        assert (a.queue.num_budget_pops, a.queue.num_overdue_pops) == (1, 0)


def test_a_request_takes_its_ticket_at_once_only_within_every_queued_credit_and_draws_on_them() -> None:
    for max_bypass_s, other_shard in ((math.inf, "d1"), (1.5 * TURN_WORK, None)):
        a = admission(QueueOrder.WORK, max_bypass_s=max_bypass_s)
        full(a)
        assert a.admit(req("new", prompt=150, base=9000), now=0.0) is None
        for done in ("r2", "r3"):  # room for 120 tokens on each shard, for 150 on neither
            assert a.release(done, now=1.0).tickets == []
        turn = a.admit(req("turn", prompt=120, session="s"), now=2.0)  # less work than the head, within budget
        assert turn is not None and turn.shard == "d0"
        assert a.queue.credit_s("new") == max_bypass_s - TURN_WORK  # as if it had been queued and popped
        # another 120-token prompt, computed whole: still less work than the newcomer, but more than its
        # credit left (half a turn's) with the budget
        assert admission_work_s(120, 0) < NEW_WORK
        other = a.admit(req("other", prompt=120, base=7000), now=2.0)
        assert (other.shard if other is not None else None) == other_shard, max_bypass_s
        if other is None:
            assert a.queued_ids() == ["new", "other"] and a.queue.head(2.0).request.request_id == "new"
            assert a.queue.credit_s("new") == TURN_WORK / 2


def test_the_queue_leads_and_takes_at_once_by_the_same_credits() -> None:
    q = AdmissionQueue(QueueOrder.WORK, math.inf, max_bypass_s=3.0)
    q.push(req("old"), 5.0, now=0.0, deadline=9.0)
    assert (q.leads(3.0, now=1.0), q.leads(3.5, now=1.0), q.leads(5.0, now=1.0)) == (True, False, False)
    with pytest.raises(InvalidArgument, match="does not lead") as error:
        q.take_at_once(req("young"), 3.5, now=1.0, deadline=9.0)  # nothing changes
    assert error.value.field == "request_id"
    assert ("young" not in q, q.credit_s("old"), q.head(1.0).request.request_id) == (True, 3.0, "old")
    q.take_at_once(req("young"), 2.0, now=1.0, deadline=9.0)
    assert (q.credit_s("old"), q.leads(1.0, now=1.0), q.leads(1.5, now=1.0)) == (1.0, True, False)
    assert (len(q), q.num_budget_pops) == (1, 0)  # it went first by the order: the budget held nobody back
    unbounded = AdmissionQueue(QueueOrder.WORK, math.inf)
    unbounded.push(req("old"), 5.0, now=0.0, deadline=9.0)
    assert (unbounded.max_bypass_s, unbounded.leads(4.9, now=1.0)) == (math.inf, True)
    fifo = AdmissionQueue(QueueOrder.FIFO, 4.0, max_bypass_s=0.0)  # FIFO overtakes nobody: no credit drawn
    assert fifo.leads(0.0, now=0.0)
    fifo.push(req("old"), 5.0, now=0.0, deadline=9.0)
    assert not fifo.leads(0.0, now=0.0)
    with pytest.raises(InvalidArgument, match="max_bypass_s") as error:
        AdmissionQueue(QueueOrder.WORK, 4.0, max_bypass_s=-1.0)
    assert error.value.field == "max_bypass_s"
