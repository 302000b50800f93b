"""The pool index's eviction and failed-group rules, each an object the index holds.

``Eviction`` frees space for a put; it sees the index only through
``Evictable`` (groups in LRU order, used bytes, and two ways to free).
``GroupFailures`` remembers which groups are refused for a while after a
member failed to save; it knows nothing of the index.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from kvpool.core.pool.records import Group, IndexCounters, Segment
from kvpool.core.tenancy.shares import TenantShares, VictimOrder


class Evictable(Protocol):
    """What eviction needs of the index."""

    @property
    def lru_groups(self) -> OrderedDict[str, Group]:
        """Every group, least recently used first."""
        ...

    def tenant_groups(self, tenant: str) -> OrderedDict[str, Group]:
        """One tenant's groups, least recently used first."""
        ...

    @property
    def tenant_bytes(self) -> dict[str, int]:
        """The room each tenant's objects take (``room``; tenants holding none are absent)."""
        ...

    @property
    def share_capacity(self) -> float:
        """The bytes tenants' shares divide."""
        ...

    @property
    def used_bytes(self) -> int: ...

    def drop_group(self, group_id: str) -> int:
        """Free every member of a group and forget it; returns members dropped."""
        ...

    def evict(self, victims: list[Group]) -> None:
        """``drop_group`` of each of ``victims``, in order (groups of one tenant, none of whose members is in
        flight), at once."""
        ...

    def room(self, size: int) -> int:
        """The room an object of ``size`` bytes takes in a segment (its size aligned), as ``used_bytes`` counts."""
        ...

    def drop_member(self, group: Group, position: int) -> None:
        """Free one committed member; a group left with no member is forgotten."""
        ...

    def allocate(self, order: list[Segment], size: int) -> tuple[Segment, int] | None:
        """Place ``size`` bytes in the first segment of ``order`` with room, or nowhere."""
        ...


