"""Plain records the pool master's index keeps and returns."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from kvpool.core.allocator import SegmentAllocator


class PutStatus(enum.Enum):
    RESERVED = 1
    ALREADY_EXISTS = 2
    NO_SPACE = 3


@dataclass(slots=True, frozen=True)
class PutRequestItem:
    key: str
    group_id: str
    group_size: int
    size: int


@dataclass(slots=True)
class Segment:
    """One store's DRAM segment; offsets from its allocator are relative to ``base_address``."""

    segment_id: str
    endpoint: str
    host: str
    numa_node: int
    base_address: int
    size: int
    allocator: SegmentAllocator
    last_heartbeat: float
    keys: set[str] = field(default_factory=set)


@dataclass(slots=True)
class StoredObject:
    """One object; readable only once ``committed`` (its checksum is then known)."""

    key: str
    group_id: str
    segment_id: str
    offset: int
    size: int
    checksum: int = 0
    committed: bool = False


@dataclass(slots=True)
class Group:
    """The members of one chunk; complete when all ``size`` members are committed."""

    group_id: str
    size: int
    members: dict[str, StoredObject] = field(default_factory=dict)
    num_committed: int = 0
    num_in_flight: int = 0
    num_leases: int = 0

    @property
    def complete(self) -> bool:
        return self.num_committed == self.size

    @property
    def busy(self) -> bool:
        """Busy groups are never evicted."""
        return self.num_in_flight > 0 or self.num_leases > 0


@dataclass(slots=True)
class PutOutcome:
    status: PutStatus
    segment: Segment | None = None
    offset: int = 0


@dataclass(slots=True)
class LookupResult:
    groups: list[Group]
    lease_id: int
    lease_s: float
