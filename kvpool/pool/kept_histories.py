"""The pool client's side of the master's history handles (``kvpool.core.pool.histories``).

A lookup's answer gives a handle for the history it found; the client keeps it under that history's last id,
with the ids it stands for. A later lookup whose ids begin with them sends the handle and only the ids after
(the master skips finding those groups again). The ids are compared whole, so a handle is only ever used for
the ids it was made from. A handle is used once: its answer brings the next one.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

MAX_HANDLES = 4096


class KeptHistories:
    def __init__(self, max_handles: int = MAX_HANDLES) -> None:
        self.max_handles = max_handles
        self._by_last: OrderedDict[str, tuple[int, list[str]]] = OrderedDict()  # last id -> (handle, its ids)

    def take(self, group_ids: Sequence[str]) -> tuple[int, int]:
        """(handle, how many leading ids it stands for) for the longest kept prefix of ``group_ids``, taken
        out (the answer brings its successor); (0, 0) when none is kept."""
        by_last = self._by_last
        for i in range(len(group_ids) - 1, -1, -1):
            kept = by_last.get(group_ids[i])
            if kept is not None and len(kept[1]) == i + 1 and kept[1] == list(group_ids[:i + 1]):
                del by_last[group_ids[i]]
                return kept[0], i + 1
        return 0, 0

    def keep(self, group_ids: Sequence[str], handle: int) -> None:
        """``handle`` stands for ``group_ids`` (a found prefix, in order)."""
        if not handle or not group_ids:
            return
        self._by_last[group_ids[-1]] = (handle, list(group_ids))
        self._by_last.move_to_end(group_ids[-1])
        while len(self._by_last) > self.max_handles:
            self._by_last.popitem(last=False)

    def clear(self) -> None:
        self._by_last.clear()

    def __len__(self) -> int:
        return len(self._by_last)
