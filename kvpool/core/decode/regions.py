"""Decode receive regions: where prefill writes one request's KV for a shard.

Pure: no torch, no I/O; time from an injectable clock. A shard owns one
bounded arena of registered memory; ``reserve`` carves a region for one
request's handoff (layout: ``kvpool.core.handoff.layout``), ``claim`` hands it
to exactly one Generate, ``free`` returns it. A region reserved but never
claimed is reclaimed at its deadline by ``expire`` — a writer that died
never leaks the arena.

Prefill stages write a region while they compute, and each asks decode
whether the region is still reserved right before each write (``Landed``
with no range). So a region given back (``free`` with ``grace_s``) or
expired leaves the table at once but its bytes stay allocated for
``writer_grace_s`` more: a write that passed its check just before lands in
bytes nobody else holds yet.

With ``control`` (``kvpool.core.handoff.control``: the records a same-host
writer reads instead of asking), a region's fence is up exactly while it is
reserved and unclaimed, and ids skip slots a live region holds.

Invariants: a region id is issued once; a region is reserved, claimed,
draining or gone, and only a reserved one can be claimed or expire; the
arena bytes in use equal the sum of live and draining regions' (rounded)
sizes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from kvpool.core.pool.allocator import SegmentAllocator
from kvpool.core.errors import InvalidArgument, NotFound, ResourceExhausted
from kvpool.core.handoff.control import ControlRecords
from kvpool.core.handoff.landing import LandedParts
from kvpool.core.handoff.layout import HandoffLayout

Clock = Callable[[], float]
REGION_ALIGNMENT = 4096


@dataclass(slots=True)
class ReceiveRegion:
    """One reserved region: ``size`` bytes at ``offset`` of the arena."""

    region_id: int
    offset: int
    size: int
    layout: HandoffLayout
    deadline: float
    claimed: bool = False
    seq_id: str = ""  # the sequence whose pages were reserved with it, if any
    landed: LandedParts | None = None  # what prefill told us has landed (and was scattered, with pages)
    writers: dict[int, int] = field(default_factory=dict)  # stage -> the nonce of its attempt seen last
    rewritten: bool = False  # a stage wrote it again (a retried request): scatter all of it at Generate

    def seen_writer(self, stage: int, nonce: int) -> bool:
        """Note ``stage``'s attempt ``nonce``; True when it differs from the one seen before (that stage's
        landed parts are forgotten: the new attempt writes them again)."""
        previous = self.writers.get(stage)
        self.writers[stage] = nonce
        if previous is None or previous == nonce:
            return False
        self.rewritten = True
        assert self.landed is not None
        self.landed.forget(stage)
        return True

    def __post_init__(self) -> None:
        if self.landed is None:
            self.landed = LandedParts(self.layout)


class RegionTable:
    """The shard's receive regions over one arena of ``arena_size`` bytes."""

    def __init__(self, arena_size: int, deadline_s: float, clock: Clock, writer_grace_s: float = 0.0,
                 control: ControlRecords | None = None) -> None:
        if deadline_s <= 0:
            raise InvalidArgument(f"deadline_s: must be positive, got {deadline_s}")
        self._allocator = SegmentAllocator(arena_size, alignment=REGION_ALIGNMENT)
        self.deadline_s = deadline_s
        self._clock = clock
        self._regions: dict[int, ReceiveRegion] = {}
        self._draining: list[tuple[float, ReceiveRegion]] = []  # (bytes free at, region)
        self.writer_grace_s = writer_grace_s
        self.control = control
        self._next_id = 1

    @property
    def used_bytes(self) -> int:
        return self._allocator.used_bytes

    @property
    def num_regions(self) -> int:
        return len(self._regions)

    def reserve(self, layout: HandoffLayout, hold_s: float | None = None) -> ReceiveRegion:
        """A region for ``layout``, reclaimed if unclaimed after ``hold_s`` (default: the
        table's ``deadline_s``); ResourceExhausted when the arena has no room now."""
        if hold_s is not None and hold_s <= 0:
            raise InvalidArgument(f"hold_s: must be positive, got {hold_s}")
        if layout.nbytes > self._allocator.capacity:
            raise InvalidArgument(
                f"num_tokens: {layout.nbytes} bytes of KV can never fit the {self._allocator.capacity}-byte "
                "receive arena"
            )
        region_id = self._next_id
        if self.control is not None:  # the next id whose control slot no live region holds
            while self.control.in_use(region_id):
                region_id += 1
                if region_id - self._next_id >= self.control.slots:
                    raise ResourceExhausted(f"receive arena: all {self.control.slots} region slots are in use")
        offset = self._allocator.allocate(layout.nbytes)
        if offset is None:
            raise ResourceExhausted(f"receive arena: no room for {layout.nbytes} bytes now")
        self._next_id = region_id + 1
        region = ReceiveRegion(region_id, offset, layout.nbytes, layout,
                               self._clock() + (self.deadline_s if hold_s is None else hold_s))
        self._regions[region.region_id] = region
        if self.control is not None:
            self.control.open(region_id)
        return region

    def claim(self, region_id: int) -> ReceiveRegion:
        """Hand a reserved region to its one Generate; it no longer expires."""
        region = self._regions.get(region_id)
        if region is None and 0 < region_id < self._next_id:
            # ids are issued in order and never reused: this one was used or expired
            raise InvalidArgument(f"region_id: {region_id} was already used or expired")
        if region is None:
            raise NotFound(f"region_id: {region_id} was never reserved on this shard")
        if region.claimed:
            raise InvalidArgument(f"region_id: {region_id} is already in use by another Generate")
        region.claimed = True
        if self.control is not None:
            self.control.close(region_id)  # prefill is done with it
        return region

    def free(self, region_id: int, grace_s: float = 0.0) -> bool:
        """Give a region back (its bytes after ``grace_s``); False if it was already gone (idempotent)."""
        region = self._regions.pop(region_id, None)
        if region is None:
            return False
        if self.control is not None:
            self.control.close(region_id)
        if grace_s > 0:
            self._draining.append((self._clock() + grace_s, region))
        else:
            self._allocator.free(region.offset)
        return True

    @property
    def num_draining(self) -> int:
        return len(self._draining)

    def open_regions(self) -> list[ReceiveRegion]:
        """The regions reserved or claimed now, in id order."""
        return list(self._regions.values())

    def get(self, region_id: int) -> ReceiveRegion | None:
        return self._regions.get(region_id)

    def expire(self) -> list[ReceiveRegion]:
        """Free every unclaimed region past its deadline (its bytes after the writers' grace) and the
        bytes of draining regions past theirs; the expired regions."""
        now = self._clock()
        drained = [r for at, r in self._draining if at <= now]
        self._draining = [(at, r) for at, r in self._draining if at > now]
        for region in drained:
            self._allocator.free(region.offset)
        expired = [r for r in self._regions.values() if not r.claimed and r.deadline <= now]
        for region in expired:
            self.free(region.region_id, self.writer_grace_s)
        return expired
