"""The queue in front of a prefill pipeline: FIFO, or work-aware with aging that bounds every wait.

Pure: no grpc, no I/O; time comes in as numbers from the caller's clock.

Two orders (``QueueOrder``, the ``sched=`` of the comparisons):
- ``FIFO``: arrival order, nobody overtakes.
- ``WORK``: the request bringing the least work goes first (``prefill_work_s``:
  its tokens to compute at their context, plus the restore it needs), ties by
  arrival. Aging: a request that has waited ``max_wait_s`` or more is
  *overdue*, and overdue requests go before every other, oldest first. So no
  request waits without bound: once overdue, only requests overdue before it
  and the one being served stand ahead of it.

- ``RATIO``: highest response ratio next, (waited + work) / work: short
  requests go first, and every waiting request's ratio grows with its wait,
  a long one's more slowly. Ties by arrival. Aging as in ``WORK``: overdue
  requests go first, oldest first (a ratio alone lets a stream of short
  requests hold a long one back for minutes: the simulator's closed loop).

Invariants: a request id is queued at most once; ``len`` counts the queued;
``FIFO`` pops in push order; ``WORK`` pops the oldest request when it is
overdue, else the least work (earliest push on a tie).

Why aging and not pure shortest-first: at saturation, reordering cannot lower
the mean wait with throughput held (Little's law); it moves wait from short
requests to long ones. The bound keeps the long ones' tail from growing
without limit (a cold 100K-token prompt behind a stream of short turns).
"""

from __future__ import annotations

import enum
import heapq
import itertools
from collections import OrderedDict
from dataclasses import dataclass

from kvpool.core.errors import InvalidArgument


class QueueOrder(enum.Enum):
    FIFO = "fifo"
    WORK = "work"
    RATIO = "ratio"


RATIO_FLOOR_S = 1e-3  # RATIO: work below this counts as this (a turn computing a handful of tokens)


@dataclass(frozen=True, slots=True)
class WorkWeights:
    """How long a pipeline takes per unit of work, for ordering only (never a promise).

    A chunk at context ``c`` computes in ``chunk_base_s + per_context_token_s × c``
    per stage (attention grows with the context); a restored token costs
    ``restore_per_token_s`` (its bytes on one stage, the stages reading at once).
    """

    chunk_tokens: int = 256
    chunk_base_s: float = 0.00124
    per_context_token_s: float = 8.46e-8
    restore_per_token_s: float = 1.5e-6

    def __post_init__(self) -> None:
        if self.chunk_tokens <= 0:
            raise InvalidArgument(f"chunk_tokens: must be positive, got {self.chunk_tokens}")
        for name in ("chunk_base_s", "per_context_token_s", "restore_per_token_s"):
            if not getattr(self, name) >= 0:
                raise InvalidArgument(f"{name}: must be >= 0, got {getattr(self, name)}")


def prefill_work_s(num_tokens: int, num_cached_tokens: int, num_restore_tokens: int, weights: WorkWeights) -> float:
    """Estimated pipeline time of one prompt: compute tokens ``[num_cached_tokens, num_tokens)``, each
    chunk at its mean context, plus restoring ``num_restore_tokens`` of the cached ones."""
    if num_tokens < 0 or not 0 <= num_cached_tokens <= num_tokens or not 0 <= num_restore_tokens <= num_cached_tokens:
        raise InvalidArgument(f"prefill_work_s({num_tokens}, {num_cached_tokens}, {num_restore_tokens})")
    n = num_tokens - num_cached_tokens
    mean_context = num_cached_tokens + n / 2
    per_token = (weights.chunk_base_s + weights.per_context_token_s * mean_context) / weights.chunk_tokens
    return n * per_token + num_restore_tokens * weights.restore_per_token_s


@dataclass(slots=True)
class _Entry:
    request_id: str
    work: float
    enqueued_at: float
    seq: int


