"""The pool master's object index: segments, objects, groups, leases, eviction.

Pure policy: no grpc, no I/O, an injectable clock. The servicer converts
protobuf to these calls; unit tests drive it directly.

Invariants:
- a group is visible to lookups only when every declared member is committed;
- eviction removes whole groups, least recently used first within the rule
  of tenants' shares (``tenancy.shares``; a group is its first writer's
  tenant's), never a group that is leased or has a put in flight
  (``eviction="object"``, for comparisons only, removes one member at a time
  and may leave partial groups, invisible);
- eviction starts when used bytes would pass ``high_watermark × capacity`` and
  frees down to ``low_watermark × capacity``;
- every allocated byte belongs to exactly one object (committed or in flight);
- a group with a member that failed to save, or still incomplete long after
  its last member arrived, is dropped by the put table's rules (``pool.puts``);
- a group a reader found corrupt (``pool.corrupt``) is invisible to lookups
  and dropped once no lease holds it;
- each segment's journal holds the changes to its committed objects that its
  store has not acknowledged; a store reports what it holds on (re-)mount and
  only what passes ``plan_report`` becomes an object again (block reports,
  see ``pool.recovery``).

The index holds its parts as objects with small interfaces, each in its own
module: ``GroupTable`` (groups and tenants in LRU order), ``SegmentTable``
(space, mounts, heartbeats), ``PutTable`` (puts in flight, incomplete and
failed groups), ``Eviction``, ``GroupFailures`` and ``LeaseTable``. Eviction,
the segment table and the put table see the index only through the protocols
they declare (``Evictable``, ``SegmentHost``, ``PutHost``); nothing here is a
mixin, and no part imports the index.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from operator import attrgetter

from kvpool.core.chunk_hash import DEFAULT_TENANT
from kvpool.core.pool import fields
from kvpool.core.pool.corrupt import condemn, droppable
from kvpool.core.pool.eviction import Eviction, GroupFailures
from kvpool.core.pool.groups import GroupTable
from kvpool.core.pool.leases import LeaseTable
from kvpool.core.pool.paths import SharedMemoryRef
from kvpool.core.pool.put_groups import as_commit_groups, as_groups
from kvpool.core.pool.puts import PlacedGroups, PutTable
from kvpool.core.pool.records import (
    ChangeRow,
    JournalChanges,
    Group,
    IndexCounters,
    LookupResult,
    MountResult,
    ObjectRecord,
    PutOutcome,
    PutRequestItem,
    Segment,
    SegmentChange,
    StoredObject,
    change_of_row,
)
from kvpool.core.pool.histories import HistoryHandles
from kvpool.core.pool.segments import SegmentTable
from kvpool.core.pool.settings import IndexSettings
from kvpool.core.tenancy.shares import TenantShares, tenant_name


def leading_usable(groups: list[Group | None]) -> list[Group]:
    """The leading groups that are there, complete and not corrupt (a lookup's found run; none of them is
    dropped: they are the table's). One field of each read in one pass (``Group.ready``, ``fields.leading``), a
    whole history at a time: one Python step per group was most of a long lookup's cost (None, a missing group,
    ends the run)."""
    n = fields.leading(groups, Group, "ready")
    return groups if n == len(groups) else groups[:n]  # type: ignore[return-value]


def still_usable(groups: list[Group]) -> list[Group]:
    """Those of ``groups`` the index still holds (not dropped, nor replaced by a new group of the same id: the
    table marks what it forgets) and that are not corrupt, in order; in C when all are ready (a release,
    nearly always), with no lookup by id."""
    if fields.count(groups, Group, "ready") == len(groups) or \
            (not fields.count(groups, Group, "dropped") and not fields.count(groups, Group, "corrupt")):
        return groups
    return [g for g in groups if not g.dropped and not g.corrupt]


class PoolIndex:
    """Where every object lives, which groups are complete, what to evict (invariants above)."""

    __slots__ = (
        "settings", "clock", "owners", "groups", "counters", "segment_table", "eviction", "failures",
        "leases", "group_table", "shares", "puts", "histories",
    )

    def __init__(self, settings: IndexSettings | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings if settings is not None else IndexSettings()
        self.clock = clock
        # the group of each object whose group keeps its keys whole, by key (the others are found by their group's
        # id: ``owner``)
        self.owners: dict[str, Group] = {}
        self.group_table = GroupTable()
        self.groups = self.group_table.groups  # LRU order: the first is the least recently used
        self.shares = TenantShares.parse(self.settings.tenant_weights)
        self.counters = IndexCounters()
        self.failures = GroupFailures(self.settings.failed_group_hold_s, clock)
        self.leases = LeaseTable(clock)
        self.histories = HistoryHandles()  # found histories, for their next lookup
        self.segment_table = SegmentTable(self, self.settings, clock, self.counters, self.failures)
        self.eviction = Eviction(self, self.counters, self.settings.eviction, self.shares,
                                 self.settings.max_evictions_per_put)
        self.puts = PutTable(self, self.settings, clock, self.counters, self.failures, self.group_table,
                             self.segment_table, self.eviction)

    # ---- writes (the put table's calls) --------------------------------

    def put_start(self, client_host: str, items: Sequence[PutRequestItem], read_lease: int = 0,
                  corrupt_group_ids: Collection[str] = ()) -> list[PutOutcome]:
        """See :meth:`PutTable.put_start`; leases past their time end first.

        ``read_lease``: the lease of the restore this save follows (with the groups its reader found corrupt),
        used (``use_lease``) once the batch passed its checks, before anything is placed: the read came first.
        The lease still holds through the put, so its eviction spares what was read; the caller ends it after."""
        self.expire_leases()
        if not read_lease:
            return self.puts.put_start(client_host, items)
        return self.puts.put_start(client_host, items, lambda: self.use_lease(read_lease, corrupt_group_ids))

    def put_groups(self, client_host: str, group_ids: Sequence[str], member_sizes: Sequence[int], by_member: bool,
                   tenant: str = DEFAULT_TENANT, read_lease: int = 0,
                   corrupt_group_ids: Collection[str] = ()) -> PlacedGroups | None:
        """See :meth:`PutTable.put_groups` (None: the caller puts the items, ``put_start``); leases past their time
        end first, ``read_lease`` as in ``put_start``."""
        self.expire_leases()
        if not read_lease:
            return self.puts.put_groups(client_host, group_ids, member_sizes, by_member, tenant)
        return self.puts.put_groups(client_host, group_ids, member_sizes, by_member, tenant,
                                    lambda: self.use_lease(read_lease, corrupt_group_ids))

    def put_start_grouped(self, client_host: str, items: Sequence[PutRequestItem], read_lease: int = 0,
                          corrupt_group_ids: Collection[str] = ()) -> list[PutOutcome]:
        """``put_start`` as the master serves a pool client's put of these items: where they are a put of whole
        groups of one tenant (``put_groups.as_groups``, what the client then sends as ``PutGroups``),
        ``put_groups`` first. For what runs the master's decisions without its messages (the simulator)."""
        groups = None
        if items and all(item.tenant == items[0].tenant for item in items):
            groups = as_groups([(item.key, item.group_id, item.group_size, item.size) for item in items])
        if groups is not None:
            group_ids, member_sizes, by_member = groups
            placed = self.put_groups(client_host, group_ids, member_sizes, by_member, items[0].tenant, read_lease,
                                     corrupt_group_ids)
            if placed is not None:
                return placed.outcomes(len(member_sizes), by_member)
        return self.put_start(client_host, items, read_lease, corrupt_group_ids)

    def put_end(self, commits: Sequence[tuple[str, int]], field: str = "items[{}].key") -> int:
        """Commit in-flight puts (key, checksum); all or none (a bad one named as ``field`` with its place)."""
        return self.puts.put_end(commits, field)

    def put_end_groups(self, group_ids: Sequence[str], members: int, by_member: bool, checksums: Sequence[int],
                       field: str = "groups (commit {})") -> int:
        """See :meth:`PutTable.put_end_groups`: ``put_end`` of the commits a commit of whole groups stands for."""
        return self.puts.put_end_groups(group_ids, members, by_member, checksums, field)

    def put_end_grouped(self, commits: Sequence[tuple[str, int]]) -> int:
        """``put_end`` as the master serves a pool client's commit of these: where they are whole groups'
        (``put_groups.as_commit_groups``, what the client then sends as ``CommitGroups``), ``put_end_groups``.
        For what runs the master's decisions without its messages (the simulator)."""
        groups = as_commit_groups([key for key, _ in commits])
        if groups is None:
            return self.put_end(commits)
        group_ids, members, by_member = groups
        return self.put_end_groups(group_ids, members, by_member, [checksum for _, checksum in commits])

    def put_revoke(self, keys: Iterable[str]) -> int:
        """Give back the space of in-flight puts and fail their groups; committed or unknown keys are left alone."""
        return self.puts.put_revoke(keys)

    def revoke_expired_puts(self) -> list[str]:
        """Revoke puts started more than ``put_timeout_s`` ago (their writer died)."""
        return self.puts.revoke_expired_puts()

    def drop_incomplete_groups(self) -> list[str]:
        """See :meth:`PutTable.drop_incomplete_groups`."""
        return self.puts.drop_incomplete_groups()

    # ---- reads ----------------------------------------------------------

    def lookup(self, group_ids: Sequence[str], lease_s: float | None = None, held_prefix: int = 0,
               history: int = 0, history_len: int = 0) -> LookupResult:
        """Count leading complete groups; touch them; lease those after the first ``held_prefix``.

        The caller holds the first ``held_prefix`` groups itself (its device cache): they count and are
        touched as any found group, but are not leased (nobody reads them from the pool). The release
        touches them again with the leased ones, as if they were leased.

        ``history``: a handle an earlier lookup returned (``LookupResult.history``), standing for the first
        ``history_len`` groups; ``group_ids`` are then the ids after them, and ``held_prefix`` counts from the
        handle's first group. The found groups are kept under a new handle (``kvpool.core.pool.histories``),
        which replaces the one used.
        """
        self.expire_leases()
        if history:
            kept = self.histories.get(history)
            if kept is None or len(kept) < history_len:
                return LookupResult([], 0, 0.0, unknown_history=True)
            prefix = kept[:history_len]
            if fields.count(prefix, Group, "dropped"):  # forgotten since: what the dict holds under their ids now
                get = self.groups.get
                prefix = [get(g.group_id) if g.dropped else g for g in prefix]
            candidates = prefix + list(map(self.groups.get, group_ids)) if group_ids else prefix
        else:
            candidates = list(map(self.groups.get, group_ids))
        found = leading_usable(candidates)
        if history:
            self.histories.drop(history)  # the answer's handle, if any, stands for the same history and more
        if not found:
            return LookupResult([], 0, 0.0)
        duration = self.settings.lease_s if lease_s is None else lease_s
        leased = found[held_prefix:] if held_prefix else found
        lease_id = self.leases.grant(leased, duration, found[:held_prefix]) if leased else 0
        self.group_table.touch_groups(found)
        if lease_id:
            self.leases.mark(lease_id, self.group_table.version)  # the order this touch left
        kept_list = list(found) if leased is found else found  # (the lease keeps its own list)
        handle = self.histories.keep(kept_list, len(self.groups))
        return LookupResult(leased, lease_id, duration, len(found), handle)

    def release_lease(self, lease_id: int, corrupt_group_ids: Collection[str] = ()) -> bool:
        """End a lease early (the reader is done); a read counts as a use.

        ``corrupt_group_ids``: groups of this lease with a member whose bytes
        failed their checksum; they are hidden now and dropped once no lease
        holds them (``pool.corrupt``). Unknown to an ended or expired lease.
        """
        if not self.use_lease(lease_id, corrupt_group_ids):  # its read counts as a use, unless it did already
            return False
        groups, _ = self.leases.release(lease_id)  # type: ignore[misc]  (live: use_lease found it)
        self._drop_corrupt(groups)  # this lease's or an earlier reader's condemned groups no lease holds now
        return True

    def use_lease(self, lease_id: int, corrupt_group_ids: Collection[str] = ()) -> bool:
        """The reader is done reading but the lease holds on a while: its read counts as a use now, and the
        groups it found corrupt are hidden now; ``release_lease`` then touches nothing. A save that follows its
        restore does this first (its new groups are used after the history it read) and ends the lease after
        its put (whose eviction must spare that history). False for an ended or expired lease."""
        lease = self.leases.get(lease_id)
        if lease is None:
            return False
        groups, held = lease
        if corrupt_group_ids:
            condemn(groups, self.groups, corrupt_group_ids)
        if self.leases.was_read(lease_id):
            return True
        self.leases.note_read(lease_id)
        # in prefix order, the held prefix first, as the lookup found them; unless nothing changed the order
        # since the lookup's touch (removals leave it) and all are usable: they are still last, in this order
        found = held + groups if held else groups
        usable = still_usable(found)
        if usable is not found or self.leases.mark_of(lease_id) != self.group_table.version:
            self.group_table.touch_groups(usable)
        return True

    def expire_leases(self) -> int:
        """End every lease past its time; returns how many condemned groups that dropped."""
        return self._drop_corrupt(self.leases.expire())

    def _drop_corrupt(self, ended: Sequence[Group]) -> int:
        dropped = droppable(ended, self.groups)
        for group in dropped:
            self.counters.corrupt_groups += 1
            self.drop_group(group.group_id)
        return len(dropped)

    @property
    def objects(self) -> ObjectsView:
        """Every object as a value, by key (``StoredObject``s made on demand: for tests and cold paths)."""
        return ObjectsView(self)

    @property
    def num_objects(self) -> int:
        return self.group_table.num_objects

    def owner(self, key: str) -> tuple[Group, int] | None:
        """The group holding object ``key`` and its place there, or None."""
        group = self.owners.get(key)
        if group is not None:
            return group, group.keys.index(key)
        cut = key.rfind("/")
        if cut > 0:
            group = self.groups.get(key[:cut])
            if group is not None and not group.whole:
                part = key[cut + 1:]
                if part in group.keys:
                    return group, group.keys.index(part)
        return None

    def holds(self, key: str) -> bool:
        """An object ``key`` is here (committed or in flight)."""
        return self.owner(key) is not None

    def holds_any(self, keys: list[str]) -> bool:
        """Any of ``keys`` is here. A save's keys name new groups: no key is kept whole and no key's would-be group
        (all but its last part) is known, which settles it in C, not one ``owner`` a key."""
        if not self.owners.keys().isdisjoint(keys):
            return True
        groups = self.groups
        if not any(map(groups.__contains__, [key[:key.rfind("/")] for key in keys])):
            return False
        return any(map(self.holds, keys))

    def exists(self, keys: Iterable[str]) -> list[bool]:
        return [(found := self.owner(key)) is not None and found[0].committed(found[1]) for key in keys]

    def remove(self, group_ids: Iterable[str]) -> tuple[int, list[str]]:
        """Remove whole groups; busy ones (leased, put in flight) are left and named."""
        self.expire_leases()
        removed, busy = 0, []
        for group_id in group_ids:
            group = self.groups.get(group_id)
            if group is None:
                continue
            if group.busy:
                busy.append(group_id)
                continue
            self.drop_group(group_id)
            removed += 1
        return removed, busy

    def touch(self, group_ids: Iterable[str]) -> None:
        """Mark groups used, the first named becoming the most recently used.

        Group ids come in prefix order; a chunk is useless without the chunks
        before it, so within one request the tail is made older than the head
        and is evicted first.
        """
        self.group_table.touch(group_ids)

    def demote(self, group_ids: Iterable[str]) -> int:
        """Lower groups to the front of eviction (a session that ended: ``session_end``), the last named
        first; nothing else changes (a leased group is still never evicted). Returns how many exist."""
        return self.group_table.demote(group_ids)

    # ---- accounting -----------------------------------------------------

    @property
    def segments(self) -> dict[str, Segment]:
        return self.segment_table.segments

    @property
    def capacity(self) -> int:
        return self.segment_table.capacity

    @property
    def used_bytes(self) -> int:
        """Bytes allocated in every segment: a running total, O(1) (a put reads it on every placement)."""
        return self.segment_table.used_bytes

    @property
    def num_leases(self) -> int:
        return len(self.leases)

    @property
    def num_in_flight(self) -> int:
        return len(self.puts.in_flight)

    # ---- segments (the table's calls) -----------------------------------

    def mount_segment(
        self,
        segment_id: str,
        endpoint: str,
        host: str,
        base_address: int,
        size: int,
        numa_node: int = -1,
        records: Sequence[ObjectRecord] = (),
        shared: SharedMemoryRef | None = None,
    ) -> MountResult:
        """See :meth:`SegmentTable.mount`."""
        return self.segment_table.mount(segment_id, endpoint, host, base_address, size, numa_node, records, shared)

    def unmount_segment(self, segment_id: str) -> int:
        """Drop a segment and every group with a member in it; returns objects dropped."""
        return self.segment_table.unmount(segment_id)

    def heartbeat(self, segment_id: str, acked_sequence: int = 0) -> tuple[list[SegmentChange], bool]:
        """Keep a segment alive; returns the changes its store has not acknowledged, and whether more wait."""
        rows, more = self.segment_table.heartbeat(segment_id, acked_sequence)
        return list(map(change_of_row, rows)), more

    def heartbeat_rows(self, segment_id: str, acked_sequence: int = 0) -> tuple[list[ChangeRow], bool]:
        """``heartbeat``, the changes as rows (``PackedChanges``' columns)."""
        return self.segment_table.heartbeat(segment_id, acked_sequence)

    def heartbeat_changes(self, segment_id: str, acked_sequence: int = 0) -> tuple[JournalChanges, bool]:
        """``heartbeat``, the changes in a journal's columns (``GroupedChanges``' own)."""
        return self.segment_table.heartbeat_changes(segment_id, acked_sequence)

    def expire_segments(self) -> list[str]:
        """Unmount every segment whose store missed heartbeats for the TTL."""
        return self.segment_table.expire()

    # ---- what the parts see (Evictable, SegmentHost, PutHost) -----------

    @property
    def lru_groups(self) -> OrderedDict[str, Group]:
        return self.groups

    def tenant_groups(self, tenant: str) -> OrderedDict[str, Group]:
        return self.group_table.of_tenant(tenant)

    @property
    def tenant_bytes(self) -> dict[str, int]:
        return self.group_table.tenant_bytes

    @property
    def share_capacity(self) -> float:
        """What tenants' shares divide: the bytes the pool fills before it evicts."""
        return self.settings.high_watermark * self.capacity

    def room(self, size: int) -> int:
        """The room an object of ``size`` bytes takes in a segment: its size rounded to the alignment (one for
        every segment). What the segments' used bytes, the tenants' bytes and a group's ``nbytes`` count."""
        alignment = self.settings.alignment
        return size if not size & (alignment - 1) else -(-size // alignment) * alignment

    def allocate(self, order: list[Segment], size: int) -> tuple[Segment, int] | None:
        return self.segment_table.allocate(order, size)

    def drop_group(self, group_id: str) -> int:
        """Forget a group and give back every member's space: one tenant's bytes, one run of space per segment."""
        group = self.groups[group_id]
        self.group_table.remove(group)
        self.puts.incomplete.pop(group_id, None)
        if group.pending:
            in_flight = self.puts.in_flight
            for key in group.full_keys():
                in_flight.pop(key, None)
        if group.whole:
            owners = self.owners
            for key in group.keys:
                del owners[key]
        self.group_table.remove_members(group.tenant, group.nbytes, len(group.keys))
        self.segment_table.release_group(group)
        return len(group.keys)

    def evict(self, victims: list[Group]) -> None:
        """``drop_group`` of each of ``victims`` in order: groups of one tenant that the table holds, none of
        whose members is in flight (eviction's). Groups keeping their keys in part, each in one segment (nearly
        every one), go a run at a time; any other alone, in its place."""
        run: list[Group] = []
        for group in victims:
            segment_ids = group.segment_ids
            if not group.whole and segment_ids and segment_ids.count(segment_ids[0]) == len(segment_ids):
                run.append(group)
                continue
            if run:
                self._evict_idle(run)
                run = []
            self.drop_group(group.group_id)
        if run:
            self._evict_idle(run)

    def _evict_idle(self, run: list[Group]) -> None:
        table = self.group_table
        table.remove_idle(run)
        incomplete = self.puts.incomplete
        if incomplete:
            for group in run:
                incomplete.pop(group.group_id, None)
        table.remove_members(run[0].tenant, sum(map(_NBYTES, run)), sum(map(len, map(_KEYS, run))))
        self.segment_table.release_idle(run)

    def drop_member(self, group: Group, position: int) -> None:
        """Forget one member of a group and give back its space; a group left with no member is forgotten."""
        self.segment_table.release_member(group, position)
        if group.complete:  # no longer, once a member leaves
            self.group_table.num_complete -= 1
        room = self.room(group.sizes[position])
        member = group.remove_member(position, room)
        if group.whole:
            del self.owners[member.key]
        self.group_table.remove_members(group.tenant, room)
        if not group.keys:
            self.group_table.remove(group)
            self.puts.incomplete.pop(group.group_id, None)

    def adopt(self, record: ObjectRecord, segment: Segment) -> None:
        """A committed object a store reported in ``segment`` joins its group (``plan_report`` accepted it)."""
        group = self.groups.get(record.group_id)
        if group is None:
            group = self.group_table.add(Group(record.group_id, record.group_size, tenant=tenant_name(record.tenant)))
        was_complete = group.complete
        # a group is one tenant's, whatever a report says
        room = self.room(record.size)
        self.owners.update(dict.fromkeys(group.add_member(record.key, segment.segment_id, record.offset, record.size,
                                                          room, record.checksum, committed=True), group))
        self.group_table.num_complete += group.complete - was_complete
        segment.groups[group.group_id] = group
        segment.num_objects += 1
        self.group_table.add_members(group.tenant, room)
        if not group.complete:  # its other members are in stores that have not reported yet
            self.puts.mark_incomplete(group.group_id)
        else:
            self.puts.incomplete.pop(group.group_id, None)


class ObjectsView(Mapping[str, StoredObject]):
    """The index's objects by key, each a ``StoredObject`` made when asked for (the index keeps groups' columns)."""

    __slots__ = ("_index",)

    def __init__(self, index: PoolIndex) -> None:
        self._index = index

    def __getitem__(self, key: str) -> StoredObject:
        found = self._index.owner(key)
        if found is None:
            raise KeyError(key)
        return found[0].member(found[1])

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and self._index.owner(key) is not None

    def __iter__(self) -> Iterator[str]:
        for group in list(self._index.groups.values()):
            yield from group.full_keys()

    def __len__(self) -> int:
        return self._index.num_objects


_NBYTES = attrgetter("nbytes")
_KEYS = attrgetter("keys")
