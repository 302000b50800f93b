"""The admission queue's order: FIFO, or least estimated work first with aging (the router's ``--sched``)."""

from __future__ import annotations

import math

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvpool.core.admission.admission import Admission, Admitted, AdmissionRequest, QueueOrder, ShardShape
from kvpool.core.admission.queue import AdmissionQueue, admission_work_s
from kvpool.core.sessions.prefix import MAX_SESSION_PREFIXES, matched_prefix, remember_prompt
from kvpool.core.errors import InvalidArgument, ResourceExhausted
from kvpool.core.prefill.queue import WorkWeights, prefill_work_s
from kvpool.core.admission.routing import RoutingPolicy
from tests.core.admission_cluster import Cluster, owner_fits

# a region of a 100-token prompt: 100 * 4000 + 4096 -> 405,504 bytes; 120 tokens 484,096; 150 tokens 604,096
SHAPE = ShardShape(num_pages=100, page_size=16, arena_bytes=1_000_000, region_bytes_per_token=4000,
                   region_trailer_bytes=4096, max_context=4096)
W = WorkWeights()
MACHINE_SHAPE = ShardShape(60, 16, 1_000_000, 2000, 4096, 2048)  # the state machine's one shard


def admission(order: QueueOrder, max_wait_s: float = 5.0, max_bypass_s: float = math.inf) -> Cluster:
    """Admission over two shards that answer every ticket as their Serve does (``Cluster``)."""
    routing = RoutingPolicy.of(["p0", "p1"], ["d0", "d1"])
    a = Admission(routing, {"d0": "s0", "d1": "s1"}, {"p0": "s0", "p1": "s1"}, max_queue=4,
                  queue_timeout_s=10.0, order=order, max_wait_s=max_wait_s, max_bypass_s=max_bypass_s)
    for pipeline in ("p0", "p1"):
        a.set_pipeline_shape(pipeline, 64, 16)
    return Cluster(a, {"d0": SHAPE, "d1": SHAPE})


def req(request_id: str, prompt: int = 100, session: str = "", base: int = 0) -> AdmissionRequest:
    """Prompts of one ``base`` extend each other: tokens base, base + 1, ..."""
    return AdmissionRequest(request_id, session, prompt, 60, list(range(base, base + prompt)))


def full(a: Cluster) -> None:
    """Four 100-token tickets fill both arenas (two regions each); r0 is session s's first turn, on d0."""
    tickets = [a.admit(req(f"r{i}", session="s" if i == 0 else "", base=1000 * i), now=0.0) for i in range(4)]
    assert [(t.request_id, t.shard) for t in tickets] == [("r0", "d0"), ("r1", "d1"), ("r2", "d0"), ("r3", "d1")]


def test_the_work_estimate_counts_the_tokens_beyond_the_cached_prefix() -> None:
    assert admission_work_s(150, 0) == prefill_work_s(150, 0, 0, W)  # nothing remembered: the whole prompt
    assert admission_work_s(120, 100) == prefill_work_s(120, 100, 0, W)  # 20 tokens at context 100..120
    assert admission_work_s(100, 100) == prefill_work_s(100, 99, 0, W)  # the same prompt again: its last token
    assert admission_work_s(120, 100) < admission_work_s(30, 0)
    for bad in ((0, 0), (10, -1)):
        with pytest.raises(InvalidArgument):
            admission_work_s(*bad)


def tokens(base: int, n: int) -> list[int]:
    return list(range(base, base + n))


def test_a_session_remembers_its_timelines_last_prompts_and_a_turn_matches_the_one_it_extends() -> None:
    parent1, sub1 = tokens(0, 300), tokens(5000, 80)  # an agent and its subagent, under one session key
    prefixes = remember_prompt(remember_prompt((), parent1), sub1)
    assert [p.num_tokens for p in prefixes] == [300, 80]
    assert matched_prefix(prefixes, tokens(0, 340)).num_tokens == 300  # the parent's next turn
    assert matched_prefix(prefixes, tokens(5000, 95)).num_tokens == 80  # the subagent's
    assert matched_prefix(prefixes, tokens(0, 200)) is None  # shorter than the parent's: not an extension
    assert matched_prefix(prefixes, tokens(9000, 400)) is None  # a new timeline
    assert matched_prefix(prefixes, [1, *tokens(1, 339)]) is None  # one token differs
    # a turn replaces the prompt it extends; a new timeline is added, the oldest going past the bound
    prefixes = remember_prompt(prefixes, tokens(0, 340))
    assert [p.num_tokens for p in prefixes] == [80, 340]
    for i in range(5):
        prefixes = remember_prompt(prefixes, tokens(10_000 * (i + 1), 10 + i))
    assert [p.num_tokens for p in prefixes] == [11, 12, 13, 14] and MAX_SESSION_PREFIXES == 4
    again = remember_prompt(prefixes, tokens(40_000, 13))  # the same prompt again: once, now the newest
    assert [p.num_tokens for p in again] == [11, 12, 14, 13]


