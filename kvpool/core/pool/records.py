"""Plain records the pool master's index keeps and returns.

The index keeps a record per group, not per object: a ``Group`` holds its members as columns (keys, segments,
offsets, sizes, checksums; keys as the parts after its id where they are "<group id>/<part>", found by the group's
id), a segment's journal holds an entry per group's commit or removal (``JournalEntry``), and a segment names its
groups, not its keys. A save of a chunk's four stage objects makes one record where it
made four objects, four dict entries and eight journal records (``StoredObject`` is now a value made on demand,
for tests and cold paths). The records a save still makes per object (``PutRequestItem``, ``PutOutcome``) are not
frozen dataclasses: a frozen one's ``__init__`` sets each field through ``object.__setattr__``, 2.4 µs against
0.3 for a plain one of seven fields.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import repeat
from typing import TypeVar

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


# one change as the store receives it: sequence, key, group id, group size (0: the key is removed), offset, size,
# checksum, tenant (``PackedChanges``' columns)
ChangeRow = tuple[int, str, str, int, int, int, int, str]


# one journal entry's part in a heartbeat: the entry, how many of its first changes the store acknowledged
# already, and how many go now (``GroupedChanges``' entries)
EntrySlice = tuple["JournalEntry", int, int]


def change_of_row(row: ChangeRow) -> SegmentChange:
    sequence, key, group_id, group_size, offset, size, checksum, tenant = row
    if not group_size:
        return SegmentChange(sequence, removed_key=key)
    return SegmentChange(sequence, added=ObjectRecord(key, group_id, group_size, offset, size, checksum, tenant))


@dataclass(slots=True)
class JournalEntry:
    """Changes to one segment made at once, numbered ``first`` on: members of one group added (``group_size`` > 0,
    with their offsets, sizes and checksums), or keys removed (``group_size`` 0). A save's commit or an eviction
    is one entry a group, not one a member."""

    first: int
    keys: tuple[str, ...]
    group_id: str = ""
    group_size: int = 0
    offsets: tuple[int, ...] = ()
    sizes: tuple[int, ...] = ()
    checksums: tuple[int, ...] = ()
    tenant: str = ""
    # each key is this and one of ``keys`` (a group's derived keys: the strings are made when sent, not kept)
    prefix: str = ""

    @property
    def last(self) -> int:
        return self.first + len(self.keys) - 1

    def rows(self, after: int, limit: int) -> list[ChangeRow]:
        """This entry's changes numbered past ``after``, at most ``limit``."""
        skip = max(0, after - self.first + 1)
        keys = self.keys[skip:skip + limit]
        if self.prefix:
            prefix = self.prefix
            keys = tuple(prefix + key for key in keys)
        sequences = range(self.first + skip, self.first + skip + len(keys))
        if not self.group_size:
            return [(s, k, "", 0, 0, 0, 0, "") for s, k in zip(sequences, keys)]
        n = len(keys)
        return list(zip(sequences, keys, repeat(self.group_id, n), repeat(self.group_size, n),
                        self.offsets[skip:skip + n], self.sizes[skip:skip + n], self.checksums[skip:skip + n],
                        repeat(self.tenant, n)))


@dataclass(slots=True)
class SegmentJournal:
    """Changes to one segment's committed objects that its store has not acknowledged yet.

    Each change has its own sequence number (the store acknowledges them one by one); they are kept a group at a
    time (``JournalEntry``). Invariant: ``entries`` hold exactly the changes with ``acked < sequence`` (the first
    entry possibly in part), in sequence order; the store's records equal the master's committed objects in the
    segment once it has applied every change.
    """

    sequence: int = 0
    acked: int = 0
    entries: deque[JournalEntry] = field(default_factory=deque)

    def add(self, record: ObjectRecord) -> None:
        """One object added (a block report's resync; commits come a group at a time: ``add_members``)."""
        self.add_members(record.group_id, record.group_size, (record.key,), (record.offset,), (record.size,),
                         (record.checksum,), record.tenant)

    def add_members(self, group_id: str, group_size: int, keys: tuple[str, ...], offsets: tuple[int, ...],
                    sizes: tuple[int, ...], checksums: tuple[int, ...], tenant: str, prefix: str = "") -> None:
        """Members of one group added; each key ``prefix`` and one of ``keys``."""
        if keys:
            self.entries.append(JournalEntry(self.sequence + 1, keys, group_id, group_size, offsets, sizes,
                                             checksums, tenant, prefix))
            self.sequence += len(keys)

    def remove(self, key: str) -> None:
        self.remove_keys((key,))

    def remove_keys(self, keys: tuple[str, ...], prefix: str = "") -> None:
        """Keys removed; each ``prefix`` and one of ``keys``."""
        if keys:
            self.entries.append(JournalEntry(self.sequence + 1, keys, prefix=prefix))
            self.sequence += len(keys)

    @property
    def unacked(self) -> int:
        """Changes the store has not acknowledged."""
        return self.sequence - self.acked

    def ack(self, sequence: int) -> None:
        """The store applied every change up to ``sequence`` (a later one than ours is clamped)."""
        acked = self.acked = max(self.acked, min(sequence, self.sequence))
        entries = self.entries
        while entries and (entry := entries[0]).first + len(entry.keys) <= acked + 1:  # (its last is acked)
            entries.popleft()

    def pending_rows(self, limit: int) -> list[ChangeRow]:
        """The first ``limit`` changes the store has not acknowledged, as rows."""
        rows: list[ChangeRow] = []
        for entry in self.entries:
            if len(rows) >= limit:
                break
            rows += entry.rows(self.acked, limit - len(rows))
        return rows

    def pending_entries(self, limit: int) -> list[EntrySlice]:
        """The first ``limit`` changes the store has not acknowledged, an entry at a time (no row made)."""
        slices: list[EntrySlice] = []
        left, acked = limit, self.acked
        for entry in self.entries:
            if left <= 0:
                break
            skip = max(0, acked - entry.first + 1)
            count = min(len(entry.keys) - skip, left)
            if count > 0:
                slices.append((entry, skip, count))
                left -= count
        return slices

    def pending(self, limit: int) -> list[SegmentChange]:
        """``pending_rows`` as changes."""
        return list(map(change_of_row, self.pending_rows(limit)))


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
    # every group with a member here, by id (a group nearly always lies in one segment)
    groups: dict[str, Group] = field(default_factory=dict)
    journal: SegmentJournal = field(default_factory=SegmentJournal)
    shared: SharedMemoryRef | None = None  # mapped by clients on ``host`` (kvpool.core.pool.paths)
    # this segment's number, unique for the index's life: a segment mounted anew gets a new one
    number: int = 0
    # members of its groups that lie here, committed or in flight (a running count: Stats reads it)
    num_objects: int = 0

    @property
    def access(self) -> SegmentAccess:
        return SegmentAccess(self.segment_id, self.host, self.base_address, self.shared)


