"""The master keeps the collector off its index: each sweep freezes what survived, and a full collection comes
only every ``full_every_s``, when it says how long it took."""

from __future__ import annotations

import gc
import weakref

from kvpool.heap import HeapKeeper


class Node:
    def __init__(self) -> None:
        self.other: object = None


def cyclic_garbage() -> weakref.ref[Node]:
    """Two objects that point at each other and at nothing else: only a collection can free them."""
    a, b = Node(), Node()
    a.other, b.other = b, a
    return weakref.ref(a)


def test_a_tick_freezes_and_only_a_due_one_collects_what_a_freeze_kept() -> None:
    try:
        gc.unfreeze()
        keeper = HeapKeeper(full_every_s=600.0, last_full=1000.0)
        survivors = [[i] for i in range(1_000)]  # long-lived objects the collector tracks
        a, b = Node(), Node()
        a.other, b.other = b, a
        kept = weakref.ref(a)
        assert keeper.tick(1001.0) is None  # not due: a freeze only
        assert gc.get_freeze_count() >= len(survivors)
        del a, b  # a cycle that was alive at the freeze and is garbage now
        gc.collect()
        assert kept() is not None  # frozen: collections do not look at it
        fresh = cyclic_garbage()
        gc.collect()
        assert fresh() is None  # what was never frozen is collected as ever
        took = keeper.tick(1600.0)  # due: everything back, collected in full, frozen again
        assert took is not None and took >= 0.0 and keeper.last_full == 1600.0
        assert kept() is None
        assert keeper.tick(1601.0) is None
        assert len(survivors) == 1_000
    finally:
        gc.unfreeze()
