"""The router's requests and their admission tickets: a request gets its ticket now, or waits for it in
the queue holding nothing.

Every decision is the core's (``kvpool.core.admission.admission``); this is its asyncio
shell. A queued request waits on a future until its ticket comes, the queue's
timeout passes, or a backend it needs stays missing; each outcome the core
answers (``Admitted``) reaches its waiter through ``apply``, and the queue's
gauges follow. Whatever may free room applies what the core answers (a
release, a first token, a health round); ``room_freed`` is set each time, for
a request waiting to be retried on another pipeline.
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
        # set (and replaced) whenever admission may have freed room: a request waiting to be retried looks again
        self.room_freed = asyncio.Event()
        # the queue's aging, budget and backlog-gate pops already counted in metrics
        self._overdue_seen = self._budget_seen = self._backlog_seen = 0

    async def admit(self, request_id: str, request: GenerationRequest) -> Ticket:
        """A ticket now, or after waiting in the queue; queued requests hold nothing."""
        loop = asyncio.get_running_loop()
        ticket = self.admission.admit(admission_request(request_id, request), loop.time())
        if ticket is not None:
            return ticket
        self.metrics.queued.inc()
        waiter: asyncio.Future[Ticket] = loop.create_future()
        self._waiting[request_id] = waiter
        timer = loop.call_later(self.admission.queue_timeout_s, self._expire)
        self._publish()
        try:
            return await waiter
        except BaseException:
            # the client went away while queued (or just as its ticket came): its slot or ticket goes
            self.release(request_id)
            raise
        finally:
            timer.cancel()
            self._waiting.pop(request_id, None)

    def _expire(self) -> None:
        self.apply(self.admission.poll(asyncio.get_running_loop().time()))

    def release(self, request_id: str) -> None:
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
        self.room_freed.set()
        self.room_freed = asyncio.Event()
        self._publish()

    def _refuse(self, request_id: str, error: KvpoolError) -> None:
        """A queued request leaves without a ticket: its waiter gets ``error``."""
        waiter = self._waiting.pop(request_id, None)
        self.metrics.queue_expired.inc()
        if waiter is not None and not waiter.done():
            waiter.set_exception(error)

    def _publish(self) -> None:
        self.metrics.queue_length.set(self.admission.num_queued)
        overdue = self.admission.queue.num_overdue_pops
        self.metrics.queue_overdue.inc(overdue - self._overdue_seen)
        self._overdue_seen = overdue
        budget = self.admission.queue.num_budget_pops
        self.metrics.queue_budget.inc(budget - self._budget_seen)
        self._budget_seen = budget
        backlog = self.admission.queue.num_backlog_pops
        self.metrics.queue_backlog.inc(backlog - self._backlog_seen)
        self._backlog_seen = backlog
        self.metrics.admitted.set(self.admission.num_admitted)
        for name, shard in self.admission.shards.items():
            self.metrics.shard_pages.labels(name).set(shard.used_pages)
            self.metrics.shard_region_bytes.labels(name).set(shard.used_bytes)
        for name, pipeline in self.admission.pipelines.items():
            self.metrics.pipeline_blocks.labels(name).set(pipeline.used_blocks)


def admission_request(request_id: str, request: GenerationRequest) -> AdmissionRequest:
    return AdmissionRequest(request_id, scoped_session_key(request.tenant, request.session_key),
                            len(request.prompt_ids), request.max_tokens, request.prompt_ids)
