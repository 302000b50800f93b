"""Plain records the pool master's index keeps and returns.

The index keeps a record per group, not per object: a ``Group`` holds its members as columns (keys, segments,
offsets, sizes, checksums; keys as the parts after its id where they are "<group id>/<part>", found by the group's
id), a segment's journal holds an entry per group's commit or removal (in ``SegmentJournal``'s columns), and a
segment names its groups, not its keys. A save of a chunk's four stage objects makes one record where it
made four objects, four dict entries and eight journal records (``StoredObject`` is now a value made on demand,
for tests and cold paths). The records a save still makes per object (``PutRequestItem``, ``PutOutcome``) are not
frozen dataclasses: a frozen one's ``__init__`` sets each field through ``object.__setattr__``, 2.4 µs against
0.3 for a plain one of seven fields.
"""

from __future__ import annotations

import enum
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import accumulate, chain, repeat
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


def change_of_row(row: ChangeRow) -> SegmentChange:
    sequence, key, group_id, group_size, offset, size, checksum, tenant = row
    if not group_size:
        return SegmentChange(sequence, removed_key=key)
    return SegmentChange(sequence, added=ObjectRecord(key, group_id, group_size, offset, size, checksum, tenant))


@dataclass(slots=True)
class JournalChanges:
    """Changes of a segment's journal in ``GroupedChanges``' columns: entry ``i`` is changes ``first[i]`` to
    ``first[i] + count[i] - 1``, of group ``group_id[i]`` (``group_size[i]`` > 0: members added, with the next
    ``count[i]`` of ``offset``, ``size``, ``checksum``; 0: keys removed), each key ``prefix[i]`` and the next of
    ``part``."""

    first: list[int] = field(default_factory=list)
    count: list[int] = field(default_factory=list)
    prefix: list[str] = field(default_factory=list)
    group_id: list[str] = field(default_factory=list)
    group_size: list[int] = field(default_factory=list)
    tenant: list[str] = field(default_factory=list)
    part: list[str] = field(default_factory=list)
    offset: list[int] = field(default_factory=list)
    size: list[int] = field(default_factory=list)
    checksum: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        """Changes (a change is a key)."""
        return len(self.part)

    def rows(self) -> list[ChangeRow]:
        """Every change as a row (``PackedChanges``' columns)."""
        rows: list[ChangeRow] = []
        p = a = 0  # the next part, the next added member
        for first, n, prefix, group_id, group_size, tenant in zip(self.first, self.count, self.prefix, self.group_id,
                                                                 self.group_size, self.tenant):
            keys = [prefix + part for part in self.part[p:p + n]]
            sequences = range(first, first + n)
            if not group_size:
                rows += [(s, k, "", 0, 0, 0, 0, "") for s, k in zip(sequences, keys)]
            else:
                rows += zip(sequences, keys, repeat(group_id, n), repeat(group_size, n), self.offset[a:a + n],
                            self.size[a:a + n], self.checksum[a:a + n], repeat(tenant, n))
                a += n
            p += n
        return rows