def test_routing_keeps_a_sessions_prompts_and_forgets_them_with_the_session() -> None:
    policy = RoutingPolicy.of(["p0"], ["d0"], max_sessions=2)
    policy.place_pipeline("a", token_ids=tokens(0, 100))
    policy.place_pipeline("b", token_ids=tokens(0, 200))
    policy.place_pipeline("a", token_ids=tokens(0, 300))
    policy.place_pipeline("", token_ids=tokens(0, 50))  # no session: nothing remembered
    assert [p.num_tokens for p in policy.session_prefixes("a")] == [300]
    assert policy.session_prefixes("") == ()
    policy.place_pipeline("c", token_ids=tokens(0, 400))  # b was used least recently: forgotten, both its facts
    assert (policy.session_prefixes("b"), policy.session_pipeline("b")) == ((), None)
    assert len(policy._session_prefixes) == len(policy._sessions) == 2


def test_a_session_turn_passes_a_new_session_that_does_not_fit_where_fifo_holds_it_back() -> None:
    for order, expected in ((QueueOrder.FIFO, []), (QueueOrder.WORK, ["turn"])):
        a = admission(order)
        full(a)
        assert a.admit(req("new", prompt=150, base=9000), now=0.0) is None  # 150 tokens of work
        assert a.admit(req("turn", prompt=120, session="s"), now=1.0) is None  # 20 tokens beyond s's 100
        assert a.queued_ids() == ["new", "turn"]  # arrival order, whatever the order
        # d1 frees its second region: 594,496 bytes hold the 120-token turn, not the 150-token newcomer
        assert [t.request_id for t in a.release("r3", now=2.0).tickets] == expected, order
        assert [p.num_tokens for p in a.routing.session_prefixes("s")] == [120 if order is QueueOrder.WORK else 100]
    # a subagent's own prompt under the session's key is no extension: it is estimated whole
    a = admission(QueueOrder.WORK)
    full(a)
    assert a.work_s(req("sub", prompt=120, session="s", base=7000)) == admission_work_s(120, 0)
    assert a.work_s(req("turn", prompt=120, session="s")) == admission_work_s(120, 100)


def test_the_estimates_are_in_the_pipelines_measured_seconds() -> None:
    """Each pipeline's StageInfo says how much slower it computes than the estimates' reference; the queue's
    estimates (and so its bypass budget) are in the known pipelines' mean of it."""
    a = admission(QueueOrder.WORK)
    turn = req("turn", prompt=120)
    assert a.work_scale == 1.0 and a.work_s(turn) == admission_work_s(120, 0)
    a.set_pipeline_shape("p0", 64, 16, work_scale=40.0)
    a.set_pipeline_shape("p1", 64, 16, work_scale=60.0)
    assert a.work_scale == 50.0
    assert a.work_s(turn) == pytest.approx(50.0 * admission_work_s(120, 0))
    a.set_pipeline_shape("p1", 64, 16, work_scale=0.0)  # an older stage 0 says nothing: the reference speed
    assert a.work_scale == pytest.approx((40.0 + 1.0) / 2)
    a.set_pipeline_shape("p0", 64, 16, work_scale=1e9)  # bounded as the measurement is
    assert a.pipelines["p0"].work_scale == 1e4
    for bad in (-1.0, math.inf, math.nan):
        with pytest.raises(InvalidArgument, match="^work_scale: "):
            a.set_pipeline_shape("p0", 64, 16, work_scale=bad)
    fresh = Admission(RoutingPolicy.of(["p0"], ["d0"]), {"d0": "s0"}, {"p0": "s0"}, max_queue=4,
                      queue_timeout_s=10.0, order=QueueOrder.WORK)
    assert fresh.work_scale == 1.0  # no pipeline known yet


