"""The master's HA decisions: epochs and fences, a candidate's deadline, what a client follows, when a new leader
opens; and a state machine over kills, pauses and partitions that checks no two candidates ever serve at once."""

from __future__ import annotations

import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvpool.core.ha.epochs import Epoch, EpochFence, Leader, LeaderView
from kvpool.core.ha.leadership import AdoptionGate, Leadership, LeaseTimes, Role

TIMES = LeaseTimes(ttl_s=2.0, keepalive_s=0.4, margin_s=0.3)


# ---- fences --------------------------------------------------------------------------------------------------


def test_a_fence_admits_the_same_or_newer_epoch_and_refuses_older() -> None:
    fence = EpochFence()
    assert [fence.admit(e) for e in (0, 5, 5, 4, 7, 6, 0)] == [True, True, True, False, True, False, False]
    assert fence.epoch == 7 and fence.num_refused == 3


def test_a_leader_needs_an_address_and_a_positive_epoch() -> None:
    with pytest.raises(ValueError, match="address"):
        Leader("", Epoch(3))
    with pytest.raises(ValueError, match="epoch"):
        Leader("a:1", Epoch(0))


def test_a_client_switches_only_to_a_newer_epoch() -> None:
    view = LeaderView()
    a, b = Leader("a:1", Epoch(10)), Leader("b:1", Epoch(12))
    assert view.announce(a) is True and view.leader == a
    assert view.announce(a) is False  # the same announcement read again
    assert view.announce(Leader("c:1", Epoch(9))) is False  # a delayed event of an older leader
    assert view.announce(b) is True and view.leader == b and view.num_switches == 1
    assert view.announce(a) is False and view.leader == b


def test_a_vacancy_leaves_no_leader_until_a_newer_one_and_older_vacancies_change_nothing() -> None:
    view = LeaderView()
    view.announce(Leader("a:1", Epoch(10)))
    assert view.vacate(9) is False and view.leader is not None
    assert view.vacate(10) is True and view.leader is None and view.epoch == 10
    assert view.vacate(10) is False
    assert view.announce(Leader("a:1", Epoch(10))) is False  # its put event arrived after its delete
    assert view.announce(Leader("b:1", Epoch(11))) is True and view.leader == Leader("b:1", Epoch(11))
    assert view.num_switches == 0  # the switch went through a vacancy


