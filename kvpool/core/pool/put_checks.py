"""A put batch's checks, made before the index changes anything (a bad item leaves it untouched)."""

from __future__ import annotations

from collections.abc import Container, Mapping, Sequence

from kvpool.core.errors import FailedPrecondition, InvalidArgument
from kvpool.core.pool.records import Group, PutRequestItem, Segment


def check_put_batch(
    items: Sequence[PutRequestItem],
    segments: Mapping[str, Segment],
    groups: Mapping[str, Group],
    objects: Container[str],
) -> None:
    """Raise ``InvalidArgument`` naming the first bad item: a duplicate key, an object larger than any
    segment, a ``group_size`` that disagrees with the group's, or more members than the group holds."""
    largest = max((s.size for s in segments.values()), default=0)
    declared: dict[str, int] = {}
    new_members: dict[str, int] = {}
    seen: set[str] = set()
    for i, item in enumerate(items):
        if item.key in seen:
            raise InvalidArgument(f"items[{i}].key: duplicate key {item.key!r} in one batch")
        seen.add(item.key)
        if segments and item.size > largest:
            raise InvalidArgument(
                f"items[{i}].size: {item.size} bytes is larger than any segment (largest {largest})"
            )
        group = groups.get(item.group_id)
        expected = group.size if group is not None else declared.get(item.group_id)
        if expected is not None and expected != item.group_size:
            raise InvalidArgument(
                f"items[{i}].group_size: {item.group_size} disagrees with {expected} "
                f"declared earlier for group {item.group_id!r}"
            )
        declared[item.group_id] = item.group_size
        if item.key not in objects:
            count = new_members.get(item.group_id, 0) + 1
            new_members[item.group_id] = count
            have = len(group.members) if group is not None else 0
            if have + count > item.group_size:
                raise InvalidArgument(
                    f"items[{i}].key: group {item.group_id!r} already has {have + count - 1} "
                    f"of {item.group_size} members"
                )


def check_put_end(commits: Sequence[tuple[str, int]], in_flight: Container[str]) -> None:
    """Raise naming the first commit that is a duplicate or has no put in flight (never started, revoked, timed out)."""
    seen: set[str] = set()
    for i, (key, _checksum) in enumerate(commits):
        if key in seen:
            raise InvalidArgument(f"items[{i}].key: duplicate key {key!r} in one batch")
        seen.add(key)
        if key not in in_flight:
            raise FailedPrecondition(
                f"items[{i}].key: no put in flight for {key!r} (never started, revoked or timed out)"
            )