def test_a_new_request_that_would_lead_and_fits_takes_a_ticket_at_once() -> None:
    for order, expected in ((QueueOrder.FIFO, None), (QueueOrder.WORK, "d1")):
        a = admission(order)
        full(a)
        assert a.admit(req("new", prompt=150, base=9000), now=0.0) is None
        assert a.release("r3", now=1.0).tickets == []  # room for 120 tokens on d1, the head needs 150
        ticket = a.admit(req("turn", prompt=120, session="s"), now=2.0)
        assert (ticket.shard if ticket else None) == expected, order
        # the same work as the head (ties: the earlier arrival) queues behind it
        assert a.admit(req("same", prompt=150, base=8000), now=2.0) is None


def test_an_overdue_request_is_the_head_and_no_smaller_one_passes_it() -> None:
    a = admission(QueueOrder.WORK, max_wait_s=5.0)
    full(a)
    assert a.admit(req("new", prompt=150, base=9000), now=0.0) is None
    assert a.admit(req("turn", prompt=120, session="s"), now=6.0) is None  # new is overdue: turn queues behind
    assert a.release("r1", now=6.5).tickets == []  # room for turn, not for new: the overdue head holds it back
    admitted = a.release("r3", now=7.0)  # d1 empty: new (overdue, by aging); turn no longer fits there
    assert [(t.request_id, t.queued_s) for t in admitted.tickets] == [("new", 7.0)]
    assert [(t.request_id, t.shard, t.queued_s) for t in a.release("r2", now=8.0).tickets] == [("turn", "d0", 2.0)]
    assert a.queue.num_overdue_pops == 1


def test_aging_makes_a_big_request_the_head_once_it_is_overdue() -> None:
    a = admission(QueueOrder.WORK, max_wait_s=5.0)
    full(a)
    assert a.admit(req("new", prompt=150, base=9000), now=0.0) is None
    assert a.admit(req("turn", prompt=120, session="s"), now=1.0) is None
    assert a.queue.head(4.9).request.request_id == "turn"
    assert a.queue.head(5.0).request.request_id == "new"
    # expiry still goes by each request's deadline, in arrival order; the refusal's hint is the oldest's
    assert a.retry_after_s(now=3.0) == 7
    assert a.poll(now=10.0).expired == ["new"]
    assert a.queued_ids() == ["turn"]


def test_the_queue_checks_its_input() -> None:
    q = AdmissionQueue(QueueOrder.WORK, 1.0)
    q.push(req("a"), 1.0, now=0.0, deadline=9.0)
    with pytest.raises(InvalidArgument, match="already queued"):
        q.push(req("a"), 1.0, now=0.0, deadline=9.0)
    with pytest.raises(InvalidArgument):
        q.push(req("b"), -1.0, now=0.0, deadline=9.0)
    assert "b" not in q and len(q) == 1
    assert q.remove("a") is not None and q.remove("a") is None
    with pytest.raises(InvalidArgument):
        q.oldest()
    with pytest.raises(InvalidArgument):
        AdmissionQueue(QueueOrder.WORK, 0.0)
    with pytest.raises(InvalidArgument, match="fifo or work"):
        AdmissionQueue(QueueOrder.RATIO, 4.0)


def model_head(queued: list[list], now: float, max_wait_s: float) -> str:
    """The reference order: [id, work, enqueued_at, credit] in arrival order; the oldest if overdue, else the
    least work among those whose work every older request's credit covers (the bypass budget)."""
    if now - queued[0][2] >= max_wait_s:
        return queued[0][0]
    allowed = [(q[1], k, q[0]) for k, q in enumerate(queued) if all(q[1] <= older[3] for older in queued[:k])]
    return min(allowed)[2]