# ---- lease times ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, field", [
    ({"ttl_s": 0.5}, "lease_ttl_s"), ({"ttl_s": 2.5}, "lease_ttl_s"), ({"margin_s": 1.0}, "lease_margin_s"),
    ({"margin_s": 0.0}, "lease_margin_s"), ({"keepalive_s": 0.6}, "lease_keepalive_s"),
    ({"keepalive_s": 0.0}, "lease_keepalive_s"),
])
def test_lease_times_refuse_settings_that_would_flap_or_overlap(kwargs: dict[str, float], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        LeaseTimes(**kwargs)


# ---- leadership ----------------------------------------------------------------------------------------------


def test_a_leader_serves_until_its_send_time_plus_ttl_less_the_margin() -> None:
    lead = Leadership(TIMES)
    assert lead.serving(0.0) is False
    lead.won(epoch=7, sent_at=10.0)
    assert lead.role is Role.LEADER and lead.epoch == 7 and lead.deadline == pytest.approx(11.7)
    assert lead.serving(11.69) is True and lead.serving(11.7) is False
    lead.renewed(sent_at=11.0, ttl_s=2.0)  # answered late: counted from when it was sent
    assert lead.deadline == pytest.approx(12.7)
    lead.renewed(sent_at=10.5, ttl_s=2.0)  # an older answer never shortens it
    assert lead.deadline == pytest.approx(12.7)
    lead.renewed(sent_at=12.0, ttl_s=1.0)  # etcd says less is left: believe it
    assert lead.deadline == pytest.approx(12.7)
    assert lead.check(12.69) is True and lead.check(12.7) is False
    assert lead.role is Role.DEPOSED
    lead.renewed(sent_at=12.8, ttl_s=2.0)  # a deposed candidate is never revived by a late answer
    assert lead.serving(12.9) is False


def test_a_lapsed_lease_deposes_at_once_and_a_new_term_needs_a_newer_epoch() -> None:
    lead = Leadership(TIMES)
    lead.won(epoch=3, sent_at=0.0)
    lead.renewed(sent_at=0.4, ttl_s=0)
    assert lead.role is Role.DEPOSED and lead.serving(0.5) is False
    lead.stand_by()
    assert lead.role is Role.STANDBY
    with pytest.raises(ValueError, match="epoch"):
        lead.won(epoch=3, sent_at=1.0)
    lead.won(epoch=9, sent_at=5.0)
    assert lead.serving(5.0) is True and lead.num_terms == 2


def test_the_adoption_gate_opens_when_every_registered_store_reported_or_after_the_grace() -> None:
    gate = AdoptionGate(won_at=100.0, grace_s=1.0)
    assert gate.open(100.2, frozenset({"s0", "s1"}), frozenset({"s0"})) is False
    assert gate.open(100.3, frozenset({"s0", "s1"}), frozenset({"s0", "s1", "s2"})) is True
    assert gate.open(101.0, frozenset({"s0", "s1"}), frozenset()) is True
    assert gate.open(100.0, frozenset(), frozenset()) is True  # no store registered: nothing to wait for


# ---- the state machine ---------------------------------------------------------------------------------------

CANDIDATES = 3


class Election(RuleBasedStateMachine):
    """Candidates under etcd's lease, with time, kills, pauses, partitions from etcd and late keep-alive answers.
    etcd expires a lease ``ttl`` after it received the last keep-alive; a client and a store keep fences."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.revision = 0
        self.holder: int | None = None  # etcd's leader key: whose lease holds it
        self.holder_epoch = 0
        self.expires_at = 0.0
        self.lead = [Leadership(TIMES) for _ in range(CANDIDATES)]
        self.alive = [True] * CANDIDATES
        self.paused = [False] * CANDIDATES
        self.cut = [False] * CANDIDATES  # partitioned from etcd
        self.in_flight: list[tuple[int, float, float]] = []  # keep-alive answers on their way: (who, sent, ttl)
        self.client = EpochFence()
        self.view = LeaderView()
        self.store = EpochFence()
        self.commits: list[int] = []  # epochs of the commits the store took, in order
        self.replies: list[int] = []  # epochs of answers on the wire to the client

    def _running(self, c: int) -> bool:
        return self.alive[c] and not self.paused[c]

    @rule(dt=st.floats(0.01, 1.5))
    def tick(self, dt: float) -> None:
        self.now += dt
        if self.holder is not None and self.now >= self.expires_at:
            self.view.vacate(self.holder_epoch)
            self.holder = None

    @rule(c=st.integers(0, CANDIDATES - 1))
    def campaign(self, c: int) -> None:
        if not self._running(c) or self.cut[c] or self.lead[c].role is Role.LEADER or self.holder is not None:
            return
        self.lead[c].stand_by()
        self.revision += 1
        self.holder, self.holder_epoch, self.expires_at = c, self.revision, self.now + TIMES.ttl_s
        self.lead[c].won(self.revision, sent_at=self.now)
        self.view.announce(Leader(f"m{c}:1", Epoch(self.revision)))

    @rule(c=st.integers(0, CANDIDATES - 1), answered_later=st.booleans())
    def keepalive(self, c: int, answered_later: bool) -> None:
        if not self._running(c) or self.lead[c].role is not Role.LEADER or self.cut[c]:
            return
        held = self.holder == c and self.holder_epoch == self.lead[c].epoch and self.now < self.expires_at
        if held:
            self.expires_at = self.now + TIMES.ttl_s  # received now: it counts from now
        answer = (c, self.now, TIMES.ttl_s if held else 0.0)
        if answered_later:
            self.in_flight.append(answer)
        else:
            self.lead[c].renewed(answer[1], answer[2])

    @precondition(lambda self: self.in_flight)
    @rule(data=st.data())
    def deliver(self, data: st.DataObject) -> None:
        c, sent, ttl = self.in_flight.pop(data.draw(st.integers(0, len(self.in_flight) - 1)))
        if self._running(c):
            self.lead[c].renewed(sent, ttl)

    @rule(c=st.integers(0, CANDIDATES - 1))
    def kill_and_restart(self, c: int) -> None:
        self.alive[c] = True
        self.paused[c] = False
        self.lead[c] = Leadership(TIMES)  # a new process knows nothing
        self.in_flight = [a for a in self.in_flight if a[0] != c]

    @rule(c=st.integers(0, CANDIDATES - 1))
    def pause_or_resume(self, c: int) -> None:
        self.paused[c] = not self.paused[c]

    @rule(c=st.integers(0, CANDIDATES - 1))
    def partition_or_heal(self, c: int) -> None:
        self.cut[c] = not self.cut[c]

    @rule(c=st.integers(0, CANDIDATES - 1), late=st.booleans())
    def serve_and_commit(self, c: int, late: bool) -> None:
        """A candidate answers a client and makes a commit durable at the store, only while it serves."""
        if not self._running(c) or not self.lead[c].check(self.now):
            return
        epoch = self.lead[c].epoch
        if self.store.admit(epoch):
            self.commits.append(epoch)
        if late:
            self.replies.append(epoch)
        else:
            self.client.admit(epoch)

    @precondition(lambda self: self.replies)
    @rule()
    def late_reply(self) -> None:
        before, epoch = self.client.epoch, self.replies.pop(0)
        admitted = self.client.admit(epoch)
        # a reply of an older epoch than the client heard is refused, and leaves what it heard as it was
        assert admitted == (epoch >= before) and self.client.epoch == max(before, epoch)

    @invariant()
    def at_most_one_serves_and_it_holds_the_lease(self) -> None:
        serving = [c for c in range(CANDIDATES) if self.alive[c] and self.lead[c].serving(self.now)]
        assert len(serving) <= 1, serving
        for c in serving:
            assert self.holder == c and self.lead[c].epoch == self.holder_epoch
            assert self.lead[c].deadline <= self.expires_at  # it stops before etcd could let another win

    @invariant()
    def the_store_took_commits_in_epoch_order(self) -> None:
        assert self.commits == sorted(self.commits)
        assert not self.commits or self.store.epoch == self.commits[-1]

    @invariant()
    def the_client_follows_the_newest_leader(self) -> None:
        assert self.view.epoch <= self.revision
        if self.view.leader is not None:
            assert self.view.leader.epoch == self.holder_epoch


TestElection = Election.TestCase
TestElection.settings = settings(max_examples=150, stateful_step_count=60, deadline=None)
