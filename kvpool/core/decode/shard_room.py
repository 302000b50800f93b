"""A decode shard's room, as the shard counts it: the one ledger a router's tickets are answered from.

Pure: no grpc, torch or I/O. A request's room is its pages for its whole life
(``DecodeScheduler.reserve``) and, where the shard has a receive arena, its
region (``RegionTable``); both or neither. ``reserve`` holds them or refuses at
once naming the give-back count (``RoomEpoch.refused``: the router queues the
request again and asks no more until room comes back); ``end`` gives them back
and says whether that rings (a refusal waits on it: ``WatchRoom`` tells the
routers). The simulator's shards and the admission tests answer tickets
with it, as the decode shard's ``reserve_now`` does.

Invariants: a sequence holds its pages (and region) from ``reserve`` to ``end``
and nothing after; ``RoomEpoch``'s (it rings once per run of refusals, at the
first give-back that follows).
"""

from __future__ import annotations

from kvpool.core.admission.room import ShardShape
from kvpool.core.decode.regions import RegionTable
from kvpool.core.decode.room_epoch import Held, RoomEpoch
from kvpool.core.decode.scheduler import DecodeScheduler
from kvpool.core.errors import ResourceExhausted
from kvpool.core.handoff.layout import HandoffLayout

REGION_HOLD_S = 3600.0  # a region's deadline here: nothing expires it (the request's end frees it)


class ShardRoom:
    """Pages, regions (``shape``'s arena; none without a shape) and the give-back count of one shard."""

    def __init__(self, scheduler: DecodeScheduler, shape: ShardShape | None = None) -> None:
        self.scheduler = scheduler
        self.shape = shape
        self.regions = RegionTable(shape.arena_bytes, REGION_HOLD_S, lambda: 0.0) if shape is not None else None
        self.room = RoomEpoch()
        self._region_of: dict[str, int] = {}

    def reserve(self, seq_id: str, num_prompt_tokens: int, max_tokens: int) -> int | None:
        """Hold the request's room (None), or refuse it: the epoch the refusal names."""
        region = None
        if self.regions is not None and self.shape is not None:
            layout = HandoffLayout.of(num_prompt_tokens, [(0, 1)], self.shape.region_bytes_per_token,
                                      self.shape.region_trailer_bytes)
            try:
                region = self.regions.reserve(layout)
            except ResourceExhausted:
                return self.room.refused()
        try:
            self.scheduler.reserve(seq_id, num_prompt_tokens, max_tokens)
        except ResourceExhausted:
            if region is not None and self.regions is not None:
                self.regions.free(region.region_id)
            return self.room.refused()
        if region is not None:
            self._region_of[seq_id] = region.region_id
        self._observe()
        return None

    def end(self, seq_id: str) -> bool:
        """The request's call ended: its room goes back (nothing if it held none). True: the give-back rings."""
        region = self._region_of.pop(seq_id, None)
        if region is not None and self.regions is not None:
            self.regions.free(region)
        if self.scheduler.release(seq_id) is None and region is None:
            return False
        return self._observe()

    @property
    def epoch(self) -> int:
        return self.room.epoch

    @property
    def num_held(self) -> int:
        return self.scheduler.num_reserved + self.scheduler.num_waiting + self.scheduler.num_running

    def _observe(self) -> bool:
        used, count = (self.regions.used_bytes, self.regions.num_regions) if self.regions is not None else (0, 0)
        return self.room.observe(Held(self.scheduler.num_pages_used, used, count))
