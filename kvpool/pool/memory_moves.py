"""The pool's same-host path: bytes copied between the caller's memory and a store's mapped segment.

A store on this client's host offers its segment as shared memory (``kvpool.shared_memory``); the
pool client maps it once (``SegmentMaps``, which unmaps it when the store goes away) and copies, one
worker thread per call, each object of a read verified against its checksum as it lands, exactly as
the engine path verifies (``kvpool.pool.endpoint_batches``). Which path a move takes is the core's
(``kvpool.core.pool.paths.byte_path``).

A segment whose store died or restarted fails its moves at once: a read is NOT_READ (a miss: the
caller recomputes), a write is not stored. One whose socket is not within this process's reach (as in
another container) leaves its moves unattempted (None): the pool client sends them by the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import structlog

from kvpool.core.pool.paths import SegmentAccess
from kvpool.pool.objects import ReadStatus, checksum
from kvpool.shared_memory import OutOfReach, SegmentMaps, SharedMemoryUnavailable, copy

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class MemoryMove:
    """``size`` bytes between the caller's ``local`` address and ``remote`` (the store's own address, as
    locations carry it) in segment ``segment_id``."""

    segment_id: str
    local: int
    remote: int
    size: int


async def move_by_memory(maps: SegmentMaps, accesses: dict[str, SegmentAccess], moves: Sequence[MemoryMove],
                         write: bool, expected: Sequence[int] | None = None) -> list[Any]:
    """Per move: success (a write, or a read without ``expected``), its ``ReadStatus``, or None where its
    segment could not be mapped (module doc)."""
    result: list[Any] = [None] * len(moves)
    by_segment: dict[str, list[int]] = defaultdict(list)
    for i, move in enumerate(moves):
        by_segment[move.segment_id].append(i)
    spans: list[tuple[int, int, Any]] = []  # (move, address in this process, its mapping)
    for segment_id, indices in by_segment.items():
        access = accesses.get(segment_id)
        if access is None or access.shared is None:
            continue
        shared = access.shared
        try:
            mapped = await maps.map(shared.socket_path, shared.name, shared.token)
        except OutOfReach as exc:  # left unattempted: the engine may reach it
            log.info("shared_memory_out_of_reach", segment_id=segment_id, reason=str(exc), moves=len(indices))
            continue
        except SharedMemoryUnavailable as exc:  # its store died or restarted: a miss
            log.info("shared_memory_miss", segment_id=segment_id, reason=str(exc), moves=len(indices))
            for i in indices:
                result[i] = False if expected is None else ReadStatus.NOT_READ
            continue
        for i in indices:
            move = moves[i]
            offset = access.offset(move.remote)
            if not 0 <= offset <= mapped.size - move.size:  # the master's location does not fit this memory
                log.warning("shared_memory_out_of_range", segment_id=segment_id, offset=offset, size=move.size)
                result[i] = False if expected is None else ReadStatus.NOT_READ
                continue
            spans.append((i, mapped.address + offset, mapped))

    def run() -> None:
        """Every copy in one worker thread, each mapping pinned while its copies run."""
        with contextlib.ExitStack() as pins:
            for mapped in {id(m): m for _, _, m in spans}.values():
                pins.enter_context(mapped.using())
            for i, address, _ in spans:
                move = moves[i]
                if write:
                    copy(address, move.local, move.size)
                    result[i] = True
                    continue
                copy(move.local, address, move.size)
                if expected is None:
                    result[i] = True
                else:
                    good = checksum(move.local, move.size) == expected[i]
                    result[i] = ReadStatus.VERIFIED if good else ReadStatus.CORRUPT

    if spans:
        try:
            await asyncio.to_thread(run)
        except SharedMemoryUnavailable as exc:  # a mapping went away before its copies began: their moves miss
            log.info("shared_memory_miss", reason=str(exc), moves=len(spans))
    return result