def _ratio_key(entry: _Entry, now: float) -> tuple[float, int]:
    """RATIO's order, highest first: the response ratio, then the earlier arrival."""
    return (now - entry.enqueued_at + entry.work) / max(entry.work, RATIO_FLOOR_S), -entry.seq


class PrefillQueue:
    """Requests waiting for a pipeline, popped in ``order`` (see the module doc)."""

    def __init__(self, order: QueueOrder = QueueOrder.FIFO, max_wait_s: float = 30.0) -> None:
        if not max_wait_s > 0:
            raise InvalidArgument(f"max_wait_s: must be positive, got {max_wait_s}")
        self.order = order
        self.max_wait_s = max_wait_s
        self._arrivals: OrderedDict[str, _Entry] = OrderedDict()  # push order: the oldest first
        self._by_work: list[tuple[float, int, str]] = []  # a heap; entries of popped ids are skipped lazily
        self._seq = itertools.count()
        self.num_overdue_pops = 0  # pops decided by aging (a metric: how often the bound binds)

    def __len__(self) -> int:
        return len(self._arrivals)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._arrivals

    def push(self, request_id: str, work: float, now: float) -> None:
        if request_id in self._arrivals:
            raise InvalidArgument(f"request_id: {request_id!r} is already queued", field="request_id")
        if not work >= 0:
            raise InvalidArgument(f"work: must be >= 0, got {work}")
        entry = _Entry(request_id, work, now, next(self._seq))
        self._arrivals[request_id] = entry
        if self.order is QueueOrder.WORK:
            heapq.heappush(self._by_work, (work, entry.seq, request_id))

    def remove(self, request_id: str) -> bool:
        """Take a request out wherever it is (it ended while waiting); False if not queued."""
        return self._arrivals.pop(request_id, None) is not None

    def peek(self, now: float) -> str | None:
        """The request to serve next, or None when empty."""
        if not self._arrivals:
            return None
        oldest = next(iter(self._arrivals.values()))
        if self.order is QueueOrder.FIFO or now - oldest.enqueued_at >= self.max_wait_s:
            return oldest.request_id
        if self.order is QueueOrder.RATIO:
            return max(self._arrivals.values(), key=lambda e: _ratio_key(e, now)).request_id
        heap = self._by_work
        while heap:
            _, seq, request_id = heap[0]
            entry = self._arrivals.get(request_id)
            if entry is not None and entry.seq == seq:
                return request_id
            heapq.heappop(heap)  # popped or removed before
        raise AssertionError("a queued request is missing from the work heap")  # invariant

    def pop(self, now: float) -> str:
        """Take the request ``peek`` names; InvalidArgument when empty."""
        request_id = self.peek(now)
        if request_id is None:
            raise InvalidArgument("pop: the queue is empty")
        entry = self._arrivals.pop(request_id)
        if self.order is not QueueOrder.FIFO and now - entry.enqueued_at >= self.max_wait_s:
            self.num_overdue_pops += 1
        return request_id

    def waited_s(self, request_id: str, now: float) -> float:
        return now - self._arrivals[request_id].enqueued_at

    def serving_order(self, now: float) -> list[str]:
        """Queued ids in the order they would be popped at ``now`` with no arrival meanwhile: the overdue
        oldest first, then (``WORK``) least work, ties by arrival; ``FIFO``: push order. (With ``WORK``,
        waiting on makes more of them overdue: this is the order as of ``now``.)"""
        if self.order is QueueOrder.FIFO:
            return list(self._arrivals)
        entries = self._arrivals.values()
        overdue = [e.request_id for e in entries if now - e.enqueued_at >= self.max_wait_s]
        waiting = [e for e in entries if now - e.enqueued_at < self.max_wait_s]
        if self.order is QueueOrder.RATIO:
            rest = sorted(waiting, key=lambda e: _ratio_key(e, now), reverse=True)
        else:
            rest = sorted(waiting, key=lambda e: (e.work, e.seq))
        return overdue + [e.request_id for e in rest]

    def ids(self) -> list[str]:
        """Queued ids in push order."""
        return list(self._arrivals)
