"""The router's generate path: admit, then one call to the decode shard that reserves its room, has the
pipeline prefill into it and decodes — and free everything at once whatever happens.

Every decision is the core's: the request's driver (``kvpool.core.admission.request_driver``,
sans-I/O: events in, effects out) over admission (``kvpool.core.admission.admission``).
Its ``admit`` hands back a ticket (a pipeline and a decode shard) or queues the
request, holding nothing, until a shard can take it (the waiting is
``kvpool.services.router.tickets``'s); its ``end`` releases it. This module carries
the effects out and tells the driver what each call answered. The room is
the owners': the shard counts its pages and receive arena, stage 0 its device
blocks. Between admit and release this module makes one call:

    admit (queue) → Serve (decode: region + pages, or "no room now"; decode → stage 0 Prefill(target):
          every stage streams its layers into the region as its forward passes them,
          decode scatters each part as it lands, the last stage adds the final
          logits; then decode samples every token, the first included)

The call's first message says the shard holds the room (``confirmed``), the
next is the prefill's answer, then the tokens; its end, however it comes,
frees the region and pages at decode. A shard with no room answers so at once
(``NoRoomNow``): the request queues again in its place, and the shard takes no
ticket until its ``WatchRoom`` stream says room came back. Nothing here polls.

Faults (the driver decides, by ``kvpool.core.admission.retry.retry_move``): a prefill
pipeline that failed (decode answers UNAVAILABLE naming the field ``pipeline``)
is retried once on another healthy pipeline when nothing reached the client
(or, within ``--health-wait-s``, on its own once a health round finds it
serving again), in a new call to the same shard. A decode shard that is down
or unreachable before the first token (the call failed, or prefill could not
write to it: the field ``target``) moves the request once to another shard
that takes it, in a new call (the prefix is in the device cache or the pool by
then). Once a token has reached the client, a failure ends the stream and is
never hidden. Cancelling (the client went away) drops a queued request,
cancels the call, which frees the region and pages at decode, and releases the
ticket, at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import math
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import grpc
import structlog

from kvpool.core.admission.admission import Admission, Ticket
from kvpool.core.admission.request_driver import (
    Apply, Failed, Moved, RouterRequest, Serve, WaitForHealth, effect_fields)
from kvpool.core.admission.request_driver import Effect as RequestEffect
from kvpool.core.admission.retry import PIPELINE_FIELD
from kvpool.core.errors import ROOM_FIELD, InvalidArgument, KvpoolError, NoRoomNow, ResourceExhausted
from kvpool.core.prefill.queue import QueueOrder
from kvpool.core.tenancy.shares import TenantShares
from kvpool.core.api.public_errors import PIPELINE, SHARD, backend_label, public_error, served_by
from kvpool.core.admission.routing import RoutingPolicy
from kvpool.core.api.served_context import ShardLimits, served_context
from kvpool.request_id import bound_request_id, new_request_id
from kvpool.request_record import RequestRecord
from kvpool.tracing import name_request
from kvpool.status import error_field, from_status, room_epoch
from kvpool.services.router.backend_clients import LATE_CHECKS_OUT, Backends, Prefilled, Sampling, ServeStream, server_of
from kvpool.services.router.generation_request import GenerationRequest, ModelLimits
from kvpool.services.router.http_api import Usage
from kvpool.services.router.metrics import RouterMetrics
from kvpool.services.router.tickets import Tickets, admission_request

T = TypeVar("T")
log = structlog.get_logger(__name__)

# a backend's answer the client must see as such: its own bad input, or no room now (429)
_PASSED_ON = (InvalidArgument, ResourceExhausted)

CALL_TIMEOUT_S = 30.0


class Router:
    """Admission, the backends' clients and the generate path (see the module doc)."""

    def __init__(self, pipelines: list[str], shards: list[str], metrics: RouterMetrics,
                 affinity_max_queue: int = 4, max_in_flight: int = 256, request_timeout_s: float = 600.0,
                 max_queue: int = 64, queue_timeout_s: float = 30.0, locality: bool = True,
                 servers: dict[str, str] | None = None, limits: ModelLimits | None = None,
                 order: QueueOrder = QueueOrder.FIFO, max_wait_s: float = 4.0,
                 late_checks_out: int = LATE_CHECKS_OUT, health_wait_s: float = 0.0,
                 max_bypass_s: float = math.inf, reorder_below_s: float = math.inf,
                 shares: TenantShares | None = None, fair: bool = True) -> None:
        self.metrics = metrics
        self.limits = limits  # its context follows every health round (kvpool.core.api.served_context)
        self.max_in_flight = max_in_flight
        self.request_timeout_s = request_timeout_s
        self.in_flight = 0
        names = servers or {}
        self.admission = Admission(
            RoutingPolicy.of(pipelines, shards, affinity_max_queue=affinity_max_queue),
            {s: server_of(s, names) for s in shards}, {p: server_of(p, names) for p in pipelines},
            max_queue=max_queue, queue_timeout_s=queue_timeout_s, locality=locality, order=order,
            max_wait_s=max_wait_s, health_wait_s=health_wait_s, max_bypass_s=max_bypass_s,
            reorder_below_s=reorder_below_s, shares=shares, fair=fair,
        )
        metrics.queue_order.labels(order.value).set(1)
        self.tickets = Tickets(self.admission, metrics)
        self.backends = Backends(pipelines, shards, self.admission, metrics, late_checks_out, self.tickets.apply)
        self._prefetches: set[asyncio.Task[None]] = set()  # fire-and-forget: a turn's end never waits on them
        self.record = RequestRecord("router")  # each request's driver effects (kvpool simulate --validate)

    async def close(self) -> None:
        await self.backends.close()

    async def check_health(self) -> dict[str, bool]:
        healthy = await self.backends.check_health()
        # a shard seen again may take the head
        self.tickets.apply(self.admission.poll(asyncio.get_running_loop().time()))
        if self.limits is not None:  # what /v1/models advertises and the front door enforces
            shapes = [s.shape for s in self.admission.shards.values() if s.shape is not None]
            self.limits.context = served_context(
                self.limits.model_context, self.admission.pipeline_max_prompt.values(),
                [ShardLimits(s.max_context, s.num_pages, s.page_size, s.arena_bytes, s.region_bytes_per_token,
                             s.region_trailer_bytes) for s in shapes])
        return healthy

    async def health_forever(self, interval_s: float) -> None:
        while True:
            await self.check_health()
            await asyncio.sleep(interval_s)

    # ---- generate -------------------------------------------------------

    async def generate(self, request: GenerationRequest, usage: Usage) -> AsyncIterator[int]:
        """Token ids as they are made (see the module doc); ``usage`` is filled as the request goes.

        The request's id is bound throughout: every call it makes carries it and
        every log line about it names it, ending with one ``generate_ended``.
        """
        request.request_id = request.request_id or new_request_id()
        # the caller's task binds it too (HTTP middleware, gRPC handler): a generator's own binding
        # holds only in the task that first iterates it
        with bound_request_id(request.request_id):
            name_request(request.request_id)  # a gRPC entry call's span learns the id it was given
            if self.in_flight >= self.max_in_flight:
                log.info("generate_refused", in_flight=self.in_flight)
                raise ResourceExhausted(
                    f"router: {self.in_flight} requests in flight, the limit is {self.max_in_flight}",
                    retry_after_s=1.0)
            self.in_flight += 1
            self.metrics.in_flight.set(self.in_flight)
            ended = "cancelled"
            try:
                async for token in self._generate(request, usage, request.request_id):
                    yield token
                ended = "done"
            except GeneratorExit:
                ended = "closed"  # the reader stopped: a stop string, or its client went away
                raise
            except KvpoolError as exc:
                ended = type(exc).__name__
                log.info("generate_failed", request_id=request.request_id, error=str(exc))
                # both APIs answer with this: no internal address reaches a client, whoever raised it
                public = public_error(exc)
                if public is exc:
                    raise
                raise public from None
            finally:
                self.in_flight -= 1
                self.metrics.in_flight.set(self.in_flight)
                hinted = request.session_end or request.expected_next_s is not None
                if ended in ("done", "closed") and hinted and usage.pipeline:
                    self._turn_ended(request, usage.pipeline)
                # the client reads the labels; this line maps them to the addresses, by request id
                usage.pipeline_label, usage.shard_label = served_by(
                    list(self.backends.pipelines), list(self.backends.shards), usage.pipeline, usage.shard)
                log.info("generate_ended", request_id=request.request_id, session_key=request.session_key,
                         ended=ended, pipeline=usage.pipeline, shard=usage.shard,
                         pipeline_label=usage.pipeline_label, shard_label=usage.shard_label,
                         prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens,
                         device_tokens=usage.device_tokens, pool_tokens=usage.pool_tokens,
                         ttft_s=round(usage.ttft_seconds, 4), queued_s=round(usage.queued_seconds, 4),
                         queue_order=self.admission.queue.order.value)

    async def _generate(self, request: GenerationRequest, usage: Usage, request_id: str) -> AsyncIterator[int]:
        """The request driver's effects carried out (``kvpool.core.admission.request_driver``): its ticket, one
        Serve call at a time, the driver told of each answer."""
        started = time.perf_counter()
        loop = asyncio.get_running_loop()
        driver = RouterRequest(self.admission, admission_request(request_id, request))
        if self.record.on:
            driver.log = []
        first_at = 0.0
        try:
            ticket = await self._next_ticket(driver, lambda: driver.admit(loop.time()))
            usage.queued_seconds = queued = time.perf_counter() - started
            self.metrics.queue_seconds.observe(queued)
            self.metrics.placements.labels("pipeline", ticket.pipeline, ticket.pipeline_reason.value).inc()
            # an unseeded request draws a fresh seed: two such requests differ; a seeded one is reproducible
            seed = request.seed if request.seed is not None else secrets.randbits(63)
            while True:
                self.metrics.placements.labels("shard", ticket.shard, ticket.locality.value).inc()
                usage.pipeline, usage.shard = ticket.pipeline, ticket.shard
                stream = self._serve(ticket, request, request_id, seed, started)
                try:
                    await self._answer(stream.reserved(), ticket, request_id)
                    self._carry(driver.reserved(loop.time()))
                    prefilled = await self._answer(stream.prefilled(), ticket, request_id)
                    if prefilled is not None:
                        self._count_prefill(prefilled, usage, ticket.shard)
                    else:  # the first token came first: the prefill's answer comes among the tokens
                        stream.on_prefilled = functools.partial(self._count_prefill, usage=usage, shard=ticket.shard)
                    async for token in self._tokens(stream, ticket, request_id):
                        if not first_at:
                            first_at = time.perf_counter()
                            usage.ttft_seconds = first_at - started
                            self.metrics.ttft.observe(usage.ttft_seconds)
                            self._carry(driver.token())  # never prefilled again now
                        yield token
                    usage.finish_reason = stream.finish_reason or usage.finish_reason
                    usage.decode_seconds = time.perf_counter() - (first_at or started)
                    self.metrics.decode.observe(usage.decode_seconds)
                    return
                except NoRoomNow as refused:  # the shard has no room now: the request queues again
                    epoch = refused.room_epoch
                    log.info("decode_room_refused", shard=ticket.shard, room_epoch=epoch)
                    self.metrics.room_refusals.labels(ticket.shard).inc()
                    ticket = await self._next_ticket(driver, lambda: driver.refused(epoch, loop.time()))
                except KvpoolError as error:
                    ticket = await self._recover(driver, error)
                finally:
                    stream.cancel()  # a no-op once it ended; else decode frees the region and pages now
        finally:
            self._carry(driver.end(loop.time()))
            self.tickets.ended(request_id)
            for event, effect in driver.log or ():
                self.record.write("effect", request_id, session_key=request.session_key, event=event,
                                  **effect_fields(effect))
            self.metrics.completion_tokens.inc(usage.completion_tokens)

    def _carry(self, effects: list[RequestEffect]) -> None:
        """Effects that need no waiting: admission's answers for the other requests' waiters."""
        for effect in effects:
            if isinstance(effect, Apply):
                self.tickets.apply(effect.admitted)

    async def _next_ticket(self, driver: RouterRequest, step: Callable[[], list[RequestEffect]]) -> Ticket:
        """The ticket ``step`` (an admission, a refusal) leads to: at once, or after a wait in the queue, whose
        waiter is made first (admission may hand the ticket out within the step)."""
        waiter = self.tickets.expect(driver.request_id)
        try:
            effects = step()
        except BaseException:
            self.tickets.forget(driver.request_id)
            raise
        self._carry(effects)
        serve = next((e for e in effects if isinstance(e, Serve)), None)
        if serve is not None:
            self.tickets.forget(driver.request_id)
            return serve.ticket
        deadline = driver.arrived_at + self.admission.queue_timeout_s
        ticket = await self.tickets.wait(driver.request_id, waiter, deadline)
        driver.ticketed(ticket)
        return ticket

    async def _recover(self, driver: RouterRequest, error: KvpoolError) -> Ticket:
        """Where a request goes after a failed Serve (the driver decides): another pipeline or shard (waiting,
        within ``--health-wait-s``, for its own pipeline to serve again when the core allows), else ``error``."""
        loop = asyncio.get_running_loop()
        effects = driver.failed(error, loop.time())
        while True:
            wait = None
            for effect in effects:
                if isinstance(effect, Moved):
                    if effect.kind == "pipeline":
                        self.metrics.retries.inc()
                        log.warning("prefill_retried_elsewhere" if effect.to != effect.came_from else "prefill_retried",
                                    pipeline=effect.came_from, to=effect.to, error=str(error))
                    else:
                        self.metrics.shard_moves.inc()
                        log.warning("decode_moved_elsewhere", shard=effect.came_from, to=effect.to, error=str(error))
                elif isinstance(effect, Serve):
                    return effect.ticket
                elif isinstance(effect, Failed):
                    raise effect.error
                elif isinstance(effect, WaitForHealth):
                    wait = effect
            if wait is None:
                raise error
            log.info("prefill_retry_waits", error=str(error))
            changed = self.tickets.changed
            with contextlib.suppress(TimeoutError):  # a health round applies what it found, setting ``changed``
                await asyncio.wait_for(changed.wait(), max(0.0, wait.deadline - loop.time()))
            effects = driver.health_round(loop.time(), wait.deadline)
            if not effects:
                effects = [wait]

    def _serve(self, ticket: Ticket, request: GenerationRequest, request_id: str, seed: int,
               started: float) -> ServeStream:
        """The request's one call to its shard, which takes its room, has its pipeline prefill into it and
        decodes."""
        shard = self.backends.shards[ticket.shard]
        left_s = max(1.0, self.request_timeout_s - (time.perf_counter() - started))
        return shard.serve(ticket.pipeline, self.backends.layer_split(ticket.pipeline, ticket.shard),
                           request.prompt_ids, Sampling(request.temperature, request.top_p, request.top_k, seed),
                           request.max_tokens, request.stop_token_ids, request_id, request.session_key,
                           request.tenant, request.cache_salt, left_s, self.request_timeout_s)

    async def _answer(self, call: Awaitable[T], ticket: Ticket, request_id: str) -> T:
        try:
            return await call
        except grpc.aio.AioRpcError as exc:
            raise self._serve_error(exc, ticket, request_id) from None

    async def _tokens(self, stream: ServeStream, ticket: Ticket, request_id: str) -> AsyncIterator[int]:
        try:
            async for token in stream:
                yield token
        except grpc.aio.AioRpcError as exc:
            raise self._serve_error(exc, ticket, request_id) from None

    def _serve_error(self, exc: grpc.aio.AioRpcError, ticket: Ticket, request_id: str) -> KvpoolError:
        """A failed Serve as the client may see it, blaming the pipeline when decode said the prefill failed;
        ``NoRoomNow`` when the shard had no room (the client never sees that: the request queues again)."""
        field = error_field(exc)
        if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and field == ROOM_FIELD:
            return NoRoomNow(exc.details() or "decode_room: none now", room_epoch=room_epoch(exc))
        if exc.code() == grpc.StatusCode.UNAVAILABLE and field == PIPELINE_FIELD:  # keeps its field
            return self._backend_error(exc, PIPELINE, ticket.pipeline, request_id)
        return self._backend_error(exc, SHARD, ticket.shard, request_id)

    def _turn_ended(self, request: GenerationRequest, pipeline: str) -> None:
        """Session-aware prefill, for a turn that carried a hint (a session key comes with each): the
        session's pipeline stages its history for the next turn, ``expected_next_s`` ahead (or, with
        ``session_end``, lets it go), off this request's path; a failure only costs the hint."""
        task = asyncio.ensure_future(self._prefetch(request, pipeline))
        self._prefetches.add(task)
        task.add_done_callback(self._prefetches.discard)

    async def _prefetch(self, request: GenerationRequest, pipeline: str) -> None:
        try:
            await self.backends.pipelines[pipeline].prefetch(request.session_key, request.tenant, request.cache_salt,
                                                             request.session_end, request.expected_next_s,
                                                             CALL_TIMEOUT_S)
            self.metrics.prefetch_calls.labels("session_end" if request.session_end else "stage").inc()
        except grpc.aio.AioRpcError as exc:
            self.metrics.prefetch_calls.labels("failed").inc()
            log.info("prefetch_call_failed", pipeline=pipeline, code=exc.code().name)

    def _count_prefill(self, prefill: Prefilled, usage: Usage, shard: str) -> None:
        usage.device_tokens, usage.pool_tokens = prefill.device_tokens, prefill.pool_tokens
        usage.computed_tokens = prefill.computed_tokens
        usage.handoff_transfers, usage.handoff_bytes = prefill.handoff_transfers, prefill.handoff_bytes
        self.metrics.handoff_bytes.labels(self._link(usage.pipeline, shard)).inc(usage.handoff_bytes)
        for source, count in (("device", usage.device_tokens), ("pool", usage.pool_tokens),
                              ("computed", usage.computed_tokens)):
            self.metrics.prompt_tokens.labels(source).inc(count)

    def _link(self, pipeline: str, shard: str) -> str:
        same = self.admission.pipeline_servers[pipeline] == self.admission.shards[shard].server
        return "same_server" if same else "cross_server"

    def _backend_error(self, exc: grpc.aio.AioRpcError, kind: str, name: str, request_id: str) -> KvpoolError:
        """A backend's failure as the client may see it (``kvpool.core.api.public_errors``): the backend by
        its index, no address anywhere; the whole story goes to this log line, with the request id."""
        names = list(self.backends.pipelines if kind == PIPELINE else self.backends.shards)
        error = from_status(exc, backend_label(kind, names, name), _PASSED_ON)
        log.warning("backend_call_failed", request_id=request_id, backend=f"{kind} {name}",
                    code=exc.code().name, details=exc.details())
        return public_error(error)
