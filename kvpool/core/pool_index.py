"""The pool master's object index: segments, objects, groups, leases, eviction.

Pure policy: no grpc, no I/O, an injectable clock. The servicer converts
protobuf to these calls; unit tests drive it directly.

Invariants:
- a group is visible to lookups only when every declared member is committed;
- eviction removes whole groups, least recently used first within the rule
  of tenants' shares (``tenant_shares``; a group is its first writer's
  tenant's), never a group that is leased or has a put in flight
  (``eviction="object"``, for comparisons only, removes one member at a time
  and may leave partial groups, invisible);
- eviction starts when used bytes would pass ``high_watermark × capacity`` and
  frees down to ``low_watermark × capacity``;
- every allocated byte belongs to exactly one object (committed or in flight);
- a group with a member that failed to save (no space, revoked, timed out) is
  dropped at once, or as soon as no member is in flight, and its other
  members are refused for ``failed_group_hold_s``;
- a group a reader found corrupt (``pool_corrupt``) is invisible to lookups
  and dropped once no lease holds it;
- a group still incomplete ``incomplete_group_s`` after its last member
  arrived, with nothing in flight, is dropped (its other writers died, or the
  stores with its other members never re-reported after a master restart);
- each segment's journal holds the changes to its committed objects that its
  store has not acknowledged; a store reports what it holds on (re-)mount and
  only what passes ``plan_report`` becomes an object again (block reports,
  see ``pool_recovery``).

The index holds its parts as objects with small interfaces, each in its own
module: ``GroupTable`` (groups and tenants in LRU order), ``SegmentTable``
(space, mounts, heartbeats), ``Eviction``, ``GroupFailures`` and ``LeaseTable``. Eviction and the segment table see the
index only through the protocols they declare (``Evictable``,
``SegmentHost``); nothing here is a mixin, and no part imports the index.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable, Sequence

from kvpool.core.placement import batch_orders, group_first
from kvpool.core.pool_corrupt import condemn, droppable
from kvpool.core.pool_eviction import Eviction, GroupFailures
from kvpool.core.pool_groups import GroupTable
from kvpool.core.pool_leases import LeaseTable
from kvpool.core.pool_put_checks import check_put_batch, check_put_end
from kvpool.core.pool_records import (
    Group,
    IndexCounters,
    LookupResult,
    MountResult,
    ObjectRecord,
    PutOutcome,
    PutRequestItem,
    PutStatus,
    Segment,
    SegmentChange,
    StoredObject,
)
from kvpool.core.pool_segments import SegmentTable
from kvpool.core.pool_settings import IndexSettings
from kvpool.core.tenant_shares import TenantShares, tenant_name


class PoolIndex:
    """Where every object lives, which groups are complete, what to evict (invariants above)."""

    __slots__ = (
        "settings", "clock", "objects", "groups", "counters", "segment_table", "eviction", "failures",
        "leases", "group_table", "shares", "_in_flight", "_incomplete",
    )

    def __init__(self, settings: IndexSettings | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings if settings is not None else IndexSettings()
        self.clock = clock
        self.objects: dict[str, StoredObject] = {}
        self.group_table = GroupTable()
        self.groups = self.group_table.groups  # LRU order: the first is the least recently used
        self.shares = TenantShares.parse(self.settings.tenant_weights)
        self.counters = IndexCounters()
        # puts in flight, with when they started (in that order)
        self._in_flight: OrderedDict[str, float] = OrderedDict()
        # incomplete groups, with when they are dropped unless a member arrives (in that order)
        self._incomplete: OrderedDict[str, float] = OrderedDict()
        self.failures = GroupFailures(self.settings.failed_group_hold_s, clock)
        self.leases = LeaseTable(clock)
        self.segment_table = SegmentTable(self, self.settings, clock, self.counters, self.failures)
        self.eviction = Eviction(self, self.counters, self.settings.eviction, self.shares)

    # ---- writes ---------------------------------------------------------

    def put_start(self, client_host: str, items: Sequence[PutRequestItem]) -> list[PutOutcome]:
        """Reserve space for each item, evicting LRU groups when needed.

        The whole batch is validated before anything changes, so a bad item
        leaves the index untouched. A member with no space fails its group:
        members of it reserved earlier in this batch are given back at once
        (``GROUP_FAILED``), later ones are refused.
        """
        self.expire_leases()
        check_put_batch(items, self.segments, self.groups, self.objects)
        self.failures.prune()
        outcomes: list[PutOutcome] = []
        rotations = batch_orders(
            self.segments.values(), client_host, sum(item.size for item in items), self.settings.stripe_min_bytes
        )
        num_placed = 0
        capacity = self.capacity
        high = self.settings.high_watermark * capacity
        low = self.settings.low_watermark * capacity
        started = self.clock()
        objects, groups, in_flight, failed = self.objects, self.groups, self._in_flight, self.failures
        failed_here: set[str] = set()
        for item in items:
            key = item.key
            if key in objects:
                outcomes.append(PutOutcome(PutStatus.ALREADY_EXISTS))
                continue
            if item.group_id in failed:
                outcomes.append(PutOutcome(PutStatus.GROUP_FAILED))
                continue
            group = groups.get(item.group_id)
            order = rotations[num_placed % len(rotations)]
            if group is not None and group.members:
                # keep a group in one store where room allows
                order = group_first(order, {m.segment_id for m in group.members.values()}, client_host)
            # a group is its first writer's
            tenant = group.tenant if group is not None else tenant_name(item.tenant)
            placed = self.eviction.reserve(order, item.size, high, low, keep=item.group_id, tenant=tenant)
            if placed is None:
                outcomes.append(PutOutcome(PutStatus.NO_SPACE))
                failed_here.add(item.group_id)
                self._fail_group(item.group_id, item.group_size)
                continue
            num_placed += 1
            segment, offset = placed
            group = groups.get(item.group_id)  # eviction may have dropped it meanwhile
            if group is None:
                group = self.group_table.add(Group(item.group_id, item.group_size, tenant=tenant))
            obj = StoredObject(key, item.group_id, segment.segment_id, offset, item.size, tenant=group.tenant)
            objects[key] = obj
            self.group_table.add_object(obj)
            segment.keys.add(key)
            group.members[key] = obj
            group.num_in_flight += 1
            self._mark_incomplete(item.group_id)
            in_flight[key] = started
            outcomes.append(PutOutcome(PutStatus.RESERVED, segment, offset))
        if failed_here:
            self._give_back_failed(items, outcomes, failed_here)
        self.touch(dict.fromkeys(item.group_id for item in items if item.group_id in groups))
        return outcomes

    def put_end(self, commits: Sequence[tuple[str, int]]) -> int:
        """Commit in-flight puts (key, checksum); all or none."""
        check_put_end(commits, self._in_flight)
        for key, checksum in commits:
            del self._in_flight[key]
            obj = self.objects[key]
            obj.checksum = checksum
            obj.committed = True
            group = self.groups[obj.group_id]
            group.num_in_flight -= 1
            group.num_committed += 1
            if group.complete:
                self._incomplete.pop(obj.group_id, None)
            self.segments[obj.segment_id].journal.add(
                ObjectRecord(key, obj.group_id, group.size, obj.offset, obj.size, checksum, obj.tenant)
            )
            if group.failed and group.num_in_flight == 0:
                self._drop_failed(group)
        return len(commits)

    def put_revoke(self, keys: Iterable[str]) -> int:
        """Give back the space of in-flight puts and fail their groups; committed or unknown keys are left alone."""
        revoked = 0
        for key in keys:
            if key in self._in_flight:
                self._revoke(key)
                revoked += 1
        return revoked

    def revoke_expired_puts(self) -> list[str]:
        """Revoke puts started more than ``put_timeout_s`` ago (their writer died)."""
        deadline = self.clock() - self.settings.put_timeout_s
        expired = []
        for key, started in self._in_flight.items():
            if started > deadline:
                break  # ordered by start time
            expired.append(key)
        for key in expired:
            if key in self._in_flight:  # an earlier revoke may have dropped its group
                self._revoke(key)
        return expired

    def drop_incomplete_groups(self) -> list[str]:
        """Drop groups still incomplete ``incomplete_group_s`` after their last member arrived.

        A group with a put in flight is left to its put timeout and looked at again later.
        """
        now = self.clock()
        dropped = []
        while self._incomplete:
            group_id, deadline = next(iter(self._incomplete.items()))
            if deadline > now:
                break
            del self._incomplete[group_id]
            group = self.groups.get(group_id)
            if group is None or group.complete:
                continue
            if group.busy:
                self._mark_incomplete(group_id)
                continue
            self.counters.abandoned_groups += 1
            self.drop_group(group_id)
            dropped.append(group_id)
        return dropped

    def _mark_incomplete(self, group_id: str) -> None:
        self._incomplete[group_id] = self.clock() + self.settings.incomplete_group_s
        self._incomplete.move_to_end(group_id)

    # ---- reads ----------------------------------------------------------

    def lookup(self, group_ids: Sequence[str], lease_s: float | None = None) -> LookupResult:
        """Count leading complete groups; lease and touch them."""
        self.expire_leases()
        found: list[Group] = []
        for group_id in group_ids:
            group = self.groups.get(group_id)
            if group is None or not group.complete or group.corrupt:
                break
            found.append(group)
        if not found:
            return LookupResult([], 0, 0.0)
        duration = self.settings.lease_s if lease_s is None else lease_s
        lease_id = self.leases.grant(found, duration)
        self.touch([g.group_id for g in found])
        return LookupResult(found, lease_id, duration)

    def release_lease(self, lease_id: int, corrupt_group_ids: Collection[str] = ()) -> bool:
        """End a lease early (the reader is done); a read counts as a use.

        ``corrupt_group_ids``: groups of this lease with a member whose bytes
        failed their checksum; they are hidden now and dropped once no lease
        holds them (``pool_corrupt``). Unknown to an ended or expired lease.
        """
        groups = self.leases.release(lease_id)
        if groups is None:
            return False
        condemn(groups, self.groups, corrupt_group_ids)
        self.touch(g.group_id for g in groups if self.groups.get(g.group_id) is g and not g.corrupt)
        self._drop_corrupt(groups)
        return True

    def expire_leases(self) -> int:
        """End every lease past its time; returns how many condemned groups that dropped."""
        return self._drop_corrupt(self.leases.expire())

    def _drop_corrupt(self, ended: Iterable[Group]) -> int:
        dropped = droppable(ended, self.groups)
        for group in dropped:
            self.counters.corrupt_groups += 1
            self.drop_group(group.group_id)
        return len(dropped)

    def exists(self, keys: Iterable[str]) -> list[bool]:
        return [(obj := self.objects.get(key)) is not None and obj.committed for key in keys]

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
        return len(self._in_flight)

    # ---- internals ------------------------------------------------------

    def _revoke(self, key: str) -> None:
        del self._in_flight[key]
        obj = self.objects[key]
        group = self.groups[obj.group_id]
        del group.members[key]
        group.num_in_flight -= 1
        self._free(obj)
        if not group.members:
            self.group_table.remove(group)
        self.counters.revoked_puts += 1
        self._fail_group(obj.group_id, group.size)

    def _free(self, obj: StoredObject) -> None:
        del self.objects[obj.key]
        self.group_table.remove_object(obj)
        self.segment_table.release(obj)

    # ---- failed groups --------------------------------------------------

    def _fail_group(self, group_id: str, group_size: int) -> None:
        """A member failed to save: drop the group now, or once no member is in flight; refuse it for a while."""
        self.failures.hold(group_id, group_size)
        group = self.groups.get(group_id)
        if group is None:
            return
        group.failed = True
        if not group.busy:
            self._drop_failed(group)

    def _drop_failed(self, group: Group) -> None:
        self.counters.failed_groups += 1
        self.drop_group(group.group_id)

    def _give_back_failed(self, items: Sequence[PutRequestItem], outcomes: list[PutOutcome], failed: set[str]) -> None:
        """Undo this batch's reservations for groups that failed in it (their writer never sees the space)."""
        for i, item in enumerate(items):
            if item.group_id in failed and outcomes[i].status is PutStatus.RESERVED:
                outcomes[i] = PutOutcome(PutStatus.GROUP_FAILED)
                obj = self.objects[item.key]
                group = self.groups[item.group_id]
                del self._in_flight[item.key]
                del group.members[item.key]
                group.num_in_flight -= 1
                self._free(obj)
        for group_id in failed:
            group = self.groups.get(group_id)
            if group is not None and not group.members:
                self.group_table.remove(group)
            elif group is not None and not group.busy:
                self._drop_failed(group)

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
    ) -> MountResult:
        """See :meth:`SegmentTable.mount`."""
        return self.segment_table.mount(segment_id, endpoint, host, base_address, size, numa_node, records)

    def unmount_segment(self, segment_id: str) -> int:
        """Drop a segment and every group with a member in it; returns objects dropped."""
        return self.segment_table.unmount(segment_id)

    def heartbeat(self, segment_id: str, acked_sequence: int = 0) -> tuple[list[SegmentChange], bool]:
        """Keep a segment alive; returns the changes its store has not acknowledged, and whether more wait."""
        return self.segment_table.heartbeat(segment_id, acked_sequence)

    def expire_segments(self) -> list[str]:
        """Unmount every segment whose store missed heartbeats for the TTL."""
        return self.segment_table.expire()

    # ---- what the parts see (Evictable, SegmentHost) --------------------

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

    def allocate(self, order: list[Segment], size: int) -> tuple[Segment, int] | None:
        return self.segment_table.allocate(order, size)

    def drop_group(self, group_id: str) -> int:
        group = self.groups[group_id]
        self.group_table.remove(group)
        self._incomplete.pop(group_id, None)
        for key, obj in group.members.items():
            self._in_flight.pop(key, None)
            self._free(obj)
        return len(group.members)

    def drop_member(self, group: Group, key: str) -> None:
        obj = group.members.pop(key)
        group.num_committed -= 1
        self._free(obj)
        if not group.members:
            self.group_table.remove(group)
            self._incomplete.pop(group.group_id, None)

    def adopt(self, obj: StoredObject, group_size: int) -> None:
        group = self.groups.get(obj.group_id)
        if group is None:
            group = self.group_table.add(Group(obj.group_id, group_size, tenant=obj.tenant))
        obj.tenant = group.tenant  # a group is one tenant's, whatever a report says
        self.objects[obj.key] = obj
        self.group_table.add_object(obj)
        group.members[obj.key] = obj
        group.num_committed += 1
        if not group.complete:  # its other members are in stores that have not reported yet
            self._mark_incomplete(obj.group_id)
        else:
            self._incomplete.pop(obj.group_id, None)