def shared(columns: tuple[T, ...]) -> tuple[T, ...]:
    """One tuple for every group's equal column: groups' segment ids and sizes repeat (a save's chunks lie in one
    store, with one size a stage), so a million groups hold a few dozen such tuples, not a million each. Bounded,
    whatever callers send."""
    if len(_SHARED) > MAX_SHARED:
        _SHARED.clear()
    return _SHARED.setdefault(columns, columns)  # type: ignore[return-value]


def parts_of(group_id: str, keys: Sequence[str]) -> tuple[str, ...] | None:
    """What a group keeping its keys in part holds of ``keys`` (each ``Group.part``), decided a batch at a time
    (steps in C); None unless every key is ``group_id``, "/" and a part with no "/"."""
    prefix = group_id + "/"
    if not all(map(str.startswith, keys, repeat(prefix))):
        return None
    n = len(prefix)
    parts = [key[n:] for key in keys]
    if not all(parts) or "/" in "".join(parts):
        return None
    return tuple(parts)


T = TypeVar("T")
_SHARED: dict[tuple[object, ...], tuple[object, ...]] = {}
MAX_SHARED = 1 << 16


@dataclass(slots=True, frozen=True)
class StoredObject:
    """One member of a group, as a value: made on demand (``Group.member``) for tests and cold paths; the index
    keeps its members in the group's columns."""

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
    """The members of one chunk; complete when all ``size`` members are committed.

    Its members are columns, one entry a member in the order they arrived (``keys``, ``segment_ids``, ``offsets``,
    ``sizes`` as tuples, ``checksums`` a list set at each commit), not an object each: a save of a chunk makes one
    record, not one per stage, and the index's memory is its columns. ``pending`` has bit ``i`` set while member
    ``i``'s put is in flight.

    Keys: a member's key is nearly always its group's id, "/" and a part with no "/" (a stage's object key,
    ``kvpool.core.chunk_hash``). While every member's is, ``keys`` holds only those parts (one tuple shared by every
    such group: ``shared``) and the index keeps no string and no ``owners`` entry of its own a key: it finds a key's
    group by its id (``PoolIndex.owner``). A group with any other key holds its keys ``whole``, each in ``owners``.
    """

    group_id: str
    size: int
    tenant: str = DEFAULT_TENANT
    keys: tuple[str, ...] = ()  # whole, or each the part after "<group_id>/" (see above)
    whole: bool = False
    segment_ids: tuple[str, ...] = ()
    offsets: tuple[int, ...] = ()
    sizes: tuple[int, ...] = ()
    checksums: list[int] = field(default_factory=list)
    pending: int = 0
    nbytes: int = 0  # the room its members take in their segments: their sizes rounded to the alignment, summed
    # its members are one allocation at ``offsets[0]``, in order (placed as a run, none taken out since)
    run: bool = False
    num_committed: int = 0
    num_in_flight: int = 0
    num_leases: int = 0
    # a member failed to save: the group is dropped once no member is in flight
    failed: bool = False
    # a reader found a member failing its checksum: hidden, dropped once no lease holds it
    corrupt: bool = False
    # the master's encoding of the complete group's locations for lookups, made at the first lookup
    # that finds it; the index sets it back to None whenever a member changes
    encoded: object = None
    # the same in the compact form (kvpool.core.pool.compact), made and forgotten alike
    compact: object = None
    # the index forgot it (dropped, evicted, removed): a lease may still hold it, a lookup never finds it again
    dropped: bool = False
    # its place in the group table's orders while the table holds it, else -1 (kvpool.core.pool.groups)
    slot: int = field(default=-1, compare=False, repr=False)
    # complete, not corrupt and not dropped: what a lookup finds and a release still counts (one field to read a
    # whole history's worth of, not three); ``update_ready`` after any of those changes
    ready: bool = field(default=False, compare=False, repr=False)

    @property
    def complete(self) -> bool:
        return self.num_committed == self.size

    def update_ready(self) -> None:
        self.ready = self.num_committed == self.size and not self.corrupt and not self.dropped

    def key(self, position: int) -> str:
        return self.keys[position] if self.whole else f"{self.group_id}/{self.keys[position]}"

    def full_keys(self) -> tuple[str, ...]:
        """Every member's key, whole (made anew unless the group keeps them whole)."""
        if self.whole:
            return self.keys
        prefix = self.group_id + "/"
        return tuple(prefix + part for part in self.keys)

    @property
    def key_prefix(self) -> str:
        """What a kept key lacks: "" when the group keeps them whole."""
        return "" if self.whole else self.group_id + "/"

    def position(self, key: str) -> int:
        """Member ``key``'s place; ValueError when it is not a member."""
        if self.whole:
            return self.keys.index(key)
        part = self.part(key)
        if part is None:
            raise ValueError(f"{key!r} is not a member of {self.group_id!r}")
        return self.keys.index(part)

    def part(self, key: str) -> str | None:
        """What ``keys`` would hold of ``key`` in a group keeping its keys in part: None unless ``key`` is the
        group's id, "/" and a part with no "/" (``parts_of``)."""
        parts = parts_of(self.group_id, (key,))
        return parts[0] if parts is not None else None

    def by_segment(self, positions: Sequence[int]) -> dict[str, list[int]]:
        """``positions`` (in order) by the segment each member lies in."""
        found: dict[str, list[int]] = {}
        segment_ids = self.segment_ids
        for position in positions:
            found.setdefault(segment_ids[position], []).append(position)
        return found

    def committed(self, position: int) -> bool:
        return not self.pending >> position & 1

    def member(self, position: int) -> StoredObject:
        return StoredObject(self.key(position), self.group_id, self.segment_ids[position], self.offsets[position],
                            self.sizes[position], self.checksums[position], self.committed(position), self.tenant)

    @property
    def members(self) -> dict[str, StoredObject]:
        """Every member as a value, by key (made anew at each call: for tests and cold paths)."""
        return {self.key(i): self.member(i) for i in range(len(self.keys))}

    def add_member(self, key: str, segment_id: str, offset: int, size: int, room: int, checksum: int = 0,
                   committed: bool = False) -> tuple[str, ...]:
        """A member of ``size`` bytes taking ``room`` in its segment (its size aligned) joins; returns the keys
        the index must now find by ``owners`` (none while the group keeps its keys in part; every member's when
        this key makes it keep them whole)."""
        if not committed:
            self.pending |= 1 << len(self.keys)
            self.num_in_flight += 1
        else:
            self.num_committed += 1
        part = None if self.whole else self.part(key)
        if part is not None:
            self.keys = shared(self.keys + (part,))
            tracked: tuple[str, ...] = ()
        elif self.whole:
            self.keys += (key,)
            tracked = (key,)
        else:  # the first key that is not "<group_id>/<part>": the group keeps its keys whole from now on
            self.keys = self.full_keys() + (key,)
            self.whole = True
            tracked = self.keys
        self.segment_ids = shared(self.segment_ids + (segment_id,))
        self.offsets += (offset,)
        self.sizes = shared(self.sizes + (size,))
        self.checksums.append(checksum)
        self.nbytes += room
        self.forget_encodings()
        self.update_ready()
        return tracked

    def remove_member(self, position: int, room: int) -> StoredObject:
        """Take member ``position``, which takes ``room`` in its segment, out (its counts with it); returns it as
        it was."""
        member = self.member(position)
        if member.committed:
            self.num_committed -= 1
        else:
            self.num_in_flight -= 1
        low = self.pending & ((1 << position) - 1)
        self.pending = low | (self.pending >> (position + 1) << position)
        cut = slice(position, position + 1)
        keys, segment_ids, offsets, sizes = (list(self.keys), list(self.segment_ids), list(self.offsets),
                                             list(self.sizes))
        for column in (keys, segment_ids, offsets, sizes, self.checksums):
            del column[cut]
        self.keys = tuple(keys) if self.whole else shared(tuple(keys))
        self.segment_ids, self.offsets, self.sizes = shared(tuple(segment_ids)), tuple(offsets), shared(tuple(sizes))
        self.nbytes -= room
        self.forget_encodings()
        self.update_ready()
        return member

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
