"""The segment allocator: exact behaviour, equal-size churn and a state machine against an interval model, each
run on the Python allocator and on its C twin (``new_allocator``); then the two fed one random stream of calls,
answer for answer."""

from __future__ import annotations

import random
from collections.abc import Callable
from functools import partial
from typing import Any

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from kvpool.core.pool import allocator as allocator_module, lru
from kvpool.core.pool.allocator import (
    AllocatorError,
    Extent,
    SegmentAllocator,
    UnknownOffsetError,
    native_allocator_class,
    new_allocator,
)

Make = Callable[..., Any]


@pytest.fixture(params=[False, True], ids=["python", "c"])
def make(request: pytest.FixtureRequest) -> Make:
    """An allocator's constructor: the Python one, or its C twin."""
    return partial(new_allocator, native=request.param)


def extents(alloc: SegmentAllocator) -> list[tuple[int, int]]:
    return [(e.offset, e.size) for e in alloc.free_extents()]


# -- exact behaviour ----------------------------------------------------------


def test_fresh_segment_hands_out_offsets_in_order(make: Make) -> None:
    alloc = make(1024)
    assert (alloc.capacity, alloc.alignment) == (1024, 64)
    assert [alloc.allocate(64), alloc.allocate(100), alloc.allocate(1)] == [0, 64, 192]
    assert alloc.used_bytes == 256
    assert alloc.free_bytes == 768
    assert alloc.num_allocations == 3
    assert extents(alloc) == [(256, 768)]
    assert alloc.largest_free == 768


def test_alignment_rounding(make: Make) -> None:
    alloc = make(8192)
    assert alloc.rounded_size(1) == 64
    assert alloc.rounded_size(64) == 64
    assert alloc.rounded_size(65) == 128
    assert alloc.allocate(1) == 0
    assert alloc.allocate(65) == 64
    assert alloc.allocation_size(0) == 64
    assert alloc.allocation_size(64) == 128
    assert alloc.used_bytes == 192

    page = make(3 * 4096, alignment=4096)
    assert [page.allocate(1), page.allocate(4097)] == [0, 4096]
    assert page.free_bytes == 0

    exact = make(100, alignment=1)
    assert [exact.allocate(3), exact.allocate(7), exact.allocate(90)] == [0, 3, 10]
    assert exact.allocate(1) is None


def test_unaligned_capacity_keeps_short_tail(make: Make) -> None:
    alloc = make(200)  # 3 * 64 + 8
    assert [alloc.allocate(64) for _ in range(3)] == [0, 64, 128]
    assert extents(alloc) == [(192, 8)]
    assert alloc.allocate(1) is None  # needs 64
    alloc.free(128)
    assert extents(alloc) == [(128, 72)]
    assert alloc.allocate(1) == 128


@pytest.fixture
def four_blocks(make: Make) -> SegmentAllocator:
    # a=0 b=64 c=128 d=192, free tail (256, 64)
    alloc = make(320)
    assert [alloc.allocate(64) for _ in range(4)] == [0, 64, 128, 192]
    assert extents(alloc) == [(256, 64)]
    return alloc


def test_free_coalesces_left_neighbour(four_blocks: SegmentAllocator) -> None:
    four_blocks.free(64)
    assert extents(four_blocks) == [(64, 64), (256, 64)]
    four_blocks.free(128)
    assert extents(four_blocks) == [(64, 128), (256, 64)]
    assert four_blocks.largest_free == 128


def test_free_coalesces_right_neighbour(four_blocks: SegmentAllocator) -> None:
    four_blocks.free(128)
    four_blocks.free(64)
    assert extents(four_blocks) == [(64, 128), (256, 64)]
    four_blocks.free(192)  # right neighbour is the tail
    assert extents(four_blocks) == [(64, 256)]


def test_free_coalesces_both_neighbours(four_blocks: SegmentAllocator) -> None:
    four_blocks.free(0)
    four_blocks.free(128)
    assert extents(four_blocks) == [(0, 64), (128, 64), (256, 64)]
    four_blocks.free(64)
    assert extents(four_blocks) == [(0, 192), (256, 64)]
    assert four_blocks.num_free_extents == 2
    four_blocks.free(192)
    assert extents(four_blocks) == [(0, 320)]
    assert (four_blocks.used_bytes, four_blocks.largest_free) == (0, 320)
    assert four_blocks.free_extents() == [Extent(0, 320)]
    assert Extent(0, 320).end == 320