@dataclass(slots=True)
class Eviction:
    """Frees space for a put of one tenant, least recently used group first within the rule of shares.

    Invariants:
    - victims follow ``TenantShares.victim_order`` (``tenancy.shares``'s rule,
      shares of ``index.share_capacity``, fixed for the put of one object): a
      tenant over its share loses its own oldest groups first, then the
      tenants furthest over theirs do; a tenant within its share never loses a
      group to a tenant over its share;
    - when a put would pass ``high`` used bytes, groups of the putting tenant
      (if over) and of tenants over their share go until it does not, then on
      toward ``low``, at most ``step`` more in one put batch (``new_batch``), so
      that no one call holds the master long; then, while
      the object still does not fit, one more at a time, and only then, for a
      tenant within its share, any group in global LRU order (step 3 of the
      rule); a tenant over its share that finds nothing gets no space;
    - never a busy group (leased, or a put in flight), nor the group ``keep``
      that the put itself joins (evicting it would only leave it incomplete);
    - ``mode="group"`` removes whole groups; ``mode="object"`` (for
      comparisons) removes one member at a time, as upstream's best-effort
      groups allow, and may leave partial groups (lookups never count them);
    - ``counters.evicted_groups``/``evicted_bytes`` count every group it
      removed and the room it gave back (sizes aligned, as ``used_bytes``).
    """

    index: Evictable
    counters: IndexCounters
    mode: str = "group"
    shares: TenantShares = field(default_factory=TenantShares)
    # groups a put batch may evict toward ``low`` (beyond what its objects need to fit)
    step: int = 256
    # what is left of it in this batch
    _left: int = 0

    def new_batch(self) -> None:
        """A put batch begins: it may evict ``step`` groups toward ``low``."""
        self._left = self.step

    def reserve(
        self, order: list[Segment], size: int, high: float, low: float, keep: str = "", tenant: str = "default"
    ) -> tuple[Segment, int] | None:
        """Place ``size`` bytes of ``tenant``: evict to ``low`` used bytes past ``high`` (for the room they take,
        as used bytes and tenants' bytes count it), then allocate."""
        if not order:
            return None
        index = self.index
        room = index.room(size)
        victims = self.make_room(room, high, low, keep, tenant)
        while True:
            placed = index.allocate(order, size)
            if placed is not None:
                return placed
            if victims is None:
                victims = self.victim_order(tenant, room)
            if not self.evict_one(victims, keep, any_allowed=True):
                return None

    def make_room(self, size: int, high: float, low: float, keep: str = "", tenant: str = "default"
                  ) -> VictimOrder | None:
        """Where ``size`` more bytes of ``tenant`` (room: sizes aligned) would pass ``high``: evict until they
        would not, then on toward ``low`` as far as the batch's step allows (a put's item; or an item of a put of
        whole groups, with the room of the items before it: ``PutTable._evict_as_items``). The victims' order it
        used; None where the bytes fit below ``high``."""
        index = self.index
        if index.used_bytes + size <= high:
            return None
        victims = self.victim_order(tenant, size)
        if victims.own and self.mode == "group" and \
                self._evict_run(index.tenant_groups(victims.tenant), size, high, low, keep):
            return victims
        # under ``high`` whatever it takes, then on toward ``low`` as far as the batch's step allows
        while True:
            under = index.used_bytes + size <= high
            if (under and (self._left <= 0 or index.used_bytes + size <= low)) or \
                    not self.evict_one(victims, keep, any_allowed=False):
                break
            self._left -= under
        return victims

    def _evict_run(self, groups: object, size: int, high: float, low: float, keep: str) -> bool:
        """``make_room``'s loop while its victims are the putting tenant's own groups (``evict_one``'s first
        rule), in one pass over their order: the groups it would evict one call at a time, in that order (each
        call's first idle group is the next idle one: an eviction changes no other group's place or business),
        with no pass started again from the first group for each. True when that made the room; False, with what
        it evicted gone, when the tenant's idle groups ran out first (the loop goes on to other tenants')."""
        order, by_slot = getattr(groups, "order", None), getattr(groups, "by_slot", None)
        if order is None or by_slot is None:  # not a table's order (then the loop does it all)
            return False
        # the groups go once chosen, together (``Evictable.evict``): each takes its ``nbytes`` from the used bytes
        index = self.index
        used = index.used_bytes
        victims: list[Group] = []
        made = False
        s = order.first()
        while s >= 0:
            under = used + size <= high
            if under and (self._left <= 0 or used + size <= low):
                made = True
                break
            group = by_slot[s]
            s = order.after(s)
            if group.num_in_flight > 0 or group.num_leases > 0 or group.group_id == keep:  # busy, or the put's own
                continue
            victims.append(group)
            used -= group.nbytes
            self._left -= under
        if victims:
            counters = self.counters
            counters.evicted_groups += len(victims)
            by_tenant = counters.evicted_groups_by_tenant
            tenant = victims[0].tenant
            by_tenant[tenant] = by_tenant.get(tenant, 0) + len(victims)
            counters.evicted_bytes += index.used_bytes - used
            index.evict(victims)
        return made

    def victim_order(self, tenant: str, size: int) -> VictimOrder:
        index = self.index
        return self.shares.victim_order(index.tenant_bytes, tenant, size, index.share_capacity, any_allowed=True)

    def evict_one(self, victims: VictimOrder, keep: str = "", any_allowed: bool = True) -> bool:
        """Evict one idle group (or, by object, one member) by the rule; False if none may go."""
        index = self.index
        if victims.own and self._evict_first(index.tenant_groups(victims.tenant), keep):
            return True
        # the tenants furthest over their share, re-ranked after each group they lose
        tried: list[str] = []
        while over := self.shares.most_over(victims, index.tenant_bytes, tried):
            if self._evict_first(index.tenant_groups(over[0]), keep):
                return True
            tried.append(over[0])  # nothing of it may go: the next one
        return any_allowed and victims.then_any and self._evict_first(index.lru_groups, keep)

    def _evict_first(self, groups: OrderedDict[str, Group], keep: str) -> bool:
        """Evict the first idle group of ``groups`` (LRU first), or by object its oldest member."""
        by_tenant = self.counters.evicted_groups_by_tenant
        for group_id, group in groups.items():
            if group.busy or group_id == keep:
                continue
            if self.mode == "object":
                # all members are committed: the group is not busy
                self.counters.evicted_bytes += self.index.room(group.sizes[0])
                self.index.drop_member(group, 0)
                if group_id not in self.index.lru_groups:
                    self.counters.evicted_groups += 1
                    by_tenant[group.tenant] = by_tenant.get(group.tenant, 0) + 1
                return True
            self.counters.evicted_groups += 1
            by_tenant[group.tenant] = by_tenant.get(group.tenant, 0) + 1
            self.counters.evicted_bytes += group.nbytes
            self.index.drop_group(group_id)
            return True
        return False


@dataclass(slots=True)
class GroupFailures:
    """Groups whose members are refused for ``hold_s`` after one of them failed to save.

    A member that failed (no space, revoked, timed out) fails its group: its
    other members would only make an incomplete group. A one-member group has
    no other members to refuse: it may be saved again at once.

    Invariant: entries are in expiry order (one ``hold_s`` for all, and a group
    failed again moves to the end), so ``prune`` stops at the first live one.
    """

    hold_s: float
    clock: Callable[[], float]
    _until: OrderedDict[str, float] = field(default_factory=OrderedDict)

    def hold(self, group_id: str, group_size: int) -> None:
        if group_size > 1:
            self._until[group_id] = self.clock() + self.hold_s
            self._until.move_to_end(group_id)

    def prune(self) -> None:
        """Forget holds that have run out."""
        now = self.clock()
        until = self._until
        while until and next(iter(until.values())) <= now:
            until.popitem(last=False)

    def __contains__(self, group_id: object) -> bool:
        """Held (as of the last ``prune``)."""
        return group_id in self._until
