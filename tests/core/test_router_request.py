"""The router's request driver (``kvpool.core.admission.request_driver``): its effects for each answer a
request's Serve call can get, and over any order of answers, health changes and deadlines, admission holds
exactly what the live requests hold."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

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
from kvpool.core.errors import InvalidArgument, ResourceExhausted, Unavailable

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


class RouterRequestMachine(RuleBasedStateMachine):
    """Requests at the router, each run by its driver, with every answer a Serve call can get, health changes
    and queue deadlines in any order: admission's tickets are exactly the live requests' that hold one, a
    request waits in the queue or holds a ticket (never both), and once every request ended nothing is
    held anywhere."""

    def __init__(self) -> None:
        super().__init__()
        self.a = admission(health_wait_s=5.0)
        self.a.begin_health_round()
        self.now = 0.0
        self.next_id = 0
        self.drivers: dict[str, RouterRequest] = {}
        self.state: dict[str, str] = {}  # waiting | serving | confirmed | health | ended

    def _apply(self, request_id: str, effects: list[object]) -> None:
        if any(isinstance(e, WaitForTicket) for e in effects):  # as the router makes its waiter first
            self.state[request_id] = "waiting"
        for effect in effects:
            if isinstance(effect, Apply):
                for other in effect.admitted.expired + list(effect.admitted.unavailable):
                    self._end(other)  # refused in the queue: its request ends
                for ticket in effect.admitted.tickets:
                    assert self.state[ticket.request_id] == "waiting"
                    self._apply(ticket.request_id, self.drivers[ticket.request_id].ticketed(ticket))
            elif isinstance(effect, Serve):
                self.state[request_id] = "serving"
            elif isinstance(effect, WaitForTicket):
                pass  # (before the rest: above)
            elif isinstance(effect, WaitForHealth):
                self.state[request_id] = "health"
            elif isinstance(effect, Failed):
                self._end(request_id)

    def _end(self, request_id: str) -> None:
        if self.state.get(request_id) != "ended":
            self.state[request_id] = "ended"
            self._apply(request_id, self.drivers[request_id].end(self.now))

    def _in(self, *states: str) -> list[str]:
        return sorted(r for r, s in self.state.items() if s in states)

    @rule(session=st.sampled_from(["", "a", "b"]))
    def arrive(self, session: str) -> None:
        request_id = f"r{self.next_id}"
        self.next_id += 1
        driver = self.drivers[request_id] = RouterRequest(self.a, req(request_id, session))
        self.state[request_id] = "new"
        try:
            self._apply(request_id, driver.admit(self.now))
        except (InvalidArgument, ResourceExhausted, Unavailable):
            self._end(request_id)

    @precondition(lambda self: self._in("serving"))
    @rule(i=st.integers(0, 50), answer=st.sampled_from(["reserved", "refused", "pipeline", "shard"]))
    def serve_answers(self, i: int, answer: str) -> None:
        ids = self._in("serving")
        request_id = ids[i % len(ids)]
        driver = self.drivers[request_id]
        if answer == "reserved":
            self.state[request_id] = "confirmed"
            self._apply(request_id, driver.reserved(self.now))
        elif answer == "refused":
            self._apply(request_id, driver.refused(None, self.now))
        else:
            field = "pipeline" if answer == "pipeline" else ""
            self._apply(request_id, driver.failed(Unavailable("down", field=field), self.now))

    @precondition(lambda self: self._in("confirmed"))
    @rule(i=st.integers(0, 50), after_token=st.booleans())
    def decode_ends(self, i: int, after_token: bool) -> None:
        ids = self._in("confirmed")
        request_id = ids[i % len(ids)]
        driver = self.drivers[request_id]
        if after_token:
            assert driver.token() == [] and not self.a.is_prefilling(request_id)
        self._end(request_id)

    @precondition(lambda self: any(self.state.values()))
    @rule(i=st.integers(0, 50))
    def client_goes_away(self, i: int) -> None:
        ids = self._in("new", "waiting", "serving", "confirmed", "health")
        if ids:
            self._end(ids[i % len(ids)])

    @rule(name=st.sampled_from(["p0", "p1", "d0", "d1"]), healthy=st.booleans())
    def health(self, name: str, healthy: bool) -> None:
        self.a.begin_health_round()
        self.a.set_health(name, healthy)
        for request_id in self._in("health"):
            self._apply(request_id, self.drivers[request_id].health_round(self.now, self.now + 5.0))

    @rule(dt=st.floats(0, 3), shard=st.sampled_from(["d0", "d1"]))
    def room_comes_back(self, dt: float, shard: str) -> None:
        self.now += dt
        self._apply("", [Apply(self.a.room_again(shard, 0, self.now))])
        for request_id in self._in("health"):  # a wait's deadline
            self._apply(request_id, self.drivers[request_id].health_round(self.now, self.now))

    @invariant()
    def tickets_are_the_live_requests_that_hold_one(self) -> None:
        holding = {r for r, s in self.state.items() if s in ("serving", "confirmed", "health")}
        assert {t.request_id for t in self.a.tickets()} == holding
        assert set(self.a.queued_ids()) == {r for r, s in self.state.items() if s == "waiting"}
        for name, pipeline in self.a.routing.pipelines.items():
            assert pipeline.in_flight == sum(1 for t in self.a.tickets() if t.pipeline == name)

    def teardown(self) -> None:
        for request_id in list(self.state):
            self._end(request_id)
        assert self.a.num_admitted == 0 and self.a.num_queued == 0
        assert all(p.in_flight == 0 for p in self.a.routing.pipelines.values())
        assert all(s.num_tickets == 0 and not s.unconfirmed for s in self.a.shards.values())


TestRouterRequestMachine = RouterRequestMachine.TestCase
TestRouterRequestMachine.settings = settings(max_examples=100, stateful_step_count=30, deadline=None)
