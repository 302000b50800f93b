"""Space allocator for one segment: best-fit over coalesced free extents.

Pure, no I/O: the master owns one allocator per mounted segment and only
ever hands out offsets; the bytes live in the store. ``SegmentAllocator`` is
the allocator in Python; ``new_allocator`` gives its C twin (a type of the
index's extension module, ``kvpool/native/lru.c``) where that is built and
not switched off (``KVPOOL_NATIVE_ORDER=off``, as for the index's order): the
same offsets for the same calls, and the same errors. A save allocates and
frees a run per chunk; in C each is a tree step and a few map probes, where
the Python one took several dict and heap steps. The tests hold the two to one
behaviour.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from itertools import accumulate
from dataclasses import dataclass
from heapq import heapify, heappop, heappush
from typing import Any

from kvpool.core.pool import lru

# 64 bytes = one cache line: objects never share a line (no false sharing
# between concurrent writers), and the transfer engine's DMA / memcpy paths
# run fastest on aligned addresses. Segments are mmap'd, hence page-aligned,
# so an aligned offset is an aligned address.
DEFAULT_ALIGNMENT = 64


class AllocatorError(Exception):
    """Base class for allocator errors (a bad free, not a lack of space)."""


class UnknownOffsetError(AllocatorError, KeyError):
    """`free` of an offset that is not a live allocation (never allocated,
    or already freed). A KeyError too, so callers may map it to NOT_FOUND."""

    def __str__(self) -> str:
        # KeyError's str() would repr() the message
        return str(self.args[0]) if self.args else ""


@dataclass(frozen=True, slots=True)
class Extent:
    """A contiguous byte range [offset, offset + size) of the segment."""

    offset: int
    size: int

    @property
    def end(self) -> int:
        return self.offset + self.size


class SegmentAllocator:
    """Best-fit allocator for one segment of `capacity` bytes.

    Invariants, after every public call:
    - live allocations and free extents tile [0, capacity) exactly: they never
      overlap and `used_bytes + free_bytes == capacity`;
    - free extents never overlap or touch: a freed block is merged with its
      free left and right neighbours at once (always coalesced);
    - every allocation starts at a multiple of `alignment` and its size is the
      requested size rounded up to `alignment` (`used_bytes` counts rounded
      sizes). The tail extent may end unaligned at `capacity`.

    `allocate` picks the smallest free extent that fits (lowest offset on
    ties) and carves from its start. With equal-sized requests (the KV case)
    every hole is then a whole number of objects, so the segment never
    fragments: if capacity is a multiple of the rounded size, `allocate`
    succeeds iff `free_bytes >= size`.

    Every operation is O(log n) in the number of free extents, and runs in C but for a few steps: the free
    extents' distinct sizes are a sorted list (few: equal-sized objects leave holes of whole numbers of
    objects), and the extents of one size a heap of offsets. An extent taken out of the middle of its heap
    (merged with a neighbour) stays there, stale, until a pop meets it (``_free_at`` says which entries are
    live) or the heaps are built afresh once stale entries outnumber live ones.
    """

    __slots__ = (
        "_capacity",
        "_alignment",
        "_sizes",
        "_at_size",
        "_count",
        "_stale",
        "_free_at",
        "_free_ending_at",
        "_allocations",
        "_used_bytes",
    )

    def __init__(self, capacity: int, alignment: int = DEFAULT_ALIGNMENT) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity <= 0:
            raise ValueError(f"capacity must be a positive int, got {capacity!r}")
        if (
            isinstance(alignment, bool)
            or not isinstance(alignment, int)
            or alignment <= 0
            or alignment & (alignment - 1)
        ):
            raise ValueError(f"alignment must be a positive power of two, got {alignment!r}")
        self._capacity = capacity
        self._alignment = alignment
        # best fit = the lowest live offset in the heap of the smallest size >= need
        self._sizes: list[int] = [capacity]  # distinct sizes of free extents, ascending
        self._at_size: dict[int, list[int]] = {capacity: [0]}  # size -> heap of offsets, stale ones included
        self._count: dict[int, int] = {capacity: 1}  # size -> free extents of that size (never 0)
        self._stale = 0  # heap entries no free extent stands behind
        self._free_at: dict[int, int] = {0: capacity}  # offset -> size
        self._free_ending_at: dict[int, int] = {capacity: 0}  # end -> offset
        self._allocations: dict[int, int] = {}  # offset -> rounded size
        self._used_bytes = 0

    # -- queries --------------------------------------------------------------

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def alignment(self) -> int:
        return self._alignment

    @property
    def used_bytes(self) -> int:
        return self._used_bytes

    @property
    def free_bytes(self) -> int:
        return self._capacity - self._used_bytes

    @property
    def largest_free(self) -> int:
        """Size of the largest contiguous free extent (0 when full)."""
        return self._sizes[-1] if self._sizes else 0

    @property
    def num_allocations(self) -> int:
        return len(self._allocations)

    @property
    def num_free_extents(self) -> int:
        return len(self._free_at)

    def rounded_size(self, size: int) -> int:
        """Bytes an allocation of `size` takes: `size` rounded up to the alignment (`size` itself when aligned:
        the live allocations of one size then share one int, not one each)."""
        if not size & (self._alignment - 1):
            return size
        return -(-size // self._alignment) * self._alignment

    def allocation_size(self, offset: int) -> int:
        """Rounded size of the live allocation at `offset`; UnknownOffsetError if none."""
        size = self._allocations.get(offset)
        if size is None:
            raise UnknownOffsetError(f"no live allocation at offset {offset}")
        return size

    def free_extents(self) -> list[Extent]:
        """All free extents in offset order. O(n log n): for tests and metrics."""
        return [Extent(offset, self._free_at[offset]) for offset in sorted(self._free_at)]

    def allocations(self) -> list[tuple[int, int]]:
        """All live allocations, (offset, rounded size), in offset order. O(n log n): for tests and metrics."""
        return sorted(self._allocations.items())

    # -- mutations ------------------------------------------------------------

    def allocate(self, size: int) -> int | None:
        """Reserve `size` bytes (rounded up to the alignment); return the offset,
        or None when no free extent is large enough."""
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
            raise ValueError(f"size must be a positive int, got {size!r}")
        need = self.rounded_size(size)
        sizes = self._sizes
        i = bisect_left(sizes, need)
        if i == len(sizes):
            return None
        hole_size = sizes[i]
        heap, free_at = self._at_size[hole_size], self._free_at
        offset = heappop(heap)
        while free_at.get(offset) != hole_size:  # stale: that extent was merged or taken meanwhile
            self._stale -= 1
            offset = heappop(heap)
        del free_at[offset]
        del self._free_ending_at[offset + hole_size]
        count = self._count[hole_size] - 1
        if count:
            self._count[hole_size] = count
        else:  # the last of its size: what is left in its heap is stale
            del self._count[hole_size]
            self._stale -= len(self._at_size.pop(hole_size))
            del sizes[i]
        if hole_size > need:
            # the remainder stays one extent; its right neighbour is allocated,
            # so it is still coalesced
            self._add_free(offset + need, hole_size - need)
        self._allocations[offset] = need
        self._used_bytes += need
        return offset

    def allocate_run(self, sizes: list[int]) -> list[int] | None:
        """Reserve room for one piece per size, back to back, as ONE allocation (a group's members: one hole
        found, one remainder left, one entry kept); return each piece's offset (each the next start where the one
        before ends, rounded), or None when no free extent holds them all. ``free`` of the first offset frees them
        all; ``split_run`` makes each piece an allocation of its own (to free one alone)."""
        needs = self._needs(sizes)
        first = self.allocate(sum(needs))
        if first is None:
            return None
        return list(accumulate(needs[:-1], initial=first))

    def split_run(self, first: int, sizes: list[int]) -> list[int]:
        """The allocation at ``first``, made by ``allocate_run(sizes)``, becomes one allocation per size; returns
        their offsets. UnknownOffsetError, nothing changed, unless ``first`` is a live allocation of exactly
        those sizes' room (ValueError unless they are positive ints)."""
        needs = self._needs(sizes)
        allocations = self._allocations
        if allocations.get(first) != sum(needs):
            raise UnknownOffsetError(f"no live allocation of {sum(needs)} bytes at offset {first} to split")
        offsets = []
        offset = first
        for need in needs:
            allocations[offset] = need
            offsets.append(offset)
            offset += need
        return offsets

    def free_run(self, offsets: list[int]) -> None:
        """``free`` each of ``offsets``; allocations that lie back to back (as ``allocate_run`` left them) go back
        as one extent, merged with their neighbours once. Checked first: UnknownOffsetError, and nothing freed,
        if any is not a live allocation or is named twice."""
        if not offsets:
            return
        allocations = self._allocations
        if len(set(offsets)) != len(offsets):
            raise UnknownOffsetError(f"offsets named twice in one run: {sorted(offsets)}")
        for offset in offsets:
            if offset not in allocations:
                raise UnknownOffsetError(f"no live allocation at offset {offset}")
        ordered = sorted(offsets)
        start = end = ordered[0]
        for offset in ordered:
            if offset != end:  # a gap: what ran so far goes back, a new run starts
                self._free_extent(start, end)
                start = offset
            end = offset + allocations.pop(offset)
        self._free_extent(start, end)

    def free(self, offset: int) -> None:
        """Release the allocation at `offset`, merging it with free neighbours.
        UnknownOffsetError if `offset` is not a live allocation (double free)."""
        size = self._allocations.pop(offset, None)
        if size is None:
            raise UnknownOffsetError(f"no live allocation at offset {offset}")
        self._free_extent(offset, offset + size)

    def _free_extent(self, start: int, end: int) -> None:
        """[start, end), allocated until now, becomes free, merged with free neighbours."""
        self._used_bytes -= end - start
        left = self._free_ending_at.get(start)
        if left is not None:
            self._remove_free(left, start - left)
            start = left
        right_size = self._free_at.get(end)
        if right_size is not None:
            self._remove_free(end, right_size)
            end += right_size
        self._add_free(start, end - start)

    # -- internals ------------------------------------------------------------

    def _needs(self, sizes: list[int]) -> list[int]:
        if not sizes or not all(isinstance(size, int) and not isinstance(size, bool) and size > 0 for size in sizes):
            raise ValueError(f"sizes must be positive ints, got {sizes!r}")
        return [self.rounded_size(size) for size in sizes]

    def _add_free(self, offset: int, size: int) -> None:
        self._free_at[offset] = size
        self._free_ending_at[offset + size] = offset
        count = self._count.get(size)
        if count is None:
            insort(self._sizes, size)
            self._count[size] = 1
            self._at_size[size] = [offset]
        else:
            self._count[size] = count + 1
            heappush(self._at_size[size], offset)

    def _remove_free(self, offset: int, size: int) -> None:
        """Take a free extent out (it merges with a neighbour); its heap entry goes stale."""
        del self._free_at[offset]
        del self._free_ending_at[offset + size]
        count = self._count[size] - 1
        if count:
            self._count[size] = count
            self._stale += 1
            if self._stale > 2 * len(self._free_at) + 64:
                self._rebuild_heaps()
        else:  # the last of its size: its heap goes, with the stale entries in it
            del self._count[size]
            self._stale -= len(self._at_size.pop(size)) - 1
            del self._sizes[bisect_left(self._sizes, size)]

    def _rebuild_heaps(self) -> None:
        at_size: dict[int, list[int]] = {}
        for offset, size in self._free_at.items():
            at_size.setdefault(size, []).append(offset)
        for heap in at_size.values():
            heapify(heap)
        self._at_size, self._stale = at_size, 0

    def __repr__(self) -> str:
        return (
            f"SegmentAllocator(capacity={self._capacity}, used={self._used_bytes}, "
            f"allocations={len(self._allocations)}, free_extents={len(self._free_at)}, "
            f"largest_free={self.largest_free})"
        )