def test_best_fit_picks_smallest_hole_that_fits(make: Make) -> None:
    alloc = make(1024)
    h1 = alloc.allocate(192)  # 0
    alloc.allocate(64)  # 192, separator
    h2 = alloc.allocate(64)  # 256
    alloc.allocate(64)  # 320, separator
    h3 = alloc.allocate(128)  # 384
    alloc.allocate(64)  # 512, separator
    for offset in (h1, h2, h3):
        assert offset is not None
        alloc.free(offset)
    assert extents(alloc) == [(0, 192), (256, 64), (384, 128), (576, 448)]

    assert alloc.allocate(64) == 256  # the 64-byte hole, not the first one
    assert alloc.allocate(100) == 384  # 128 rounded: the 128-byte hole
    assert alloc.allocate(150) == 0  # 192 rounded: the 192-byte hole
    assert alloc.allocate(200) == 576  # 256 rounded: carved from the start of the tail
    assert extents(alloc) == [(832, 192)]


def test_best_fit_tie_takes_lowest_offset(make: Make) -> None:
    alloc = make(640)
    offsets = [alloc.allocate(64) for _ in range(10)]
    for offset in (384, 128, 512):
        alloc.free(offset)
    assert extents(alloc) == [(128, 64), (384, 64), (512, 64)]
    assert [alloc.allocate(64), alloc.allocate(64), alloc.allocate(64)] == [128, 384, 512]
    assert offsets == list(range(0, 640, 64))


def test_out_of_space_returns_none_and_changes_nothing(make: Make) -> None:
    alloc = make(256)
    assert alloc.allocate(257) is None
    assert [alloc.allocate(64) for _ in range(4)] == [0, 64, 128, 192]
    assert alloc.allocate(1) is None
    # 128 bytes free, but in two 64-byte holes: no contiguous 128
    alloc.free(0)
    alloc.free(128)
    assert (alloc.free_bytes, alloc.largest_free) == (128, 64)
    assert alloc.allocate(65) is None
    assert extents(alloc) == [(0, 64), (128, 64)]
    assert (alloc.used_bytes, alloc.num_allocations) == (128, 2)


@pytest.mark.parametrize("size", [0, -1, -64, 1.5, "64", None, True])
def test_allocate_rejects_bad_size(make: Make, size: object) -> None:
    alloc = make(1024)
    with pytest.raises(ValueError, match="size must be a positive int"):
        alloc.allocate(size)  # type: ignore[arg-type]
    assert alloc.used_bytes == 0


