"""The queue in front of a prefill pipeline: FIFO, or work-aware with bounds on what reordering costs.

Pure: no grpc, no I/O; time comes in as numbers from the caller's clock.

Three orders (``QueueOrder``, the ``sched=`` of the comparisons):
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

Bypass budget (``max_bypass_s``, for ``WORK`` and ``RATIO``): wall-clock
aging does not say how much a request was delayed *by reordering* (at
saturation every wait passes any small bound, and the order becomes FIFO).
The budget does: each request is pushed with a credit of ``max_bypass_s``
seconds of estimated work. When a request is popped, every older request
still queued is overtaken and its credit is debited the popped request's
work; a request may be popped only if no older request's credit would go
negative (so the oldest is always poppable). Among the poppable, the order
decides. Aging still applies first (an overdue pop is the oldest's, which
overtakes nobody). Measured in the simulator: docs/simulation.md, "The
bypass budget".

Backlog gate (``reorder_below_s``, for ``WORK`` and ``RATIO``): the queue
reorders only while the estimated work queued is under ``reorder_below_s``
seconds; at or over it, it pops the oldest, as FIFO does. A queue's tail is
made in bursts, when the backlog is deep: in them the gate serves arrivals
in order, so the turns that wait longest wait about what they would under
FIFO, while in calmer stretches short turns still go first. Measured in the
simulator: docs/simulation.md, "The backlog gate".

Invariants: a request id is queued at most once; ``len`` counts the queued;
``FIFO`` pops in push order (an undone pop, ``undo``, takes its
place again with its credit, and those it overtook get theirs back); ``WORK`` pops the oldest request when it is
overdue, else the least work (earliest push on a tie) among those the
budget lets go. No credit is ever negative, so the work popped between a
request's push and its pop is at most the work queued at its push plus
``max_bypass_s``: with one server whose service times are the estimates, a
request waits at most what it would wait under FIFO plus ``max_bypass_s``
(the unfinished work at its arrival is the same under any order that never
idles). Cost: ``push`` O(1) (``WORK``: O(log n)), ``leads`` O(n); with a finite budget,
``pop``/``peek`` scan the queue, O(n), and ``serving_order`` plays the pops,
O(n²); without one, ``WORK`` pops from a heap and ``RATIO`` scans.

Why aging and not pure shortest-first: at saturation, reordering cannot lower
the mean wait with throughput held (Little's law); it moves wait from short
requests to long ones. The bound keeps the long ones' tail from growing
without limit (a cold 100K-token prompt behind a stream of short turns).
"""

from __future__ import annotations

import enum
import heapq
import itertools
import math
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
    credit: float  # the bypass budget left: how much more younger work may still overtake it


@dataclass(slots=True)
class _Pop:
    """What an undoable pop changed: the entry, those it debited, the counter it moved."""

    entry: _Entry
    debited: list[str]
    counter: str | None


def _ratio_key(entry: _Entry, now: float) -> tuple[float, int]:
    """RATIO's order, highest first: the response ratio, then the earlier arrival."""
    return (now - entry.enqueued_at + entry.work) / max(entry.work, RATIO_FLOOR_S), -entry.seq


