"""What the core tests share: a hand-driven clock and a pool index on mounted segments."""

from __future__ import annotations

from dataclasses import dataclass

from kvpool.core.pool.index import IndexSettings, PoolIndex
from kvpool.core.pool.records import MountResult, ObjectRecord

KB = 1024


@dataclass(slots=True)
class Clock:
    """A clock that moves only when a test sets ``now``."""

    now: float = 1000.0

    def __call__(self) -> float:
        return self.now


def mount(
    index: PoolIndex, segment_id: str, records: list[ObjectRecord] | None = None, size: int = 100 * KB
) -> MountResult:
    """Mount ``seg<i>`` at ``127.0.0.1:<9000+i>`` on ``host<i>``, base address ``0x10000000 × (i+1)``."""
    i = int(segment_id.removeprefix("seg"))
    return index.mount_segment(segment_id, f"127.0.0.1:{9000 + i}", f"host{i}", 0x10000000 * (i + 1), size,
                               records=records or [])


def make_index(segment_bytes: int = 100 * KB, segments: int = 1, **settings: object) -> tuple[PoolIndex, Clock]:
    """An index with ``segments`` segments ``seg0``… of ``segment_bytes`` each, byte alignment unless
    ``settings`` say otherwise, and a clock at 1000.0."""
    clock = Clock()
    index = PoolIndex(IndexSettings(**{"alignment": 1, **settings}), clock=clock)  # type: ignore[arg-type]
    for i in range(segments):
        mount(index, f"seg{i}", size=segment_bytes)
    return index, clock
