"""The router's admission queue: requests waiting for room, each with a deadline, in FIFO or work order,
shared fairly between tenants.

Pure: no grpc, no I/O; time comes in as numbers from the caller's clock.

Between tenants (the API keys'), the queue is the core's fair queue
(``kvpool.core.prefill.fair_queue.FairQueue``, as stage 0's gate): start-time
fair queuing over the estimated work, by weight, so one tenant's flood does
not queue another's turns behind it; within a tenant, the order below. With
``fair`` off, or one tenant, it is that order alone.

The order is the prefill queue's (``kvpool.core.prefill.queue.PrefillQueue``,
the same ``QueueOrder``): ``FIFO`` is arrival order; ``WORK`` takes the
least estimated work first and a request waiting ``max_wait_s`` or more
before every other, oldest first, and with a bypass budget (``max_bypass_s``)
lets nobody overtake a request whose credit it would overdraw. A request that
takes its ticket at once, never queued, overtakes every queued request: it
may only when the budget lets it (``leads``), and it is debited from their
credits as a pop would be (``take_at_once``), so the budget's bound holds for
the router's queue as for stage 0's.

The work the router can estimate (``admission_work_s``): it sees no device
cache, only the prompt and, per session, a fingerprint of each of the last
few prompts it placed (``kvpool.core.sessions.prefix``: a length and a
digest of those tokens, kept by ``RoutingPolicy`` and forgotten with the
session). A turn that extends one of them (its first
tokens hash the same) counts the longest such prefix as cached and the
tokens beyond it as computed at their context; anything else (an unknown
session, a subagent's own prompt under its parent's key) computes its whole
prompt. Several fingerprints, because an agent's subagents share its session
key and interleave with it: each one's next turn extends its own last
prompt. The restore is left out: the router cannot tell a prefix still on
the device from one in the pool, and a restore costs far less than the
compute it saves (stage 0's gate refines the estimate with the device cache
it owns).

Invariants: a request id is queued at most once; ``ids`` are in arrival
order; ``head`` is the request the order serves next (``PrefillQueue.peek``),
and the oldest request always has the earliest deadline (one timeout for all);
every request that leaves with a ticket, queued or not, is a pop of the core's
queue (the credits it keeps are those of ``PrefillQueue``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvpool.core.admission.room import AdmissionRequest
from kvpool.core.errors import InvalidArgument
from kvpool.core.prefill.fair_queue import FairQueue
from kvpool.core.prefill.queue import QueueOrder, WorkWeights, prefill_work_s
from kvpool.core.tenancy.shares import TenantShares

# the gate's weights (services/prefill/stage0/prefetch.py): only their ratios matter for an order
ROUTER_WORK_WEIGHTS = WorkWeights()
def admission_work_s(num_prompt_tokens: int, num_cached_tokens: int,
                     weights: WorkWeights = ROUTER_WORK_WEIGHTS) -> float:
    """The router's estimate of a prompt's prefill work (see the module doc): the tokens beyond
    ``num_cached_tokens`` (the longest remembered prompt it extends; 0: none), at their context; at
    least the last token is computed, as stage 0 always computes it."""
    if num_prompt_tokens <= 0 or num_cached_tokens < 0:
        raise InvalidArgument(f"admission_work_s({num_prompt_tokens}, {num_cached_tokens})")
    cached = min(num_cached_tokens, num_prompt_tokens - 1)
    return prefill_work_s(num_prompt_tokens, cached, 0, weights)


@dataclass(slots=True)
class QueuedRequest:
    request: AdmissionRequest
    enqueued_at: float
    deadline: float
    work_s: float


class AdmissionQueue:
    """Queued requests and their order (see the module doc)."""

    def __init__(self, order: QueueOrder = QueueOrder.FIFO, max_wait_s: float = 4.0,
                 max_bypass_s: float = math.inf, reorder_below_s: float = math.inf,
                 shares: TenantShares | None = None, fair: bool = True) -> None:
        if order not in (QueueOrder.FIFO, QueueOrder.WORK):  # the router's --sched: fifo or session
            raise InvalidArgument(f"order: the admission queue takes fifo or work, got {order.value}", field="order")
        self._order = FairQueue(order, max_wait_s, max_bypass_s, reorder_below_s, shares, fair)
        self._queued: dict[str, QueuedRequest] = {}  # insertion order: arrival order
        self._left: dict[str, QueuedRequest] = {}  # took tickets, their shards' answers not in yet

    @property
    def order(self) -> QueueOrder:
        return self._order.order

    @property
    def fair(self) -> bool:
        return self._order.fair

    @property
    def max_wait_s(self) -> float:
        return self._order.max_wait_s

    @property
    def max_bypass_s(self) -> float:
        return self._order.max_bypass_s

    @property
    def num_overdue_pops(self) -> int:
        """Requests taken because aging made them the head (how often the bound binds)."""
        return self._order.num_overdue_pops

    @property
    def reorder_below_s(self) -> float:
        return self._order.reorder_below_s

    @property
    def num_backlog_pops(self) -> int:
        """Requests taken in arrival order because the backlog reached the gate (``reorder_below_s``)."""
        return self._order.num_backlog_pops

    @property
    def num_budget_pops(self) -> int:
        """Requests taken where the bypass budget held back the order's first choice (how often it binds)."""
        return self._order.num_budget_pops

    def credit_s(self, request_id: str) -> float:
        """What is left of a queued request's bypass budget."""
        return self._order.credit_s(request_id)

    def __len__(self) -> int:
        return len(self._queued)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._queued

    def push(self, request: AdmissionRequest, work_s: float, now: float, deadline: float) -> None:
        self._order.push(request.request_id, work_s, now, request.tenant)  # raises on a duplicate or a bad work
        self._queued[request.request_id] = QueuedRequest(request, now, deadline, work_s)

    def remove(self, request_id: str) -> QueuedRequest | None:
        """Take a request out wherever it is (it ended, expired or got a ticket)."""
        if self._order.remove(request_id):
            return self._queued.pop(request_id)
        return None

    def head(self, now: float) -> QueuedRequest | None:
        """The request the order serves next; None when empty."""
        request_id = self._order.peek(now)
        return None if request_id is None else self._queued[request_id]

    def pop_head(self, now: float) -> QueuedRequest:
        """Take ``head(now)`` (counting an aging pop) until ``settle``: ``undo`` puts it back; InvalidArgument
        when empty."""
        request_id = self._order.pop(now, undoable=True)
        self._left[request_id] = queued = self._queued.pop(request_id)
        return queued

    def leads(self, work_s: float, now: float, tenant: str = "") -> bool:
        """Whether a request of ``tenant`` arriving now with ``work_s`` would be the head (``FairQueue.leads``):
        its tenant's turn comes first, and in its tenant's queue (``PrefillQueue.leads``) that queue is empty,
        or (``WORK``) nobody there is overdue, it brings strictly less work than its head (ties: the earlier)
        and its work is within every one of them's bypass credit."""
        return self._order.leads(work_s, now, tenant)

    def take_at_once(self, request: AdmissionRequest, work_s: float, now: float, deadline: float) -> None:
        """A request that ``leads`` took its ticket without queueing: those it overtook are debited its
        work, as its pop would debit them (until ``settle``: ``undo`` queues it as if it had arrived and
        not led); InvalidArgument (nothing changes) unless it leads."""
        request_id = request.request_id
        self._order.push(request_id, work_s, now, request.tenant)  # raises on a duplicate or a bad work
        if self._order.peek(now) != request_id:
            self._order.remove(request_id)
            raise InvalidArgument(f"request_id: {request_id!r} does not lead the admission queue",
                                  field="request_id")
        self._order.pop(now, undoable=True)
        self._left[request_id] = QueuedRequest(request, now, deadline, work_s)

    def settle(self, request_id: str) -> None:
        """The shard holds the room of a request that left with a ticket: its pop stands (nothing if none)."""
        self._order.settle(request_id)
        self._left.pop(request_id, None)

    def undo(self, request_id: str) -> bool:
        """The shard refused the ticket of a request that left: it is queued again as if it had never left
        (its place, deadline and credit, and those it overtook get theirs back); False when it had not
        left (nothing changes)."""
        queued = self._left.pop(request_id, None)
        if queued is None or not self._order.undo(request_id):
            return False
        self._queued[request_id] = queued
        self._queued = {queued_id: self._queued[queued_id] for queued_id in self._order.ids()}  # push order
        return True

    def oldest(self) -> QueuedRequest:
        """The request queued longest (the earliest deadline); InvalidArgument when empty."""
        if not self._queued:
            raise InvalidArgument("oldest: the queue is empty")
        return next(iter(self._queued.values()))

    def expired(self, now: float) -> list[str]:
        """Ids whose deadline has come, in arrival order (not removed)."""
        return [request_id for request_id, q in self._queued.items() if q.deadline <= now]

    def enqueued_before(self, when: float) -> list[str]:
        """Ids queued at ``when`` or earlier, in arrival order (not removed)."""
        return [request_id for request_id, q in self._queued.items() if q.enqueued_at <= when]

    def ids(self) -> list[str]:
        """Queued ids in arrival order."""
        return list(self._queued)
