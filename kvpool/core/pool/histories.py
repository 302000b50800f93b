"""Histories a lookup found, kept for the next lookup of the same history (``LookupRequest.history``).

A turn's lookup names every chunk of its history, and the next turn of the session names the same ones again
plus a few new ones. Finding each again by id costs the master a hash and a probe into a dict of every group
(cache misses on a large index); a history's ``Group`` objects, kept in a list under a handle, are checked by
C-level attribute maps instead. The answer is exactly the one the ids would give: a group the index forgot
since (``Group.dropped``) is looked up by its id again, so a group of that id saved anew is found as the dict
would find it. The caller names how many leading ids the handle stands for and sends only the ids after them;
it must use a handle only for a request whose leading ids are the ones the handle was made from (the pool
client keeps them and compares). Handles are random 63-bit numbers, so nobody reads another caller's history
by guessing one; they live as long as the index (a new master knows none: the caller sends its ids).
"""

from __future__ import annotations

import secrets
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvpool.core.pool.records import Group

# Group references kept over all handles, at most (the oldest handles go first): twice as many as the index
# holds groups (sessions share their system and tool prefixes, so live histories name groups more than once),
# and never fewer than this. A kept group the index forgot stays in memory with its members until its handle
# goes, so the bound scales with the index: forgotten kept groups cost at most twice the live ones.
MIN_KEPT_GROUPS = 1 << 16
KEPT_PER_LIVE_GROUP = 2


@dataclass(slots=True)
class HistoryHandles:
    """Handle -> a found history's groups, in prefix order; least recently used handles go past the bound."""

    min_groups: int = MIN_KEPT_GROUPS
    _kept: OrderedDict[int, list[Group]] = field(default_factory=OrderedDict)
    _num_groups: int = 0

    def keep(self, groups: Sequence[Group], live_groups: int = 0) -> int:
        """A new handle for ``groups`` (not copied again: the caller gives up the list); 0 when it cannot be
        kept (empty, or more than the bound: twice ``live_groups``, the index's, or ``min_groups``)."""
        bound = max(self.min_groups, KEPT_PER_LIVE_GROUP * live_groups)
        if not groups or len(groups) > bound:
            return 0
        handle = secrets.randbits(63) or 1
        while handle in self._kept:
            handle = secrets.randbits(63) or 1
        self._kept[handle] = groups if isinstance(groups, list) else list(groups)
        self._num_groups += len(groups)
        while self._num_groups > bound:
            _, oldest = self._kept.popitem(last=False)
            self._num_groups -= len(oldest)
        return handle

    def drop(self, handle: int) -> None:
        """Forget a handle (its lookup made a newer one of the same history: the caller keeps that one)."""
        groups = self._kept.pop(handle, None)
        if groups is not None:
            self._num_groups -= len(groups)

    def get(self, handle: int) -> list[Group] | None:
        groups = self._kept.get(handle)
        if groups is not None:
            self._kept.move_to_end(handle)
        return groups

    def __len__(self) -> int:
        return len(self._kept)

    @property
    def num_groups(self) -> int:
        return self._num_groups
