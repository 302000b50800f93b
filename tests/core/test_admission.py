"""Admission: tickets before prefill, a bounded FIFO queue with deadlines, locality, retries, refusals."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvpool.core.admission.admission import Admission, Admitted, AdmissionRequest, Locality, ShardShape, Ticket
from kvpool.core.admission.retry import Move, may_retry, retry_move
from kvpool.core.prefill.block_manager import BlockManager
from kvpool.core.chunk_hash import ChunkHash
from kvpool.core.decode.pages import pages_for_request
from kvpool.core.decode.scheduler import FINISH_CONTEXT, FINISH_LENGTH, FINISH_STOP, finish_reason
from kvpool.core.errors import InvalidArgument, ResourceExhausted, Unavailable
from kvpool.core.prefill.request import PrefillRequest
from kvpool.core.admission.routing import PipelineReason, RoutingPolicy

# a region of a 100-token prompt: 100 * 4000 + 4096 -> 405,504 bytes (99 pages of 4,096)
SHAPE = ShardShape(num_pages=100, page_size=16, arena_bytes=1_000_000, region_bytes_per_token=4000,
                   region_trailer_bytes=4096, max_context=4096)


def admission(max_queue: int = 4, locality: bool = True, shape: ShardShape = SHAPE) -> Admission:
    routing = RoutingPolicy.of(["p0", "p1"], ["d0", "d1"])
    a = Admission(routing, {"d0": "s0", "d1": "s1"}, {"p0": "s0", "p1": "s1"}, max_queue=max_queue,
                  queue_timeout_s=10.0, locality=locality)
    a.set_shard_shape("d0", shape)
    a.set_shard_shape("d1", shape)
    for pipeline in ("p0", "p1"):
        a.set_pipeline_shape(pipeline, 64, 16)  # 1,024 tokens: a 100-token prompt takes 7 blocks
    return a


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


def test_tickets_hold_pages_and_region_until_release_then_the_queue_moves() -> None:
    a = admission()
    t1 = a.admit(req("r1", session="a"), now=0.0)
    assert t1 == Ticket("r1", "p0", PipelineReason.NEW_SESSION, "d0", Locality.SAME_SERVER, 10, 405_504, 0.0,
                        num_blocks=7, num_prompt_tokens=100)
    t2 = a.admit(req("r2"), now=0.0)
    assert (t2.pipeline, t2.shard, t2.locality) == ("p1", "d1", Locality.SAME_SERVER)
    t3 = a.admit(req("r3"), now=0.0)  # p0 (fewest placed on a tie), d0: 2 regions = 811,008 bytes fit
    assert (t3.pipeline, t3.shard) == ("p0", "d0")
    t4 = a.admit(req("r4"), now=0.0)
    assert (t4.pipeline, t4.shard) == ("p1", "d1")
    # both arenas hold 2 regions: the next ones queue and hold nothing
    assert a.admit(req("r5"), now=1.0) is None
    assert a.admit(req("r6"), now=2.0) is None
    assert (a.num_queued, a.num_admitted) == (2, 4)
    assert (a.shards["d0"].used_pages, a.shards["d0"].used_bytes, a.shards["d0"].num_tickets) == (20, 811_008, 2)
    moved = a.release("r2", now=3.0)
    assert [(t.request_id, t.shard, t.queued_s) for t in moved.tickets] == [("r5", "d1", 2.0)]
    assert moved.expired == []
    assert a.queued_ids() == ["r6"]
    assert a.routing.pipelines["p1"].in_flight == 2  # r4 and r5


def test_fifo_without_overtaking() -> None:
    a = admission()
    for i in range(4):
        a.admit(req(f"r{i}"), now=0.0)
    assert a.admit(req("big", prompt=200), now=0.0) is None  # needs 808 KB: waits for an empty arena
    assert a.admit(req("small", prompt=10), now=0.0) is None  # would fit now, but queues behind the head
    assert a.release("r0", now=1.0).tickets == []  # d0 has 1 region left: big still does not fit
    admitted = a.release("r2", now=2.0).tickets  # d0 empty: big, then small
    assert [t.request_id for t in admitted] == ["big", "small"]
    assert [t.shard for t in admitted] == ["d0", "d0"]


def test_queue_full_is_refused_with_retry_after() -> None:
    a = admission(max_queue=1)
    for i in range(4):
        a.admit(req(f"r{i}"), now=0.0)
    assert a.admit(req("q"), now=0.0) is None
    with pytest.raises(ResourceExhausted, match="queue is full") as refused:
        a.admit(req("over"), now=3.5)
    assert refused.value.retry_after_s == 7  # the head times out at 10 s
    assert a.queued_ids() == ["q"]


def test_queued_requests_expire_at_their_deadline_and_can_be_dropped() -> None:
    a = admission()
    for i in range(4):
        a.admit(req(f"r{i}"), now=0.0)
    a.admit(req("q1"), now=0.0)
    a.admit(req("q2"), now=5.0)
    assert a.poll(now=9.9).expired == []
    assert a.poll(now=10.0).expired == ["q1"]
    assert a.release("q2", now=11.0).tickets == []  # the client went away while queued
    assert a.num_queued == 0 and a.num_admitted == 4


def test_a_request_that_can_never_fit_names_the_field_and_limit() -> None:
    a = admission()
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


def test_locality_prefers_the_pipelines_server_while_it_has_room() -> None:
    a = admission()
    a.set_shard_shape("d1", ShardShape(200, 16, 4_000_000, 4000, 4096, 4096))  # d1 has more room
    first = a.admit(req("r0", session="x"), now=0.0)
    assert (first.pipeline, first.shard, first.locality) == ("p0", "d0", Locality.SAME_SERVER)
    a.admit(req("r1", session="x"), now=0.0)  # affinity: p0 again, d0 again (its last region)
    third = a.admit(req("r2", session="x"), now=0.0)
    assert (third.pipeline, third.shard, third.locality) == ("p0", "d1", Locality.LOCAL_FULL)
    a.set_health("d0", False)
    fourth = a.admit(req("r3", session="x"), now=0.0)
    assert (fourth.pipeline, fourth.shard, fourth.locality) == ("p0", "d1", Locality.NO_LOCAL_SHARD)
    off = admission(locality=False)
    off.set_shard_shape("d1", ShardShape(200, 16, 4_000_000, 4000, 4096, 4096))
    assert off.admit(req("r0"), now=0.0).locality == Locality.OFF
    assert off.admit(req("r1"), now=0.0).shard == "d1"  # most free pages


def test_retry_moves_the_pipeline_once_and_keeps_the_room() -> None:
    a = admission()
    ticket = a.admit(req("r", session="s"), now=0.0)
    moved = a.retry(ticket, Unavailable("down"), num_tokens_sent=0, session_key="s")
    assert moved is not None
    assert (moved.pipeline, moved.shard, moved.tries, moved.num_pages) == ("p1", ticket.shard, 2, ticket.num_pages)
    assert (a.routing.pipelines["p0"].in_flight, a.routing.pipelines["p1"].in_flight) == (0, 1)
    assert a.retry(moved, Unavailable("down"), 0, "s") is None  # at most once
    assert a.retry(moved, InvalidArgument("x: y"), 0, "s") is None
    a.release("r", now=1.0)
    assert a.routing.pipelines["p1"].in_flight == 0 and a.shards[ticket.shard].used_pages == 0


def test_a_retry_with_no_device_room_elsewhere_waits_for_it() -> None:
    a = admission(max_queue=0, shape=ShardShape(1000, 16, 100_000_000, 4000, 4096, 4096))
    a.set_health("p1", False)
    # p0's cache (64 blocks of 16): 9 prompts of 100 tokens (7 blocks each) still prefilling take 63
    on_p0 = [a.admit(req(f"f{i}"), now=0.0) for i in range(9)]
    assert {t.pipeline for t in on_p0} == {"p0"} and a.pipelines["p0"].used_blocks == 63
    a.set_health("p1", True)
    on_p1 = a.admit(req("r"), now=0.0)
    assert on_p1.pipeline == "p1"
    down = Unavailable("stage 2 down")
    assert a.retry(on_p1, down, 0, "") is None  # p0 has no room now
    assert a.retry_may_wait(on_p1, down, 0)  # ... but could hold it: the request waits
    assert not a.retry_may_wait(on_p1, down, 1)  # a token reached the client: never moved
    assert not a.retry_may_wait(on_p1, InvalidArgument("x: y"), 0)
    a.prefill_ended("f0", now=1.0)  # its first token is out: its 7 blocks go
    moved = a.retry(on_p1, down, 0, "")
    assert moved is not None and (moved.pipeline, moved.shard, moved.tries) == ("p0", on_p1.shard, 2)
    assert a.pipelines["p0"].used_blocks == 63 and a.pipelines["p1"].used_blocks == 0
    assert not a.retry_may_wait(moved, down, 0)  # moved once already: a second failure is final


def test_no_retry_wait_without_another_healthy_pipeline_that_could_hold_it() -> None:
    a = admission()
    ticket = a.admit(req("r"), now=0.0)
    other = "p1" if ticket.pipeline == "p0" else "p0"
    a.set_health(other, False)
    assert not a.retry_may_wait(ticket, Unavailable("down"), 0)
    a.set_health(other, True)
    assert a.retry_may_wait(ticket, Unavailable("down"), 0)
    a.release("r", now=0.0)
    assert not a.retry_may_wait(ticket, Unavailable("down"), 0)  # no longer a live ticket


def test_retry_move_blames_the_part_that_failed() -> None:
    first = Ticket("r", "p0", PipelineReason.NEW_SESSION, "d0", Locality.SAME_SERVER, 10, 405_504, 0.0)
    assert retry_move(Unavailable("stage 1 down"), 0, first, at_decode=False) is Move.PIPELINE
    assert retry_move(Unavailable("decode down"), 0, first, at_decode=True) is Move.SHARD
    # prefill could not write to its decode target: the shard failed, not the pipeline
    assert retry_move(Unavailable("target: writing to decode failed", field="target"), 0, first, False) is Move.SHARD
    assert retry_move(Unavailable("decode down"), 1, first, at_decode=True) is None  # a token reached the client
    assert retry_move(ResourceExhausted("no room"), 0, first, at_decode=True) is None
    assert retry_move(InvalidArgument("prompt: too long"), 0, first, at_decode=True) is None
    moved_pipeline = Ticket("r", "p1", PipelineReason.EXCLUDED_AFTER_FAILURE, "d0", Locality.SAME_SERVER, 10,
                            405_504, 0.0, tries=2)
    assert retry_move(Unavailable("down"), 0, moved_pipeline, at_decode=False) is None  # once per kind
    assert retry_move(Unavailable("down"), 0, moved_pipeline, at_decode=True) is Move.SHARD
    moved_shard = Ticket("r", "p0", PipelineReason.NEW_SESSION, "d1", Locality.LOCAL_FULL, 10, 405_504, 0.0,
                         shard_tries=2)
    assert retry_move(Unavailable("down"), 0, moved_shard, at_decode=True) is None
    assert retry_move(Unavailable("down"), 0, moved_shard, at_decode=False) is Move.PIPELINE


def test_move_shard_takes_the_other_shards_room_and_gives_the_old_back() -> None:
    a = admission()
    request = req("r", session="s")
    ticket = a.admit(request, now=0.0)
    assert (ticket.pipeline, ticket.shard, ticket.num_pages) == ("p0", "d0", 10)
    # a pipeline's failure is not the shard's to handle, nor a failure after a token
    assert a.move_shard(ticket, request, Unavailable("down"), 0, at_decode=False) is None
    assert a.move_shard(ticket, request, Unavailable("down"), 1, at_decode=True) is None
    moved = a.move_shard(ticket, request, Unavailable("decode d0: UNAVAILABLE"), 0, at_decode=True)
    assert moved is not None
    assert (moved.pipeline, moved.shard, moved.locality, moved.shard_tries, moved.tries) == (
        "p0", "d1", Locality.LOCAL_FULL, 2, 1)
    assert (moved.num_pages, moved.region_bytes) == (10, 405_504)
    assert (a.shards["d0"].used_pages, a.shards["d0"].used_bytes, a.shards["d0"].num_tickets) == (0, 0, 0)
    assert (a.shards["d1"].used_pages, a.shards["d1"].used_bytes, a.shards["d1"].num_tickets) == (10, 405_504, 1)
    assert a.ticket("r") == moved and a.routing.pipelines["p0"].in_flight == 1
    assert a.move_shard(ticket, request, Unavailable("x"), 0, at_decode=True) is None  # a stale ticket
    assert a.move_shard(moved, request, Unavailable("x"), 0, at_decode=True) is None  # once
    a.release("r", now=1.0)
    assert a.shards["d1"].used_pages == 0 and a.routing.pipelines["p0"].in_flight == 0


def test_move_shard_needs_another_healthy_shard_with_room() -> None:
    a = admission()
    request = req("r")
    ticket = a.admit(request, now=0.0)
    a.set_health("d1", False)
    assert a.move_shard(ticket, request, Unavailable("down"), 0, at_decode=True) is None
    assert a.shards["d0"].used_pages == 10  # nothing moved: the request still holds its room until release
    a.set_health("d1", True)
    a.admit(req("other", max_tokens=60 + 80 * 16), now=0.0)  # 90 pages on d1, p1's own shard
    assert a.shards["d1"].free_pages == 10
    big = req("r", max_tokens=61 + 16)  # 11 pages: more than d1 has free
    assert a.move_shard(ticket, big, Unavailable("down"), 0, at_decode=True) is None


def test_unknown_shapes_admit_nothing_and_unhealthy_everything_is_unavailable() -> None:
    routing = RoutingPolicy.of(["p0"], ["d0"])
    a = Admission(routing, {"d0": "s0"}, {"p0": "s0"}, max_queue=2, queue_timeout_s=5.0)
    assert a.admit(req("r"), now=0.0) is None  # no Stats yet: it queues
    a.set_shard_shape("d0", SHAPE)
    assert a.poll(now=0.5).tickets == []  # nor StageInfo: the pipeline's device cache is unknown
    a.set_pipeline_shape("p0", 64, 16)
    assert [t.request_id for t in a.poll(now=1.0).tickets] == ["r"]
    a.set_health("d0", False)
    with pytest.raises(Unavailable, match="decode shard"):
        a.admit(req("r2"), now=1.0)
    with pytest.raises(InvalidArgument, match="request_id"):
        a.admit(req("r"), now=1.0)
    with pytest.raises(InvalidArgument, match="servers"):
        Admission(routing, {}, {"p0": "s0"}, max_queue=2, queue_timeout_s=5.0)


def stage0_admits(blocks: BlockManager, request_id: str, num_tokens: int, prefix: str = "") -> None:
    """What stage 0 does with a ticketed request: take its device blocks now (``NoFreeBlocks`` if it
    would have to wait), the computed chunks cached for later prompts of the same prefix."""
    hashes = [ChunkHash(f"{prefix or request_id}/{i}") for i in range(num_tokens // blocks.chunk_size)]
    request = PrefillRequest(request_id, num_tokens, blocks.chunk_size, hashes)
    request.admit(blocks)
    blocks.commit_chunks(request_id, request.num_device_chunks, hashes[request.num_device_chunks:])


def test_an_admitted_request_finds_its_device_blocks_free_at_stage_0() -> None:
    # the failure this prevents: both tickets issued at once, the second waited at stage 0 for blocks
    # the first held through its whole prefill, and failed there at admission_timeout_s
    routing = RoutingPolicy.of(["p0"], ["d0"])
    a = Admission(routing, {"d0": "s0"}, {"p0": "s0"}, max_queue=4, queue_timeout_s=60.0)
    a.set_shard_shape("d0", ShardShape(10_000, 16, 100_000_000, 4000, 4096, 8192))  # decode room for many
    a.set_pipeline_shape("p0", 8, 256)  # stage 0 holds 2,048 tokens
    stage0 = BlockManager(8, 256)
    first = a.admit(req("a", prompt=1500, max_tokens=8), now=0.0)
    assert first is not None and first.num_blocks == 6
    stage0_admits(stage0, "a", 1500)
    assert a.admit(req("b", prompt=1500, max_tokens=8), now=0.0) is None  # 6 + 6 > 8 blocks: it queues
    assert a.admit(req("c", prompt=300, max_tokens=8), now=0.0) is None  # 2 blocks would fit: FIFO
    assert (a.pipelines["p0"].used_blocks, a.num_admitted, a.num_queued) == (6, 1, 2)
    assert a.release("nobody", now=1.0).tickets == []
    # a's first token: it is never prefilled again, its blocks go to the queue's head
    stage0.free("a")
    admitted = a.prefill_ended("a", now=2.0).tickets
    assert [(t.request_id, t.num_blocks, t.queued_s) for t in admitted] == [("b", 6, 2.0), ("c", 2, 2.0)]
    stage0_admits(stage0, "b", 1500)  # no wait: the blocks the router counted are free there
    stage0_admits(stage0, "c", 300)
    assert (a.pipelines["p0"].used_blocks, a.shards["d0"].num_tickets) == (8, 3)
    assert not a.is_prefilling("a") and a.is_prefilling("b")
    a.release("a", now=3.0)  # its decode room goes; no blocks counted twice
    assert a.pipelines["p0"].used_blocks == 8
    a.release("b", now=4.0)  # ended before a token (a failure): its blocks go back with it
    assert a.pipelines["p0"].used_blocks == 2


def test_a_session_whose_pipeline_is_full_moves_and_a_retry_needs_room() -> None:
    a = admission()
    a.set_pipeline_shape("p0", 10, 16)  # 160 tokens: one 100-token prompt (7 blocks) at a time
    first = a.admit(req("r0", session="s"), now=0.0)
    assert (first.pipeline, first.pipeline_reason, first.num_blocks) == ("p0", PipelineReason.NEW_SESSION, 7)
    second = a.admit(req("r1", session="s"), now=0.0)
    assert (second.pipeline, second.pipeline_reason) == ("p1", PipelineReason.DEVICE_CACHE_FULL)
    assert (a.pipelines["p0"].used_blocks, a.pipelines["p1"].used_blocks) == (7, 7)
    # p1's stage fails r1: p0 has no room for it now, so it does not move (it fails with its error)
    assert a.retry(second, Unavailable("stage 1 down"), 0, "s") is None
    a.prefill_ended("r0", now=1.0)
    moved = a.retry(second, Unavailable("stage 1 down"), 0, "s")
    assert moved is not None and (moved.pipeline, moved.num_blocks) == ("p0", 7)
    assert (a.pipelines["p0"].used_blocks, a.pipelines["p1"].used_blocks) == (7, 0)
    a.prefill_ended("r1", now=2.0)  # after its first token nothing moves it
    assert a.move_shard(moved, req("r1", session="s"), Unavailable("down"), 0, at_decode=True) is None


class AdmissionMachine(RuleBasedStateMachine):
    """Room counted equals the live tickets' room and never exceeds a shard; ids are in one place."""

    def __init__(self) -> None:
        super().__init__()
        routing = RoutingPolicy.of(["p0", "p1"], ["d0", "d1", "d2"], affinity_max_queue=2)
        self.a = Admission(routing, {"d0": "s0", "d1": "s1", "d2": "s1"}, {"p0": "s0", "p1": "s1"},
                           max_queue=3, queue_timeout_s=5.0)
        for name, pages in (("d0", 40), ("d1", 20), ("d2", 60)):
            self.a.set_shard_shape(name, ShardShape(pages, 16, 1_000_000, 2000, 4096, 2048))
        # stage 0 of each pipeline, as the real one takes and frees blocks (freed here at the first
        # token, later than the real one does): every ticket must find its blocks free there at once
        self.stage0: dict[str, BlockManager] = {}
        for name, num_blocks in (("p0", 24), ("p1", 40)):
            self.a.set_pipeline_shape(name, num_blocks, 16)
            self.stage0[name] = BlockManager(num_blocks, 16)
        self.now = 0.0
        self.next_id = 0
        self.live: set[str] = set()
        self.queued: list[str] = []
        self.requests: dict[str, AdmissionRequest] = {}

    def _apply(self, admitted: Admitted) -> None:
        for request_id in admitted.expired:  # expiry comes first, then the heads that fit
            self.queued.remove(request_id)
        for ticket in admitted.tickets:
            assert ticket.request_id == self.queued.pop(0)  # FIFO
            self._prefill(ticket)

    def _prefill(self, ticket: Ticket) -> None:
        """Stage 0 takes the ticket's blocks without waiting (NoFreeBlocks would fail the test)."""
        self.live.add(ticket.request_id)
        request = self.requests[ticket.request_id]
        stage0_admits(self.stage0[ticket.pipeline], ticket.request_id, request.num_prompt_tokens,
                      request.session_key)

    def _prefill_over(self, request_id: str) -> None:
        ticket = self.a.ticket(request_id)
        if ticket is not None and self.a.is_prefilling(request_id):
            self.stage0[ticket.pipeline].free(request_id)

    @rule(prompt=st.integers(1, 400), max_tokens=st.integers(1, 400), session=st.sampled_from(["", "a", "b"]))
    def admit(self, prompt: int, max_tokens: int, session: str) -> None:
        request_id = f"r{self.next_id}"
        self.next_id += 1
        self.requests[request_id] = AdmissionRequest(request_id, session, prompt, max_tokens)
        try:
            ticket = self.a.admit(self.requests[request_id], self.now)
        except (InvalidArgument, ResourceExhausted, Unavailable) as exc:
            if isinstance(exc, ResourceExhausted):
                assert len(self.queued) == 3 and exc.retry_after_s >= 1
            return
        if ticket is None:
            self.queued.append(request_id)
        else:
            assert not self.queued  # nobody overtakes
            self._prefill(ticket)

    @precondition(lambda self: self.live or self.queued)
    @rule(i=st.integers(0, 100))
    def release(self, i: int) -> None:
        ids = sorted(self.live) + self.queued
        request_id = ids[i % len(ids)]
        if request_id in self.live:
            self._prefill_over(request_id)
            self.live.discard(request_id)
        else:
            self.queued.remove(request_id)
        self._apply(self.a.release(request_id, self.now))

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 100))
    def first_token(self, i: int) -> None:
        request_id = sorted(self.live)[i % len(self.live)]
        self._prefill_over(request_id)
        self._apply(self.a.prefill_ended(request_id, self.now))

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 100), at_decode=st.booleans())
    def fail(self, i: int, at_decode: bool) -> None:
        """A live request's shard (or pipeline) fails before any token: it moves or stays put."""
        request_id = sorted(self.live)[i % len(self.live)]
        ticket = self.a.ticket(request_id)
        assert ticket is not None
        prefilling = self.a.is_prefilling(request_id)
        moved = (self.a.move_shard(ticket, self.requests[request_id], Unavailable("down"), 0, at_decode) if at_decode
                 else self.a.retry(ticket, Unavailable("down"), 0, self.requests[request_id].session_key))
        if moved is not None:
            assert prefilling  # nothing moves once its first token is out
            assert moved.shard != ticket.shard if at_decode else moved.pipeline != ticket.pipeline
            assert self.a.ticket(request_id) == moved
            if not at_decode:  # prefilled again on the new pipeline: the old stage 0 let go
                self.stage0[ticket.pipeline].free(request_id)
                request = self.requests[request_id]
                stage0_admits(self.stage0[moved.pipeline], request_id, request.num_prompt_tokens,
                              request.session_key)

    @rule(dt=st.floats(0, 3))
    def tick(self, dt: float) -> None:
        self.now += dt
        self._apply(self.a.poll(self.now))

    @rule(name=st.sampled_from(["p0", "p1", "d0", "d1", "d2"]), healthy=st.booleans())
    def health(self, name: str, healthy: bool) -> None:
        self.a.set_health(name, healthy)

    @invariant()
    def room_matches_tickets(self) -> None:
        tickets = self.a.tickets()
        assert {t.request_id for t in tickets} == self.live
        assert self.a.queued_ids() == self.queued
        assert not self.live & set(self.queued)
        for name, shard in self.a.shards.items():
            mine = [t for t in tickets if t.shard == name]
            assert shard.used_pages == sum(t.num_pages for t in mine) <= shard.shape.num_pages
            assert shard.used_bytes == sum(t.region_bytes for t in mine) <= shard.shape.arena_bytes
            assert shard.num_tickets == len(mine)
        for name, pipeline in self.a.routing.pipelines.items():
            assert pipeline.in_flight == sum(1 for t in tickets if t.pipeline == name)
            prefilling = [t for t in tickets if t.pipeline == name and self.a.is_prefilling(t.request_id)]
            room = self.a.pipelines[name]
            assert room.used_blocks == sum(t.num_blocks for t in prefilling) <= room.num_blocks


TestAdmissionMachine = AdmissionMachine.TestCase
TestAdmissionMachine.settings = settings(max_examples=100, stateful_step_count=30, deadline=None)


def test_domain_errors_carry_their_field() -> None:
    assert InvalidArgument("token_ids[3]: 9 is outside the vocabulary").field == "token_ids[3]"
    assert InvalidArgument("sampling.top_p: must be in (0, 1]").field == "sampling.top_p"
    assert InvalidArgument("receive arena: no room").field is None  # not an identifier: no field
    assert InvalidArgument("no room", field="prompt").field == "prompt"
    assert ResourceExhausted("full", retry_after_s=3).retry_after_s == 3