class PrefillQueue:
    """Requests waiting for a pipeline, popped in ``order`` (see the module doc for the invariants).

    ``max_wait_s``: aging's wall-clock bound (``math.inf``: none); ``max_bypass_s``: the bypass budget in
    seconds of estimated work (``math.inf``: none; ``FIFO`` overtakes nobody and ignores both).
    """

    def __init__(self, order: QueueOrder = QueueOrder.FIFO, max_wait_s: float = 30.0,
                 max_bypass_s: float = math.inf, reorder_below_s: float = math.inf) -> None:
        if not max_wait_s > 0:
            raise InvalidArgument(f"max_wait_s: must be positive, got {max_wait_s}", field="max_wait_s")
        if not max_bypass_s >= 0:
            raise InvalidArgument(f"max_bypass_s: must be >= 0, got {max_bypass_s}", field="max_bypass_s")
        if not reorder_below_s > 0:
            raise InvalidArgument(f"reorder_below_s: must be positive, got {reorder_below_s}",
                                  field="reorder_below_s")
        self.order = order
        self.max_wait_s = max_wait_s
        self.max_bypass_s = max_bypass_s
        self.reorder_below_s = reorder_below_s
        self.queued_work_s = 0.0  # the estimated work queued (the backlog gate's measure)
        self._arrivals: OrderedDict[str, _Entry] = OrderedDict()  # push order: the oldest first
        self._by_work: list[tuple[float, int, str]] = []  # a heap; entries of popped ids are skipped lazily
        self._seq = itertools.count()
        self.num_overdue_pops = 0  # pops decided by aging (a metric: how often the bound binds)
        self.num_budget_pops = 0  # pops where the budget held the order's first choice back
        self.num_backlog_pops = 0  # pops in arrival order because the backlog reached ``reorder_below_s``
        self._undoable: dict[str, _Pop] = {}  # pops not settled yet (``pop(undoable=True)``)

    @property
    def _budgeted(self) -> bool:
        return self.order is not QueueOrder.FIFO and self.max_bypass_s < math.inf

    def _in_order(self, oldest: _Entry, now: float) -> bool:
        """Whether the next pop is the oldest's: FIFO, the oldest overdue, or the backlog at the gate."""
        return (self.order is QueueOrder.FIFO or now - oldest.enqueued_at >= self.max_wait_s
                or self.queued_work_s >= self.reorder_below_s)

    def __len__(self) -> int:
        return len(self._arrivals)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._arrivals

    def push(self, request_id: str, work: float, now: float) -> None:
        if request_id in self._arrivals:
            raise InvalidArgument(f"request_id: {request_id!r} is already queued", field="request_id")
        if not 0 <= work < math.inf:
            raise InvalidArgument(f"work: must be finite and >= 0, got {work}", field="work")
        entry = _Entry(request_id, work, now, next(self._seq), self.max_bypass_s)
        self._arrivals[request_id] = entry
        self.queued_work_s += work
        if self.order is QueueOrder.WORK and not self._budgeted:
            heapq.heappush(self._by_work, (work, entry.seq, request_id))

    def remove(self, request_id: str) -> bool:
        """Take a request out wherever it is (it ended while waiting); False if not queued."""
        entry = self._arrivals.pop(request_id, None)
        if entry is None:
            return False
        self._took(entry)
        return True

    def _took(self, entry: _Entry) -> None:
        self.queued_work_s = max(0.0, self.queued_work_s - entry.work) if self._arrivals else 0.0

    def peek(self, now: float) -> str | None:
        """The request to serve next, or None when empty."""
        if not self._arrivals:
            return None
        oldest = next(iter(self._arrivals.values()))
        if self._in_order(oldest, now):
            return oldest.request_id
        if self._budgeted:
            entries = list(self._arrivals.values())
            return entries[self._pick(entries, [e.credit for e in entries], now)[0]].request_id
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

    def leads(self, work: float, now: float) -> bool:
        """Whether a request pushed now with ``work`` would be the next pop: the queue is empty, or nobody is
        overdue, the backlog with its work stays under the gate, the order puts it first (ties go to the
        queued, as earlier) and the budget lets it overtake every queued request. A caller that then serves it at once pushes and pops it, so that those it
        overtook are debited its work. O(n)."""
        if not self._arrivals:
            return True
        oldest = next(iter(self._arrivals.values()))
        if self._in_order(oldest, now) or self.queued_work_s + work >= self.reorder_below_s:
            return False  # (with its own work the backlog is deep: it would be pushed behind, in order)
        entries = list(self._arrivals.values())
        entries.append(_Entry("", work, now, entries[-1].seq + 1, self.max_bypass_s))  # the youngest
        return self._pick(entries, [e.credit for e in entries], now)[0] == len(entries) - 1

    def _pick(self, entries: list[_Entry], credits: list[float], now: float) -> tuple[int, bool]:
        """The index in ``entries`` (push order) the budget lets go that the order prefers, and whether the
        budget held back a request the order preferred. O(n): one pass with the least credit of the older."""
        key = (lambda e: (e.work, e.seq)) if self.order is QueueOrder.WORK else (lambda e: _neg(_ratio_key(e, now)))
        best = first = 0
        best_key = first_key = key(entries[0])
        least_credit = credits[0]
        for i in range(1, len(entries)):
            k = key(entries[i])
            if k < first_key:
                first, first_key = i, k
            if k < best_key and entries[i].work <= least_credit:
                best, best_key = i, k
            least_credit = min(least_credit, credits[i])
        return best, best != first

    def pop(self, now: float, undoable: bool = False) -> str:
        """Take the request ``peek`` names, debiting those it overtakes; InvalidArgument when empty.
        ``undoable``: until ``settle``, ``undo`` puts it back as if it had never been popped."""
        if not self._arrivals:
            raise InvalidArgument("pop: the queue is empty")
        oldest = next(iter(self._arrivals.values()))
        in_order = self._in_order(oldest, now)
        debited: list[str] = []
        counter = None
        if self._budgeted and not in_order:
            entries = list(self._arrivals.values())
            index, held = self._pick(entries, [e.credit for e in entries], now)
            request_id = entries[index].request_id
            work = entries[index].work
            for older in entries[:index]:
                older.credit -= work  # >= 0: ``_pick`` let it go only if work <= every older credit
                debited.append(older.request_id)
            if held:
                self.num_budget_pops += 1
                counter = "num_budget_pops"
        else:
            request_id = self.peek(now)
            assert request_id is not None
        entry = self._arrivals.pop(request_id)
        self._took(entry)
        if self.order is not QueueOrder.FIFO and now - entry.enqueued_at >= self.max_wait_s:
            self.num_overdue_pops += 1
            counter = "num_overdue_pops"
        elif in_order and self.order is not QueueOrder.FIFO:
            self.num_backlog_pops += 1
            counter = "num_backlog_pops"
        if undoable:
            self._undoable[request_id] = _Pop(entry, debited, counter)
        return request_id

    def settle(self, request_id: str) -> None:
        """An undoable pop stands (nothing if there is none)."""
        self._undoable.pop(request_id, None)

    def undo(self, request_id: str) -> bool:
        """Put an undoable pop back: the request in its place by push order, with the credit it had, and
        those it overtook with theirs; False (nothing changes) when there is no such pop to undo."""
        popped = self._undoable.pop(request_id, None)
        if popped is None or request_id in self._arrivals:
            return False
        entry = popped.entry
        for older in popped.debited:
            if older in self._arrivals:
                self._arrivals[older].credit += entry.work
        if popped.counter is not None:
            setattr(self, popped.counter, getattr(self, popped.counter) - 1)
        self._arrivals[request_id] = entry
        self._arrivals = OrderedDict(sorted(self._arrivals.items(), key=lambda item: item[1].seq))
        self.queued_work_s += entry.work
        if self.order is QueueOrder.WORK and not self._budgeted:
            heapq.heappush(self._by_work, (entry.work, entry.seq, request_id))
        return True

    def waited_s(self, request_id: str, now: float) -> float:
        return now - self._arrivals[request_id].enqueued_at

    def credit_s(self, request_id: str) -> float:
        """What is left of a queued request's bypass budget (``max_bypass_s`` at its push)."""
        return self._arrivals[request_id].credit

    def serving_order(self, now: float) -> list[str]:
        """Queued ids in the order they would be popped at ``now`` with no arrival meanwhile: the overdue
        oldest first, then (``WORK``) least work, ties by arrival, or (``RATIO``) the highest ratio, each among
        those the bypass budget lets go (with a budget: the pops played on a copy of the credits, O(n²));
        ``FIFO``: push order. (Waiting on makes more of them overdue: this is the order as of ``now``.)"""
        if self.order is QueueOrder.FIFO or self.queued_work_s >= self.reorder_below_s:
            return list(self._arrivals)  # (past the gate: in order for as long as the backlog stays deep)
        entries = self._arrivals.values()
        overdue = [e.request_id for e in entries if now - e.enqueued_at >= self.max_wait_s]
        waiting = [e for e in entries if now - e.enqueued_at < self.max_wait_s]
        if self._budgeted:
            credits = [e.credit for e in waiting]
            rest: list[_Entry] = []
            while waiting:
                index, _ = self._pick(waiting, credits, now)
                work = waiting[index].work
                for i in range(index):
                    credits[i] -= work
                rest.append(waiting.pop(index))
                del credits[index]
        elif self.order is QueueOrder.RATIO:
            rest = sorted(waiting, key=lambda e: _ratio_key(e, now), reverse=True)
        else:
            rest = sorted(waiting, key=lambda e: (e.work, e.seq))
        return overdue + [e.request_id for e in rest]

    def oldest(self) -> str:
        """The id queued longest (pushed first); InvalidArgument when empty."""
        if not self._arrivals:
            raise InvalidArgument("oldest: the queue is empty")
        return next(iter(self._arrivals))

    def ids(self) -> list[str]:
        """Queued ids in push order."""
        return list(self._arrivals)


def _neg(key: tuple[float, int]) -> tuple[float, int]:
    return -key[0], -key[1]
