"""The queue in front of prefill: FIFO, work-aware order, aging's bound, exact pops; a state machine."""

from __future__ import annotations

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvpool.core.errors import InvalidArgument
from kvpool.core.prefill.queue import PrefillQueue, QueueOrder, WorkWeights, prefill_work_s


def filled(order: QueueOrder, works: list[float], max_wait_s: float = 10.0) -> PrefillQueue:
    queue = PrefillQueue(order, max_wait_s)
    for i, work in enumerate(works):
        queue.push(f"r{i}", work, now=float(i))
    return queue


def test_fifo_pops_in_arrival_order_whatever_the_work() -> None:
    queue = filled(QueueOrder.FIFO, [5.0, 1.0, 3.0])
    assert [queue.pop(3.0) for _ in range(3)] == ["r0", "r1", "r2"]
    assert queue.peek(3.0) is None


def test_work_order_pops_least_work_first_ties_by_arrival() -> None:
    queue = filled(QueueOrder.WORK, [5.0, 1.0, 3.0, 1.0])
    assert [queue.pop(4.0) for _ in range(4)] == ["r1", "r3", "r2", "r0"]
    assert queue.num_overdue_pops == 0


def test_aging_puts_overdue_requests_first_oldest_first() -> None:
    queue = filled(QueueOrder.WORK, [9.0, 8.0, 1.0], max_wait_s=10.0)  # pushed at 0, 1, 2
    assert queue.peek(9.9) == "r2"
    assert queue.pop(10.0) == "r0"  # waited 10 s: overdue, before the least work
    assert queue.pop(10.5) == "r2"  # r1 has waited 9.5 s: not yet
    assert queue.pop(11.0) == "r1"
    assert queue.num_overdue_pops == 2


def test_serving_order_is_the_pop_order_as_of_now() -> None:
    queue = filled(QueueOrder.WORK, [9.0, 8.0, 1.0, 8.0], max_wait_s=10.0)  # pushed at 0, 1, 2, 3
    assert queue.serving_order(9.9) == ["r2", "r1", "r3", "r0"]  # least work, ties by arrival
    assert queue.serving_order(11.0) == ["r0", "r1", "r2", "r3"]  # r0 and r1 overdue: oldest first
    assert [queue.pop(11.0) for _ in range(4)] == ["r0", "r1", "r2", "r3"]
    fifo = filled(QueueOrder.FIFO, [5.0, 1.0, 3.0])
    assert fifo.serving_order(0.0) == ["r0", "r1", "r2"]


def test_ratio_order_pops_the_highest_response_ratio_its_wait_ages_every_request() -> None:
    queue = filled(QueueOrder.RATIO, [5.0, 1.0, 3.0, 1.0])  # pushed at 0, 1, 2, 3
    # at 4 s: r0 (4 + 5) / 5 = 1.8, r1 4.0, r2 (2 + 3) / 3 = 1.67, r3 2.0; least work alone would take r2 before r0
    assert queue.serving_order(4.0) == ["r1", "r3", "r0", "r2"]
    assert [queue.pop(4.0) for _ in range(4)] == ["r1", "r3", "r0", "r2"]
    queue = PrefillQueue(QueueOrder.RATIO, max_wait_s=10_000.0)
    queue.push("long", 100.0, now=0.0)
    queue.push("short", 1.0, now=999.5)
    queue.push("empty", 0.0, now=999.9)  # below the floor: counts as 1 ms of work, (0.1 + 0) / 0.001 = 100
    assert queue.pop(1000.0) == "empty"
    assert queue.pop(1000.0) == "long"  # (1000 + 100) / 100 = 11 against (0.5 + 1) / 1 = 1.5
    assert queue.pop(1000.0) == "short" and queue.num_overdue_pops == 0
    queue.push("a", 2.0, now=0.0)
    queue.push("b", 2.0, now=0.0)
    assert queue.pop(1.0) == "a"  # a tie: by arrival
    # aging as in WORK: past max_wait_s the oldest goes first, whatever the ratios
    aged = filled(QueueOrder.RATIO, [50.0, 0.5], max_wait_s=5.0)  # pushed at 0, 1
    assert aged.serving_order(4.0) == ["r1", "r0"] and aged.serving_order(5.0) == ["r0", "r1"]
    assert aged.pop(5.0) == "r0" and aged.num_overdue_pops == 1


def test_the_backlog_gate_pops_in_arrival_order_while_the_queued_work_is_deep() -> None:
    queue = PrefillQueue(QueueOrder.WORK, max_wait_s=100.0, reorder_below_s=10.0)
    for i, work in enumerate([6.0, 1.0, 5.0, 2.0]):  # 14 s queued: at or over the gate
        queue.push(f"r{i}", work, now=float(i))
    assert queue.queued_work_s == 14.0
    assert queue.serving_order(4.0) == ["r0", "r1", "r2", "r3"] and queue.peek(4.0) == "r0"
    assert not queue.leads(0.5, 4.0)  # nobody overtakes while the backlog is deep
    assert queue.pop(4.0) == "r0"  # 8 s left: under the gate, least work first again
    assert queue.queued_work_s == 8.0
    assert queue.leads(0.5, 4.0) and not queue.leads(2.0, 4.0)  # 8 + 2 would reach the gate: in line
    assert [queue.pop(4.0) for _ in range(3)] == ["r1", "r3", "r2"]
    assert (queue.num_backlog_pops, queue.num_overdue_pops, queue.queued_work_s) == (1, 0, 0.0)
    queue.push("a", 12.0, now=5.0)
    assert queue.remove("a") and queue.queued_work_s == 0.0
    with pytest.raises(InvalidArgument, match="reorder_below_s"):
        PrefillQueue(QueueOrder.WORK, reorder_below_s=0.0)


