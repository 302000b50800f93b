"""Telling routers that room came back: the shard's ``WatchRoom`` streams over the core's give-back count
(``kvpool.core.decode.room_epoch``).

A ring wakes every watcher, which sends the epoch; rings while a watcher was
busy come as one message with the latest epoch.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from kvpool.core.decode.room_epoch import Held, RoomEpoch


class RoomBell:
    """The give-back count and the watchers waiting on it."""

    def __init__(self) -> None:
        self.count = RoomEpoch()
        self.num_rings = 0
        self._rung = asyncio.Event()

    @property
    def epoch(self) -> int:
        return self.count.epoch

    def refused(self) -> int:
        return self.count.refused()

    def observe(self, held: Held) -> bool:
        """What the shard holds now; True: it rang (every watcher is told)."""
        if not self.count.observe(held):
            return False
        self.num_rings += 1
        self._rung.set()
        self._rung = asyncio.Event()
        return True

    async def watch(self) -> AsyncIterator[int]:
        """The epoch now, then the epoch after each ring (rings while the caller was busy come as one)."""
        seen = self.num_rings
        yield self.epoch
        while True:
            rung = self._rung
            if self.num_rings == seen:
                await rung.wait()
                continue
            seen = self.num_rings
            yield self.epoch
