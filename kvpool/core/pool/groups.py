"""The pool index's groups: every group least recently used first, each tenant's the same way, and its bytes.

Eviction takes a tenant's own oldest group in O(1) and weighs tenants by
their bytes (``tenancy.shares``). It knows nothing of the index.

Invariants: ``by_tenant[t]`` holds exactly the groups of tenant ``t``, in
their relative order in ``groups``; ``tenant_bytes[t]`` is the size of every
object (committed or in flight) of ``t``'s groups; a tenant holding nothing
has no entry in either.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from operator import attrgetter

from kvpool.core.pool.records import Group, StoredObject


@dataclass(slots=True)
class GroupTable:
    groups: OrderedDict[str, Group] = field(default_factory=OrderedDict)  # first: least recently used
    by_tenant: dict[str, OrderedDict[str, Group]] = field(default_factory=dict)
    tenant_bytes: dict[str, int] = field(default_factory=dict)

    def add(self, group: Group) -> Group:
        """A new group, the most recently used."""
        self.groups[group.group_id] = group
        self.by_tenant.setdefault(group.tenant, OrderedDict())[group.group_id] = group
        return group

    def remove(self, group: Group) -> None:
        del self.groups[group.group_id]
        groups = self.by_tenant[group.tenant]
        del groups[group.group_id]
        if not groups:
            del self.by_tenant[group.tenant]

    def touch(self, group_ids: Iterable[str]) -> None:
        """Mark groups used, the first named becoming the most recently used."""
        groups, by_tenant = self.groups, self.by_tenant
        for group_id in reversed(list(group_ids)):
            group = groups.get(group_id)
            if group is not None:
                groups.move_to_end(group_id)
                by_tenant[group.tenant].move_to_end(group_id)

    def touch_groups(self, found: list[Group]) -> None:
        """``touch`` for groups the table holds, as objects: the moves run in C, not one Python step each
        (a lookup touches a whole history)."""
        if not found:
            return
        ids = list(map(_GROUP_ID, reversed(found)))
        deque(map(self.groups.move_to_end, ids), maxlen=0)
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
        groups, by_tenant = self.groups, self.by_tenant
        found = 0
        for group_id in group_ids:
            group = groups.get(group_id)
            if group is not None:
                groups.move_to_end(group_id, last=False)
                by_tenant[group.tenant].move_to_end(group_id, last=False)
                found += 1
        return found

    def add_object(self, obj: StoredObject) -> None:
        self.tenant_bytes[obj.tenant] = self.tenant_bytes.get(obj.tenant, 0) + obj.size

    def remove_object(self, obj: StoredObject) -> None:
        left = self.tenant_bytes[obj.tenant] - obj.size
        if left:
            self.tenant_bytes[obj.tenant] = left
        else:
            del self.tenant_bytes[obj.tenant]

    def of_tenant(self, tenant: str) -> OrderedDict[str, Group]:
        return self.by_tenant.get(tenant, _EMPTY)


_EMPTY: OrderedDict[str, Group] = OrderedDict()
_GROUP_ID = attrgetter("group_id")
_TENANT = attrgetter("tenant")