def test_remove_and_repush_of_an_id() -> None:
    queue = filled(QueueOrder.WORK, [1.0, 2.0])
    assert queue.remove("r0") and not queue.remove("r0")
    queue.push("r0", 3.0, now=5.0)  # its old heap entry must not count
    assert [queue.pop(5.0), queue.pop(5.0)] == ["r1", "r0"]
    assert len(queue) == 0


def test_bad_calls() -> None:
    queue = filled(QueueOrder.WORK, [1.0])
    with pytest.raises(InvalidArgument, match="request_id"):
        queue.push("r0", 1.0, 0.0)
    with pytest.raises(InvalidArgument, match="work"):
        queue.push("x", -1.0, 0.0)
    with pytest.raises(InvalidArgument, match="max_wait_s"):
        PrefillQueue(QueueOrder.WORK, 0.0)
    queue.pop(0.0)
    with pytest.raises(InvalidArgument, match="empty"):
        queue.pop(0.0)


def test_work_counts_compute_at_its_context_and_restore() -> None:
    weights = WorkWeights(chunk_tokens=256, chunk_base_s=0.001, per_context_token_s=1e-8, restore_per_token_s=1e-6)
    # 512 computed after 1024 cached (mean context 1280), 1024 restored
    assert prefill_work_s(1536, 1024, 1024, weights) == pytest.approx(512 * (0.001 + 1e-8 * 1280) / 256 + 1024e-6)
    assert prefill_work_s(1536, 1024, 0, weights) < prefill_work_s(1536, 1024, 1024, weights)
    assert prefill_work_s(1536, 0, 0, weights) > prefill_work_s(1536, 1024, 1024, weights)
    with pytest.raises(InvalidArgument):
        prefill_work_s(10, 11, 0, weights)
    with pytest.raises(InvalidArgument):
        prefill_work_s(10, 5, 6, weights)


class QueueMachine(RuleBasedStateMachine):
    """Random pushes, pops and removals on a clock that moves forward; the bound of aging holds."""

    MAX_WAIT = 5.0
    GATE = 150.5  # the backlog gate of a twin queue: reached with two or more pushes of up to 100

    def __init__(self) -> None:
        super().__init__()
        self.queue = PrefillQueue(QueueOrder.WORK, self.MAX_WAIT)
        self.gated = PrefillQueue(QueueOrder.WORK, self.MAX_WAIT, reorder_below_s=self.GATE)
        self.fifo = PrefillQueue(QueueOrder.FIFO, self.MAX_WAIT)
        self.model: dict[str, tuple[float, float, int]] = {}  # id -> (work, enqueued_at, push index)
        self.now = 0.0
        self.pushes = 0

    @rule(dt=st.floats(0, 3))
    def tick(self, dt: float) -> None:
        self.now += dt

    @rule(work=st.floats(0, 100))
    def push(self, work: float) -> None:
        request_id = f"r{self.pushes}"
        self.queue.push(request_id, work, self.now)
        self.gated.push(request_id, work, self.now)
        self.fifo.push(request_id, work, self.now)
        self.model[request_id] = (work, self.now, self.pushes)
        self.pushes += 1

    @precondition(lambda self: self.model)
    @rule()
    def pop(self) -> None:
        overdue = [(at, i, r) for r, (w, at, i) in self.model.items() if self.now - at >= self.MAX_WAIT]
        expected = min(overdue)[2] if overdue else min((w, i, r) for r, (w, at, i) in self.model.items())[2]
        backlog = sum(w for w, _, _ in self.model.values())
        oldest = min((i, r) for r, (_, _, i) in self.model.items())[1]
        gated = self.gated.pop(self.now)
        if abs(backlog - self.GATE) > 1e-6:  # (at the gate itself, float sums may round either way)
            assert gated == (oldest if backlog >= self.GATE else expected)
        got = self.queue.pop(self.now)
        assert got == expected
        assert self.fifo.pop(self.now) == min((i, r) for r, (_, _, i) in self.model.items())[1]
        del self.model[got]
        # keep the twins in step: they popped the oldest, which may differ; rebuild them from the model
        self.fifo = PrefillQueue(QueueOrder.FIFO, self.MAX_WAIT)
        self.gated = PrefillQueue(QueueOrder.WORK, self.MAX_WAIT, reorder_below_s=self.GATE)
        for r, (w, at, _) in sorted(self.model.items(), key=lambda kv: kv[1][2]):
            self.fifo.push(r, w, at)
            self.gated.push(r, w, at)

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def remove(self, data: st.DataObject) -> None:
        request_id = data.draw(st.sampled_from(sorted(self.model)))
        assert self.queue.remove(request_id) and self.fifo.remove(request_id) and self.gated.remove(request_id)
        del self.model[request_id]

    @invariant()
    def holds_exactly_the_queued(self) -> None:
        assert len(self.queue) == len(self.model)
        assert self.gated.ids() == self.queue.ids()
        assert self.gated.queued_work_s == pytest.approx(sum(w for w, _, _ in self.model.values()), abs=1e-6)
        assert self.queue.ids() == sorted(self.model, key=lambda r: self.model[r][2])

    @invariant()
    def serving_order_starts_with_the_next_pop(self) -> None:
        order = self.queue.serving_order(self.now)
        assert sorted(order) == sorted(self.model)
        assert (order[0] if order else None) == self.queue.peek(self.now)
        assert self.fifo.serving_order(self.now) == self.fifo.ids()


TestQueueMachine = QueueMachine.TestCase
