"""Decode receive regions: exact offsets, one claim per region, deadline reclaim."""

from __future__ import annotations

import pytest

from kvpool.core.decode.regions import RegionTable
from kvpool.core.errors import InvalidArgument, NotFound, ResourceExhausted
from kvpool.core.handoff.layout import HandoffLayout
from tests.core.fixtures import Clock


def layout(num_tokens: int) -> HandoffLayout:
    return HandoffLayout.of(num_tokens, [(0, 2), (2, 4)], 1024)  # 4 KiB per token


def test_reserve_claim_free_and_exact_offsets() -> None:
    clock = Clock(100.0)
    table = RegionTable(arena_size=64 << 10, deadline_s=5.0, clock=clock)
    a = table.reserve(layout(3))  # 12 KiB
    b = table.reserve(layout(2))
    assert (a.region_id, a.offset, a.size, a.deadline) == (1, 0, 12 << 10, 105.0)
    assert (b.region_id, b.offset) == (2, 12 << 10)
    assert table.claim(1) is a
    with pytest.raises(InvalidArgument, match="region_id: 1 is already in use"):
        table.claim(1)
    assert table.free(1) and not table.free(1)
    with pytest.raises(InvalidArgument, match="region_id: 1 was already used"):
        table.claim(1)
    with pytest.raises(NotFound, match="region_id: 99"):
        table.claim(99)
    assert table.used_bytes == 8 << 10


def test_full_arena_and_never_fitting() -> None:
    table = RegionTable(arena_size=16 << 10, deadline_s=5.0, clock=Clock(100.0))
    table.reserve(layout(3))
    with pytest.raises(ResourceExhausted):
        table.reserve(layout(2))
    with pytest.raises(InvalidArgument, match="num_tokens"):
        table.reserve(layout(5))


def test_unclaimed_regions_expire_at_their_deadline_claimed_ones_never() -> None:
    clock = Clock(100.0)
    table = RegionTable(arena_size=64 << 10, deadline_s=5.0, clock=clock)
    table.reserve(layout(1))
    table.reserve(layout(1))
    table.claim(2)
    clock.now = 104.999
    assert table.expire() == []
    clock.now = 105.0
    assert [r.region_id for r in table.expire()] == [1]
    clock.now = 1e9
    assert table.expire() == [] and table.num_regions == 1
    with pytest.raises(InvalidArgument, match="expired"):
        table.claim(1)


def test_a_region_may_carry_its_own_hold_and_a_logits_trailer() -> None:
    clock = Clock(100.0)
    table = RegionTable(arena_size=64 << 10, deadline_s=5.0, clock=clock)
    with_trailer = HandoffLayout.of(2, [(0, 2)], 1024, trailer_bytes=400)
    assert (with_trailer.kv_nbytes, with_trailer.trailer_offset, with_trailer.nbytes) == (4096, 4096, 4496)
    long = table.reserve(with_trailer, hold_s=60.0)
    assert (long.size, table.used_bytes) == (4496, 8192)  # rounded to the 4 KiB alignment in the arena
    clock.now = 159.0
    assert table.expire() == []
    clock.now = 160.0
    assert [r.region_id for r in table.expire()] == [long.region_id]
    with pytest.raises(InvalidArgument, match="hold_s"):
        table.reserve(with_trailer, hold_s=0.0)


def test_a_region_given_back_keeps_its_bytes_for_the_writers_grace_then_frees_them() -> None:
    # prefill checks the region right before each write: a write that passed the check lands in
    # bytes no other region holds yet
    clock = Clock(100.0)
    table = RegionTable(arena_size=16 << 10, deadline_s=5.0, clock=clock, writer_grace_s=0.5)
    a = table.reserve(layout(3))  # 12 KiB of 16
    assert table.free(a.region_id, grace_s=0.5)
    assert table.get(a.region_id) is None and table.num_regions == 0 and table.num_draining == 1
    assert table.used_bytes == 12 << 10
    with pytest.raises(ResourceExhausted):
        table.reserve(layout(2))  # the bytes are still the writers'
    clock.now = 100.499
    assert table.expire() == [] and table.used_bytes == 12 << 10
    clock.now = 100.5
    assert table.expire() == [] and table.used_bytes == 0 and table.num_draining == 0
    assert table.reserve(layout(3)).offset == 0
    # an expired region drains the same way
    clock.now = 105.5
    [expired] = table.expire()
    assert expired.region_id == 2 and table.used_bytes == 12 << 10 and table.num_draining == 1
    clock.now = 106.0
    table.expire()
    assert table.used_bytes == 0