_NATIVE: Any = False  # False: not looked for yet; None: not built or switched off


def native_allocator_class() -> Any:
    """The C allocator's class (``SegmentAllocator``'s twin), or None where the index's module is not built or is
    switched off (``lru.native_module``); looked for once per process."""
    global _NATIVE
    if _NATIVE is False:
        module = lru.native_module()
        base = getattr(module, "Allocator", None)
        if base is None:
            _NATIVE = None
        else:
            module.name_unknown_offset_error(UnknownOffsetError)  # type: ignore[union-attr]

            class NativeSegmentAllocator(base):  # type: ignore[misc, valid-type]
                """``SegmentAllocator`` in C (``kvpool/native/lru.c``); ``check()`` raises AssertionError unless
                its structures agree."""

                __slots__ = ()

                def free_extents(self) -> list[Extent]:
                    """All free extents in offset order. O(n log n): for tests and metrics."""
                    return [Extent(offset, size) for offset, size in sorted(self.extents())]

                def allocations(self) -> list[tuple[int, int]]:
                    """All live allocations, (offset, rounded size), in offset order. O(n log n)."""
                    return sorted(self.live())

                def __repr__(self) -> str:
                    return (f"NativeSegmentAllocator(capacity={self.capacity}, used={self.used_bytes}, "
                            f"allocations={self.num_allocations}, free_extents={self.num_free_extents}, "
                            f"largest_free={self.largest_free})")

            _NATIVE = NativeSegmentAllocator
    return _NATIVE


def new_allocator(capacity: int, alignment: int = DEFAULT_ALIGNMENT, native: bool | None = None) -> SegmentAllocator:
    """An allocator for a segment of ``capacity`` bytes: the C one where it is built (``native`` None), else
    ``SegmentAllocator``; ``native`` True asks for the C one (``NativeUnavailable`` where it is not built)."""
    cls = native_allocator_class()
    if native is None:
        native = cls is not None
    if native:
        if cls is None:
            raise lru.native_build.NativeUnavailable(f"{lru.SOURCE.name}'s module is not built here "
                                                     "(scripts/setup.sh)")
        return cls(capacity, alignment)  # type: ignore[no-any-return]
    return SegmentAllocator(capacity, alignment)
