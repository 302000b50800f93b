"""The pool index's groups: every group least recently used first, each tenant's the same way, and its bytes.

Eviction takes a tenant's own oldest group in O(1) and weighs tenants by
their bytes (``tenancy.shares``). It knows nothing of the index.

While every group is one tenant's (nearly always), that tenant's ordered dict
is ``groups`` itself: a use moves each group once, not twice. A second tenant's
first group copies the first tenant's order into a dict of its own, once: the
table never goes back (a tenant whose only group comes and goes would otherwise
copy the whole table at each return). ``version``
counts the changes of order (a use, a new group, a demotion; a removal leaves
the others' order as it was), so a caller can tell that groups it moved to
the end are still there in the same order (a release after its lookup).

Invariants: ``by_tenant[t]`` holds exactly the groups of tenant ``t``, in
their relative order in ``groups`` (and is ``groups`` when ``t`` is the only
tenant); ``tenant_bytes[t]`` is the size of every
object (committed or in flight) of ``t``'s groups; a tenant holding nothing
has no entry in either.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from operator import attrgetter

from kvpool.core.pool.records import Group


@dataclass(slots=True)
class GroupTable:
    groups: OrderedDict[str, Group] = field(default_factory=OrderedDict)  # first: least recently used
    by_tenant: dict[str, OrderedDict[str, Group]] = field(default_factory=dict)
    tenant_bytes: dict[str, int] = field(default_factory=dict)
    version: int = 0  # changes of order so far
    num_objects: int = 0  # every group's members (committed or in flight)
    num_complete: int = 0  # groups with every member committed (a running count: Stats reads it)

    @property
    def one_tenant(self) -> bool:
        """Every group is one tenant's, whose ordered dict is ``groups`` itself."""
        return len(self.by_tenant) == 1 and next(iter(self.by_tenant.values())) is self.groups

    def add(self, group: Group) -> Group:
        """A new group, the most recently used."""
        self.version += 1
        by_tenant = self.by_tenant
        self.groups[group.group_id] = group
        of_tenant = by_tenant.get(group.tenant)
        if of_tenant is self.groups:
            return group
        if not by_tenant:  # the first tenant: its groups are all the groups
            by_tenant[group.tenant] = self.groups
            return group
        if self.one_tenant:  # a second tenant: the first one's groups get a dict of their own
            (only,) = by_tenant
            by_tenant[only] = OrderedDict((g, v) for g, v in self.groups.items() if g != group.group_id)
        by_tenant.setdefault(group.tenant, OrderedDict())[group.group_id] = group
        return group

    def remove(self, group: Group) -> None:
        group.dropped = True
        if group.complete:
            self.num_complete -= 1
        del self.groups[group.group_id]
        groups = self.by_tenant[group.tenant]
        if groups is not self.groups:
            del groups[group.group_id]
        if not groups:
            del self.by_tenant[group.tenant]

    def touch(self, group_ids: Iterable[str]) -> None:
        """Mark groups used, the first named becoming the most recently used."""
        self.version += 1
        groups, by_tenant, one = self.groups, self.by_tenant, self.one_tenant
        for group_id in reversed(list(group_ids)):
            group = groups.get(group_id)
            if group is not None:
                groups.move_to_end(group_id)
                if not one:
                    by_tenant[group.tenant].move_to_end(group_id)

    def touch_groups(self, found: list[Group]) -> None:
        """``touch`` for groups the table holds, as objects: the moves run in C, not one Python step each
        (a lookup touches a whole history)."""
        if not found:
            return
        self.version += 1
        ids = list(map(_GROUP_ID, reversed(found)))
        deque(map(self.groups.move_to_end, ids), maxlen=0)
        if self.one_tenant:
            return
        tenant = found[0].tenant
        if found[-1].tenant == tenant and len(set(map(_TENANT, found))) == 1:
            deque(map(self.by_tenant[tenant].move_to_end, ids), maxlen=0)
            return
        by_tenant = self.by_tenant
        for group in reversed(found):
            by_tenant[group.tenant].move_to_end(group.group_id)

    def demote(self, group_ids: Iterable[str]) -> int:
        """Make groups the least recently used, the last named evicted first (a prefix's tail before its
        head). Returns how many were found."""
        self.version += 1
        groups, by_tenant, one = self.groups, self.by_tenant, self.one_tenant
        found = 0
        for group_id in group_ids:
            group = groups.get(group_id)
            if group is not None:
                groups.move_to_end(group_id, last=False)
                if not one:
                    by_tenant[group.tenant].move_to_end(group_id, last=False)
                found += 1
        return found

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

    def of_tenant(self, tenant: str) -> OrderedDict[str, Group]:
        return self.by_tenant.get(tenant, _EMPTY)


_EMPTY: OrderedDict[str, Group] = OrderedDict()
_GROUP_ID = attrgetter("group_id")
_TENANT = attrgetter("tenant")