@pytest.mark.parametrize(
    ("capacity", "alignment", "message"),
    [
        (0, 64, "capacity"),
        (-1, 64, "capacity"),
        (1.0, 64, "capacity"),
        (1024, 0, "alignment"),
        (1024, 48, "alignment"),
        (1024, -64, "alignment"),
    ],
)
def test_constructor_rejects_bad_arguments(make: Make, capacity: object, alignment: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make(capacity, alignment)  # type: ignore[arg-type]


def test_free_of_unknown_offset_and_double_free_raise(make: Make) -> None:
    alloc = make(1024)
    offset = alloc.allocate(128)
    assert offset == 0
    with pytest.raises(UnknownOffsetError, match="no live allocation at offset 64"):
        alloc.free(64)  # inside the allocation, not its start
    alloc.free(offset)
    with pytest.raises(UnknownOffsetError) as excinfo:
        alloc.free(offset)
    assert isinstance(excinfo.value, KeyError)
    assert isinstance(excinfo.value, AllocatorError)
    assert str(excinfo.value) == "no live allocation at offset 0"
    with pytest.raises(UnknownOffsetError):
        alloc.allocation_size(0)
    assert extents(alloc) == [(0, 1024)]
    assert alloc.used_bytes == 0


# -- equal-size churn: the KV case --------------------------------------------


def test_equal_size_churn_never_fragments(make: Make) -> None:
    size = 1000  # rounds to 1024
    rounded = 1024
    num_slots = 2048
    alloc = make(num_slots * rounded)
    rng = random.Random(1234)
    live: list[int] = []
    num_refused = 0

    for step in range(200_000):
        # drift towards 99% full so the segment is often completely full
        p_alloc = 0.6 if len(live) < num_slots - 20 else 0.4
        if not live or rng.random() < p_alloc:
            fits = alloc.free_bytes >= size
            offset = alloc.allocate(size)
            assert (offset is not None) == fits, step
            if offset is None:
                num_refused += 1
            else:
                assert offset % rounded == 0
                live.append(offset)
        else:
            i = rng.randrange(len(live))
            live[i], live[-1] = live[-1], live[i]
            alloc.free(live.pop())
        assert alloc.largest_free % rounded == 0
        if step % 20_000 == 0:
            assert all(e.size % rounded == 0 for e in alloc.free_extents())

    assert num_refused > 0  # the full segment was reached and refused correctly
    assert alloc.used_bytes == len(live) * rounded
    assert alloc.used_bytes + alloc.free_bytes == alloc.capacity
    for offset in live:
        alloc.free(offset)
    assert alloc.largest_free == alloc.capacity
    assert (alloc.num_free_extents, alloc.num_allocations, alloc.used_bytes) == (1, 0, 0)


# -- the best-fit structure's own accounting ------------------------------------


def check_heaps(alloc: Any) -> None:
    """The sizes, heaps and counts agree with the free extents, and the stale count with the heaps; the C one's
    own check (its tree in order, its maps agreeing with it and with each other, the bytes adding up)."""
    if not isinstance(alloc, SegmentAllocator):
        alloc.check()
        return
    by_size: dict[int, list[int]] = {}
    for offset, size in alloc._free_at.items():
        by_size.setdefault(size, []).append(offset)
    assert alloc._sizes == sorted(by_size)
    assert alloc._count == {size: len(offsets) for size, offsets in by_size.items()}
    assert set(alloc._at_size) == set(by_size)
    for size, offsets in by_size.items():
        assert set(offsets) <= set(alloc._at_size[size])  # every free extent has its entry
    entries = sum(len(heap) for heap in alloc._at_size.values())
    assert alloc._stale == entries - len(alloc._free_at)


def test_stale_entries_are_skipped_and_the_heaps_built_afresh_when_they_outnumber_live_ones() -> None:
    alloc = SegmentAllocator(64 * 1000, 64)
    offsets = [alloc.allocate(64) for _ in range(1000)]
    for offset in offsets[::2]:  # 500 one-block holes, none touching
        alloc.free(offset)
    check_heaps(alloc)
    assert alloc._stale == 0 and alloc.num_free_extents == 500
    rebuilt = False
    for offset in offsets[1::2][:-1]:  # each merges two holes into one: their entries go stale
        alloc.free(offset)
        check_heaps(alloc)
        rebuilt = rebuilt or alloc._stale == 0
    assert rebuilt  # stale entries came to outnumber the live ones at least once
    # what is left: blocks 0-998 free as one, block 999 live; the best fit still takes the lowest offset
    assert alloc.free_extents() == [Extent(0, 64 * 999)] and alloc.allocate(64) == 0
    check_heaps(alloc)


# -- mixed sizes against a reference model -------------------------------------


class AllocatorMachine(RuleBasedStateMachine):
    """Checks the allocator against an interval-list model after every op: the
    model's free extents are the gaps between live allocations, so they are
    maximal (coalesced) by construction, and its best fit is computed naively."""

    native = False

    def __init__(self) -> None:
        super().__init__()
        self.alloc = new_allocator(64, native=self.native)
        self.live: dict[int, int] = {}  # offset -> rounded size
        self.runs: dict[int, list[int]] = {}  # a run's allocation (in live) -> its pieces' sizes, as asked

    @initialize(capacity=st.integers(1, 4096), alignment=st.sampled_from([1, 8, 64, 256]))
    def start(self, capacity: int, alignment: int) -> None:
        self.alloc = new_allocator(capacity, alignment, native=self.native)
        self.live = {}
        self.runs = {}

    def model_gaps(self) -> list[tuple[int, int]]:
        gaps: list[tuple[int, int]] = []
        cursor = 0
        for offset in sorted(self.live):
            if offset > cursor:
                gaps.append((cursor, offset - cursor))
            cursor = offset + self.live[offset]
        if cursor < self.alloc.capacity:
            gaps.append((cursor, self.alloc.capacity - cursor))
        return gaps

    @rule(size=st.integers(1, 1500))
    def allocate(self, size: int) -> None:
        align = self.alloc.alignment
        need = -(-size // align) * align
        fitting = [(gap_size, offset) for offset, gap_size in self.model_gaps() if gap_size >= need]
        offset = self.alloc.allocate(size)
        if not fitting:
            assert offset is None
            return
        assert offset == min(fitting)[1]  # best fit, lowest offset on ties
        self.live[offset] = need

    @rule(sizes=st.lists(st.integers(1, 700), min_size=1, max_size=5))
    def allocate_run(self, sizes: list[int]) -> None:
        """A group's members: one best-fit hole for them all, one allocation, the pieces back to back."""
        align = self.alloc.alignment
        needs = [-(-size // align) * align for size in sizes]
        fitting = [(gap_size, offset) for offset, gap_size in self.model_gaps() if gap_size >= sum(needs)]
        offsets = self.alloc.allocate_run(sizes)
        if not fitting:
            assert offsets is None
            return
        assert offsets is not None and offsets[0] == min(fitting)[1]
        offset = offsets[0]
        for need, got in zip(needs, offsets, strict=True):
            assert got == offset  # back to back
            offset += need
        self.live[offsets[0]] = sum(needs)
        self.runs[offsets[0]] = sizes

    @precondition(lambda self: self.runs)
    @rule(data=st.data())
    def split_run(self, data: st.DataObject) -> None:
        """A run's pieces become allocations of their own, each freed alone after; a wrong split changes nothing."""
        first = data.draw(st.sampled_from(sorted(self.runs)))
        sizes = self.runs.pop(first)
        if len(sizes) > 1:
            with pytest.raises(UnknownOffsetError):
                self.alloc.split_run(first, sizes[:-1])
        offsets = self.alloc.split_run(first, sizes)
        align = self.alloc.alignment
        del self.live[first]
        for offset, size in zip(offsets, sizes, strict=True):
            self.live[offset] = -(-size // align) * align

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free_run(self, data: st.DataObject) -> None:
        """Any live allocations at once, back to back or not: the same free extents as freeing each."""
        offsets = data.draw(st.lists(st.sampled_from(sorted(self.live)), min_size=1, max_size=6, unique=True))
        self.alloc.free_run(offsets)
        for offset in offsets:
            del self.live[offset]
            self.runs.pop(offset, None)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), dead=st.integers(-1, 5000))
    def free_run_with_a_dead_offset_frees_nothing(self, data: st.DataObject, dead: int) -> None:
        live = data.draw(st.lists(st.sampled_from(sorted(self.live)), min_size=1, max_size=3, unique=True))
        for bad in ([*live, dead] if dead not in self.live else [], [*live, live[0]]):
            if not bad:
                continue
            try:
                self.alloc.free_run(bad)
            except UnknownOffsetError:
                continue
            raise AssertionError(f"free_run({bad}) did not raise")

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        offset = data.draw(st.sampled_from(sorted(self.live)))
        self.alloc.free(offset)
        del self.live[offset]
        self.runs.pop(offset, None)

    @rule(offset=st.integers(-1, 5000))
    def free_unknown(self, offset: int) -> None:
        if offset in self.live:
            return
        try:
            self.alloc.free(offset)
        except UnknownOffsetError:
            return
        raise AssertionError(f"free({offset}) of a dead offset did not raise")

    @invariant()
    def matches_model(self) -> None:
        alloc = self.alloc
        spans = sorted(self.live.items())
        for (a, a_size), (b, _) in zip(spans, spans[1:]):
            assert a + a_size <= b  # no overlap between live allocations
        for offset, size in spans:
            assert offset % alloc.alignment == 0
            assert 0 <= offset and offset + size <= alloc.capacity
            assert alloc.allocation_size(offset) == size
        gaps = self.model_gaps()
        free = extents(alloc)
        assert free == gaps
        for (a, a_size), (b, _) in zip(free, free[1:]):
            assert a + a_size < b  # coalesced: free extents never touch
        assert alloc.used_bytes == sum(self.live.values())
        assert alloc.used_bytes + alloc.free_bytes == alloc.capacity
        assert alloc.largest_free == max((s for _, s in gaps), default=0)
        assert alloc.num_allocations == len(self.live)
        assert alloc.num_free_extents == len(gaps)
        check_heaps(alloc)


class NativeAllocatorMachine(AllocatorMachine):
    native = True


TestAllocatorMachine = AllocatorMachine.TestCase
TestAllocatorMachine.settings = settings(max_examples=150, stateful_step_count=60, deadline=None)
TestNativeAllocatorMachine = NativeAllocatorMachine.TestCase
TestNativeAllocatorMachine.settings = settings(max_examples=150, stateful_step_count=60, deadline=None)


# -- the C twin ------------------------------------------------------------------


def test_setup_built_the_c_allocator_and_the_index_takes_it() -> None:
    assert lru.native_module() is not None, "kvpool/native/lru.c is not built: scripts/setup.sh builds it"
    cls = native_allocator_class()
    assert cls is not None and isinstance(new_allocator(1024), cls)
    from kvpool.core.pool.recovery import allocator_with_ranges

    assert isinstance(allocator_with_ranges(1024, 64, [(64, 64)]), cls)


def test_the_python_allocator_is_the_fallback_when_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lru, "_NATIVE", False)
    monkeypatch.setattr(lru, "_MODULE", None)
    monkeypatch.setattr(allocator_module, "_NATIVE", False)
    monkeypatch.setenv(lru.SWITCH_ENV, "off")
    assert native_allocator_class() is None and type(new_allocator(1024)) is SegmentAllocator
    with pytest.raises(lru.native_build.NativeUnavailable):
        new_allocator(1024, native=True)


def answer(call: Callable[[], object]) -> object:
    """What a call gave, or its error's class and message."""
    try:
        return call()
    except (ValueError, KeyError) as exc:
        return type(exc), str(exc)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_two_answer_one_stream_of_calls_alike(seed: int) -> None:
    """The same calls, right and wrong, on both: the same offsets, errors, free extents and counts throughout
    (a segment of mixed sizes and runs, filled past full and emptied again, as a store's is)."""
    rng = random.Random(seed)
    capacity, alignment = rng.choice([(1 << 20, 64), (1 << 20 | 40, 64), (99_999, 8), (1 << 16, 1)])
    py, c = SegmentAllocator(capacity, alignment), new_allocator(capacity, alignment, native=True)
    live: list[int] = []
    runs: dict[int, list[int]] = {}
    for step in range(6000):
        roll = rng.random()
        fill = step // 1500 % 2 == 0  # phases: fill, then drain
        if roll < (0.45 if fill else 0.2):
            size = rng.choice([1, 63, 64, 65, 256, 1000, 4096, rng.randrange(1, 9000)])
            got = answer(lambda: py.allocate(size))
            assert answer(lambda: c.allocate(size)) == got, step
            if isinstance(got, int):
                live.append(got)
        elif roll < (0.6 if fill else 0.3):
            sizes = [rng.choice([256, 300, 1024]) for _ in range(rng.randrange(1, 6))]
            got = answer(lambda: py.allocate_run(sizes))
            assert answer(lambda: c.allocate_run(sizes)) == got, step
            if isinstance(got, list):
                live.append(got[0])
                runs[got[0]] = sizes
        elif roll < 0.7 and runs:
            first = rng.choice(sorted(runs))
            sizes = runs.pop(first)
            wrong = sizes[:-1] or [sizes[0] + alignment]
            assert answer(lambda: c.split_run(first, wrong)) == answer(lambda: py.split_run(first, wrong)), step
            got = answer(lambda: py.split_run(first, sizes))
            assert answer(lambda: c.split_run(first, sizes)) == got, step
            assert isinstance(got, list)
            live.remove(first)
            live.extend(got)
        elif roll < 0.85 and live:
            picked = rng.sample(live, min(len(live), rng.randrange(1, 5)))
            bad = rng.random() < 0.2
            offsets = picked + [picked[0]] if bad and rng.random() < 0.5 else picked + [capacity + 1] if bad else picked
            got = answer(lambda: py.free_run(offsets))
            assert answer(lambda: c.free_run(offsets)) == got, step
            if not bad:
                for offset in picked:
                    live.remove(offset)
                    runs.pop(offset, None)
        elif live:
            offset = rng.choice(live) if rng.random() < 0.9 else rng.randrange(-1, capacity + 2)
            got = answer(lambda: py.free(offset))
            assert answer(lambda: c.free(offset)) == got, step
            if got is None:
                live.remove(offset)
                runs.pop(offset, None)
        if step % 50 == 0:
            assert (c.free_extents(), c.allocations()) == (py.free_extents(), py.allocations()), step
            c.check()
        assert (c.used_bytes, c.num_allocations, c.num_free_extents, c.largest_free) == \
            (py.used_bytes, py.num_allocations, py.num_free_extents, py.largest_free), step
    assert c.free_extents() == py.free_extents()
    for offset in live:
        assert c.allocation_size(offset) == py.allocation_size(offset)


@pytest.mark.parametrize("native", [False, True])
def test_both_refuse_what_is_not_a_size_or_a_live_offset_alike(native: bool) -> None:
    alloc = new_allocator(1024, native=native)
    for sizes in ([], [0], [64, -1], [1.5], ["64"], [True]):
        with pytest.raises(ValueError, match="sizes must be positive ints"):
            alloc.allocate_run(sizes)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="sizes must be positive ints"):
            alloc.split_run(0, sizes)  # type: ignore[arg-type]
    assert alloc.allocate_run([2000]) is None and alloc.allocate_run([1 << 70]) is None
    assert alloc.allocate(1 << 70) is None
    run = alloc.allocate_run([64, 100])
    assert run == [0, 64]
    with pytest.raises(UnknownOffsetError, match="no live allocation at offset 64"):
        alloc.free(64)  # a run's piece is no allocation of its own until split
    with pytest.raises(UnknownOffsetError, match="no live allocation of 128 bytes at offset 0 to split"):
        alloc.split_run(0, [64, 64])
    with pytest.raises(UnknownOffsetError, match=r"offsets named twice in one run: \[0, 0\]"):
        alloc.free_run([0, 0])
    for offset in (-1, 1 << 70, "0", None):
        with pytest.raises(UnknownOffsetError, match="no live allocation at offset"):
            alloc.free(offset)  # type: ignore[arg-type]
    alloc.free_run([])  # nothing named: nothing freed
    assert alloc.used_bytes == 192 and alloc.allocation_size(0) == 192
    aligned = 1 << 40
    assert alloc.rounded_size(aligned) is aligned  # an aligned size is kept, not made anew
    assert alloc.rounded_size(1 << 70 | 1) == (1 << 70) + 64 and alloc.rounded_size(-65) == -64
    alloc.free(0)
    assert alloc.free_extents() == [Extent(0, 1024)] and "capacity=1024" in repr(alloc)


def test_the_c_allocator_holds_a_million_pieces_and_gives_every_byte_back() -> None:
    """Equal runs filling a large segment, every other one freed, then the rest: one extent at the end."""
    alloc = new_allocator(1024 * 250_000, native=True)
    firsts = [alloc.allocate_run([256, 256, 256, 256]) for _ in range(250_000)]
    assert all(run is not None for run in firsts) and alloc.free_bytes == 0 and alloc.allocate(1) is None
    for run in firsts[::2]:
        alloc.free(run[0])  # type: ignore[index]
    assert alloc.num_free_extents == 125_000 and alloc.largest_free == 1024
    alloc.check()
    alloc.free_run([run[0] for run in firsts[1::2]])  # type: ignore[index]
    assert alloc.free_extents() == [Extent(0, alloc.capacity)] and alloc.num_allocations == 0
    alloc.check()