class WorkOrderMachine(RuleBasedStateMachine):
    """Against a reference model, with the shard answering every ticket as its Serve does (``Cluster``): every
    ticket from the queue was the order's head when it left, the queue keeps arrival order, and after every
    call the head (if any) does not fit the shard; every queued request's bypass credit is the budget less
    the work of those that overtook it, queued or not (a refused ticket changes none of that); the shard
    holds the room of exactly the live tickets."""

    MAX_WAIT_S = 2.0
    MAX_BYPASS_S = math.inf

    def __init__(self) -> None:
        super().__init__()
        routing = RoutingPolicy.of(["p0"], ["d0"])
        self.a = Admission(routing, {"d0": "s0"}, {"p0": "s0"}, max_queue=5, queue_timeout_s=6.0,
                           order=QueueOrder.WORK, max_wait_s=self.MAX_WAIT_S, max_bypass_s=self.MAX_BYPASS_S)
        self.a.set_pipeline_shape("p0", 40, 16)
        self.c = Cluster(self.a, {"d0": MACHINE_SHAPE})
        self.now = 0.0
        self.next_id = 0
        self.live: set[str] = set()
        self.queued: list[list] = []  # [id, work, enqueued_at, credit], arrival order
        self.requests: dict[str, AdmissionRequest] = {}

    def _pop(self, request_id: str) -> None:
        """The model's queue pops ``request_id``, which must be its head."""
        head = model_head(self.queued, self.now, self.MAX_WAIT_S)
        assert request_id == head  # in the order, nobody overtaking the head
        k = [q[0] for q in self.queued].index(head)
        for older in self.queued[:k]:
            older[3] -= self.queued[k][1]
        del self.queued[k]
        self.live.add(head)

    def _apply(self, admitted: Admitted) -> None:
        for request_id in admitted.expired:
            self.queued = [q for q in self.queued if q[0] != request_id]
        for ticket in self.c.log:
            self._pop(ticket.request_id)
        self.c.log.clear()

    def _head_does_not_fit(self) -> None:
        if self.queued:
            head = self.requests[model_head(self.queued, self.now, self.MAX_WAIT_S)]
            assert not owner_fits(self.c.owners["d0"], head)

    @rule(prompt=st.integers(1, 600), session=st.sampled_from(["", "a", "b", "c"]), timeline=st.integers(0, 2))
    def admit(self, prompt: int, session: str, timeline: int) -> None:
        request_id = f"r{self.next_id}"
        self.next_id += 1
        base = 1000 * ("abc".find(session) + 1) + 100_000 * timeline  # a session's timelines extend their own
        request = self.requests[request_id] = AdmissionRequest(request_id, session, prompt, 20,
                                                               tokens(base, prompt))
        work = self.a.work_s(request)
        leads = not self.queued or (
            self.now - self.queued[0][2] < self.MAX_WAIT_S
            and work < min(q[1] for q in self.queued) and work <= min(q[3] for q in self.queued))
        try:
            ticket = self.c.admit(request, self.now)
        except InvalidArgument:
            return  # never fits
        except ResourceExhausted:  # queue full: the model's queue is full too (refused tickets queue past it)
            assert len(self.queued) >= 5
            return
        if ticket is not None and self.c.log[0].request_id == request_id:  # at once
            assert leads  # a ticket at once only for a request that would be the head
            for older in self.queued:  # it overtook every queued request
                older[3] -= work
            self.live.add(request_id)
            del self.c.log[0]
        else:  # queued (its shard may have refused it first), and it may have left the queue since
            self.queued.append([request_id, work, self.now, self.MAX_BYPASS_S])
        self._apply(Admitted())
        self._head_does_not_fit()

    @rule(i=st.integers(0, 100), first_token=st.booleans())
    def end(self, i: int, first_token: bool) -> None:
        ids = sorted(self.live) + [q[0] for q in self.queued]
        if not ids:
            return
        request_id = ids[i % len(ids)]
        if first_token and request_id in self.live:
            self.a.prefill_ended(request_id)
        else:
            self.live.discard(request_id)
            self.queued = [q for q in self.queued if q[0] != request_id]
            self._apply(self.c.release(request_id, self.now))
        self._head_does_not_fit()

    @rule(dt=st.floats(0, 1.5))
    def tick(self, dt: float) -> None:
        self.now += dt
        self._apply(self.c.poll(self.now))
        self._head_does_not_fit()

    @invariant()
    def queue_matches_the_model(self) -> None:
        assert self.a.queued_ids() == [q[0] for q in self.queued]
        # (a refused ticket's refund adds back what its pop took: equal up to rounding)
        assert [self.a.queue.credit_s(q[0]) for q in self.queued] == pytest.approx([q[3] for q in self.queued])
        assert all(q[3] >= 0 for q in self.queued)
        assert {t.request_id for t in self.a.tickets()} == self.live == set(self.c.owners["d0"].region_of)
        assert not self.a.shards["d0"].unconfirmed


TestWorkOrderMachine = WorkOrderMachine.TestCase
TestWorkOrderMachine.settings = settings(max_examples=100, stateful_step_count=30, deadline=None)


class BudgetedWorkOrderMachine(WorkOrderMachine):
    """The same with a bypass budget about a 400-token prompt's work (prompts bring 0 to 3 ms): it binds."""

    MAX_BYPASS_S = 0.002


TestBudgetedWorkOrderMachine = BudgetedWorkOrderMachine.TestCase
TestBudgetedWorkOrderMachine.settings = settings(max_examples=100, stateful_step_count=30, deadline=None)
