"""The router's requests and their admission tickets: a request gets its ticket now, or waits for it in
the queue holding nothing.

Every decision is the core's (``kvpool.core.admission``: the request driver and admission); this is
their asyncio shell. A queued request waits on a future until its ticket comes, the queue's
timeout passes, or a backend it needs stays missing; each outcome the core
answers (``Admitted``) reaches its waiter through ``apply``, and the queue's
gauges follow. Whatever may let a ticket go applies what the core answers (a
release, a shard's answer to Serve, a shard saying room came back, a health
round); ``changed`` is set each time, for a request waiting to be retried.
"""

from __future__ import annotations

import asyncio

from kvpool.core.admission.admission import Admission, Admitted, AdmissionRequest, Ticket
from kvpool.core.errors import KvpoolError, ResourceExhausted, Unavailable
from kvpool.core.tenancy.tenants import scoped_session_key
from kvpool.services.router.generation_request import GenerationRequest
from kvpool.services.router.metrics import RouterMetrics


class Tickets:
    """Waiters for the core's tickets (see the module doc): a queued request has one until its ticket
    comes, it is refused, or it leaves; a ticket whose request has gone is released at once."""

    def __init__(self, admission: Admission, metrics: RouterMetrics) -> None:
        self.admission = admission
        self.metrics = metrics
        self._waiting: dict[str, asyncio.Future[Ticket]] = {}
        self._queued_once: set[str] = set()  # live requests the queued counter counted
        # set (and replaced) whenever admission's answers may have changed: a request waiting to be retried looks again
        self.changed = asyncio.Event()
        # the queue's aging, budget and backlog-gate pops already counted in metrics
        self._overdue_seen = self._budget_seen = self._backlog_seen = 0

    def expect(self, request_id: str) -> asyncio.Future[Ticket]:
        """A waiter for the request's next ticket, made before the admission call that may hand it out."""
        waiter: asyncio.Future[Ticket] = asyncio.get_running_loop().create_future()
        self._waiting[request_id] = waiter
        return waiter

    def forget(self, request_id: str) -> None:
        """The request needs no waiter now (it got its ticket at once, or was refused)."""
        self._waiting.pop(request_id, None)

    async def wait(self, request_id: str, waiter: asyncio.Future[Ticket], deadline: float) -> Ticket:
        """The request's ticket once the queue hands it out; its deadline (the loop's clock) refuses it."""
        self._count_queued(request_id)
        self._publish()
        timer = asyncio.get_running_loop().call_at(deadline, self._expire)
        try:
            return await waiter
        finally:
            timer.cancel()
            self._waiting.pop(request_id, None)

    def _count_queued(self, request_id: str) -> None:
        """A request waits in the queue: counted once however often its shard refuses it."""
        if request_id not in self._queued_once:
            self._queued_once.add(request_id)
            self.metrics.queued.inc()

    def ended(self, request_id: str) -> None:
        self._queued_once.discard(request_id)

    def _expire(self) -> None:  # a queued request's deadline came
        self.apply(self.admission.poll(asyncio.get_running_loop().time()))

    def release(self, request_id: str) -> None:
        """A ticket whose request has gone (its waiter ended first) goes back at once."""
        self.apply(self.admission.release(request_id, asyncio.get_running_loop().time()))

    def apply(self, admitted: Admitted) -> None:
        """Hand tickets to their waiting requests; refuse the expired ones."""
        for request_id in admitted.expired:
            self._refuse(request_id, ResourceExhausted(
                f"router: no decode room within the queue's {self.admission.queue_timeout_s:g} s",
                retry_after_s=self.admission.retry_after_s(asyncio.get_running_loop().time())))
        for request_id, missing in admitted.unavailable.items():
            self._refuse(request_id, Unavailable(f"{missing} for {self.admission.health_wait_s:g} s"))
        for ticket in admitted.tickets:
            waiter = self._waiting.pop(ticket.request_id, None)
            if waiter is None or waiter.done():
                self.release(ticket.request_id)  # its client went away meanwhile
            else:
                waiter.set_result(ticket)
        self.changed.set()
        self.changed = asyncio.Event()
        self._publish()

    def _refuse(self, request_id: str, error: KvpoolError) -> None:
        """A queued request leaves without a ticket: its waiter gets ``error``."""
        waiter = self._waiting.pop(request_id, None)
        self.metrics.queue_expired.inc()
        if waiter is not None and not waiter.done():
            waiter.set_exception(error)

    def _publish(self) -> None:
        self.metrics.queue_length.set(self.admission.num_queued)
        # a pop a shard's refusal undid leaves the core's counts: a counter counts the highest each reached
        queue = self.admission.queue
        overdue, budget, backlog = queue.num_overdue_pops, queue.num_budget_pops, queue.num_backlog_pops
        self.metrics.queue_overdue.inc(max(0, overdue - self._overdue_seen))
        self.metrics.queue_budget.inc(max(0, budget - self._budget_seen))
        self.metrics.queue_backlog.inc(max(0, backlog - self._backlog_seen))
        self._overdue_seen = max(self._overdue_seen, overdue)
        self._budget_seen = max(self._budget_seen, budget)
        self._backlog_seen = max(self._backlog_seen, backlog)
        self.metrics.admitted.set(self.admission.num_admitted)
        for name, shard in self.admission.shards.items():
            self.metrics.shard_full.labels(name).set(1 if shard.full else 0)


def admission_request(request_id: str, request: GenerationRequest) -> AdmissionRequest:
    return AdmissionRequest(request_id, scoped_session_key(request.tenant, request.session_key),
                            len(request.prompt_ids), request.max_tokens, request.prompt_ids, request.tenant)