@dataclass(slots=True)
class SegmentJournal:
    """Changes to one segment's committed objects that its store has not acknowledged yet.

    Each change has its own sequence number (the store acknowledges them one by one); they are kept a group at a
    time, an entry each (a save's commit of a group's members, or a removal of a group's keys), in columns: an
    entry is one more item in each list, not an object, and a heartbeat's changes are slices of them
    (``pending_columns``), not a walk over entries. Entry ``i`` (``head <= i``) is changes ``firsts[i]`` to
    ``firsts[i] + len(keys[i]) - 1``; ``group_sizes[i]`` 0 is a removal (its ``offsets``, ``sizes`` and
    ``checksums`` empty), and each key is ``prefixes[i]`` and one of ``keys[i]`` (a group's derived keys: the
    strings are made when sent, not kept).

    Invariant: entries ``head`` on hold exactly the changes with ``acked < sequence`` (entry ``head`` possibly in
    part), in sequence order (``firsts`` increasing, each entry's changes numbered on from the one before); the
    store's records equal the master's committed objects in the segment once it has applied every change.
    Entries before ``head`` are acknowledged, kept until they are many (``compact_after``) and half the lists.
    """

    sequence: int = 0
    acked: int = 0
    head: int = 0
    compact_after: int = 4096  # acknowledged entries kept before they are forgotten (when half the lists too)
    firsts: list[int] = field(default_factory=list)
    keys: list[tuple[str, ...]] = field(default_factory=list)
    group_ids: list[str] = field(default_factory=list)
    group_sizes: list[int] = field(default_factory=list)
    offsets: list[tuple[int, ...]] = field(default_factory=list)
    sizes: list[tuple[int, ...]] = field(default_factory=list)
    checksums: list[tuple[int, ...]] = field(default_factory=list)
    tenants: list[str] = field(default_factory=list)
    prefixes: list[str] = field(default_factory=list)

    def add(self, record: ObjectRecord) -> None:
        """One object added (a block report's resync; commits come a group at a time: ``add_members``)."""
        self.add_members(record.group_id, record.group_size, (record.key,), (record.offset,), (record.size,),
                         (record.checksum,), record.tenant)

    def add_members(self, group_id: str, group_size: int, keys: tuple[str, ...], offsets: tuple[int, ...],
                    sizes: tuple[int, ...], checksums: tuple[int, ...], tenant: str, prefix: str = "") -> None:
        """Members of one group added; each key ``prefix`` and one of ``keys``."""
        if keys:
            self.firsts.append(self.sequence + 1)
            self.keys.append(keys)
            self.group_ids.append(group_id)
            self.group_sizes.append(group_size)
            self.offsets.append(offsets)
            self.sizes.append(sizes)
            self.checksums.append(checksums)
            self.tenants.append(tenant)
            self.prefixes.append(prefix)
            self.sequence += len(keys)

    def remove(self, key: str) -> None:
        self.remove_keys((key,))

    def remove_keys(self, keys: tuple[str, ...], prefix: str = "") -> None:
        """Keys removed; each ``prefix`` and one of ``keys``."""
        if keys:
            self.firsts.append(self.sequence + 1)
            self.keys.append(keys)
            self.group_ids.append("")
            self.group_sizes.append(0)
            self.offsets.append(())
            self.sizes.append(())
            self.checksums.append(())
            self.tenants.append("")
            self.prefixes.append(prefix)
            self.sequence += len(keys)

    def add_groups(self, group_ids: list[str], keys: tuple[str, ...], offsets: list[tuple[int, ...]],
                   sizes: list[tuple[int, ...]], checksums: list[tuple[int, ...]], tenants: list[str],
                   prefixes: list[str]) -> None:
        """``add_members`` of each of whole groups of ``len(keys)`` members keyed alike (a commit's), in order: the
        i-th of ``group_id``, ``offsets[i]``, ``sizes[i]``, ``checksums[i]``, ``tenants[i]``, ``prefixes[i]``."""
        members, n = len(keys), len(group_ids)
        if not members or not n:
            return
        first = self.sequence + 1
        self.firsts.extend(range(first, first + n * members, members))
        self.keys.extend(repeat(keys, n))
        self.group_ids.extend(group_ids)
        self.group_sizes.extend(repeat(members, n))
        self.offsets.extend(offsets)
        self.sizes.extend(sizes)
        self.checksums.extend(checksums)
        self.tenants.extend(tenants)
        self.prefixes.extend(prefixes)
        self.sequence += n * members

    def remove_groups(self, keys: list[tuple[str, ...]], prefixes: list[str]) -> None:
        """``remove_keys`` of each of ``keys`` with its prefix, in order."""
        if len(prefixes) != len(keys):
            raise ValueError(f"{len(prefixes)} prefixes for {len(keys)} removals")
        if not all(keys):  # (a removal of no key is no entry, as ``remove_keys`` makes none)
            kept = [i for i, mine in enumerate(keys) if mine]
            keys, prefixes = [keys[i] for i in kept], [prefixes[i] for i in kept]
        if not keys:
            return
        lengths = list(map(len, keys))
        first = self.sequence + 1
        self.firsts.extend(accumulate(lengths[:-1], initial=first))
        self.keys.extend(keys)
        n = len(keys)
        self.group_ids.extend(repeat("", n))
        self.group_sizes.extend(repeat(0, n))
        empty = ()
        self.offsets.extend(repeat(empty, n))
        self.sizes.extend(repeat(empty, n))
        self.checksums.extend(repeat(empty, n))
        self.tenants.extend(repeat("", n))
        self.prefixes.extend(prefixes)
        self.sequence += sum(lengths)

    @property
    def unacked(self) -> int:
        """Changes the store has not acknowledged."""
        return self.sequence - self.acked

    @property
    def num_entries(self) -> int:
        """Entries holding a change not acknowledged."""
        return len(self.firsts) - self.head

    def ack(self, sequence: int) -> None:
        """The store applied every change up to ``sequence`` (a later one than ours is clamped)."""
        acked = self.acked = max(self.acked, min(sequence, self.sequence))
        firsts = self.firsts
        if self.head == len(firsts) or firsts[self.head] > acked:
            return
        i = bisect_right(firsts, acked, self.head) - 1  # the entry holding change ``acked``
        self.head = i + 1 if firsts[i] + len(self.keys[i]) - 1 <= acked else i
        if self.head >= self.compact_after and 2 * self.head >= len(firsts):
            self._compact()

    def _compact(self) -> None:
        """Forget the acknowledged entries' columns."""
        head = self.head
        for column in self._columns():
            del column[:head]
        self.head = 0

    def _columns(self) -> tuple[list, ...]:  # type: ignore[type-arg]
        return (self.firsts, self.keys, self.group_ids, self.group_sizes, self.offsets, self.sizes, self.checksums,
                self.tenants, self.prefixes)

    def clear(self) -> None:
        """Forget every change (the store's records are taken as they are: a resync); numbers go on."""
        for column in self._columns():
            column.clear()
        self.head = 0
        self.acked = self.sequence

    def pending_columns(self, limit: int) -> JournalChanges:
        """The first ``limit`` changes the store has not acknowledged (whole entries as slices of the columns)."""
        head, acked, firsts = self.head, self.acked, self.firsts
        if head == len(firsts) or limit <= 0:
            return JournalChanges()
        last = acked + limit  # the last change that may go
        stop = bisect_right(firsts, last, head)  # entries head..stop-1 hold a change that goes
        skip = acked - firsts[head] + 1 if firsts[head] <= acked else 0  # of entry head's, acknowledged
        cut = firsts[stop - 1] + len(self.keys[stop - 1]) - 1 - last  # of entry stop-1's, kept for later
        keys = self.keys[head:stop]
        # (a removal's offsets, sizes and checksums are empty: chained, the columns hold the additions' alone)
        changes = JournalChanges(
            firsts[head:stop], list(map(len, keys)), self.prefixes[head:stop], self.group_ids[head:stop],
            self.group_sizes[head:stop], self.tenants[head:stop], list(chain.from_iterable(keys)),
            list(chain.from_iterable(self.offsets[head:stop])), list(chain.from_iterable(self.sizes[head:stop])),
            list(chain.from_iterable(self.checksums[head:stop])))
        if skip > 0 or cut > 0:
            _trim(changes, skip, max(0, cut))
        return changes

    def pending_rows(self, limit: int) -> list[ChangeRow]:
        """``pending_columns`` as rows."""
        return self.pending_columns(limit).rows()

    def pending(self, limit: int) -> list[SegmentChange]:
        """``pending_rows`` as changes."""
        return list(map(change_of_row, self.pending_rows(limit)))


def _trim(changes: JournalChanges, skip: int, cut: int) -> None:
    """Take the first entry's first ``skip`` changes and the last entry's last ``cut`` off ``changes``."""
    if skip:
        changes.first[0] += skip
        changes.count[0] -= skip
        del changes.part[:skip]
        if changes.group_size[0]:
            for column in (changes.offset, changes.size, changes.checksum):
                del column[:skip]
    if cut:
        changes.count[-1] -= cut
        del changes.part[len(changes.part) - cut:]
        if changes.group_size[-1]:
            for column in (changes.offset, changes.size, changes.checksum):
                del column[len(column) - cut:]


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
