"""The pool index's writes: puts from start to commit or revoke, the groups they leave incomplete, failed groups.

Pure. The index holds one ``PutTable``; the table sees the index's objects
only through ``PutHost`` (and frees or drops them only through it), and its
groups, segments and eviction through the parts the index gives it.

Invariants:
- ``in_flight`` holds every put started and not yet committed or revoked,
  with when it started, oldest first;
- a group with a member that failed to save (no space, revoked, timed out) is
  dropped at once, or as soon as no member is in flight, and its other
  members are refused for ``failed_group_hold_s``;
- a group still incomplete ``incomplete_group_s`` after its last member
  arrived, with nothing in flight, is dropped (its other writers died, or the
  stores with its other members never re-reported after a master restart);
  ``incomplete`` holds each such group's deadline, soonest first.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from itertools import repeat
from operator import attrgetter
from typing import Protocol

from kvpool.core.pool.placement import batch_orders, group_first
from kvpool.core.chunk_hash import DEFAULT_TENANT
from kvpool.core.pool.eviction import Eviction, GroupFailures
from kvpool.core.pool.groups import GroupTable
from kvpool.core.pool.put_checks import check_put_batch, check_put_end
from kvpool.core.pool.put_groups import PLACES, group_keys, in_item_order
from kvpool.core.pool.records import (
    Group,
    IndexCounters,
    PutOutcome,
    PutRequestItem,
    PutStatus,
    Segment,
    parts_of,
    shared,
)
from kvpool.core.pool.segments import SegmentTable
from kvpool.core.pool.settings import IndexSettings
from kvpool.core.tenancy.shares import tenant_name

_GROUP_ID = attrgetter("group_id")


class PutHost(Protocol):
    """What the put table needs of the index."""

    @property
    def owners(self) -> dict[str, Group]:
        """The group of each object whose group keeps its keys whole, by key."""
        ...

    def owner(self, key: str) -> tuple[Group, int] | None:
        """The group holding object ``key`` and its place there, or None."""
        ...

    def holds(self, key: str) -> bool:
        ...

    def holds_any(self, keys: list[str]) -> bool:
        ...

    def drop_group(self, group_id: str) -> int:
        """Free every member of a group and forget it; returns members dropped."""
        ...

    def drop_member(self, group: Group, position: int) -> None:
        """Forget one member and give its bytes back; a group left with no member is forgotten."""
        ...


@dataclass(slots=True)
class PlacedGroups:
    """A put of whole groups placed at once (``PutTable.put_groups``): each group's segment and its members'
    offsets, in the order of its group ids."""

    segments: list[Segment]
    offsets: list[list[int]]

    def outcomes(self, members: int, by_member: bool) -> list[PutOutcome]:
        """What ``put_start`` answers the items the put stands for, in their order (every one reserved)."""
        return in_item_order([PutOutcome(PutStatus.RESERVED, segment, offset)
                              for segment, offsets in zip(self.segments, self.offsets) for offset in offsets],
                             members, by_member)


@dataclass(slots=True)
class PutTable:
    """Puts in flight and the groups they leave incomplete (invariants above)."""

    index: PutHost
    settings: IndexSettings
    clock: Callable[[], float]
    counters: IndexCounters
    failures: GroupFailures
    group_table: GroupTable
    segment_table: SegmentTable
    eviction: Eviction
    # puts in flight, with when they started (in that order: a dict's own, as nothing moves an entry; an ordered
    # dict's links cost a save 16 us of its 88 keys' insertions and deletions)
    in_flight: dict[str, float] = field(default_factory=dict)
    # incomplete groups, with when they are dropped unless a member arrives (in that order)
    incomplete: OrderedDict[str, float] = field(default_factory=OrderedDict)

    def put_start(self, client_host: str, items: Sequence[PutRequestItem],
                  checked: Callable[[], object] | None = None) -> list[PutOutcome]:
        """Reserve space for each item, evicting LRU groups when needed.

        The whole batch is validated before anything changes, so a bad item
        leaves the index untouched; ``checked`` is called once it passed, before
        any item is placed. A member with no space fails its group:
        members of it reserved earlier in this batch are given back at once
        (``GROUP_FAILED``), later ones are refused.
        """
        segments = self.segment_table.segments
        all_new = check_put_batch(items, segments, self.group_table.groups, self.index.holds, self.index.holds_any)
        if checked is not None:
            checked()
        self.failures.prune()
        self.eviction.new_batch()
        outcomes: list[PutOutcome] = []
        rotations = batch_orders(
            segments.values(), client_host, sum(item.size for item in items), self.settings.stripe_min_bytes
        )
        num_placed = 0
        capacity = self.segment_table.capacity
        high = self.settings.high_watermark * capacity
        low = self.settings.low_watermark * capacity
        started = self.clock()
        holds, groups, in_flight, failed = self.index.holds, self.group_table.groups, self.in_flight, self.failures
        failed_here: set[str] = set()
        # group_first's answers in this batch: a pure function of the rotation and the group's segments, which
        # repeat from item to item (a save's groups each lie in one store), and a sort of every segment each
        firsts: dict[tuple[int, frozenset[str]], list[Segment]] = {}
        # new groups whose members all come in this batch, by their first member's place, where nothing in the
        # batch evicts (``_runs``): each is placed at once at that place, its other members' outcomes kept
        runs = self._runs(items, rotations, high, all_new)
        kept: dict[int, PutOutcome] = {}
        # each placed run's last member's place: one at a time, the group's place among the incomplete ones (its
        # deadline) is where its last member marked it
        last_of_runs: set[int] = set()
        for position, item in enumerate(items):
            if kept:
                outcome = kept.pop(position, None)
                if outcome is not None:
                    outcomes.append(outcome)
                    num_placed += 1
                    if position in last_of_runs:
                        self.mark_incomplete(item.group_id)
                    continue
            run = runs.get(position)
            if run is not None:
                first = items[run[0]]
                segment = rotations[num_placed % len(rotations)][0]
                offsets = self._place_run(first.group_id, tenant_name(first.tenant),
                                          tuple([items[p].key for p in run]),
                                          shared(tuple([items[p].size for p in run])), segment, started)
                if offsets is not None:  # else (no one hole for them there) its members go one at a time
                    placed_run = list(map(PutOutcome, repeat(PutStatus.RESERVED), repeat(segment), offsets))
                    outcomes.append(placed_run[0])
                    num_placed += 1
                    kept.update(zip(run[1:], placed_run[1:]))
                    last_of_runs.add(run[-1])
                    continue
            key = item.key
            if holds(key):
                outcomes.append(PutOutcome(PutStatus.ALREADY_EXISTS))
                continue
            if item.group_id in failed:
                outcomes.append(PutOutcome(PutStatus.GROUP_FAILED))
                continue
            group = groups.get(item.group_id)
            if group is not None and len(group.keys) >= group.size:
                # its key was another group's when the batch was checked (so it was not counted as a new member)
                # and an earlier item's eviction freed it: a group with no room takes no more members (alone, the
                # put would be refused). Not stored; the group is left as it is
                outcomes.append(PutOutcome(PutStatus.NO_SPACE))
                continue
            rotation = num_placed % len(rotations)
            order = rotations[rotation]
            if group is not None and group.keys:
                # keep a group in one store where room allows
                held = frozenset(group.segment_ids)
                first = firsts.get((rotation, held))
                if first is None:
                    first = firsts[rotation, held] = group_first(order, held, client_host)
                order = first
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
            room = segment.allocator.rounded_size(item.size)
            tracked = group.add_member(key, segment.segment_id, offset, item.size, room)
            if tracked:
                self.index.owners.update(dict.fromkeys(tracked, group))
            self.group_table.add_members(group.tenant, room)
            segment.groups[group.group_id] = group
            segment.num_objects += 1
            self.mark_incomplete(item.group_id)
            in_flight[key] = started
            outcomes.append(PutOutcome(PutStatus.RESERVED, segment, offset))
        if failed_here:
            self._give_back_failed(items, outcomes, failed_here)
        self.group_table.touch(dict.fromkeys(item.group_id for item in items if item.group_id in groups))
        return outcomes

    def _runs(self, items: Sequence[PutRequestItem], rotations: list[list[Segment]], high: float,
              all_new: bool = False) -> dict[int, list[int]]:
        """The places in ``items`` of each group the index does not hold, whose every member is in the batch
        (a save's chunk: its stages, in whatever order), keyed by its first member's place; none unless the
        whole batch fits below ``high`` and in the largest free extent of each segment a member would go to
        first. One at a time, each member would then go to its group's first member's segment, and nothing
        would evict: placing a group at once decides the same."""
        positions: dict[str, list[int]] = {}
        for position, group_id in enumerate(map(_GROUP_ID, items)):
            positions.setdefault(group_id, []).append(position)
        groups, holds, failed = self.group_table.groups, self.index.holds, self.failures
        runs = {places[0]: places for group_id, places in positions.items()
                if len(places) == items[places[0]].group_size > 1 and group_id not in groups
                and group_id not in failed and (all_new or not any(holds(items[p].key) for p in places))}
        if not runs or not rotations[0]:
            return {}
        rounded = rotations[0][0].allocator.rounded_size  # one alignment for every segment (the index's settings)
        total = sum(rounded(item.size) for item in items)
        if self.segment_table.used_bytes + total > high or \
                any(order[0].allocator.largest_free < total for order in rotations):
            return {}
        return runs

    def _place_run(self, group_id: str, tenant: str, keys: tuple[str, ...], sizes: tuple[int, ...],
                   segment: Segment, started: float) -> list[int] | None:
        """Every member of a new group at once, back to back in ``segment``: one hole, one record, one run of space
        to give back when the group goes (the caller marks it incomplete); its keys go in flight. Returns the
        members' offsets; None, with nothing changed, when the segment has no one hole for them all. ``sizes``
        shared (``shared``)."""
        offsets = self.segment_table.allocate_run(segment, list(sizes))
        if offsets is None:
            return None
        n = len(keys)
        nbytes = offsets[-1] - offsets[0] + segment.allocator.rounded_size(sizes[-1])  # their room: one run
        group = Group(group_id, n, tenant, (), False, shared((segment.segment_id,) * n), tuple(offsets), sizes,
                      [0] * n, pending=(1 << n) - 1, nbytes=nbytes, run=True, num_in_flight=n)
        parts = parts_of(group_id, keys)
        if parts is None:  # a key that is not "<group_id>/<part>": the group keeps them whole
            group.keys, group.whole = keys, True
            self.index.owners.update(zip(keys, repeat(group)))
        else:
            group.keys = shared(parts)
        self.group_table.add(group)
        self.in_flight.update(zip(keys, repeat(started)))
        self.group_table.add_members(tenant, nbytes, n)
        segment.groups[group_id] = group
        segment.num_objects += n
        return offsets

    def put_groups(self, client_host: str, group_ids: Sequence[str], member_sizes: Sequence[int], by_member: bool,
                   tenant: str = DEFAULT_TENANT, checked: Callable[[], object] | None = None) -> PlacedGroups | None:
        """A put of whole new groups (``kvpool.core.pool.put_groups``: member m of each keyed "<group id>/m"),
        placed a group at a time, each at once, with no item made.

        It requires room for the whole batch in the largest hole of every segment (``_runs`` asks it of the
        segments its rotations start with: asked of all, the answer cannot change with the rotations, which
        ``checked``, a touch, leaves as they are). Then every item of it would find a hole one at a time, and:
        where the batch fits below the high watermark, it decides exactly what ``put_start`` of the items it
        stands for decides when that places every group at once (``_runs``); where it would pass the watermark, it
        first evicts, before placing any of it, exactly what its items would evict one at a time
        (``_evict_as_items``: the same victims in the same order), then places each group at once: the items' own
        decisions but for where in its segment each member lies, and its table slot.

        None, with nothing changed and ``checked`` not called, unless it is such a put: groups of two members or
        more that the index neither holds nor refuses (``failures``), no key it holds, no member larger than a
        segment, the holes above, and, past the watermark, eviction by group (``Eviction.mode``). The caller then
        puts the items."""
        members = len(member_sizes)
        segments = self.segment_table.segments
        if members < 2 or not group_ids or not segments:
            return None
        groups, failed = self.group_table.groups, self.failures
        if any(map(groups.__contains__, group_ids)) or any(map(failed.__contains__, group_ids)):
            return None
        places = PLACES[:members]
        owners = self.index.owners
        if owners and not owners.keys().isdisjoint([g + "/" + p for g in group_ids for p in places]):
            return None
        values = segments.values()
        if max(member_sizes) > max(s.size for s in values):
            return None
        rounded = next(iter(values)).allocator.rounded_size  # one alignment for every segment (as ``_runs``)
        total = sum(map(rounded, member_sizes)) * len(group_ids)
        table = self.segment_table
        high = self.settings.high_watermark * table.capacity
        past = table.used_bytes + total > high
        if past and self.eviction.mode != "group" or any(s.allocator.largest_free < total for s in values):
            return None
        if checked is not None:
            checked()
        self.failures.prune()
        self.eviction.new_batch()
        tenant = tenant_name(tenant)
        # (before any eviction, as the items take theirs: the most free bytes first)
        rotations = batch_orders(values, client_host, sum(member_sizes) * len(group_ids),
                                 self.settings.stripe_min_bytes)
        if past:
            self._evict_as_items(member_sizes, len(group_ids), by_member, high, tenant)
        started = self.clock()
        sizes, parts = shared(tuple(member_sizes)), shared(places)
        # each group as ``_place_run`` places it (one run of space, one record), the batch's sums counted once
        table, as_list = self.group_table, list(sizes)
        new: list[Group] = []
        nbytes = sum(map(rounded, sizes))  # a group's room: its members back to back
        pending = (1 << members) - 1
        # a group's rotation is its first item's place (every item before it placed): item g by member, else g * m
        step = 1 if by_member else members
        placed_in: list[Segment] = []
        offsets: list[list[int]] = []
        in_segment: dict[str, tuple[str, ...]] = {}
        for g, group_id in enumerate(group_ids):
            segment = rotations[g * step % len(rotations)][0]
            run = segment.allocator.allocate_run(as_list)
            if run is None:  # (cannot be: the whole batch fits in this segment's largest hole)
                raise AssertionError(f"no hole for group {group_id!r} of a batch that fits in {segment.segment_id}")
            segment_ids = in_segment.get(segment.segment_id)
            if segment_ids is None:
                segment_ids = in_segment[segment.segment_id] = shared((segment.segment_id,) * members)
            # (positional: 1.1 us against 1.9 with the last five named)
            group = Group(group_id, members, tenant, parts, False, segment_ids, tuple(run), sizes, [0] * members,
                          pending, nbytes, True, 0, members)  # pending, nbytes, run, num_committed, num_in_flight
            new.append(group)
            segment.groups[group_id] = group
            segment.num_objects += members
            placed_in.append(segment)
            offsets.append(run)
        table.add_used(new)  # (each added, then all touched: the first group the most recently used)
        table.add_members(tenant, nbytes * len(group_ids), members * len(group_ids))
        self.segment_table.used_bytes += nbytes * len(group_ids)
        # in flight in the items' order, as they would have gone one at a time past the watermark (else group by
        # group, as ``_place_run`` puts them)
        self.in_flight.update(zip(group_keys(group_ids, members, by_member and past), repeat(started)))
        incomplete = self.incomplete  # each as its last member's item marks it
        if incomplete.keys().isdisjoint(group_ids):
            incomplete.update(zip(group_ids, repeat(self.clock() + self.settings.incomplete_group_s)))
        else:
            for group_id in group_ids:
                self.mark_incomplete(group_id)
        return PlacedGroups(placed_in, offsets)

    def _evict_as_items(self, member_sizes: Sequence[int], count: int, by_member: bool, high: float,
                        tenant: str) -> None:
        """Evict what the items of a put of ``count`` new groups (``group_items``' order) would evict as
        ``put_start`` reserves them one at a time, each placed: item i past ``high`` makes room for its size with
        the items before it in place (``Eviction.reserve``), so here for their room and its own together (sizes
        aligned, as the segments' used bytes and the tenants' bytes count them). The victims and their order are
        the same (a tenant's own bytes and the bytes coming count only as their sum, ``TenantShares.victim_order``,
        and the batch's groups, busy, are never victims), given that every item would find a hole (``put_groups``
        asks it first): one that found none would evict more, any tenant's."""
        table, make_room = self.segment_table, self.eviction.make_room
        rounded = next(iter(table.segments.values())).allocator.rounded_size
        low = self.settings.low_watermark * table.capacity
        sizes = [size for size in member_sizes for _ in range(count)] if by_member else list(member_sizes) * count
        ahead = 0  # the room the items before this one take
        for room in map(rounded, sizes):
            if table.used_bytes + ahead + room > high:
                make_room(ahead + room, high, low, tenant=tenant)
            ahead += room

    def put_end(self, commits: Sequence[tuple[str, int]], field: str = "items[{}].key") -> int:
        """Commit in-flight puts (key, checksum); all or none (a bad one named as ``field``, formatted with its
        place). Each group's members committed here go to their stores' journals as one entry (a group's members
        nearly always lie in one segment)."""
        check_put_end(commits, self.in_flight, field)
        in_flight, owners, groups = self.in_flight, self.index.owners, self.group_table.groups
        done: dict[int, tuple[Group, list[int]]] = {}
        for key, checksum in commits:
            del in_flight[key]
            group = owners.get(key) if owners else None  # (none while every group keeps its keys in part)
            if group is not None:
                position = group.keys.index(key)
            else:  # in flight, so held: by a group that keeps its keys in part, "<group_id>/<part>" (PoolIndex.owner)
                cut = key.rfind("/")
                group = groups[key[:cut]]
                position = group.keys.index(key[cut + 1:])
            group.checksums[position] = checksum
            group.pending &= ~(1 << position)
            entry = done.get(id(group))
            if entry is None:
                done[id(group)] = (group, [position])
            else:
                entry[1].append(position)
        segments = self.segment_table.segments
        for group, positions in done.values():
            self._committed(group, positions, segments)
        return len(commits)

    def _committed(self, group: Group, positions: list[int], segments: dict[str, Segment]) -> None:
        """Members at ``positions`` of ``group``, in flight until now, are committed (their checksums set): its
        counts, whether it is complete and ready, its journal entry, and a failed group with none left in flight
        dropped."""
        n = len(positions)
        group.num_in_flight -= n
        group.num_committed += n
        group.forget_encodings()
        if group.complete:  # just now: a group holds at most its size of members, these n were in flight
            self.group_table.num_complete += 1
            self.incomplete.pop(group.group_id, None)
            group.update_ready()
        self._journal_added(group, positions, segments)
        if group.failed and group.num_in_flight == 0:
            self._drop_failed(group)

    def put_end_groups(self, group_ids: Sequence[str], members: int, by_member: bool, checksums: Sequence[int],
                       field: str = "groups (commit {})") -> int:
        """``put_end`` of the commits that a commit of whole groups stands for (their keys in ``group_keys``'
        order, ``checksums[i]`` the i-th key's), deciding exactly what that decides: a group at a time where each
        group is one the index holds with its every member in flight and keyed by place (a save's); else
        ``put_end`` of the commits themselves, with its errors (``field``: a commit's place in that order)."""
        keys = group_keys(group_ids, members, by_member)
        if len(checksums) != len(keys):
            raise ValueError(f"{len(checksums)} checksums for {len(keys)} keys")
        groups, in_flight = self.group_table.groups, self.in_flight
        found = list(map(groups.get, group_ids))
        places, full = PLACES[:members], (1 << members) - 1
        plain = len(set(group_ids)) == len(group_ids) and all(map(in_flight.__contains__, keys))
        for group in found:
            if not plain or group is None or group.whole or group.pending != full or group.size != members or \
                    group.keys != places:
                return self.put_end(list(zip(keys, checksums)), field)
        deque(map(in_flight.__delitem__, keys), 0)
        segments, count = self.segment_table.segments, len(group_ids)
        incomplete, table = self.incomplete, self.group_table
        # ``_committed`` of every member at once, each group now complete (its every member was in flight)
        mine = [tuple(checksums[g::count]) for g in range(count)] if by_member else \
            [tuple(checksums[g * members:(g + 1) * members]) for g in range(count)]
        one_segment = True
        for group, checks in zip(found, mine):
            group.checksums = list(checks)
            group.pending = group.num_in_flight = 0
            group.num_committed = members
            group.encoded = group.compact = None
            incomplete.pop(group.group_id, None)
            group.ready = not group.corrupt and not group.dropped
            segment_ids = group.segment_ids
            one_segment = one_segment and segment_ids.count(segment_ids[0]) == members
        if one_segment and not any(group.failed for group in found):
            # nearly always: each group in one segment, none failed; each segment's entries at once, in order
            by_segment: dict[str, list[int]] = {}
            for g, group in enumerate(found):
                by_segment.setdefault(group.segment_ids[0], []).append(g)
            for segment_id, chosen in by_segment.items():
                mine_found = [found[g] for g in chosen]
                segments[segment_id].journal.add_groups(
                    [group.group_id for group in mine_found], places, [group.offsets for group in mine_found],
                    [group.sizes for group in mine_found], [mine[g] for g in chosen],
                    [group.tenant for group in mine_found], [group.group_id + "/" for group in mine_found])
        else:  # a group at a time: its entry, and a failed one dropped, in the groups' order
            for group in found:
                self._journal_added(group, list(range(members)), segments)
                if group.failed:
                    self._drop_failed(group)
        table.num_complete += count
        return len(keys)

    @staticmethod
    def _journal_added(group: Group, positions: list[int], segments: dict[str, Segment]) -> None:
        segment_ids = group.segment_ids
        checksums = group.checksums
        if len(positions) == len(segment_ids) and segment_ids.count(segment_ids[0]) == len(segment_ids):
            # every member at once, in one segment (a save's chunk)
            segments[segment_ids[0]].journal.add_members(group.group_id, group.size, group.keys, group.offsets,
                                                         group.sizes, tuple(checksums), group.tenant,
                                                         group.key_prefix)
            return
        for segment_id, mine in group.by_segment(sorted(positions)).items():
            segments[segment_id].journal.add_members(
                group.group_id, group.size, tuple(group.keys[i] for i in mine), tuple(group.offsets[i] for i in mine),
                tuple(group.sizes[i] for i in mine), tuple(checksums[i] for i in mine), group.tenant,
                group.key_prefix)

    def put_revoke(self, keys: Iterable[str]) -> int:
        """Give back the space of in-flight puts and fail their groups; committed or unknown keys are left alone."""
        revoked = 0
        for key in keys:
            if key in self.in_flight:
                self._revoke(key)
                revoked += 1
        return revoked

    def revoke_expired_puts(self) -> list[str]:
        """Revoke puts started more than ``put_timeout_s`` ago (their writer died)."""
        deadline = self.clock() - self.settings.put_timeout_s
        expired = []
        for key, started in self.in_flight.items():
            if started > deadline:
                break  # ordered by start time
            expired.append(key)
        for key in expired:
            if key in self.in_flight:  # an earlier revoke may have dropped its group
                self._revoke(key)
        return expired

    def drop_incomplete_groups(self) -> list[str]:
        """Drop groups still incomplete ``incomplete_group_s`` after their last member arrived.

        A group with a put in flight is left to its put timeout and looked at again later.
        """
        now = self.clock()
        dropped = []
        while self.incomplete:
            group_id, deadline = next(iter(self.incomplete.items()))
            if deadline > now:
                break
            del self.incomplete[group_id]
            group = self.group_table.groups.get(group_id)
            if group is None or group.complete:
                continue
            if group.busy:
                self.mark_incomplete(group_id)
                continue
            self.counters.abandoned_groups += 1
            self.index.drop_group(group_id)
            dropped.append(group_id)
        return dropped

    def mark_incomplete(self, group_id: str) -> None:
        """A member arrived: the group is dropped ``incomplete_group_s`` from now unless it completes."""
        self.incomplete[group_id] = self.clock() + self.settings.incomplete_group_s
        self.incomplete.move_to_end(group_id)

    def _revoke(self, key: str) -> None:
        del self.in_flight[key]
        group, position = self.index.owner(key)  # type: ignore[misc]  (in flight: it is there)
        self.index.drop_member(group, position)
        self.counters.revoked_puts += 1
        self._fail_group(group.group_id, group.size)

    # ---- failed groups --------------------------------------------------

    def _fail_group(self, group_id: str, group_size: int) -> None:
        """A member failed to save: drop the group now, or once no member is in flight; refuse it for a while."""
        self.failures.hold(group_id, group_size)
        group = self.group_table.groups.get(group_id)
        if group is None:
            return
        group.failed = True
        if not group.busy:
            self._drop_failed(group)

    def _drop_failed(self, group: Group) -> None:
        self.counters.failed_groups += 1
        self.index.drop_group(group.group_id)

    def _give_back_failed(self, items: Sequence[PutRequestItem], outcomes: list[PutOutcome], failed: set[str]) -> None:
        """Undo this batch's reservations for groups that failed in it (their writer never sees the space)."""
        groups = self.group_table.groups
        for i, item in enumerate(items):
            if item.group_id in failed and outcomes[i].status is PutStatus.RESERVED:
                outcomes[i] = PutOutcome(PutStatus.GROUP_FAILED)
                group = groups[item.group_id]
                del self.in_flight[item.key]
                self.index.drop_member(group, group.position(item.key))
        for group_id in failed:
            group = groups.get(group_id)
            if group is not None and group.keys and not group.busy:
                self._drop_failed(group)
