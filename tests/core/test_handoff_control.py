"""The receive arena's control records: the fence a same-host writer reads, the progress it publishes, and the
region ids decode issues so that no two live regions share a record."""

from __future__ import annotations

import pytest
from hypothesis import given, strategies as st

from kvpool.core.decode.regions import RegionTable
from kvpool.core.errors import InvalidArgument, ResourceExhausted
from kvpool.core.handoff.control import (
    COUNT_MASK,
    NONCE_MASK,
    RECORD_BYTES,
    RECORD_WORDS,
    ControlRecords,
    Frontier,
    Progress,
    fresh_nonce,
    stamp,
    unstamp,
)
from kvpool.core.handoff.layout import HandoffLayout
from tests.core.fixtures import Clock


def records(slots: int) -> ControlRecords:
    return ControlRecords(memoryview(bytearray(ControlRecords.nbytes(slots))).cast("Q"), slots)


def layout(num_tokens: int) -> HandoffLayout:
    return HandoffLayout.of(num_tokens, [(0, 2), (2, 4)], 1024)  # 4 KiB per token


def test_a_stamp_holds_its_attempt_and_count_for_its_region_only() -> None:
    assert unstamp(7, stamp(7, 3, 300)) == Progress(3, 300)
    assert unstamp(7, stamp(8, 3, 300)) is None
    assert unstamp(7 + (1 << 24), stamp(7, 3, 5)) == Progress(3, 5)  # ids compare by their low 24 bits
    assert unstamp(7, 0) is None  # a cleared word is nobody's progress
    with pytest.raises(InvalidArgument, match="count"):
        stamp(1, 1, COUNT_MASK + 1)
    with pytest.raises(InvalidArgument, match="nonce"):
        stamp(1, 0, 1)


def test_the_fence_is_up_from_open_to_close_and_progress_is_per_region() -> None:
    table = records(4)
    assert RECORD_BYTES == RECORD_WORDS * 8 == 256
    assert not table.fence_up(5)
    table.open(5)
    assert table.fence_up(5) and table.in_use(1) and not table.fence_up(1)  # 1 and 5 share slot 1
    with pytest.raises(InvalidArgument, match="slot 1 is held by region 5"):
        table.open(9)
    table.publish(5, 0, 11, 256)
    table.publish(5, 1, 12, 128, trailer=True)
    assert table.landed(5, 2) == ([Progress(11, 256), Progress(12, 128)], True)
    assert table.progress(5, 1) == Progress(12, 128)
    assert table.record_offset(5) == RECORD_BYTES
    table.close(5)
    table.close(5)  # idempotent
    assert not table.fence_up(5) and not table.in_use(5)
    table.publish(5, 0, 11, 512)  # a late writer of the closed region
    table.open(9)  # the next region in the slot starts clean
    assert table.landed(9, 2) == ([None, None], False)
    table.publish(5, 1, 12, 64)  # later still: stamped for 5, never read as 9's progress
    assert table.landed(9, 2) == ([None, None], False)


def test_a_writer_sees_one_record_as_a_table_of_one() -> None:
    table = records(8)
    table.open(11)
    words = table.words[3 * RECORD_WORDS: 4 * RECORD_WORDS]  # slot 3's record, as a writer maps it
    mine = ControlRecords(words, 1)
    assert mine.fence_up(11) and not mine.fence_up(3)
    mine.publish(11, 2, 9, 40)
    assert table.landed(11, 3) == ([None, None, Progress(9, 40)], False)


@given(st.integers(0, 1 << 32), st.none() | st.integers(1, NONCE_MASK))
def test_a_fresh_nonce_is_never_zero_nor_the_one_published(draw, previous) -> None:  # type: ignore[no-untyped-def]
    nonce = fresh_nonce(None if previous is None else Progress(previous, 1), draw)
    assert 0 < nonce <= NONCE_MASK and nonce != previous


def test_a_second_attempt_makes_decode_forget_and_scatter_all_again() -> None:
    region = RegionTable(arena_size=64 << 10, deadline_s=5.0, clock=Clock(100.0)).reserve(layout(8))
    assert region.landed is not None
    assert not region.seen_writer(0, 5)
    region.landed.land(0, 0, 6)
    assert not region.seen_writer(0, 5) and region.landed.frontier(0) == 6  # the same attempt
    assert region.seen_writer(0, 6)  # another: stage 0 is written again from token 0
    assert region.landed.frontier(0) == 0 and region.rewritten
    assert not region.seen_writer(1, 2)  # a stage's first attempt is no rewrite


def test_region_ids_skip_slots_that_live_regions_hold_and_fences_follow_the_region() -> None:
    control = records(4)
    table = RegionTable(arena_size=64 << 10, deadline_s=5.0, clock=Clock(100.0), control=control)
    a, b, c = (table.reserve(layout(1)) for _ in range(3))
    assert [r.region_id for r in (a, b, c)] == [1, 2, 3]
    assert all(control.fence_up(r.region_id) for r in (a, b, c))
    table.claim(b.region_id)  # its Generate: prefill is done with it
    assert not control.fence_up(b.region_id)
    d = table.reserve(layout(1))
    assert d.region_id == 4
    e = table.reserve(layout(1))  # 5 and 7 would share 1's and 3's slots; 6 shares claimed 2's, free now
    assert e.region_id == 6
    with pytest.raises(ResourceExhausted, match="all 4 region slots"):
        table.reserve(layout(1))
    table.free(a.region_id)
    assert not control.fence_up(a.region_id)
    assert table.reserve(layout(1)).region_id == 9  # 7 (slot 3) and 8 (slot 0, region 4) are held


def test_an_expired_region_drops_its_fence() -> None:
    clock = Clock(100.0)
    control = records(4)
    table = RegionTable(arena_size=64 << 10, deadline_s=5.0, clock=clock, writer_grace_s=0.5, control=control)
    region = table.reserve(layout(1))
    clock.now += 5.0
    assert table.expire() == [region]
    assert not control.fence_up(region.region_id)


def test_a_frontier_reaches_as_far_as_its_ranges_do_without_a_gap() -> None:
    frontier = Frontier()
    assert frontier.land(256, 512) == 0
    assert frontier.land(0, 100) == 100
    assert frontier.land(100, 256) == 512
    assert frontier.land(5, 5) == 512


@given(st.lists(st.tuples(st.integers(0, 60), st.integers(1, 20)), max_size=12), st.randoms())
def test_frontier_equals_the_gapless_cover_from_zero_in_any_order(spans, rng) -> None:  # type: ignore[no-untyped-def]
    ranges = [(s, s + n) for s, n in spans]
    rng.shuffle(ranges)
    frontier = Frontier()
    covered: set[int] = set()
    for start, end in ranges:
        value = frontier.land(start, end)
        covered.update(range(start, end))
        expected = 0
        while expected in covered:
            expected += 1
        assert value == expected
