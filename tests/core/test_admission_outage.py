"""Admission while a part is down (``health_wait_s``): a request waits for a pipeline or shard to come
back instead of failing at once, and a request whose only pipeline failed retries there once a health
round begun after the failure finds it serving. Exact, on the core alone."""

from __future__ import annotations

import pytest

from kvpool.core.admission.admission import Admission, AdmissionRequest, ShardShape
from kvpool.core.errors import InvalidArgument, Unavailable
from kvpool.core.admission.routing import RoutingPolicy

SHAPE = ShardShape(num_pages=100, page_size=16, arena_bytes=1_000_000, region_bytes_per_token=4000,
                   region_trailer_bytes=4096, max_context=4096)
PIPELINE_DOWN = "no healthy prefill pipeline"


def one_pipeline(health_wait_s: float = 5.0) -> Admission:
    a = Admission(RoutingPolicy.of(["p0"], ["d0"]), {"d0": "s0"}, {"p0": "s0"}, max_queue=2, queue_timeout_s=30.0,
                  health_wait_s=health_wait_s)
    a.set_shard_shape("d0", SHAPE)
    a.set_pipeline_shape("p0", 64, 16)
    a.begin_health_round()
    a.set_health("p0", True)
    a.set_health("d0", True)
    return a


def req(request_id: str, session: str = "") -> AdmissionRequest:
    return AdmissionRequest(request_id, session, 100, 60)


def test_while_no_pipeline_is_healthy_requests_wait_for_one_and_get_tickets_when_it_serves() -> None:
    a = one_pipeline()
    a.set_health("p0", False)  # its stage 2 is restarting
    assert a.admit(req("r1"), now=0.0) is None  # queued, not refused
    assert a.admit(req("r2"), now=1.0) is None
    with pytest.raises(Unavailable, match=PIPELINE_DOWN):  # the queue is full: what is missing, not "full"
        a.admit(req("r3"), now=1.0)
    waiting = a.poll(now=4.0)
    assert (waiting.tickets, waiting.expired, waiting.unavailable) == ([], [], {})
    a.set_health("p0", True)
    back = a.poll(now=4.5)
    assert [t.request_id for t in back.tickets] == ["r1", "r2"] and back.unavailable == {}


def test_a_request_waits_health_wait_s_for_a_missing_part_at_most() -> None:
    a = one_pipeline(health_wait_s=5.0)
    a.set_health("p0", False)
    assert a.admit(req("r1"), now=0.0) is None
    assert a.admit(req("r2"), now=3.0) is None
    assert a.poll(now=4.9).unavailable == {}
    assert a.poll(now=5.0).unavailable == {"r1": PIPELINE_DOWN}  # r2 has waited 2 s
    assert a.poll(now=8.0).unavailable == {"r2": PIPELINE_DOWN}
    assert a.num_queued == 0
    a.set_health("p0", True)
    a.set_health("d0", False)
    assert a.admit(req("r4"), now=9.0) is None
    assert a.poll(now=14.0).unavailable == {"r4": "no healthy decode shard"}  # the outage's clock restarted


def test_without_a_health_wait_a_request_is_refused_at_once() -> None:
    a = one_pipeline(health_wait_s=0.0)
    a.set_health("d0", False)
    with pytest.raises(Unavailable, match="no healthy decode shard"):
        a.admit(req("r"), now=0.0)
    a.set_health("d0", True)
    ticket = a.admit(req("r"), now=0.0)
    assert ticket is not None and not a.retry_may_wait(ticket, Unavailable("down"), 0)
    with pytest.raises(InvalidArgument, match="health_wait_s"):
        one_pipeline(health_wait_s=-1.0)


def test_a_request_whose_only_pipeline_failed_retries_there_once_a_later_round_finds_it_serving() -> None:
    a = one_pipeline()
    ticket = a.admit(req("r", session="s"), now=0.0)
    assert ticket is not None
    down = Unavailable("stage 2: UNAVAILABLE")
    in_flight = a.begin_health_round()  # a round is asking while the request fails ...
    failed_round = a.health_round
    a.set_health("p0", True)  # ... and answers: it may have asked before the failure
    assert a.retry(ticket, down, 0, "s", failed_round) is None
    assert in_flight == failed_round
    assert a.retry_may_wait(ticket, down, 0)  # no other pipeline, but its own may come back
    a.begin_health_round()
    a.set_health("p0", False)  # the stage is restarting
    assert a.retry(ticket, down, 0, "s", failed_round) is None
    a.begin_health_round()
    a.set_health("p0", True)  # back, seen by a round begun after the failure
    assert a.retry(ticket, down, 0, "s") is None  # without the failure's round: another pipeline only
    moved = a.retry(ticket, down, 0, "s", failed_round)
    assert moved is not None and (moved.pipeline, moved.shard, moved.tries) == ("p0", ticket.shard, 2)
    assert a.routing.pipelines["p0"].in_flight == 1
    assert a.retry(moved, down, 0, "s", failed_round) is None  # once only
    assert not a.retry_may_wait(moved, down, 0)
    a.release("r", now=1.0)
    assert a.routing.pipelines["p0"].in_flight == 0
