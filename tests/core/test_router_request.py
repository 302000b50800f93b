"""The router's request driver (``kvpool.core.admission.request_driver``): its effects for each answer a
request's Serve call can get."""

from __future__ import annotations

from kvpool.core.admission.admission import Admission, AdmissionRequest, ShardShape
from kvpool.core.admission.request_driver import (
    Apply,
    Failed,
    Moved,
    RouterRequest,
    Serve,
    WaitForHealth,
    WaitForTicket,
)
from kvpool.core.admission.routing import RoutingPolicy
from kvpool.core.errors import Unavailable

SHAPE = ShardShape(num_pages=100, page_size=16, arena_bytes=1_000_000, region_bytes_per_token=4000,
                   region_trailer_bytes=4096, max_context=4096)


def admission(pipelines: tuple[str, ...] = ("p0", "p1"), health_wait_s: float = 0.0) -> Admission:
    a = Admission(RoutingPolicy.of(list(pipelines), ["d0", "d1"]), {"d0": "s0", "d1": "s1"},
                  {p: f"s{i}" for i, p in enumerate(pipelines)}, max_queue=4, queue_timeout_s=10.0,
                  health_wait_s=health_wait_s)
    for shard in ("d0", "d1"):
        a.set_shard_shape(shard, SHAPE)
        a.set_watched(shard, True, 0)
    for pipeline in pipelines:
        a.set_pipeline_shape(pipeline, 64, 16)
    return a


def req(request_id: str, session: str = "s") -> AdmissionRequest:
    return AdmissionRequest(request_id, session, 100, 60)


def test_a_ticket_is_served_confirmed_and_released() -> None:
    a = admission()
    r = RouterRequest(a, req("r"))
    [serve] = r.admit(now=0.0)
    assert isinstance(serve, Serve) and (serve.ticket.pipeline, serve.ticket.shard) == ("p0", "d0")
    assert r.reserved(now=0.1) == [Apply(a.confirmed("r", 0.1))] and not a.shards["d0"].unconfirmed
    assert r.token() == [] and not a.is_prefilling("r")
    [release] = r.end(now=1.0)
    assert isinstance(release, Apply) and a.num_admitted == 0
    assert r.end(now=1.0) == []  # once


def test_a_refused_ticket_waits_in_the_queue_again() -> None:
    a = admission()
    r = RouterRequest(a, req("r"))
    r.admit(now=0.0)
    a.set_health("d1", False)
    applied, wait = r.refused(0, now=0.5)
    assert isinstance(applied, Apply) and applied.admitted.tickets == [] and wait == WaitForTicket()
    assert a.queued_ids() == ["r"] and a.shards["d0"].full and r.ticket is None


def test_a_failed_pipeline_moves_once_then_fails() -> None:
    a = admission()
    r = RouterRequest(a, req("r"))
    r.admit(now=0.0)
    down = Unavailable("stage 1 down", field="pipeline")
    moved, serve = r.failed(down, now=1.0)
    assert moved == Moved("pipeline", "p0", "p1") and isinstance(serve, Serve) and serve.ticket.pipeline == "p1"
    assert r.failed(down, now=2.0) == [Failed(down)]


def test_a_failed_shard_moves_to_another_and_nothing_moves_after_a_token() -> None:
    a = admission()
    r = RouterRequest(a, req("r"))
    r.admit(now=0.0)
    gone = Unavailable("decode d0: UNAVAILABLE")
    moved, serve = r.failed(gone, now=1.0)
    assert moved == Moved("shard", "d0", "d1") and isinstance(serve, Serve) and serve.ticket.shard == "d1"
    late = RouterRequest(a, req("late"))
    late.admit(now=1.0)
    late.token()
    assert late.failed(gone, now=2.0) == [Failed(gone)]


def test_its_only_pipeline_failed_it_waits_for_a_health_round_that_finds_it_serving() -> None:
    a = admission(pipelines=("p0",), health_wait_s=5.0)
    a.begin_health_round()
    r = RouterRequest(a, req("r"))
    r.admit(now=0.0)
    down = Unavailable("stage 2: UNAVAILABLE", field="pipeline")
    assert r.failed(down, now=1.0) == [WaitForHealth(6.0)]
    a.begin_health_round()
    a.set_health("p0", False)  # restarting
    assert r.health_round(now=2.0, deadline=6.0) == []
    a.begin_health_round()
    a.set_health("p0", True)  # back, seen by a round begun after the failure
    moved, serve = r.health_round(now=3.0, deadline=6.0)
    assert moved == Moved("pipeline", "p0", "p0") and isinstance(serve, Serve)
    other = RouterRequest(a, req("other"))
    other.admit(now=3.0)
    assert other.failed(down, now=4.0) == [WaitForHealth(9.0)]
    assert other.health_round(now=9.0, deadline=9.0) == [Failed(down)]  # the wait is over: it fails
