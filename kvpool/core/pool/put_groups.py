"""A put of whole groups (``PutGroups``): the items it stands for, and the items a client can send so.

Pure. One layout for both ends: each group's members are keyed ``"<group id>/<m>"`` for m in
``range(len(member_sizes))``, member m of ``member_sizes[m]`` bytes; the items go member by member (every
group's member 0, then every group's member 1, ...: a save's stages, as stage 0 reserves them) or group by group.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain
from typing import TypeVar

T = TypeVar("T")

# "0", "1", ...: a member's place as its key's last part (shared strings, not one made per key)
PLACES = tuple(map(str, range(1025)))


def group_items(group_ids: Sequence[str], member_sizes: Sequence[int], by_member: bool
                ) -> tuple[list[str], list[str], list[int]]:
    """The items a put of whole groups stands for, in its order: their keys, group ids and sizes (each group's
    size is ``len(member_sizes)``)."""
    places = PLACES[:len(member_sizes)]
    if by_member:
        keys = [group_id + "/" + place for place in places for group_id in group_ids]
        ids = list(group_ids) * len(member_sizes)
        sizes = [size for size in member_sizes for _ in group_ids]
    else:
        keys = [group_id + "/" + place for group_id in group_ids for place in places]
        ids = [group_id for group_id in group_ids for _ in member_sizes]
        sizes = list(member_sizes) * len(group_ids)
    return keys, ids, sizes


def group_keys(group_ids: Sequence[str], members: int, by_member: bool) -> list[str]:
    """The keys of whole groups of ``members`` members each, in ``group_items``' order."""
    places = PLACES[:members]
    if by_member:
        return [group_id + "/" + place for place in places for group_id in group_ids]
    return [group_id + "/" + place for group_id in group_ids for place in places]


def as_commit_groups(keys: Sequence[str]) -> tuple[list[str], int, bool] | None:
    """Keys as whole groups (group ids, members, by_member) whose keys are exactly them in their order
    (``group_keys``: a commit of a save's put), or None: every group whole, keyed by place, the groups
    distinct."""
    count = sum(1 for key in keys if key.endswith("/0"))
    if not count or len(keys) % count:
        return None
    members = len(keys) // count
    if members >= len(PLACES):
        return None
    for by_member in (True, False):
        firsts = keys[:count] if by_member else keys[::members]
        group_ids = [key[:-2] for key in firsts if key.endswith("/0")]
        if len(group_ids) == count and len(set(group_ids)) == count and \
                group_keys(group_ids, members, by_member) == list(keys):
            return group_ids, members, by_member
    return None


def in_item_order(by_group: list[T], members: int, by_member: bool) -> list[T]:
    """Values of a put's items listed group by group (each group's ``members`` in place order), in the items'
    own order (``group_items``'s layout)."""
    if not by_member:
        return by_group
    return list(chain.from_iterable(by_group[m::members] for m in range(members)))


def as_groups(items: Sequence[tuple[str, str, int, int]]) -> tuple[list[str], list[int], bool] | None:
    """``(key, group_id, group_size, size)`` items as a put of whole groups (group ids, member sizes,
    by_member) standing for exactly them in their order, or None when they are not such a put: every group
    whole, its members keyed by place, each place one size in every group, the groups distinct."""
    if not items:
        return None
    members = items[0][2]
    if not 0 < members < len(PLACES) or len(items) % members:
        return None
    count = len(items) // members
    for by_member in (True, False):
        if by_member:
            group_ids = [item[1] for item in items[:count]]
            member_sizes = [items[m * count][3] for m in range(members)]
        else:
            group_ids = [items[g * members][1] for g in range(count)]
            member_sizes = [item[3] for item in items[:members]]
        if len(set(group_ids)) != count:
            continue
        keys, ids, sizes = group_items(group_ids, member_sizes, by_member)
        if keys == [item[0] for item in items] and ids == [item[1] for item in items] and \
                sizes == [item[3] for item in items] and all(item[2] == members for item in items):
            return group_ids, member_sizes, by_member
    return None
