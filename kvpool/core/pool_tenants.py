"""Each tenant's groups in the pool, least recently used first, and the bytes they hold.

The index keeps one ``TenantLedger`` beside its global LRU: eviction takes a
tenant's own oldest group in O(1) and weighs tenants by their bytes
(``tenant_shares``). It knows nothing of the index.

Invariants: ``lru[t]`` holds exactly the index's groups of tenant ``t``, in
the global LRU's relative order; ``bytes[t]`` is the size of every object
(committed or in flight) of ``t``'s groups; a tenant holding nothing has no
entry in either.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from kvpool.core.pool_records import Group, StoredObject


@dataclass(slots=True)
class TenantLedger:
    lru: dict[str, OrderedDict[str, Group]] = field(default_factory=dict)
    bytes: dict[str, int] = field(default_factory=dict)

    def add_group(self, group: Group) -> None:
        self.lru.setdefault(group.tenant, OrderedDict())[group.group_id] = group

    def remove_group(self, group: Group) -> None:
        groups = self.lru[group.tenant]
        del groups[group.group_id]
        if not groups:
            del self.lru[group.tenant]

    def touch(self, group: Group) -> None:
        self.lru[group.tenant].move_to_end(group.group_id)

    def add_object(self, obj: StoredObject) -> None:
        self.bytes[obj.tenant] = self.bytes.get(obj.tenant, 0) + obj.size

    def remove_object(self, obj: StoredObject) -> None:
        left = self.bytes[obj.tenant] - obj.size
        if left:
            self.bytes[obj.tenant] = left
        else:
            del self.bytes[obj.tenant]

    def groups_of(self, tenant: str) -> OrderedDict[str, Group]:
        return self.lru.get(tenant, _EMPTY)


_EMPTY: OrderedDict[str, Group] = OrderedDict()
