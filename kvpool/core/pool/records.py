"""Plain records the pool master's index keeps and returns.

The ones a save makes per object (``PutRequestItem``, ``ObjectRecord``, ``SegmentChange``) are not frozen
dataclasses: a frozen one's ``__init__`` sets each field through ``object.__setattr__``, 2.4 µs against 0.3
for a plain one of seven fields, and a save of 88 objects made about 340 of them (a third of its cost to the
master). Nothing changes them once made; nothing hashes them.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field

from kvpool.core.pool.paths import SegmentAccess, SharedMemoryRef
from kvpool.core.pool.allocator import SegmentAllocator
from kvpool.core.chunk_hash import DEFAULT_TENANT


class PutStatus(enum.Enum):
    RESERVED = 1
    ALREADY_EXISTS = 2
    NO_SPACE = 3
    # another member of the group failed to save moments ago: this one alone
    # would only make an incomplete group
    GROUP_FAILED = 4


@dataclass(slots=True)
class PutRequestItem:
    key: str
    group_id: str
    group_size: int
    size: int
    # whose chunk: a group's tenant is its first writer's (tenant_shares)
    tenant: str = DEFAULT_TENANT


@dataclass(slots=True)
class IndexCounters:
    """What the index has done since it started (Prometheus counters are advanced from these)."""

    evicted_groups: int = 0
    evicted_bytes: int = 0
    revoked_puts: int = 0
    dropped_segments: int = 0
    failed_groups: int = 0
    abandoned_groups: int = 0
    # dropped because a reader found a member failing its checksum (``pool.corrupt``)
    corrupt_groups: int = 0
    adopted_objects: int = 0
    rejected_records: int = 0
    # groups evicted, by the tenant whose group it was
    evicted_groups_by_tenant: dict[str, int] = field(default_factory=dict)


@dataclass(slots=True)
class ObjectRecord:
    """What a store keeps of one committed object in its own segment, and reports when it (re-)mounts."""

    key: str
    group_id: str
    group_size: int
    offset: int
    size: int
    checksum: int
    tenant: str = DEFAULT_TENANT


@dataclass(slots=True)
class SegmentChange:
    """One change to a segment's committed objects: ``added`` set, or ``removed_key`` forgotten."""

    sequence: int
    added: ObjectRecord | None = None
    removed_key: str = ""


@dataclass(slots=True)
class SegmentJournal:
    """Changes to one segment's committed objects that its store has not acknowledged yet.

    Invariant: ``entries`` hold exactly the changes with ``acked < sequence``,
    in sequence order; the store's records equal the master's committed
    objects in the segment once it has applied every entry.
    """

    sequence: int = 0
    acked: int = 0
    entries: deque[SegmentChange] = field(default_factory=deque)

    def add(self, record: ObjectRecord) -> None:
        self.sequence += 1
        self.entries.append(SegmentChange(self.sequence, added=record))

    def remove(self, key: str) -> None:
        self.sequence += 1
        self.entries.append(SegmentChange(self.sequence, removed_key=key))

    def ack(self, sequence: int) -> None:
        """The store applied every change up to ``sequence`` (a later one than ours is clamped)."""
        self.acked = max(self.acked, min(sequence, self.sequence))
        while self.entries and self.entries[0].sequence <= self.acked:
            self.entries.popleft()

    def pending(self, limit: int) -> list[SegmentChange]:
        """The first ``limit`` changes the store has not acknowledged."""
        return [change for _, change in zip(range(limit), self.entries)]


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
    journal: SegmentJournal = field(default_factory=SegmentJournal)
    shared: SharedMemoryRef | None = None  # mapped by clients on ``host`` (kvpool.core.pool.paths)
    # this segment's number, unique for the index's life: a segment mounted anew gets a new one
    number: int = 0

    @property
    def access(self) -> SegmentAccess:
        return SegmentAccess(self.segment_id, self.host, self.base_address, self.shared)


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
    tenant: str = DEFAULT_TENANT


@dataclass(slots=True)
class Group:
    """The members of one chunk; complete when all ``size`` members are committed."""

    group_id: str
    size: int
    members: dict[str, StoredObject] = field(default_factory=dict)
    num_committed: int = 0
    num_in_flight: int = 0
    num_leases: int = 0
    # a member failed to save: the group is dropped once no member is in flight
    failed: bool = False
    # a reader found a member failing its checksum: hidden, dropped once no lease holds it
    corrupt: bool = False
    tenant: str = DEFAULT_TENANT
    # the master's encoding of the complete group's locations for lookups, made at the first lookup
    # that finds it; the index sets it back to None whenever a member changes
    encoded: object = None
    # the same in the compact form (kvpool.core.pool.compact), made and forgotten alike
    compact: object = None
    # the index forgot it (dropped, evicted, removed): a lease may still hold it, a lookup never finds it again
    dropped: bool = False

    @property
    def complete(self) -> bool:
        return self.num_committed == self.size

    def forget_encodings(self) -> None:
        """A member changed: the kept lookup encodings (``encoded``, ``compact``) no longer hold."""
        self.encoded = self.compact = None

    @property
    def busy(self) -> bool:
        """Busy groups are never evicted."""
        return self.num_in_flight > 0 or self.num_leases > 0


@dataclass(slots=True, frozen=True)
class MountResult:
    """What a mount did: ``fresh`` unless this exact segment was mounted already; which
    reported records became objects again and which were rejected (the store forgets
    those); the journal sequence the store's records now stand at."""

    fresh: bool
    adopted: int
    rejected_keys: list[str]
    sequence: int


@dataclass(slots=True)
class PutOutcome:
    status: PutStatus
    segment: Segment | None = None
    offset: int = 0


@dataclass(slots=True)
class LookupResult:
    """``num_found`` leading complete groups of those asked; ``groups`` the ones after the held
    prefix (leased under ``lease_id``, 0 when none is)."""

    groups: list[Group]
    lease_id: int
    lease_s: float
    num_found: int = 0
    # the found groups kept for the next lookup of this history (``kvpool.core.pool.histories``; 0: none)
    history: int = 0
    # the handle asked by is not (or no longer) known: nothing was looked up, the caller sends its ids
    unknown_history: bool = False
