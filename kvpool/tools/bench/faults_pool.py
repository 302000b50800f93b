"""The faults benchmark's pool side: groups written like four prefill stages save, readers that check every byte.

Every object's bytes stay in this process's registered buffer after the
put, so a reader compares what it read with what was written, byte for
byte, besides the checksum the client verifies.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field

import grpc
import numpy as np

from kvpool.pool.client import PoolClient
from kvpool.pool.objects import GroupLocation, PutObject, PutResult
from kvpool.transfer import HostBuffer

NUM_STAGES = 4
MISS_PAUSE_S = 0.05


@dataclass(slots=True)
class FaultGroups:
    """``num_groups`` groups of ``NUM_STAGES`` members of ``object_bytes``, sources at the buffer's start."""

    client: PoolClient
    buffer: HostBuffer
    num_groups: int
    object_bytes: int
    chunks_per_batch: int
    prefix: str = "bench-faults"
    num_readers: int = 2

    @property
    def group_ids(self) -> list[str]:
        return [f"{self.prefix}/g{g}" for g in range(self.num_groups)]

    @property
    def source_bytes(self) -> int:
        return self.num_groups * NUM_STAGES * self.object_bytes

    def key(self, g: int, stage: int) -> str:
        return f"{self.prefix}/g{g}/{stage}"

    def source(self, g: int, stage: int) -> int:
        return (g * NUM_STAGES + stage) * self.object_bytes

    def reader_region(self, reader: int) -> int:
        return self.source_bytes + reader * NUM_STAGES * self.object_bytes

    @staticmethod
    def buffer_bytes(num_groups: int, object_bytes: int, num_readers: int) -> int:
        return (num_groups + num_readers) * NUM_STAGES * object_bytes

    async def write(self) -> int:
        """Save the groups as a pipeline does: per batch of chunks, each stage puts its own objects; returns stored."""
        rng = np.random.default_rng(7)
        view = np.frombuffer(self.buffer.view(0, self.source_bytes), dtype=np.uint8)
        view[:] = rng.integers(0, 256, size=self.source_bytes, dtype=np.uint8)
        del view
        stored = 0
        for first in range(0, self.num_groups, self.chunks_per_batch):
            chunks = range(first, min(first + self.chunks_per_batch, self.num_groups))
            # the four stages' saves of one batch run at once, each its own put
            results = await asyncio.gather(*(
                self.client.put([
                    PutObject(self.key(g, stage), self.group_ids[g], NUM_STAGES,
                              self.buffer.address + self.source(g, stage), self.object_bytes)
                    for g in chunks
                ])
                for stage in range(NUM_STAGES)
            ))
            stored += sum(r.count(PutResult.STORED) for r in results)
        return stored

    async def locations(self) -> list[GroupLocation | None]:
        """Each group's member locations, or None where the group is not complete in the pool."""
        out: list[GroupLocation | None] = []
        for group_id in self.group_ids:
            found = await self.client.lookup([group_id])
            await self.client.release(found.lease_id)
            out.append(found.groups[0] if found.groups else None)
        return out

    async def usable(self, reader: int = 0) -> tuple[int, int]:
        """(groups whose every member is found, read and equal to what was written, wrong bytes seen)."""
        usable = wrong = 0
        for g, group_id in enumerate(self.group_ids):
            ok, bad = await self.read_group(g, group_id, reader)
            usable += ok
            wrong += bad
        return usable, wrong

    async def read_group(self, g: int, group_id: str, reader: int) -> tuple[bool, int]:
        """Look a group up, read every member and compare; (usable, wrong bytes)."""
        found = await self.client.lookup([group_id], lease_ms=5000)
        if not found.groups:
            return False, 0
        try:
            members = found.groups[0].members
            base = self.reader_region(reader)
            items = []
            for stage in range(NUM_STAGES):
                location = members.get(self.key(g, stage))
                if location is None:
                    return False, 0
                local = base + stage * self.object_bytes
                self.buffer.view(local, self.object_bytes)[:] = bytes(self.object_bytes)
                items.append((location, self.buffer.address + local))
            verified = await self.client.read(items)
            wrong = 0
            for stage, ok in enumerate(verified):
                if ok:  # a miss is allowed; a verified read that differs is not
                    wrong += self._differing(base + stage * self.object_bytes, self.source(g, stage))
            return all(verified) and wrong == 0, wrong
        finally:
            await self.client.release(found.lease_id)

    def _differing(self, read_at: int, source_at: int) -> int:
        n = self.object_bytes
        got = np.frombuffer(self.buffer.view(read_at, n), dtype=np.uint8)
        want = np.frombuffer(self.buffer.view(source_at, n), dtype=np.uint8)
        return int(np.count_nonzero(got != want))


@dataclass(slots=True)
class Readers:
    """Readers that look up and read random groups until stopped, counting reads, misses and wrong bytes."""

    groups: FaultGroups
    reads: int = 0
    misses: int = 0
    errors: int = 0
    wrong_bytes: int = 0
    _stop: asyncio.Event = field(default_factory=asyncio.Event)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._run(r)) for r in range(1, self.groups.num_readers)]

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks)

    async def _run(self, reader: int) -> None:
        rng = random.Random(reader)
        ids = self.groups.group_ids
        while not self._stop.is_set():
            g = rng.randrange(len(ids))
            try:
                ok, wrong = await self.groups.read_group(g, ids[g], reader)
            except grpc.aio.AioRpcError:
                self.errors += 1  # a release to a master that is down: counted, the lease expires anyway
                ok, wrong = False, 0
            self.reads += 1
            self.misses += not ok
            self.wrong_bytes += wrong
            # a miss answers at once while the master is down: pace the retries so the
            # readers do not take the cores a restarting master needs
            await asyncio.sleep(0 if ok else MISS_PAUSE_S)
