"""Decode KV pages: which page ids are free, lowest id first.

Pure: no torch, no I/O. A decode shard's KV lives in ``num_pages`` token-major
pages of ``page_size`` tokens each (every layer of a token in one page); this
module hands out page ids and takes them back, and nothing else.

Order: ``allocate`` returns the lowest free ids in increasing order, so page
tables are deterministic for a given history (exact-value tests rely on it).
Cost: O(k log n) for k pages.
"""

from __future__ import annotations

import heapq
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

    Invariant: every id in ``[0, num_pages)`` is either free (in the heap,
    once) or allocated, never both; ``num_free + num_used == num_pages``.
    """

    __slots__ = ("num_pages", "_free", "_is_free")

    def __init__(self, num_pages: int) -> None:
        if num_pages <= 0:
            raise InvalidArgument(f"num_pages: must be positive, got {num_pages}")
        self.num_pages = num_pages
        self._free = list(range(num_pages))  # already a heap
        self._is_free = [True] * num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def allocate(self, num: int) -> list[int] | None:
        """The ``num`` lowest free ids, or None (nothing taken) when fewer are free."""
        if num < 0:
            raise InvalidArgument(f"num: must be >= 0, got {num}")
        if num > len(self._free):
            return None
        page_ids = [heapq.heappop(self._free) for _ in range(num)]
        for page_id in page_ids:
            self._is_free[page_id] = False
        return page_ids

    def free(self, page_ids: Iterable[int]) -> None:
        """Give pages back; all or nothing: a free page or a bad id frees none."""
        ids = list(page_ids)
        if len(set(ids)) != len(ids):
            raise InvalidArgument("page_ids: repeats an id")
        for page_id in ids:
            if not 0 <= page_id < self.num_pages or self._is_free[page_id]:
                raise InvalidArgument(f"page_ids: {page_id} is not an allocated page")
        for page_id in ids:
            self._is_free[page_id] = True
            heapq.heappush(self._free, page_id)

    def free_page_ids(self) -> list[int]:
        return sorted(self._free)
