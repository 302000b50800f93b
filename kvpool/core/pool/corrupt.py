"""Groups a reader found corrupt: hidden at once, dropped once no lease holds them.

Pure; the index calls these when a lease ends. A reader that got a member's
bytes but not its checksum (a store segment overwritten behind the master's
back) names the group when it releases the lease it read under. Left
committed, the group would be a hit on every later lookup and a recompute on
every restore, and the reader's save of the recomputed chunk would find the
key taken (first writer wins), so reuse would not come back until eviction.

Rules:
- a reader may condemn only a group its own lease held, and only that very
  group: one dropped and put again under the same id meanwhile (a good copy)
  is left alone, as is every id the lease did not hold;
- a condemned group is invisible to lookups at once, and is dropped as soon
  as no lease holds it (another reader still reading it finds the same bad
  bytes, a miss), so the next save of the chunk stores it afresh.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence

from kvpool.core.pool import fields
from kvpool.core.pool.records import Group


def condemn(held: Iterable[Group], live: Mapping[str, Group], corrupt_group_ids: Collection[str]) -> list[Group]:
    """Mark the groups of an ended lease that its reader found corrupt; returns the ones newly marked."""
    if not corrupt_group_ids:
        return []
    marked = []
    for group in held:
        if group.group_id in corrupt_group_ids and live.get(group.group_id) is group and not group.corrupt:
            group.corrupt = True
            group.ready = False
            marked.append(group)
    return marked


def droppable(ended: Sequence[Group], live: Mapping[str, Group]) -> list[Group]:
    """Condemned groups among those whose lease ended that no lease holds any more, each once."""
    if not fields.count(ended, Group, "corrupt"):  # (nearly always: a whole history's release, one pass)
        return []
    seen: set[int] = set()
    result = []
    for group in ended:
        if group.corrupt and not group.busy and live.get(group.group_id) is group and id(group) not in seen:
            seen.add(id(group))
            result.append(group)
    return result
