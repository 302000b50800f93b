"""The pool index's groups: every group least recently used first, each tenant's the same way, and its bytes.

Eviction takes a tenant's own oldest group in O(1) and weighs tenants by
their bytes (``tenancy.shares``). It knows nothing of the index.

``groups`` is a dict by id (lookups by id run as any dict's) whose iteration
is the order, least recently used first. The order itself is a linked list
over slots (``kvpool.core.pool.lru``, in C where its module is built): each
group the table holds has a slot (``Group.slot``), so a lookup's touch of a
whole history is one call with the history's slots, not a move of an ordered
dict's entry per group.

While every group is one tenant's (nearly always), that tenant's order is
the table's own (``by_tenant[t] is groups``): a use moves each group once,
not twice. A second tenant's first group copies the order for the first
tenant, once, and from then on each tenant has an order of its own: the table
does not go back while it holds a group (a tenant whose only group comes and
goes would otherwise copy the whole order at each return). ``version``
counts the changes of order (a use, a new group, a demotion; a removal leaves
the others' order as it was), so a caller can tell that groups it moved to
the end are still there in the same order (a release after its lookup).

Invariants: ``by_tenant[t]`` holds exactly the groups of tenant ``t``, in
their relative order in ``groups`` (and is ``groups`` when ``t`` is the only
tenant and the table never held two); ``tenant_bytes[t]`` is the room every
object (committed or in flight) of ``t``'s groups takes (its size aligned, as
the segments' used bytes count it: ``PoolIndex.room``); a tenant holding nothing
has no entry in either. A group's slot is its own while the table holds it,
and -1 after; each order holds exactly the slots of its groups.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from operator import attrgetter
from typing import Any

from kvpool.core.pool import fields, lru
from kvpool.core.pool.records import Group

FIRST_SLOTS = 1024  # slots a new table has; they double as groups come


def _ids(order: lru.Order, by_slot: list[Group | None]) -> Iterator[str]:
    s = order.first()
    after = order.after
    while s >= 0:
        yield by_slot[s].group_id  # type: ignore[union-attr]
        s = after(s)


def _groups(order: lru.Order, by_slot: list[Group | None]) -> Iterator[Group]:
    s = order.first()
    after = order.after
    while s >= 0:
        yield by_slot[s]  # type: ignore[misc]
        s = after(s)


def _items(order: lru.Order, by_slot: list[Group | None]) -> Iterator[tuple[str, Group]]:
    s = order.first()
    after = order.after
    while s >= 0:
        group = by_slot[s]
        yield group.group_id, group  # type: ignore[union-attr]
        s = after(s)


class OrderView:
    """``keys()``, ``values()`` or ``items()`` of groups in order: iterable again and again, as a dict's views
    are, each iteration from the least recently used."""

    __slots__ = ("_each", "_order", "_by_slot")

    def __init__(self, each: Callable[[lru.Order, list[Group | None]], Iterator[Any]], order: lru.Order,
                 by_slot: list[Group | None]) -> None:
        self._each, self._order, self._by_slot = each, order, by_slot

    def __iter__(self) -> Iterator[Any]:
        return self._each(self._order, self._by_slot)

    def __len__(self) -> int:
        return len(self._order)


class LruGroups(dict):  # type: ignore[type-arg]  (dict[str, Group], iterated in order)
    """Every group by id; iterated (``keys``, ``values``, ``items`` too) least recently used first. The order
    must not change while an iteration goes on (eviction stops at the first group it drops)."""

    __slots__ = ("order", "by_slot")

    def __init__(self, order: lru.Order, by_slot: list[Group | None]) -> None:
        super().__init__()
        self.order = order
        self.by_slot = by_slot

    def __iter__(self) -> Iterator[str]:
        return _ids(self.order, self.by_slot)

    def keys(self) -> OrderView:  # type: ignore[override]
        return OrderView(_ids, self.order, self.by_slot)

    def values(self) -> OrderView:  # type: ignore[override]
        return OrderView(_groups, self.order, self.by_slot)

    def items(self) -> OrderView:  # type: ignore[override]
        return OrderView(_items, self.order, self.by_slot)


class TenantGroups:
    """One tenant's groups in order, least recently used first, once the table holds two tenants' (module doc)."""

    __slots__ = ("order", "by_slot", "groups")

    def __init__(self, order: lru.Order, by_slot: list[Group | None], groups: LruGroups) -> None:
        self.order = order
        self.by_slot = by_slot
        self.groups = groups  # every tenant's, by id

    def __len__(self) -> int:
        return len(self.order)

    def __bool__(self) -> bool:
        return len(self.order) > 0

    def __contains__(self, group_id: object) -> bool:
        group = self.groups.get(group_id)  # type: ignore[call-overload]
        return group is not None and group.slot in self.order

    __iter__ = LruGroups.__iter__
    keys = LruGroups.keys
    values = LruGroups.values
    items = LruGroups.items


class GroupTable:
    """Groups by id, in order, each tenant's in order, and their bytes (module doc)."""

    __slots__ = ("groups", "by_tenant", "tenant_bytes", "version", "num_objects", "num_complete", "native",
                 "_by_slot", "_free", "_order", "_tenant_orders")

    def __init__(self, native: bool | None = None) -> None:
        # the C order where its module is built (``lru.native()``), unless told which
        self.native = lru.native() if native is None else native
        self._by_slot: list[Group | None] = [None] * FIRST_SLOTS
        self._free = list(range(FIRST_SLOTS - 1, -1, -1))  # the lowest first
        self._order = lru.new_order(FIRST_SLOTS, self.native)
        self.groups = LruGroups(self._order, self._by_slot)  # first: least recently used
        self.by_tenant: dict[str, LruGroups | TenantGroups] = {}
        self._tenant_orders: dict[str, lru.Order] = {}  # each tenant's own, once the table held two tenants
        self.tenant_bytes: dict[str, int] = {}
        self.version = 0  # changes of order so far
        self.num_objects = 0  # every group's members (committed or in flight)
        self.num_complete = 0  # groups with every member committed (a running count: Stats reads it)

    @property
    def one_tenant(self) -> bool:
        """Every group is one tenant's, whose order is ``groups`` itself."""
        return len(self.by_tenant) == 1 and next(iter(self.by_tenant.values())) is self.groups

    def _take_slot(self) -> int:
        if not self._free:
            old = len(self._by_slot)
            new = 2 * old
            self._by_slot.extend([None] * old)
            self._free = list(range(new - 1, old - 1, -1))
            self._order.grow(new)
            for order in self._tenant_orders.values():
                order.grow(new)
        return self._free.pop()

    def add(self, group: Group) -> Group:
        """A new group, the most recently used."""
        if group.group_id in self.groups:
            raise ValueError(f"group {group.group_id!r} is in the table already")
        self.version += 1
        slot = self._take_slot()
        group.slot = slot
        self._by_slot[slot] = group
        self.groups[group.group_id] = group
        self._order.push_back(slot)
        by_tenant = self.by_tenant
        of_tenant = by_tenant.get(group.tenant)
        if of_tenant is self.groups:
            return group
        if not by_tenant:  # the first tenant: its groups are all the groups
            by_tenant[group.tenant] = self.groups
            return group
        orders = self._tenant_orders
        if self.one_tenant:  # a second tenant: the first one's groups get an order of their own
            (only,) = by_tenant
            first = lru.new_order(len(self._by_slot), self.native)
            self._order.copy_into(first)
            first.remove(slot)
            orders[only] = first
            by_tenant[only] = TenantGroups(first, self._by_slot, self.groups)
        order = orders.get(group.tenant)
        if order is None:
            order = orders[group.tenant] = lru.new_order(len(self._by_slot), self.native)
            by_tenant[group.tenant] = TenantGroups(order, self._by_slot, self.groups)
        order.push_back(slot)
        return group

    def remove(self, group: Group) -> None:
        group.dropped = True
        group.ready = False
        if group.complete:
            self.num_complete -= 1
        del self.groups[group.group_id]
        slot = group.slot
        self._order.remove(slot)
        order = self._tenant_orders.get(group.tenant)
        if order is not None:
            order.remove(slot)
            if not len(order):
                del self._tenant_orders[group.tenant]
                del self.by_tenant[group.tenant]
        elif not self.groups:
            del self.by_tenant[group.tenant]
        group.slot = -1
        self._by_slot[slot] = None
        self._free.append(slot)

    def add_used(self, new: list[Group]) -> None:
        """``add`` of each of ``new`` (groups of one tenant the table does not hold, their ids distinct), then
        ``touch`` of them all: the first one becomes the most recently used. In one pass where the tenant's order
        is the table's own (nearly always)."""
        if not new:
            return
        if self.by_tenant.get(new[0].tenant) is not self.groups:
            for group in new:
                self.add(group)
            self.touch_groups(new)
            return
        groups, by_slot, take = self.groups, self._by_slot, self._take_slot
        for group in new:
            slot = take()
            group.slot = slot
            by_slot[slot] = group
            groups[group.group_id] = group
        order = self._order
        for group in reversed(new):  # (added in order and touched, the first named went last)
            order.push_back(group.slot)
        self.version += len(new) + 1

    def remove_idle(self, victims: list[Group]) -> None:
        """``remove`` of each of ``victims``, groups of one tenant (eviction's, ``PoolIndex.evict``), in one pass."""
        groups, by_slot, order, free = self.groups, self._by_slot, self._order, self._free
        tenant = victims[0].tenant
        own = self._tenant_orders.get(tenant)
        complete = 0
        for group in victims:
            group.dropped = True
            group.ready = False
            complete += group.num_committed == group.size
            del groups[group.group_id]
            slot = group.slot
            order.remove(slot)
            if own is not None:
                own.remove(slot)
            group.slot = -1
            by_slot[slot] = None
            free.append(slot)
        self.num_complete -= complete
        if own is not None:
            if not len(own):
                del self._tenant_orders[tenant]
                del self.by_tenant[tenant]
        elif not groups:
            del self.by_tenant[tenant]

    def touch(self, group_ids: Iterable[str]) -> None:
        """Mark groups used, the first named becoming the most recently used."""
        self.version += 1
        get = self.groups.get
        self._move("touch", [g for g in map(get, group_ids) if g is not None])

    def touch_groups(self, found: list[Group]) -> None:
        """``touch`` for groups the table holds, as objects (a lookup's: a whole history at once)."""
        if not found:
            return
        self.version += 1
        self._move("touch", found)

    def demote(self, group_ids: Iterable[str]) -> int:
        """Make groups the least recently used, the last named evicted first (a prefix's tail before its
        head). Returns how many were found."""
        self.version += 1
        get = self.groups.get
        found = [g for g in map(get, group_ids) if g is not None]
        self._move("demote", found)
        return len(found)

    def _move(self, how: str, found: list[Group]) -> None:
        """An order's ``how`` (``touch`` or ``demote``) of ``found`` in the table's order and in each of their
        tenants' own."""
        if not found:
            return
        slots = fields.values(found, Group, "slot")  # (a list: half the cost of an array of C ints to make)
        getattr(self._order, how)(slots)
        orders = self._tenant_orders
        if not orders:
            return
        name = how
        tenant = found[0].tenant
        if found[-1].tenant == tenant and len(set(map(_TENANT, found))) == 1:
            getattr(orders[tenant], name)(slots)
            return
        by_tenant: dict[str, list[int]] = {}
        for group in found:
            by_tenant.setdefault(group.tenant, []).append(group.slot)
        for tenant, mine in by_tenant.items():
            getattr(orders[tenant], name)(mine)

    def add_members(self, tenant: str, size: int, count: int = 1) -> None:
        """``count`` objects of ``size`` bytes in all joined ``tenant``'s groups."""
        self.tenant_bytes[tenant] = self.tenant_bytes.get(tenant, 0) + size
        self.num_objects += count

    def remove_members(self, tenant: str, size: int, count: int = 1) -> None:
        self.num_objects -= count
        left = self.tenant_bytes[tenant] - size
        if left:
            self.tenant_bytes[tenant] = left
        else:
            del self.tenant_bytes[tenant]

    def of_tenant(self, tenant: str) -> LruGroups | TenantGroups | dict[str, Group]:
        return self.by_tenant.get(tenant, _EMPTY)


_EMPTY: dict[str, Group] = {}
_TENANT = attrgetter("tenant")
