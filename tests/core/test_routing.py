"""Router placement: session affinity under a queue threshold, least-loaded fallback, most free pages."""

from __future__ import annotations

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvpool.core.errors import InvalidArgument, Unavailable
from kvpool.core.admission.routing import PipelineReason, Placement, RoutingPolicy


def policy(**settings: int) -> RoutingPolicy:
    p = RoutingPolicy.of(["p0", "p1"], ["d0", "d1"], **settings)
    p.report_free_pages("d0", 100)
    p.report_free_pages("d1", 80)
    return p


def test_a_session_sticks_to_its_pipeline_below_the_threshold() -> None:
    p = policy(affinity_max_queue=2)
    first = p.place("s", 10)
    assert (first.pipeline, first.pipeline_reason, first.shard) == ("p0", PipelineReason.NEW_SESSION, "d0")
    other = p.place("t", 10)
    assert other.pipeline == "p1"  # least loaded
    second = p.place("s", 10)  # p0 has 1 in flight < 2
    assert (second.pipeline, second.pipeline_reason) == ("p0", PipelineReason.AFFINITY)
    third = p.place("s", 10)  # p0 has 2 in flight: overloaded, p1 has 1
    assert (third.pipeline, third.pipeline_reason) == ("p1", PipelineReason.OVERLOADED)
    assert p.session_pipeline("s") == "p1"  # the session moved


def test_unhealthy_pipelines_and_shards_leave_rotation() -> None:
    p = policy()
    p.place("s", 1)
    p.set_health("p0", False)
    moved = p.place("s", 1)
    assert (moved.pipeline, moved.pipeline_reason) == ("p1", PipelineReason.UNHEALTHY)
    p.set_health("p1", False)
    with pytest.raises(Unavailable, match="no healthy prefill pipeline"):
        p.place("s", 1)
    p.set_health("p0", True)
    assert p.place("", 1).pipeline == "p0"
    p.set_health("d0", False)
    p.set_health("d1", False)
    with pytest.raises(Unavailable, match="no healthy decode shard"):
        p.place("", 1)


def test_a_retry_excludes_the_pipelines_that_failed_it_without_touching_their_health() -> None:
    p = policy()
    p.finish(p.place("s", 1))  # the session lives on p0
    retry = p.place("s", 1, exclude={"p0"})
    assert (retry.pipeline, retry.pipeline_reason) == ("p1", PipelineReason.EXCLUDED_AFTER_FAILURE)
    assert p.pipelines["p0"].healthy  # out of rotation for that request only
    assert p.session_pipeline("s") == "p1"  # the session follows the retry
    # excluded and unhealthy at once: the exclusion is why this request moved
    p.set_health("p1", False)
    assert p.place("s", 1, exclude={"p1"}).pipeline_reason == PipelineReason.EXCLUDED_AFTER_FAILURE
    assert p.place("s", 1).pipeline_reason == PipelineReason.AFFINITY  # p0, where the last placement went
    p.set_health("p1", True)
    with pytest.raises(Unavailable, match="no healthy prefill pipeline"):
        p.place("s", 1, exclude={"p0", "p1"})
    assert p.set_health("p1", False) and not p.set_health("p1", False)  # True only when it changed


def test_decode_goes_to_the_most_free_pages_after_promises() -> None:
    p = policy()
    a = p.place("", 30)  # d0: 100 free -> 70 after the promise; d1 80
    assert a.shard == "d0"
    b = p.place("", 30)  # d0 70 vs d1 80
    assert b.shard == "d1"
    c = p.place("", 5)  # d0 70 vs d1 50
    assert c.shard == "d0"
    p.admitted(a, 30)  # d0 took a's pages; its next report shows them
    p.report_free_pages("d0", 70)
    p.finish(c, num_pages_not_admitted=5)
    assert (p.shards["d0"].promised_pages, p.shards["d1"].promised_pages) == (0, 30)
    assert p.place("", 1).shard == "d0"  # 70 vs 50


def test_session_memory_is_bounded_lru() -> None:
    p = policy(max_sessions=2)
    for key in ("a", "b", "c"):
        p.finish(p.place(key, 1))
    assert p.session_pipeline("a") is None
    assert p.session_pipeline("b") is not None and p.session_pipeline("c") is not None


def test_bad_configuration() -> None:
    with pytest.raises(InvalidArgument, match="affinity_max_queue"):
        RoutingPolicy(affinity_max_queue=0)
    with pytest.raises(InvalidArgument, match="at least one"):
        RoutingPolicy.of([], ["d0"])
    with pytest.raises(InvalidArgument, match="unknown"):
        policy().set_health("nope", False)


class RouterMachine(RuleBasedStateMachine):
    """In-flight counts always equal the placements not yet finished."""

    def __init__(self) -> None:
        super().__init__()
        self.policy = RoutingPolicy.of(["p0", "p1", "p2"], ["d0", "d1"], affinity_max_queue=2)
        self.open: list[tuple[Placement, int]] = []

    @rule(session=st.sampled_from(["", "a", "b", "c"]), pages=st.integers(0, 20))
    def place(self, session: str, pages: int) -> None:
        try:
            placement = self.policy.place(session, pages)
        except Unavailable:
            assert not any(b.healthy for b in self.policy.pipelines.values()) or not any(
                b.healthy for b in self.policy.shards.values())
            return
        assert self.policy.pipelines[placement.pipeline].healthy and self.policy.shards[placement.shard].healthy
        self.open.append((placement, pages))

    @precondition(lambda self: self.open)
    @rule(i=st.integers(0, 100), admit=st.booleans())
    def finish(self, i: int, admit: bool) -> None:
        placement, pages = self.open.pop(i % len(self.open))
        if admit:
            self.policy.admitted(placement, pages)
            self.policy.finish(placement)
        else:
            self.policy.finish(placement, num_pages_not_admitted=pages)

    @rule(name=st.sampled_from(["p0", "p1", "p2", "d0", "d1"]), healthy=st.booleans())
    def health(self, name: str, healthy: bool) -> None:
        self.policy.set_health(name, healthy)

    @rule(shard=st.sampled_from(["d0", "d1"]), free=st.integers(0, 200))
    def report(self, shard: str, free: int) -> None:
        self.policy.report_free_pages(shard, free)

    @invariant()
    def counts_match(self) -> None:
        for name, target in {**self.policy.pipelines, **self.policy.shards}.items():
            expected = sum(1 for p, _ in self.open if name in (p.pipeline, p.shard))
            assert target.in_flight == expected, name
        for name, shard in self.policy.shards.items():
            promised = sum(pages for p, pages in self.open if p.shard == name)
            assert shard.promised_pages == promised, name


TestRouterMachine = RouterMachine.TestCase
