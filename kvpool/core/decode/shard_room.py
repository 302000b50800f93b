"""A decode shard's room, as the shard counts it: the one ledger a router's tickets are answered from.

Pure: no grpc, torch or I/O. A request's room is its pages for its whole life
(``DecodeScheduler.reserve``) and, where the shard has a receive arena, its
region (``RegionTable``); both or neither. ``reserve`` holds them or refuses at
once naming the give-back count (``RoomEpoch.refused``: the router queues the
request again and asks no more until room comes back); ``end`` gives them back
and says whether that rings (a refusal waits on it: ``WatchRoom`` tells the
routers). The decode shard (services/decode/shard.py) counts its room with
it, and the simulator's shards and the admission tests answer tickets with it.

Invariants: a sequence holds its pages (and region) from ``reserve`` to ``end``
and nothing after; ``RoomEpoch``'s (it rings once per run of refusals, at the
first give-back that follows).
"""

from __future__ import annotations

from typing import Protocol

from kvpool.core.admission.room import ShardShape
from kvpool.core.decode.regions import ReceiveRegion, RegionTable
from kvpool.core.decode.room_epoch import Held, RoomEpoch
from kvpool.core.decode.scheduler import DecodeScheduler
from kvpool.core.errors import ResourceExhausted
from kvpool.core.handoff.layout import HandoffLayout

REGION_HOLD_S = 3600.0  # a region's deadline here: nothing expires it (the request's end frees it)


class Room(Protocol):
    """The give-back count a shard's ledger reports to: ``RoomEpoch``, or the decode shard's ``RoomBell``
    over one (which also tells its watchers)."""

    @property
    def epoch(self) -> int: ...

    def refused(self) -> int: ...

    def observe(self, held: Held) -> bool: ...


class ShardRoom:
    """Pages, regions and the give-back count of one shard: ``regions`` (the decode shard's own table), else
    ``shape``'s arena (none without a shape); ``room``, else a ``RoomEpoch`` of its own."""

    def __init__(self, scheduler: DecodeScheduler, shape: ShardShape | None = None,
                 regions: RegionTable | None = None, room: Room | None = None) -> None:
        self.scheduler = scheduler
        self.shape = shape
        if regions is None and shape is not None:
            regions = RegionTable(shape.arena_bytes, REGION_HOLD_S, lambda: 0.0)
        self.regions = regions
        self.room: Room = room if room is not None else RoomEpoch()
        self._region_of: dict[str, int] = {}

    def hold(self, num_prompt_tokens: int, max_tokens: int, seq_id: str = "", layout: HandoffLayout | None = None,
             hold_s: float | None = None) -> ReceiveRegion | None:
        """Hold a request's room: its region where the shard has an arena (``layout``'s, else the shape's for
        its prompt) and, with ``max_tokens``, its pages for its whole life under ``seq_id`` (else the region's
        ``region-N``): both or neither. ResourceExhausted (nothing held) when either is short now,
        InvalidArgument when it could never fit."""
        region = None
        if self.regions is not None:
            if layout is None:
                assert self.shape is not None
                layout = HandoffLayout.of(num_prompt_tokens, [(0, 1)], self.shape.region_bytes_per_token,
                                          self.shape.region_trailer_bytes)
            region = self.regions.reserve(layout, hold_s)
        if max_tokens:
            seq_id = seq_id or (f"region-{region.region_id}" if region is not None else "")
            try:
                self.scheduler.reserve(seq_id, num_prompt_tokens, max_tokens)
            except BaseException:
                if region is not None and self.regions is not None:
                    self.regions.free(region.region_id)
                raise
            if region is not None:
                region.seq_id = seq_id
                self._region_of[seq_id] = region.region_id
        self.observe()
        return region

    def reserve(self, seq_id: str, num_prompt_tokens: int, max_tokens: int) -> int | None:
        """Hold the request's room (None), or refuse it: the epoch the refusal names."""
        try:
            self.hold(num_prompt_tokens, max_tokens, seq_id)
        except ResourceExhausted:
            return self.room.refused()
        return None

    def release(self, region: ReceiveRegion | None, seq_id: str = "", grace_s: float = 0.0) -> bool:
        """A request's room goes back: ``region`` (its bytes after ``grace_s``; idempotent) and the pages of
        ``seq_id``, else of the region's sequence. True: the give-back rings."""
        if region is not None and self.regions is not None:
            self.regions.free(region.region_id, grace_s)
        seq_id = seq_id or (region.seq_id if region is not None else "")
        if seq_id:
            self._region_of.pop(seq_id, None)
            self.scheduler.release(seq_id)
        return self.observe()

    def end(self, seq_id: str) -> bool:
        """The request's call ended: its room goes back (nothing if it held none). True: the give-back rings."""
        region_id = self._region_of.get(seq_id)
        region = self.regions.get(region_id) if region_id is not None and self.regions is not None else None
        return self.release(region, seq_id)

    @property
    def epoch(self) -> int:
        return self.room.epoch

    @property
    def num_held(self) -> int:
        return self.scheduler.num_reserved + self.scheduler.num_waiting + self.scheduler.num_running

    def observe(self) -> bool:
        """What the shard holds now, to the give-back count (after any change). True: it rings."""
        used, count = (self.regions.used_bytes, self.regions.num_regions) if self.regions is not None else (0, 0)
        return bool(self.room.observe(Held(self.scheduler.num_pages_used, used, count)))
