"""Stage 0's gate in front of the pipeline (``--sched-slots``): the core's prefill queue in front of a few slots.

At most ``slots`` prefills run through the stages at once; the others wait in
the core's fair queue (``kvpool.core.prefill.fair_queue.FairQueue``): shared
between tenants by weight (``--tenant-fair``, ``--tenant-weights``), and each
tenant's own in ``kvpool.core.prefill.queue.PrefillQueue``'s ``order``: arrival
(``--sched fifo``), or least work first with a request waiting ``max_wait_s``
going before every other and none overtaken by more than ``max_bypass_s`` of
estimated work (``--sched session``). Both orders get the same
slots, so a comparison of the two differs only in the order. Without a gate
(``--sched-slots 0``, fifo's default) every admitted prefill runs at once and
the stages' compute threads interleave their pieces in arrival order.

Invariants: ``running <= slots``; a request waits only while every slot is
taken; a waiter that is cancelled leaves the queue, and a slot it was handed
passes on to the next.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from kvpool.core.prefill.fair_queue import FairQueue
from kvpool.core.prefill.queue import QueueOrder
from kvpool.core.sessions.table import SessionId
from kvpool.core.tenancy.shares import TenantShares


class PrefillGate:
    def __init__(self, slots: int, max_wait_s: float, order: QueueOrder = QueueOrder.WORK,
                 max_bypass_s: float = math.inf, reorder_below_s: float = math.inf,
                 shares: TenantShares | None = None, fair: bool = True) -> None:
        self.slots = slots
        self.running = 0
        self.queue = FairQueue(order, max_wait_s, max_bypass_s, reorder_below_s, shares, fair)
        self._waiters: dict[str, asyncio.Future[None]] = {}
        self._sessions: dict[str, SessionId] = {}  # waiters' sessions (those that named one)

    @asynccontextmanager
    async def slot(self, request_id: str, work_s: float, session: SessionId | None = None,
                   tenant: str = "") -> AsyncIterator[None]:
        """Hold one of the slots for the body (in the queue's order, ``tenant``'s share, when all are taken)."""
        if self.running < self.slots and not len(self.queue):
            self.running += 1
        else:
            waiter = asyncio.get_running_loop().create_future()
            self._waiters[request_id] = waiter
            if session is not None:
                self._sessions[request_id] = session
            self.queue.push(request_id, work_s, time.monotonic(), tenant)
            try:
                await waiter  # handed a slot (running counts it already)
            except asyncio.CancelledError:
                if self.queue.remove(request_id):
                    self._waiters.pop(request_id, None)
                elif waiter.done() and not waiter.cancelled():  # handed a slot as it was cancelled: pass it on
                    self._leave()
                raise
            finally:
                self._sessions.pop(request_id, None)
        try:
            yield
        finally:
            self._leave()

    def waiting_sessions(self, now: float) -> list[SessionId]:
        """The sessions of the requests still waiting, in the order they will be served (as of ``now``)."""
        return [s for i in self.queue.serving_order(now) if (s := self._sessions.get(i)) is not None]

    def _leave(self) -> None:
        self.running -= 1
        while self.running < self.slots and len(self.queue):
            request_id = self.queue.pop(time.monotonic())
            waiter = self._waiters.pop(request_id)
            if waiter.cancelled():
                continue  # its caller is gone (it leaves without a slot)
            self.running += 1
            waiter.set_result(None)
