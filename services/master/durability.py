"""A leader with standbys acknowledges a commit only once the stores hold it.

A new leader rebuilds the pool from the stores' block reports, so a commit is
durable once the store of its segment has applied the journal change that
adds its record. In HA mode each store long-polls its heartbeat (``wait_ms``):
the master answers it the moment a change waits (``kick``), the store applies
and acknowledges with its next beat, and that acknowledgement releases every
``PutEnd`` waiting on a sequence up to it (``acked``). Many commits ride one
round trip under load; a single master without standbys never waits here.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict

from kvpool.core.errors import Unavailable


class CommitWaiters:
    """Per segment: the beats held open for changes, and the commits waiting for an acknowledgement."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._beats: dict[str, asyncio.Event] = {}
        self._waiting: dict[str, list[tuple[int, asyncio.Future[None]]]] = defaultdict(list)

    def kick(self, segment_ids: set[str] | list[str]) -> None:
        """Changes wait for these segments' stores: answer their held heartbeats now."""
        for segment_id in segment_ids:
            beat = self._beats.get(segment_id)
            if beat is not None:
                beat.set()

    async def hold(self, segment_id: str, has_changes: bool, wait_s: float) -> None:
        """A heartbeat that found nothing to send waits (at most ``wait_s``) for a change to arrive."""
        if has_changes or wait_s <= 0:
            return
        beat = self._beats.setdefault(segment_id, asyncio.Event())
        beat.clear()
        try:
            await asyncio.wait_for(beat.wait(), wait_s)
        except asyncio.TimeoutError:
            pass
        finally:
            if self._beats.get(segment_id) is beat:
                self._beats.pop(segment_id, None)

    def acked(self, segment_id: str, sequence: int) -> None:
        """The store of ``segment_id`` holds every change up to ``sequence``."""
        waiting = self._waiting.get(segment_id)
        if not waiting:
            return
        keep = []
        for target, future in waiting:
            if target <= sequence:
                if not future.done():
                    future.set_result(None)
            else:
                keep.append((target, future))
        if keep:
            self._waiting[segment_id] = keep
        else:
            del self._waiting[segment_id]

    def dropped(self, segment_id: str) -> None:
        """The segment is gone (unmounted, expired): its waiting commits can never be held."""
        for _, future in self._waiting.pop(segment_id, []):
            if not future.done():
                future.set_exception(Unavailable(f"items: the store of segment {segment_id} went away before "
                                                 "it held the commit"))

    async def durable(self, targets: dict[str, int]) -> None:
        """Return once every segment's store acknowledged its target sequence; ``Unavailable`` after the
        timeout (the commit stands in this leader's index, but is not acknowledged as durable)."""
        loop = asyncio.get_running_loop()
        futures = []
        for segment_id, target in targets.items():
            future: asyncio.Future[None] = loop.create_future()
            self._waiting[segment_id].append((target, future))
            futures.append(future)
        self.kick(list(targets))
        try:
            await asyncio.wait_for(asyncio.gather(*futures), self.timeout_s)
        except asyncio.TimeoutError:
            raise Unavailable(f"items: the stores did not hold the commit within {self.timeout_s} s "
                              "(not acknowledged: the caller treats the save as not stored)") from None
