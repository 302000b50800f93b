"""How the same-host path splits one call's copies over worker threads (``kvpool.pool.memory_moves``)."""

from __future__ import annotations

from kvpool.pool import memory_moves
from kvpool.pool.memory_moves import SPLIT_MIN_BYTES, split_copies


def test_a_small_call_stays_on_one_thread() -> None:
    spans = list(range(10))
    assert split_copies(spans, [SPLIT_MIN_BYTES // 20] * 10) == [spans]


def test_a_large_call_splits_in_order_into_shares_of_about_equal_bytes(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(memory_moves, "COPY_THREADS", 4)
    spans = list(range(16))
    shares = split_copies(spans, [SPLIT_MIN_BYTES] * 16)
    assert [s for share in shares for s in share] == spans  # every copy once, in order
    assert [len(share) for share in shares] == [4, 4, 4, 4]
    uneven = split_copies(list(range(5)), [8 * SPLIT_MIN_BYTES, SPLIT_MIN_BYTES, SPLIT_MIN_BYTES, SPLIT_MIN_BYTES,
                                          SPLIT_MIN_BYTES])
    assert uneven[0] == [0] and [s for share in uneven for s in share] == list(range(5))


def test_never_more_shares_than_copies_or_threads(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(memory_moves, "COPY_THREADS", 2)
    assert len(split_copies(list(range(8)), [SPLIT_MIN_BYTES] * 8)) == 2
    monkeypatch.setattr(memory_moves, "COPY_THREADS", 8)
    assert len(split_copies([0, 1], [64 * SPLIT_MIN_BYTES] * 2)) == 2
