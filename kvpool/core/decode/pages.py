"""Decode KV pages: which page ids are free, lowest id first.

Pure: no torch, no I/O. A decode shard's KV lives in ``num_pages`` token-major
pages of ``page_size`` tokens each (every layer of a token in one page); this
module hands out page ids and takes them back, and nothing else.

Order: ``allocate`` returns the lowest free ids in increasing order, so page
tables are deterministic for a given history (exact-value tests rely on it).
Cost: per run of contiguous ids taken or given back (``PageAllocator``), not per page.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable

from kvpool.core.errors import InvalidArgument


def pages_for(num_tokens: int, page_size: int) -> int:
    """Pages that hold ``num_tokens`` tokens (ceil)."""
    return -(-num_tokens // page_size)


def kv_capacity(num_prompt_tokens: int, max_tokens: int) -> int:
    """KV entries a request can ever need on its shard: every output token but the
    last is fed back and cached, so ``prompt + max_tokens - 1``."""
    return num_prompt_tokens + max_tokens - 1


def pages_for_request(num_prompt_tokens: int, max_tokens: int, page_size: int) -> int:
    """Decode pages one request reserves for its whole life: the one count the router's
    admission and the shard's scheduler both use."""
    return pages_for(kv_capacity(num_prompt_tokens, max_tokens), page_size)


class PageAllocator:
    """Free page ids of one shard.

    The free ids are kept as sorted, disjoint, non-adjacent runs ``[start, end)``: a request takes and
    gives back its pages in runs (the lowest free ids are mostly contiguous), so ``allocate`` and ``free``
    cost per run, not per page (a prompt of 100K tokens is over a thousand pages).

    Invariant: every id in ``[0, num_pages)`` is either free (in one run, ``_is_free`` 1) or allocated
    (``_is_free`` 0), never both; ``num_free + num_used == num_pages``.
    """

    __slots__ = ("num_pages", "_starts", "_ends", "_num_free", "_is_free")

    def __init__(self, num_pages: int) -> None:
        if num_pages <= 0:
            raise InvalidArgument(f"num_pages: must be positive, got {num_pages}")
        self.num_pages = num_pages
        self._starts, self._ends = [0], [num_pages]  # the free runs, lowest first
        self._num_free = num_pages
        self._is_free = bytearray(b"\x01") * num_pages

    @property
    def num_free(self) -> int:
        return self._num_free

    @property
    def num_used(self) -> int:
        return self.num_pages - self._num_free

    def allocate(self, num: int) -> list[int] | None:
        """The ``num`` lowest free ids, or None (nothing taken) when fewer are free."""
        if num < 0:
            raise InvalidArgument(f"num: must be >= 0, got {num}")
        if num > self._num_free:
            return None
        page_ids: list[int] = []
        starts, ends = self._starts, self._ends
        taken = 0  # whole runs taken from the front
        while len(page_ids) < num:
            start, end = starts[taken], ends[taken]
            stop = min(end, start + num - len(page_ids))
            page_ids.extend(range(start, stop))
            self._is_free[start:stop] = bytes(stop - start)
            if stop == end:
                taken += 1
            else:
                starts[taken] = stop
        del starts[:taken], ends[:taken]
        self._num_free -= num
        return page_ids

    def free(self, page_ids: Iterable[int]) -> None:
        """Give pages back; all or nothing: a free page or a bad id frees none."""
        given = list(page_ids)
        if len(set(given)) != len(given):
            raise InvalidArgument("page_ids: repeats an id")
        if not given:
            return
        ids, is_free, n = sorted(given), self._is_free, self.num_pages
        if ids[0] < 0 or ids[-1] >= n or any(map(is_free.__getitem__, ids)):
            bad = next(i for i in given if not 0 <= i < n or is_free[i])
            raise InvalidArgument(f"page_ids: {bad} is not an allocated page")
        if ids[-1] - ids[0] + 1 == len(ids):  # one run (sorted, no repeats)
            self._free_run(ids[0], ids[-1] + 1)
        else:
            start = prev = ids[0]
            for page_id in ids[1:]:
                if page_id != prev + 1:
                    self._free_run(start, prev + 1)
                    start = page_id
                prev = page_id
            self._free_run(start, prev + 1)
        self._num_free += len(ids)

    def _free_run(self, start: int, end: int) -> None:
        """Pages ``[start, end)``, all allocated, go back: a run of their own, or merged with a neighbour."""
        self._is_free[start:end] = b"\x01" * (end - start)
        starts, ends = self._starts, self._ends
        k = bisect.bisect_left(starts, start)  # the first run after it
        joins_before = k > 0 and ends[k - 1] == start
        joins_after = k < len(starts) and starts[k] == end
        if joins_before and joins_after:
            ends[k - 1] = ends[k]
            del starts[k], ends[k]
        elif joins_before:
            ends[k - 1] = end
        elif joins_after:
            starts[k] = start
        else:
            starts.insert(k, start)
            ends.insert(k, end)

    def free_page_ids(self) -> list[int]:
        return [i for start, end in zip(self._starts, self._ends) for i in range(start, end)]
