"""The pool's same-host path: bytes copied between the caller's memory and a store's mapped segment.

A store on this client's host offers its segment as shared memory (``kvpool.shared_memory``); the
pool client maps it once (``SegmentMaps``, which unmaps it when the store goes away) and copies on
worker threads (a large call's copies split over up to ``COPY_THREADS`` of them, in shares of about
equal bytes), each object of a read verified against its checksum as it lands, exactly as the engine
path verifies (``kvpool.pool.endpoint_batches``). Which path a move takes is the core's
(``kvpool.core.pool.paths.byte_path``).

A segment whose store died or restarted fails its moves at once: a read is NOT_READ (a miss: the
caller recomputes), a write is not stored. One whose socket is not within this process's reach (as in
another container) leaves its moves unattempted (None): the pool client sends them by the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import structlog

from kvpool.core.pool.paths import SegmentAccess
from kvpool.pool.objects import ReadStatus, checksum
from kvpool.shared_memory import OutOfReach, SegmentMaps, SharedMemoryUnavailable, copy

log = structlog.get_logger(__name__)

# copies of one call run on up to this many worker threads (a memcpy and its xxh3 check use about one core
# each; a host's memory bandwidth takes several); below SPLIT_MIN_BYTES a thread each is not worth its hop
COPY_THREADS = max(1, min(4, os.cpu_count() or 1))
SPLIT_MIN_BYTES = 4 << 20


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

    def run(share: list[tuple[int, int, Any]]) -> None:
        """A share of the copies in one worker thread, each mapping pinned while its copies run."""
        with contextlib.ExitStack() as pins:
            for mapped in {id(m): m for _, _, m in share}.values():
                pins.enter_context(mapped.using())
            for i, address, _ in share:
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
        shares = split_copies(spans, [moves[i].size for i, _, _ in spans])
        outcomes = await asyncio.gather(*(asyncio.to_thread(run, share) for share in shares), return_exceptions=True)
        for outcome in outcomes:
            if isinstance(outcome, SharedMemoryUnavailable):  # a mapping went away before its copies began
                log.info("shared_memory_miss", reason=str(outcome), moves=len(spans))
            elif isinstance(outcome, BaseException):
                raise outcome
    return result


def split_copies(spans: list[Any], sizes: list[int]) -> list[list[Any]]:
    """The copies in up to ``COPY_THREADS`` shares of about equal bytes, in order: one share below
    ``SPLIT_MIN_BYTES`` (a thread hop costs more than a small copy gains)."""
    total = sum(sizes)
    threads = min(COPY_THREADS, len(spans), max(1, total // SPLIT_MIN_BYTES))
    if threads <= 1:
        return [spans]
    shares: list[list[Any]] = [[] for _ in range(threads)]
    target, filled, share = total / threads, 0, 0
    for span, size in zip(spans, sizes):
        if filled >= target * (share + 1) and share < threads - 1:
            share += 1
        shares[share].append(span)
        filled += size
    return [s for s in shares if s]
