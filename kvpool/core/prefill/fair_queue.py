"""Fair sharing of a prefill queue between tenants, by weight: start-time fair queuing over estimated work.

Pure: no grpc, no I/O; time comes in as numbers from the caller's clock.

The router's admission queue and stage 0's gate both hold one ``FairQueue``.
Each tenant has its own ``PrefillQueue`` (``kvpool.core.prefill.queue``), in
the configured order (FIFO, or work-aware with aging, the bypass budget and
the backlog gate: all of them act **within** the tenant, on its own requests
and its own backlog). Between tenants, start-time fair queuing (SFQ, Goyal,
Vin and Cheng 1996) decides whose turn it is:

- each tenant T has a weight φ_T (``TenantShares``: configured, else 1) and
  a tag S_T, the virtual time at which its next request starts;
- the queue's virtual time V is the tag of the last pop (0 at first);
- a push into T's empty queue sets S_T = max(V, S_T): a tenant that was
  idle starts now, with no credit for its idle time and no debt for having
  been alone (work-conserving: a tenant alone may use everything);
- a pop takes the tenant with the least tag among those with requests
  waiting (a tie goes to the tenant whose oldest waiting request came
  first), sets V to its tag and pops that tenant's queue in its own order;
  then S_T += work / φ_T, with the popped request's estimated work.

**The bound** (tested exactly, ``tests/core/test_fair_queue.py``): let a
request r of tenant A be pushed at t0 and popped at t1, with no ``undo``
of a pop between (an undo right after its pop restores everything as
before it). For any other tenant B, the work of B's requests popped
strictly between t0 and t1 is at most

    (φ_B / φ_A) · (W_A + w_A) + w_B

where W_A is the work of A's requests popped strictly between t0 and t1
(those ahead of r in A's own order, or that overtook it there), w_A the
work of A's last pop before t0 (0 if none) and w_B the largest of those B
pops. So r waits behind at most B's weighted share of A's own work, plus one
of B's requests and one of A's. Proof sketch: every waiting tenant's tag is
at least V; A's tag at t0 is at most V(t0) + w_A/φ_A and grows by exactly
W_A/φ_A until r's pop; B's tags in between grow by each B pop's work over
φ_B, start at V(t0) or later and end at most at r's tag.

With one tenant (or ``fair`` off: every request counted as one tenant's) it
pops exactly as that tenant's ``PrefillQueue`` alone.

Invariants: a request id is queued at most once, in one tenant's queue;
every pushed id leaves exactly once, by ``pop`` (an undone pop puts it back)
or ``remove``; ``len`` counts the queued; ``ids`` are in push order. Cost:
a pop is its tenant queue's plus O(tenants with requests waiting).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvpool.core.errors import InvalidArgument
from kvpool.core.prefill.queue import PrefillQueue, QueueOrder
from kvpool.core.tenancy.shares import TenantShares, tenant_name

ONE_TENANT = ""  # every request's tenant when ``fair`` is off


@dataclass(slots=True)
class _FairPop:
    """What an undoable pop changed between tenants: the tenant's tag and V before it, and the pop count
    after it (an undo with no pop since restores both exactly)."""

    tenant: str
    work: float
    tag_before: float
    virtual_before: float
    pops_after: int


class FairQueue:
    """Per-tenant ``PrefillQueue``s shared by weight (see the module doc)."""

    def __init__(self, order: QueueOrder = QueueOrder.FIFO, max_wait_s: float = 30.0,
                 max_bypass_s: float = math.inf, reorder_below_s: float = math.inf,
                 shares: TenantShares | None = None, fair: bool = True) -> None:
        self._args = (order, max_wait_s, max_bypass_s, reorder_below_s)
        PrefillQueue(*self._args)  # raises on a bad setting before any push
        self.shares = shares if shares is not None else TenantShares()
        self.fair = fair
        self._queues: dict[str, PrefillQueue] = {}
        self._tags: dict[str, float] = {}  # S_T: the virtual time the tenant's next request starts at
        self.virtual_time = 0.0  # V
        self._tenant_of: dict[str, str] = {}  # queued request -> its tenant's key
        self._seq: dict[str, int] = {}  # queued (and undoable) request -> its push number (``ids``)
        self._work: dict[str, float] = {}  # queued (and undoable) request -> its estimated work
        self._next_seq = 0
        self._pops = 0
        self._undoable: dict[str, _FairPop] = {}

    # ---- what the queue is --------------------------------------------------

    @property
    def order(self) -> QueueOrder:
        return self._args[0]

    @property
    def max_wait_s(self) -> float:
        return self._args[1]

    @property
    def max_bypass_s(self) -> float:
        return self._args[2]

    @property
    def reorder_below_s(self) -> float:
        return self._args[3]

    @property
    def queued_work_s(self) -> float:
        return math.fsum(q.queued_work_s for q in self._queues.values())

    @property
    def num_overdue_pops(self) -> int:
        return sum(q.num_overdue_pops for q in self._queues.values())

    @property
    def num_budget_pops(self) -> int:
        return sum(q.num_budget_pops for q in self._queues.values())

    @property
    def num_backlog_pops(self) -> int:
        return sum(q.num_backlog_pops for q in self._queues.values())

    def __len__(self) -> int:
        return len(self._tenant_of)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._tenant_of

    def key(self, tenant: str) -> str:
        """The tenant's queue (every request's the same one when ``fair`` is off)."""
        return tenant_name(tenant) if self.fair else ONE_TENANT

    def tag(self, tenant: str) -> float:
        """The tenant's start tag S_T (what it would start at now if it had a request waiting)."""
        key = self.key(tenant)
        tag = self._tags.get(key, 0.0)
        queue = self._queues.get(key)
        return tag if queue is not None and len(queue) else max(self.virtual_time, tag)

    def _weight(self, key: str) -> float:
        return self.shares.weight(key) if self.fair else 1.0

    # ---- changes ------------------------------------------------------------

    def push(self, request_id: str, work: float, now: float, tenant: str = "") -> None:
        if request_id in self._tenant_of:
            raise InvalidArgument(f"request_id: {request_id!r} is already queued", field="request_id")
        key = self.key(tenant)
        queue = self._queues.get(key)
        if queue is None:
            queue = self._queues[key] = PrefillQueue(*self._args)
        idle = not len(queue)
        queue.push(request_id, work, now)  # raises on a bad work
        if idle:
            self._tags[key] = max(self.virtual_time, self._tags.get(key, 0.0))
        self._tenant_of[request_id] = key
        self._work[request_id] = work
        self._seq[request_id] = self._next_seq
        self._next_seq += 1

    def remove(self, request_id: str) -> bool:
        """Take a request out wherever it is (it ended while waiting); False if not queued. Tags stay."""
        key = self._tenant_of.pop(request_id, None)
        if key is None:
            return False
        self._seq.pop(request_id, None)
        self._work.pop(request_id, None)
        return self._queues[key].remove(request_id)

    def _next_tenant(self, now: float) -> str | None:
        """The waiting tenant with the least tag; a tie goes to the one whose oldest request came first."""
        best: tuple[float, int] | None = None
        chosen = None
        for key, queue in self._queues.items():
            if not len(queue):
                continue
            rank = (self._tags[key], self._seq[queue.oldest()])
            if best is None or rank < best:
                best, chosen = rank, key
        return chosen

    def peek(self, now: float) -> str | None:
        """The request to serve next, or None when empty."""
        key = self._next_tenant(now)
        return None if key is None else self._queues[key].peek(now)

    def leads(self, work: float, now: float, tenant: str = "") -> bool:
        """Whether a request of ``tenant`` pushed now with ``work`` would be the next pop: its tenant would be
        chosen (its tag below every other waiting tenant's; a tie goes to the other, whose request came
        first) and its own queue would pop it (``PrefillQueue.leads``)."""
        key = self.key(tenant)
        queue = self._queues.get(key)
        waiting = queue is not None and len(queue) > 0
        rank = (self.tag(tenant), self._seq[queue.oldest()] if waiting else math.inf)  # type: ignore[union-attr]
        for other, q in self._queues.items():
            if other != key and len(q) and (self._tags[other], self._seq[q.oldest()]) < rank:
                return False
        return queue is None or queue.leads(work, now)

    def pop(self, now: float, undoable: bool = False) -> str:
        """Take the request ``peek`` names (its tenant's tag moves on by its work over the tenant's weight);
        InvalidArgument when empty. ``undoable``: until ``settle``, ``undo`` puts it back."""
        key = self._next_tenant(now)
        if key is None:
            raise InvalidArgument("pop: the queue is empty")
        queue = self._queues[key]
        tag = self._tags[key]
        request_id = queue.pop(now, undoable)
        work = self._work[request_id]
        virtual_before = self.virtual_time
        self.virtual_time = max(self.virtual_time, tag)
        self._tags[key] = tag + work / self._weight(key)
        del self._tenant_of[request_id]
        self._pops += 1
        if undoable:
            self._undoable[request_id] = _FairPop(key, work, tag, virtual_before, self._pops)
        else:
            self._forget(request_id)
        return request_id

    def _forget(self, request_id: str) -> None:
        self._seq.pop(request_id, None)
        self._work.pop(request_id, None)

    def settle(self, request_id: str) -> None:
        """An undoable pop stands (nothing if there is none)."""
        popped = self._undoable.pop(request_id, None)
        if popped is not None:
            self._queues[popped.tenant].settle(request_id)
            if request_id not in self._tenant_of:
                self._forget(request_id)

    def undo(self, request_id: str) -> bool:
        """Put an undoable pop back (its tenant's queue as ``PrefillQueue.undo`` does; its tenant's tag back
        by its work, and V too when no pop came since); False (nothing changes) when there is none."""
        popped = self._undoable.pop(request_id, None)
        if popped is None or request_id in self._tenant_of:
            return False
        if not self._queues[popped.tenant].undo(request_id):
            return False
        if popped.pops_after == self._pops:  # nothing popped since: as if it had never been popped
            self._tags[popped.tenant] = popped.tag_before
            self.virtual_time = popped.virtual_before
        else:
            self._tags[popped.tenant] = max(self.virtual_time,
                                            self._tags[popped.tenant] - popped.work / self._weight(popped.tenant))
        self._tenant_of[request_id] = popped.tenant
        return True

    # ---- reading ------------------------------------------------------------

    def tenant_of(self, request_id: str) -> str:
        return self._tenant_of[request_id]

    def waited_s(self, request_id: str, now: float) -> float:
        return self._queues[self._tenant_of[request_id]].waited_s(request_id, now)

    def credit_s(self, request_id: str) -> float:
        """What is left of a queued request's bypass budget (within its tenant)."""
        return self._queues[self._tenant_of[request_id]].credit_s(request_id)

    def serving_order(self, now: float) -> list[str]:
        """Queued ids in the order they would be popped at ``now`` with no arrival meanwhile: each tenant's
        own ``serving_order``, merged by the tags as the pops would move them."""
        orders = {key: q.serving_order(now) for key, q in self._queues.items() if len(q)}
        tags = {key: self._tags[key] for key in orders}
        firsts = {key: self._seq[self._queues[key].oldest()] for key in orders}
        out: list[str] = []
        while orders:
            key = min(orders, key=lambda k: (tags[k], firsts[k]))
            request_id = orders[key].pop(0)
            out.append(request_id)
            tags[key] += self._work[request_id] / self._weight(key)
            if not orders[key]:
                del orders[key]
            elif firsts[key] == self._seq[request_id]:  # ties go by the oldest still waiting
                firsts[key] = min(self._seq[i] for i in orders[key])
        return out

    def ids(self) -> list[str]:
        """Queued ids in push order."""
        return sorted(self._tenant_of, key=self._seq.__getitem__)
