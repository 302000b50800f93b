"""Admission: tickets before prefill, each shard the owner of its room, a bounded FIFO queue with deadlines,
locality, retries, refusals."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvpool.core.admission.admission import Admission, Admitted, AdmissionRequest, Locality, ShardShape, Ticket
from kvpool.core.admission.retry import Move, may_retry, retry_move
from kvpool.core.decode.pages import pages_for_request
from kvpool.core.decode.scheduler import FINISH_CONTEXT, FINISH_LENGTH, FINISH_STOP, finish_reason
from kvpool.core.errors import InvalidArgument, ResourceExhausted, Unavailable
from kvpool.core.admission.routing import PipelineReason, RoutingPolicy
from tests.core.admission_cluster import Cluster, owner_fits

# a region of a 100-token prompt: 100 * 4000 + 4096 -> 405,504 bytes (99 pages of 4,096): an arena holds two
SHAPE = ShardShape(num_pages=100, page_size=16, arena_bytes=1_000_000, region_bytes_per_token=4000,
                   region_trailer_bytes=4096, max_context=4096)


def admission(max_queue: int = 4, locality: bool = True) -> Admission:
    routing = RoutingPolicy.of(["p0", "p1"], ["d0", "d1"])
    a = Admission(routing, {"d0": "s0", "d1": "s1"}, {"p0": "s0", "p1": "s1"}, max_queue=max_queue,
                  queue_timeout_s=10.0, locality=locality)
    for pipeline in ("p0", "p1"):
        a.set_pipeline_shape(pipeline, 64, 16)  # 1,024 tokens
    return a


def cluster(max_queue: int = 4, locality: bool = True, shape: ShardShape = SHAPE, watched: bool = True,
            d1: ShardShape | None = None) -> Cluster:
    return Cluster(admission(max_queue, locality), {"d0": shape, "d1": d1 or shape}, watched)


def req(request_id: str, prompt: int = 100, max_tokens: int = 60, session: str = "") -> AdmissionRequest:
    return AdmissionRequest(request_id, session, prompt, max_tokens)


def test_the_one_page_count() -> None:
    # every output token but the last is cached: prompt + max_tokens - 1 entries
    assert pages_for_request(100, 60, 16) == 10  # 159 entries
    assert pages_for_request(100, 61, 16) == 10  # 160 entries: exactly 10 pages
    assert pages_for_request(100, 62, 16) == 11
    assert pages_for_request(1, 1, 16) == 1


def test_first_token_stop_rules() -> None:
    stops = frozenset({7})
    assert finish_reason(7, 1, stops, 10, 5, 100) == FINISH_STOP  # the first token is a stop token
    assert finish_reason(3, 1, stops, 1, 5, 100) == FINISH_LENGTH  # max_tokens 1: the first token ends it
    assert finish_reason(7, 1, stops, 1, 5, 100) == FINISH_STOP  # stop wins over length
    assert finish_reason(3, 1, stops, 10, 99, 100) == FINISH_CONTEXT  # the context is full after it
    assert finish_reason(3, 1, stops, 10, 5, 100) is None


def test_retry_eligibility() -> None:
    assert may_retry(Unavailable("x"), 0, 1)
    assert not may_retry(Unavailable("x"), 1, 1)  # a token reached the client
    assert not may_retry(Unavailable("x"), 0, 2)  # once only
    assert not may_retry(ResourceExhausted("x"), 0, 1)
    assert not may_retry(InvalidArgument("x: y"), 0, 1)
    assert may_retry(Unavailable("x"), 0, 2, max_tries=3) and not may_retry(Unavailable("x"), 0, 3, max_tries=3)


def test_tickets_place_requests_and_each_shard_holds_its_own_room() -> None:
    c = cluster()
    a = c.a
    t1 = c.admit(req("r1", session="a"), now=0.0)
    assert t1 == Ticket("r1", "p0", PipelineReason.NEW_SESSION, "d0", Locality.SAME_SERVER, 0.0, 0.0,
                        num_prompt_tokens=100)
    t2 = c.admit(req("r2"), now=0.0)
    assert (t2.pipeline, t2.shard, t2.locality) == ("p1", "d1", Locality.SAME_SERVER)
    t3 = c.admit(req("r3"), now=0.0)  # p0 (fewest placed on a tie), d0: its arena holds 2 regions
    assert (t3.pipeline, t3.shard) == ("p0", "d0")
    t4 = c.admit(req("r4"), now=0.0)
    assert (t4.pipeline, t4.shard) == ("p1", "d1")
    # both arenas hold 2 regions: the next request's ticket is refused by each shard in turn, and it queues
    assert c.admit(req("r5"), now=1.0) is None
    assert sorted(c.refusals) == [("r5", "d0"), ("r5", "d1")]
    assert a.shards["d0"].full and a.shards["d1"].full
    assert c.admit(req("r6"), now=2.0) is None  # no shard takes tickets: it queues at once
    assert len(c.refusals) == 2 and (a.num_queued, a.num_admitted) == (2, 4)
    assert [o.num_held for o in c.owners.values()] == [2, 2]
    # r2 ends: d1 gives its room back and says so; the head takes it, the next is refused there again
    moved = c.release("r2", now=3.0)
    assert [(t.request_id, t.shard, t.queued_s) for t in moved.tickets] == [("r5", "d1", 2.0)]
    assert moved.expired == [] and c.refusals[-1] == ("r6", "d1")
    assert a.queued_ids() == ["r6"] and a.shards["d1"].full
    assert sum(p.in_flight for p in a.routing.pipelines.values()) == a.num_admitted == 4


def test_fifo_without_overtaking() -> None:
    c = cluster()
    for i in range(4):
        c.admit(req(f"r{i}"), now=0.0)
    assert c.admit(req("big", prompt=200), now=0.0) is None  # needs 806 KB: waits for an empty arena
    assert c.admit(req("small", prompt=10), now=0.0) is None  # a shard could hold it, but it queues behind
    assert c.release("r0", now=1.0).tickets == []  # d0 has 1 region left: it refuses big again
    assert c.a.queued_ids() == ["big", "small"]
    admitted = c.release("r2", now=2.0).tickets  # d0 empty: big, then small
    assert [(t.request_id, t.shard) for t in admitted] == [("big", "d0"), ("small", "d0")]
    assert not c.a.shards["d0"].probing  # confirmed with nobody queued: tickets go freely again


def test_a_shard_that_says_room_came_back_takes_one_ticket_at_a_time_until_one_is_confirmed() -> None:
    a = admission()
    a.set_shard_shape("d0", SHAPE)
    a.set_shard_shape("d1", SHAPE)
    a.set_health("d1", False)
    a.set_watched("d0", True, 0)
    tickets = [a.admit(req(f"r{i}"), now=0.0) for i in range(2)]
    assert [t.shard for t in tickets if t] == ["d0", "d0"]  # both at once: nothing said it is full
    assert a.confirmed("r0", now=0.0).tickets == []  # the shard holds r0's room
    a.refused(req("r1"), 0, now=0.0)  # and had none for r1
    assert a.shards["d0"].full and a.queued_ids() == ["r1"]
    for i in (2, 3):
        assert a.admit(req(f"r{i}"), now=0.1) is None
    # room came back: the head's ticket goes, the others wait for its answer
    assert [t.request_id for t in a.room_again("d0", 1, now=0.2).tickets] == ["r1"]
    assert [t.request_id for t in a.confirmed("r1", now=0.3).tickets] == ["r2"]
    assert [t.request_id for t in a.confirmed("r2", now=0.4).tickets] == ["r3"]
    assert a.shards["d0"].probing
    assert a.confirmed("r3", now=0.5).tickets == [] and not a.shards["d0"].probing  # nobody queued
    assert a.confirmed("r3", now=0.5).tickets == []  # a second answer changes nothing
    assert [t.shard for t in (a.admit(req("r4"), now=0.6), a.admit(req("r5"), now=0.6)) if t] == ["d0", "d0"]


def test_a_refusal_older_than_the_room_the_shard_said_came_back_is_tried_again_at_once() -> None:
    a = admission()
    for shard in ("d0", "d1"):
        a.set_shard_shape(shard, SHAPE)
        a.set_watched(shard, True, 0)
    ticket = a.admit(req("r", session="s"), now=0.0)
    assert ticket.shard == "d0"
    a.room_again("d0", 3, now=0.0)  # the shard's stream said 3 give-backs (before its refusal arrived)
    again = a.refused(req("r", session="s"), 2, now=0.0)  # it refused at 2: room came back since
    assert [(t.request_id, t.shard) for t in again.tickets] == [("r", "d0")] and not a.shards["d0"].full
    elsewhere = a.refused(req("r", session="s"), 3, now=0.0)  # refused as of the latest it said: full
    assert [(t.request_id, t.shard) for t in elsewhere.tickets] == [("r", "d1")] and a.shards["d0"].full
    assert a.refused(req("r", session="s"), None, now=0.0).tickets == []  # a shard that says no count: full
    assert a.shards["d1"].full and a.queued_ids() == ["r"]
    # a shard whose stream starts anew (it restarted: its count starts at 0) is asked again, and a
    # refusal at its new count is no older than what it said
    a.set_watched("d0", False)
    assert not a.shards["d0"].full
    a.set_watched("d0", True, 0)
    retried = a.poll(now=0.1)
    assert [(t.request_id, t.shard) for t in retried.tickets] == [("r", "d0")]
    assert a.refused(req("r", session="s"), 0, now=0.1).tickets == [] and a.shards["d0"].full


def test_a_shard_that_cannot_say_room_came_back_is_asked_again_after_a_release_there_or_a_health_round() -> None:
    c = cluster(watched=False)
    a = c.a
    for i in range(4):
        c.admit(req(f"r{i}"), now=0.0)
    assert c.admit(req("q"), now=0.0) is None and a.shards["d0"].full and a.shards["d1"].full
    c.owners["d1"].end("r1")  # this router's own ticket on d1 ended (the shard freed it as the call ended)
    assert [t.request_id for t in c.answer(a.release("r1", now=1.0), now=1.0).tickets] == ["q"]
    assert a.shards["d0"].full
    assert c.admit(req("q2"), now=1.5) is None and a.shards["d1"].full
    c.owners["d0"].end("r0")  # room given back by another router's request, say: this one cannot see it
    assert c.poll(now=2.0).tickets == []
    a.begin_health_round()
    a.set_health("d0", True)  # each health round asks a silent full shard again
    assert [(t.request_id, t.shard) for t in c.poll(now=2.0).tickets] == [("q2", "d0")]


def test_queue_full_is_refused_with_retry_after_and_a_refused_request_queues_again_past_it() -> None:
    c = cluster(max_queue=1)
    for i in range(4):
        c.admit(req(f"r{i}"), now=0.0)
    assert c.admit(req("q"), now=0.0) is None
    with pytest.raises(ResourceExhausted, match="queue is full") as refused:
        c.a.admit(req("over"), now=3.5)
    assert refused.value.retry_after_s == 7  # the head times out at 10 s
    assert c.a.queued_ids() == ["q"]
    # requests that took tickets and that their shard then refuses are never dropped for a full queue
    assert [t.request_id for t in c.release("r0", now=4.0).tickets] == ["q"]
    late = [c.a.admit(req(name), now=4.0 + i / 10) for i, name in enumerate(("late", "later"))]
    assert [t.shard for t in late if t] == ["d0", "d0"]  # d0 took q and is no longer said to be full
    for name in ("late", "later"):
        epoch = c.owners["d0"].serve(req(name))
        assert epoch is not None  # it holds two regions again
        c.a.refused(req(name), epoch, now=4.2)
    assert c.a.queued_ids() == ["late", "later"] and c.a.num_queued > c.a.max_queue


def test_queued_requests_expire_at_their_first_deadline_and_can_be_dropped() -> None:
    c = cluster()
    for i in range(4):
        c.admit(req(f"r{i}"), now=0.0)
    c.admit(req("q1"), now=0.0)
    c.admit(req("q2"), now=5.0)
    assert c.poll(now=9.9).expired == []
    assert c.poll(now=10.0).expired == ["q1"]
    assert c.release("q2", now=11.0).tickets == []  # the client went away while queued
    assert c.a.num_queued == 0 and c.a.num_admitted == 4
    # one refused after it took its ticket keeps the deadline of its arrival
    c.release("r0", now=12.0)
    ticket = c.a.admit(req("r"), now=12.0)
    assert ticket is not None and ticket.arrived_at == 12.0
    c.owners["d0"].serve(req("elsewhere", prompt=200))  # another router took that room meanwhile
    assert c.a.refused(req("r"), c.owners["d0"].room.epoch, now=21.0).tickets == []
    assert c.poll(now=21.9).expired == [] and c.poll(now=22.0).expired == ["r"]


def test_a_request_that_can_never_fit_names_the_field_and_limit() -> None:
    a = cluster().a
    a.set_pipeline_shape("p0", 64, 16)
    a.set_pipeline_shape("p1", 128, 16)
    with pytest.raises(InvalidArgument, match="2048") as e:
        a.admit(req("r", prompt=3000), now=0.0)
    assert e.value.field == "prompt"
    with pytest.raises(InvalidArgument, match="context of 4096") as e:
        a.admit(req("r", prompt=2000, max_tokens=2097), now=0.0)
    assert e.value.field == "max_tokens"
    with pytest.raises(InvalidArgument, match="1600 KV tokens") as e:
        a.admit(req("r", prompt=1000, max_tokens=700), now=0.0)
    assert e.value.field == "max_tokens"
    with pytest.raises(InvalidArgument, match="receive arena takes 248 at most") as e:
        a.admit(req("r", prompt=300, max_tokens=10), now=0.0)  # 1.2 MB region, 1 MB arena
    assert e.value.field == "prompt"
    assert a.num_queued == 0 and a.num_admitted == 0
    # a prompt that p0's device cache could never hold goes to p1, the session's own or not
    assert a.admit(req("first", prompt=10, session="s"), now=0.0).pipeline == "p0"
    a.set_pipeline_shape("p0", 4, 16)  # 64 tokens
    ticket = a.admit(req("long", prompt=100, session="s"), now=0.0)
    assert ticket is not None and ticket.pipeline == "p1"


def test_locality_prefers_the_pipelines_server_while_its_shard_takes_tickets() -> None:
    bigger = ShardShape(200, 16, 4_000_000, 4000, 4096, 4096)
    c = cluster(d1=bigger)
    first = c.admit(req("r0", session="x"), now=0.0)
    assert (first.pipeline, first.shard, first.locality) == ("p0", "d0", Locality.SAME_SERVER)
    c.admit(req("r1", session="x"), now=0.0)  # affinity: p0 again, d0 again (its last region)
    third = c.admit(req("r2", session="x"), now=0.0)  # d0 refuses it: it goes to d1
    assert (third.pipeline, third.shard, third.locality) == ("p0", "d1", Locality.LOCAL_FULL)
    c.a.set_health("d0", False)
    fourth = c.admit(req("r3", session="x"), now=0.0)
    assert (fourth.pipeline, fourth.shard, fourth.locality) == ("p0", "d1", Locality.NO_LOCAL_SHARD)
    off = cluster(locality=False, d1=bigger)
    assert off.admit(req("r0"), now=0.0).locality == Locality.OFF
    assert off.admit(req("r1"), now=0.0).shard == "d1"  # the fewest tickets


def test_retry_moves_the_pipeline_once_and_keeps_the_shard() -> None:
    c = cluster()
    a = c.a
    ticket = c.admit(req("r", session="s"), now=0.0)
    moved = a.retry(ticket, Unavailable("down"), num_tokens_sent=0, session_key="s")
    assert moved is not None
    assert (moved.pipeline, moved.shard, moved.tries) == ("p1", ticket.shard, 2)
    assert (a.routing.pipelines["p0"].in_flight, a.routing.pipelines["p1"].in_flight) == (0, 1)
    assert a.retry(moved, Unavailable("down"), 0, "s") is None  # at most once
    assert a.retry(moved, InvalidArgument("x: y"), 0, "s") is None
    c.release("r", now=1.0)
    assert a.routing.pipelines["p1"].in_flight == 0 and c.owners[ticket.shard].num_held == 0


def test_a_retry_waits_only_for_its_own_pipeline_to_serve_again_within_the_health_wait() -> None:
    routing = RoutingPolicy.of(["p0"], ["d0"])
    down = Unavailable("stage 2 down")
    for health_wait_s, may_wait in ((0.0, False), (5.0, True)):
        a = Admission(routing.of(["p0"], ["d0"]), {"d0": "s0"}, {"p0": "s0"}, max_queue=2, queue_timeout_s=5.0,
                      health_wait_s=health_wait_s)
        a.set_shard_shape("d0", SHAPE)
        a.set_pipeline_shape("p0", 64, 16)
        ticket = a.admit(req("r"), now=0.0)
        assert a.retry(ticket, down, 0, "") is None  # no other pipeline
        assert a.retry_may_wait(ticket, down, 0) is may_wait
        assert not a.retry_may_wait(ticket, down, 1)  # a token reached the client: never moved
        assert not a.retry_may_wait(ticket, InvalidArgument("x: y"), 0)
        a.prefill_ended("r")
        assert not a.retry_may_wait(ticket, down, 0)  # after its first token nothing moves it


def test_retry_move_blames_the_part_that_failed() -> None:
    first = Ticket("r", "p0", PipelineReason.NEW_SESSION, "d0", Locality.SAME_SERVER, 0.0, 0.0)
    assert retry_move(Unavailable("stage 1 down"), 0, first, at_decode=False) is Move.PIPELINE
    assert retry_move(Unavailable("decode down"), 0, first, at_decode=True) is Move.SHARD
    # prefill could not write to its decode target: the shard failed, not the pipeline
    assert retry_move(Unavailable("target: writing to decode failed", field="target"), 0, first, False) is Move.SHARD
    assert retry_move(Unavailable("decode down"), 1, first, at_decode=True) is None  # a token reached the client
    assert retry_move(ResourceExhausted("no room"), 0, first, at_decode=True) is None
    assert retry_move(InvalidArgument("prompt: too long"), 0, first, at_decode=True) is None
    moved_pipeline = Ticket("r", "p1", PipelineReason.EXCLUDED_AFTER_FAILURE, "d0", Locality.SAME_SERVER, 0.0, 0.0,
                            tries=2)
    assert retry_move(Unavailable("down"), 0, moved_pipeline, at_decode=False) is None  # once per kind
    assert retry_move(Unavailable("down"), 0, moved_pipeline, at_decode=True) is Move.SHARD
    moved_shard = Ticket("r", "p0", PipelineReason.NEW_SESSION, "d1", Locality.LOCAL_FULL, 0.0, 0.0, shard_tries=2)
    assert retry_move(Unavailable("down"), 0, moved_shard, at_decode=True) is None
    assert retry_move(Unavailable("down"), 0, moved_shard, at_decode=False) is Move.PIPELINE


def test_move_shard_puts_the_ticket_on_another_shard_that_takes_it() -> None:
    c = cluster()
    a = c.a
    request = req("r", session="s")
    ticket = c.admit(request, now=0.0)
    assert (ticket.pipeline, ticket.shard) == ("p0", "d0")
    # a pipeline's failure is not the shard's to handle, nor a failure after a token
    assert a.move_shard(ticket, request, Unavailable("down"), 0, at_decode=False) is None
    assert a.move_shard(ticket, request, Unavailable("down"), 1, at_decode=True) is None
    moved = a.move_shard(ticket, request, Unavailable("decode d0: UNAVAILABLE"), 0, at_decode=True)
    assert moved is not None
    assert (moved.pipeline, moved.shard, moved.locality, moved.shard_tries, moved.tries) == (
        "p0", "d1", Locality.LOCAL_FULL, 2, 1)
    assert (a.shards["d0"].num_tickets, a.shards["d1"].num_tickets) == (0, 1)
    assert a.shards["d1"].unconfirmed == {"r"}  # its new Serve has not answered yet
    assert a.ticket("r") == moved and a.routing.pipelines["p0"].in_flight == 1
    assert a.move_shard(ticket, request, Unavailable("x"), 0, at_decode=True) is None  # a stale ticket
    assert a.move_shard(moved, request, Unavailable("x"), 0, at_decode=True) is None  # once
    a.release("r", now=1.0)
    assert a.shards["d1"].num_tickets == 0 and not a.shards["d1"].unconfirmed
    assert a.routing.pipelines["p0"].in_flight == 0


def test_move_shard_needs_another_shard_that_takes_the_request() -> None:
    c = cluster(d1=ShardShape(20, 16, 1_000_000, 4000, 4096, 4096))
    a = c.a
    request = req("r")
    ticket = c.admit(request, now=0.0)
    assert ticket.shard == "d0"
    a.set_health("d1", False)
    assert a.move_shard(ticket, request, Unavailable("down"), 0, at_decode=True) is None
    a.set_health("d1", True)
    long = req("r", max_tokens=60 + 20 * 16)  # 30 pages: more than d1 could ever hold
    assert a.move_shard(ticket, long, Unavailable("down"), 0, at_decode=True) is None
    a.set_health("d0", False)
    for i in range(3):  # d1 takes two; it refuses the third and says so
        c.admit(req(f"other{i}"), now=0.0)
    a.set_health("d0", True)
    assert a.shards["d1"].full
    assert a.move_shard(ticket, request, Unavailable("down"), 0, at_decode=True) is None


def test_unknown_shapes_admit_nothing_and_unhealthy_everything_is_unavailable() -> None:
    routing = RoutingPolicy.of(["p0"], ["d0"])
    a = Admission(routing, {"d0": "s0"}, {"p0": "s0"}, max_queue=2, queue_timeout_s=5.0)
    assert a.admit(req("r"), now=0.0) is None  # no Stats yet: it queues
    a.set_shard_shape("d0", SHAPE)
    assert a.poll(now=0.5).tickets == []  # nor StageInfo: the pipeline's stages are unknown
    a.set_pipeline_shape("p0", 64, 16)
    assert [t.request_id for t in a.poll(now=1.0).tickets] == ["r"]
    a.set_health("d0", False)
    with pytest.raises(Unavailable, match="decode shard"):
        a.admit(req("r2"), now=1.0)
    with pytest.raises(InvalidArgument, match="request_id"):
        a.admit(req("r"), now=1.0)
    with pytest.raises(InvalidArgument, match="servers"):
        Admission(routing, {}, {"p0": "s0"}, max_queue=2, queue_timeout_s=5.0)
    with pytest.raises(InvalidArgument, match="shard"):
        a.room_again("d9", 1, now=1.0)


class AdmissionMachine(RuleBasedStateMachine):
    """Two routers over the same shards, each asking the shards for room and keeping no count of it: no
    request is ever failed for lack of room (only its queue deadline ends a wait), every shard holds
    exactly the room of the tickets it confirmed, and a queue never waits on a shard that has room for its
    head (no lost word that room came back)."""

    def __init__(self) -> None:
        super().__init__()
        shapes = {name: ShardShape(pages, 16, 1_000_000, 2000, 4096, 2048)
                  for name, pages in (("d0", 40), ("d1", 20), ("d2", 60))}
        self.routers: list[Cluster] = []
        owners = None
        for _ in range(2):
            routing = RoutingPolicy.of(["p0", "p1"], ["d0", "d1", "d2"], affinity_max_queue=2)
            a = Admission(routing, {"d0": "s0", "d1": "s1", "d2": "s1"}, {"p0": "s0", "p1": "s1"},
                          max_queue=3, queue_timeout_s=5.0)
            a.set_pipeline_shape("p0", 24, 16)
            a.set_pipeline_shape("p1", 40, 16)
            router = Cluster(a, shapes)
            if owners is None:
                owners = router.owners
            router.owners = owners  # the shards are the same for both
            self.routers.append(router)
        self.owners = owners
        self.now = 0.0
        self.next_id = 0
        self.live: list[set[str]] = [set(), set()]

    def _apply(self, k: int, admitted: Admitted) -> None:
        for ticket in admitted.tickets:
            self.live[k].add(ticket.request_id)

    def _rang(self, shard: str) -> None:
        """The shard's give-back rang: every router's stream tells it."""
        for k, router in enumerate(self.routers):
            self._apply(k, router.answer(router.a.room_again(shard, self.owners[shard].room.epoch, self.now),
                                         self.now))

    @rule(k=st.integers(0, 1), prompt=st.integers(1, 400), max_tokens=st.integers(1, 400),
          session=st.sampled_from(["", "a", "b"]))
    def admit(self, k: int, prompt: int, max_tokens: int, session: str) -> None:
        request_id = f"r{self.next_id}"
        self.next_id += 1
        router = self.routers[k]
        queued = router.a.num_queued
        try:
            ticket = router.admit(AdmissionRequest(request_id, session, prompt, max_tokens), self.now)
        except (InvalidArgument, ResourceExhausted, Unavailable) as exc:
            if isinstance(exc, ResourceExhausted):
                assert queued >= 3 and exc.retry_after_s >= 1
            return
        if ticket is not None:
            self.live[k].add(request_id)

    @precondition(lambda self: any(self.live) or any(r.a.num_queued for r in self.routers))
    @rule(i=st.integers(0, 100))
    def release(self, i: int) -> None:
        ids = [(k, r) for k in (0, 1) for r in sorted(self.live[k]) + self.routers[k].a.queued_ids()]
        if not ids:
            return
        k, request_id = ids[i % len(ids)]
        router = self.routers[k]
        ticket = router.a.ticket(request_id)
        self.live[k].discard(request_id)
        self._apply(k, router.answer(router.a.release(request_id, self.now), self.now))
        if ticket is not None and self.owners[ticket.shard].end(request_id):
            self._rang(ticket.shard)

    @precondition(lambda self: any(self.live))
    @rule(i=st.integers(0, 100), at_decode=st.booleans())
    def fail(self, i: int, at_decode: bool) -> None:
        """A live request's shard (or pipeline) fails before any token: it moves or stays put."""
        ids = [(k, r) for k in (0, 1) for r in sorted(self.live[k])]
        k, request_id = ids[i % len(ids)]
        router = self.routers[k]
        ticket = router.a.ticket(request_id)
        assert ticket is not None
        request = router.requests[request_id]
        moved = (router.a.move_shard(ticket, request, Unavailable("down"), 0, at_decode) if at_decode
                 else router.a.retry(ticket, Unavailable("down"), 0, request.session_key))
        if moved is not None and at_decode:  # the old shard's call ended; the new one is served
            assert moved.shard != ticket.shard
            if self.owners[ticket.shard].end(request_id):
                self._rang(ticket.shard)
            self.live[k].discard(request_id)
            self._apply(k, router.answer(Admitted(tickets=[moved]), self.now))

    @rule(dt=st.floats(0, 3))
    def tick(self, dt: float) -> None:
        self.now += dt
        for k, router in enumerate(self.routers):
            self._apply(k, router.poll(self.now))

    @rule(name=st.sampled_from(["p0", "p1", "d0", "d1", "d2"]), healthy=st.booleans(), k=st.integers(0, 1))
    def health(self, name: str, healthy: bool, k: int) -> None:
        router = self.routers[k]
        router.a.begin_health_round()
        router.a.set_health(name, healthy)
        self._apply(k, router.poll(self.now))

    @rule(name=st.sampled_from(["d0", "d1", "d2"]), k=st.integers(0, 1))
    def watch_reopens(self, name: str, k: int) -> None:
        """A router's WatchRoom stream to a shard broke and opened again (what it would have said is lost)."""
        router = self.routers[k]
        router.a.set_watched(name, False)
        self._apply(k, router.poll(self.now))
        router.a.set_watched(name, True, self.owners[name].room.epoch)
        self._apply(k, router.answer(router.a.room_again(name, self.owners[name].room.epoch, self.now), self.now))

    @invariant()
    def each_shard_holds_what_it_confirmed_and_no_queue_waits_on_room(self) -> None:
        tickets = [t for r in self.routers for t in r.a.tickets()]
        for k, router in enumerate(self.routers):
            assert {t.request_id for t in router.a.tickets()} == self.live[k]
            assert not self.live[k] & set(router.a.queued_ids())
            for name, shard in router.a.shards.items():
                assert shard.num_tickets == sum(1 for t in router.a.tickets() if t.shard == name)
                assert not shard.unconfirmed  # every ticket was answered
            for name, pipeline in router.a.routing.pipelines.items():
                assert pipeline.in_flight == sum(1 for t in router.a.tickets() if t.pipeline == name)
        for name, owner in self.owners.items():
            assert set(owner.region_of) == {t.request_id for t in tickets if t.shard == name}
        for router in self.routers:
            head = router.a.queue.head(self.now)
            if head is None:
                continue
            for name, shard in router.a.shards.items():
                if shard.healthy and shard.can_ever_hold(head.request.num_prompt_tokens, head.request.max_tokens):
                    # a shard this router will not ask has no room for its head
                    assert not shard.full or not owner_fits(self.owners[name], head.request)


TestAdmissionMachine = AdmissionMachine.TestCase
TestAdmissionMachine.settings = settings(max_examples=100, stateful_step_count=30, deadline=None)


def test_domain_errors_carry_their_field() -> None:
    assert InvalidArgument("token_ids[3]: 9 is outside the vocabulary").field == "token_ids[3]"
    assert InvalidArgument("sampling.top_p: must be in (0, 1]").field == "sampling.top_p"
    assert InvalidArgument("receive arena: no room").field is None  # not an identifier: no field
    assert InvalidArgument("no room", field="prompt").field == "prompt"
    assert ResourceExhausted("full", retry_after_s=3).retry_after_s == 3
