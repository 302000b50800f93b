"""A put batch's checks, made before the index changes anything (a bad item leaves it untouched)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Container, Mapping, Sequence
from operator import attrgetter

from kvpool.core.errors import FailedPrecondition, InvalidArgument
from kvpool.core.pool.records import Group, PutRequestItem, Segment


def check_put_batch(
    items: Sequence[PutRequestItem],
    segments: Mapping[str, Segment],
    groups: Mapping[str, Group],
    holds: Callable[[str], bool],
    holds_any: Callable[[list[str]], bool] | None = None,
) -> bool:
    """Raise ``InvalidArgument`` naming the first bad item: a duplicate key, an object larger than any
    segment, a ``group_size`` that disagrees with the group's, or more members than the group holds. Returns
    True when it found every key new (the batch a save sends), False when it did not look at them all."""
    largest = max((s.size for s in segments.values()), default=0)
    if _all_good(items, largest, groups, holds_any or (lambda keys: any(map(holds, keys)))):
        return True
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
        if not holds(item.key):
            count = new_members.get(item.group_id, 0) + 1
            new_members[item.group_id] = count
            have = len(group.keys) if group is not None else 0
            if have + count > item.group_size:
                raise InvalidArgument(
                    f"items[{i}].key: group {item.group_id!r} already has {have + count - 1} "
                    f"of {item.group_size} members"
                )
    return False


def _all_good(items: Sequence[PutRequestItem], largest: int, groups: Mapping[str, Group],
              holds_any: Callable[[list[str]], bool]) -> bool:
    """True when the batch passes every check, decided a group at a time (most steps in C) for the batches a
    save sends: distinct new keys, one size per group. False does not say which item is bad (the loop does)."""
    keys = [item.key for item in items]
    if len(set(keys)) != len(keys) or holds_any(keys):
        return False
    if segments_too_small(items, largest):
        return False
    pairs = set(zip(map(_GROUP_ID, items), map(_GROUP_SIZE, items)))
    declared = dict(pairs)
    if len(declared) != len(pairs):
        return False  # a group declared with two sizes
    for group_id, count in Counter(map(_GROUP_ID, items)).items():
        group = groups.get(group_id)
        have, size = (len(group.keys), group.size) if group is not None else (0, declared[group_id])
        if size != declared[group_id] or have + count > size:
            return False
    return True


def segments_too_small(items: Sequence[PutRequestItem], largest: int) -> bool:
    """An item larger than the largest segment (with no segment, none is)."""
    return largest > 0 and max(map(_SIZE, items), default=0) > largest


_GROUP_ID = attrgetter("group_id")
_GROUP_SIZE = attrgetter("group_size")
_SIZE = attrgetter("size")


def check_put_end(commits: Sequence[tuple[str, int]], in_flight: Container[str], field: str = "items[{}].key") -> None:
    """Raise naming the first commit that is a duplicate or has no put in flight (never started, revoked, timed out);
    ``field``: its key's field, formatted with its place."""
    seen: set[str] = set()
    for i, (key, _checksum) in enumerate(commits):
        if key in seen:
            raise InvalidArgument(f"{field.format(i)}: duplicate key {key!r} in one batch")
        seen.add(key)
        if key not in in_flight:
            raise FailedPrecondition(
                f"{field.format(i)}: no put in flight for {key!r} (never started, revoked or timed out)"
            )
