"""Host memory carved into per-request regions.

Bytes a stage moves that are not KV pages (hidden states for the next
stage, the handoff's gathered slabs) live in one of these arenas, allocated
once at start-up and reused: registered with the transfer engine when the
stage runs one, and, for the send arena, a ``SharedSegment`` the next stage
on this host maps (``pieces``). KV moves to and from the pool need none:
they use the pages themselves (``stage_runner``).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import torch

from kvpool.core.pool.allocator import SegmentAllocator
from kvpool.shared_memory import SharedSegment
from kvpool.transfer import HostBuffer, TransferEngine

ALIGNMENT = 4096  # regions start on a page


@dataclass(slots=True, frozen=True)
class Region:
    address: int
    offset: int
    size: int


class Arena:
    """A buffer with a best-fit allocator over it (4 KiB aligned): shared memory when ``shared``, registered with
    ``engine`` when there is one."""

    def __init__(self, name: str, size: int, engine: TransferEngine | None, shared: bool = False) -> None:
        self.name = name
        self.buffer: HostBuffer | SharedSegment = SharedSegment(size, f"{name}-arena") if shared else HostBuffer(size)
        self.buffer.touch()
        if engine is not None:
            engine.register(self.buffer.address, size)
        self._engine = engine
        self._allocator = SegmentAllocator(size, alignment=ALIGNMENT)
        self._freed = asyncio.Condition()

    @property
    def size(self) -> int:
        return self.buffer.size

    @property
    def alignment(self) -> int:
        return self._allocator.alignment

    @property
    def largest_free(self) -> int:
        return self._allocator.largest_free

    def close(self) -> None:
        """Unregister (the memory may be mapped again at this address later)."""
        if self._engine is not None:
            self._engine.unregister(self.buffer.address)

    def allocate(self, size: int) -> Region | None:
        """A region of ``size`` bytes, or None when the arena is too full right now."""
        offset = self._allocator.allocate(size)
        if offset is None:
            return None
        return Region(self.buffer.address + offset, offset, size)

    async def allocate_wait(self, size: int, timeout_s: float) -> Region:
        """Wait (up to ``timeout_s``) for room; raises TimeoutError, or ValueError if it can never fit."""
        if size > self.size:
            raise ValueError(f"{self.name} arena: {size} bytes can never fit in {self.size}")
        async with self._freed:
            region = self.allocate(size)
            if region is None:
                await asyncio.wait_for(self._freed.wait_for(lambda: self._allocator.largest_free >= size), timeout_s)
                region = self.allocate(size)
            assert region is not None
            return region

    def free(self, region: Region) -> None:
        self._allocator.free(region.offset)
        asyncio.get_running_loop().create_task(self._notify())

    async def _notify(self) -> None:
        async with self._freed:
            self._freed.notify_all()

    def tensor(self, region: Region, offset: int = 0, size: int | None = None) -> torch.Tensor:
        """A uint8 tensor over (part of) a region: no copy."""
        length = region.size - offset if size is None else size
        return torch.frombuffer(self.buffer.view(region.offset + offset, length), dtype=torch.uint8)
