"""The router's generate path: admit, reserve decode room, prefill into it, decode, stream — and free
everything at once whatever happens.

Every decision is the core's (``kvpool.core.admission.admission``): one ``admit`` per
request hands back a ticket (pipeline, decode shard, pages, region bytes, the
pipeline's device blocks) or queues the request, holding nothing, until a
``release`` makes room (the waiting is ``kvpool.services.router.tickets``'s); the
first token gives the device blocks back (``prefill_ended``); one ``release``
ends it. Between them this module makes the calls:

    admit (queue) → Reserve (decode: region + pages) → Prefill(target) (every
          stage streams its layers into the region as its forward passes them,
          decode scatters each part as it lands; the last stage adds the final
          logits) → Generate (decode samples every token, the first included)

Faults (the core decides, ``kvpool.core.admission.retry.retry_move``): a prefill
pipeline that answers UNAVAILABLE is retried once on another healthy pipeline
when nothing reached the client (waiting, within the queue's timeout, for
device room there if it has none now); the region and pages stay the request's. A
decode shard that is down or unreachable before the first token (Reserve or
Generate failed, or prefill could not write to it) moves the request once to
another shard: its room there, a new Reserve and Prefill (the prefix is in the
device cache or the pool by then). Once a token has reached the client, a
failure ends the stream and is never hidden. Cancelling (the
client went away) drops a queued request, cancels the calls in flight, gives
the region and pages back and releases the ticket, at once.
"""

from __future__ import annotations

import asyncio
import math
import secrets
import time
from collections.abc import AsyncIterator

import grpc
import structlog

from kvpool.core.admission.admission import Admission, Ticket
from kvpool.core.errors import InvalidArgument, KvpoolError, ResourceExhausted
from kvpool.core.prefill.queue import QueueOrder
from kvpool.core.api.public_errors import PIPELINE, SHARD, backend_label, public_error, served_by
from kvpool.core.admission.routing import RoutingPolicy
from kvpool.core.api.served_context import ShardLimits, served_context
from kvpool.core.tenancy.tenants import scoped_session_key
from kvpool.core.handoff.target import HandoffTarget
from kvpool.request_id import bound_request_id, new_request_id
from kvpool.status import from_status
from kvpool.services.router.backend_clients import LATE_CHECKS_OUT, Backends, Prefilled, Sampling, server_of
from kvpool.services.router.generation_request import GenerationRequest, ModelLimits
from kvpool.services.router.http_api import Usage
from kvpool.services.router.metrics import RouterMetrics
from kvpool.services.router.tickets import Tickets, admission_request

log = structlog.get_logger(__name__)

# a backend's answer the client must see as such: its own bad input, or no room now (429)
_PASSED_ON = (InvalidArgument, ResourceExhausted)

CALL_TIMEOUT_S = 30.0
# decode frees a cancelled request's room a moment after the router let its ticket go: a Reserve
# that finds the room still taken waits for it this long at most (the ticket says it is coming)
RESERVE_WAIT_S = 5.0
RESERVE_RETRY_S = 0.02
# a request waiting for device room to be retried on another pipeline looks again at least this often
ROOM_RECHECK_S = 0.5


class Router:
    """Admission, the backends' clients and the generate path (see the module doc)."""

    def __init__(self, pipelines: list[str], shards: list[str], metrics: RouterMetrics,
                 affinity_max_queue: int = 4, max_in_flight: int = 256, request_timeout_s: float = 600.0,
                 max_queue: int = 64, queue_timeout_s: float = 30.0, locality: bool = True,
                 servers: dict[str, str] | None = None, limits: ModelLimits | None = None,
                 order: QueueOrder = QueueOrder.FIFO, max_wait_s: float = 4.0,
                 late_checks_out: int = LATE_CHECKS_OUT, health_wait_s: float = 0.0,
                 max_bypass_s: float = math.inf, reorder_below_s: float = math.inf) -> None:
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
            reorder_below_s=reorder_below_s,
        )
        metrics.queue_order.labels(order.value).set(1)
        self.backends = Backends(pipelines, shards, self.admission, metrics, late_checks_out)
        self.tickets = Tickets(self.admission, metrics)
        self._prefetches: set[asyncio.Task[None]] = set()  # fire-and-forget: a turn's end never waits on them

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
        started = time.perf_counter()
        ticket = await self.tickets.admit(request_id, request)
        usage.queued_seconds = queued = time.perf_counter() - started
        self.metrics.queue_seconds.observe(queued)
        self.metrics.placements.labels("pipeline", ticket.pipeline, ticket.pipeline_reason.value).inc()
        first_at = 0.0
        try:
            while True:
                self.metrics.placements.labels("shard", ticket.shard, ticket.locality.value).inc()
                usage.pipeline, usage.shard = ticket.pipeline, ticket.shard
                target: HandoffTarget | None = None
                at_decode = True  # which call failed: the shard's (Reserve, Generate) or prefill's
                try:
                    target = await self._reserve(ticket, request, started)
                    at_decode = False
                    prefill = await self._prefill(ticket, request, target, usage)
                    self._count_prefill(prefill, usage, ticket.shard)
                    at_decode = True
                    async for token in self._decode(ticket, request, target, usage, request_id):
                        if not first_at:
                            first_at = time.perf_counter()
                            usage.ttft_seconds = first_at - started
                            self.metrics.ttft.observe(usage.ttft_seconds)
                            # never prefilled again now: the pipeline's device blocks go to the queue
                            self.tickets.apply(
                                self.admission.prefill_ended(request_id, asyncio.get_running_loop().time()))
                        yield token
                    usage.decode_seconds = time.perf_counter() - (first_at or started)
                    self.metrics.decode.observe(usage.decode_seconds)
                    return
                except KvpoolError as error:
                    current = self.admission.ticket(request_id) or ticket  # prefill may have moved the pipeline
                    moved = None if first_at else self.admission.move_shard(
                        current, admission_request(request_id, request), error, 0, at_decode)
                    if moved is None:
                        raise
                    self.metrics.shard_moves.inc()
                    log.warning("decode_moved_elsewhere", shard=current.shard, to=moved.shard, error=str(error))
                    ticket = moved
                finally:
                    if target is not None and not first_at:
                        # reserved, maybe never claimed by a Generate: region and pages back now (a claimed
                        # one is decode's to free, and this is then a no-op); a dead shard's are gone
                        await self._give_back(usage.shard, target)
        finally:
            self.tickets.release(request_id)
            self.metrics.completion_tokens.inc(usage.completion_tokens)

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

    async def _reserve(self, ticket: Ticket, request: GenerationRequest, started: float) -> HandoffTarget:
        """Decode's region and pages for the ticket; the room is the ticket's, so a refusal only
        means decode has not yet freed a finished request's room."""
        shard = self.backends.shards[ticket.shard]
        hold_s = max(1.0, self.request_timeout_s - (time.perf_counter() - started))
        layer_split = self.backends.layer_split(ticket.pipeline, ticket.shard)
        deadline = time.monotonic() + RESERVE_WAIT_S
        while True:
            try:
                return await shard.reserve(len(request.prompt_ids), request.max_tokens, hold_s, layer_split,
                                           CALL_TIMEOUT_S)
            except grpc.aio.AioRpcError as exc:
                error = self._backend_error(exc, SHARD, ticket.shard, request.request_id)
                if not isinstance(error, ResourceExhausted) or time.monotonic() > deadline:
                    raise error from None
                self.metrics.reserve_waits.inc()
                await asyncio.sleep(RESERVE_RETRY_S)  # decode is freeing a cancelled request's room

    async def _prefill(self, ticket: Ticket, request: GenerationRequest, target: HandoffTarget,
                       usage: Usage) -> Prefilled:
        while True:
            client = self.backends.pipelines[ticket.pipeline]
            try:
                return await client.prefill_into(request.prompt_ids, request.session_key, request.tenant,
                                                 request.cache_salt, target, self.request_timeout_s)
            except grpc.aio.AioRpcError as exc:
                error = self._backend_error(exc, PIPELINE, ticket.pipeline, request.request_id)
            failed_round = self.admission.health_round
            session = scoped_session_key(request.tenant, request.session_key)
            moved = self.admission.retry(ticket, error, 0, session)
            if moved is None and self.admission.retry_may_wait(ticket, error, 0, own_too=True):
                moved = await self._retry_when_room(ticket, error, session, failed_round)
            if moved is None:
                raise error
            self.metrics.retries.inc()
            log.warning("prefill_retried_elsewhere" if moved.pipeline != ticket.pipeline else "prefill_retried",
                        pipeline=ticket.pipeline, to=moved.pipeline, error=str(error))
            ticket = moved
            usage.pipeline = ticket.pipeline

    async def _retry_when_room(self, ticket: Ticket, error: KvpoolError, session: str,
                               failed_round: int) -> Ticket | None:
        """Wait, within the queue's timeout, until another pipeline has device room for a request its
        own pipeline failed (a first token or a release frees blocks), then move it there; or, within
        ``--health-wait-s``, until a health round begun after the failure finds its own serving again."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        deadline, own_until = now + self.admission.queue_timeout_s, now + self.admission.health_wait_s
        log.info("prefill_retry_waits", pipeline=ticket.pipeline, error=str(error))
        while loop.time() < deadline:
            freed = self.tickets.room_freed
            try:
                await asyncio.wait_for(freed.wait(), min(ROOM_RECHECK_S, max(0.0, deadline - loop.time())))
            except TimeoutError:
                pass  # health may have changed meanwhile: ask again
            own = loop.time() < own_until
            moved = self.admission.retry(ticket, error, 0, session, failed_round if own else None)
            if moved is not None or not self.admission.retry_may_wait(ticket, error, 0, own_too=own):
                return moved
        return None

    async def _decode(self, ticket: Ticket, request: GenerationRequest, target: HandoffTarget,
                      usage: Usage, request_id: str) -> AsyncIterator[int]:
        shard = self.backends.shards[ticket.shard]
        # an unseeded request draws a fresh seed: two such requests differ; a seeded one is reproducible
        seed = request.seed if request.seed is not None else secrets.randbits(63)
        call = shard.generate(target.region_id, request.prompt_ids,
                              Sampling(request.temperature, request.top_p, request.top_k, seed), request.max_tokens,
                              request.stop_token_ids, request_id, self.request_timeout_s)
        try:
            async for token in call:
                yield token
            if call.finish_reason:
                usage.finish_reason = call.finish_reason
        except grpc.aio.AioRpcError as exc:
            raise self._backend_error(exc, SHARD, ticket.shard, request_id) from None
        finally:
            call.cancel()  # a no-op once the stream ended; frees the pages when the client went away

    def _backend_error(self, exc: grpc.aio.AioRpcError, kind: str, name: str, request_id: str) -> KvpoolError:
        """A backend's failure as the client may see it (``kvpool.core.api.public_errors``): the backend by
        its index, no address anywhere; the whole story goes to this log line, with the request id."""
        names = list(self.backends.pipelines if kind == PIPELINE else self.backends.shards)
        error = from_status(exc, backend_label(kind, names, name), _PASSED_ON)
        log.warning("backend_call_failed", request_id=request_id, backend=f"{kind} {name}",
                    code=exc.code().name, details=exc.details())
        return public_error(error)

    async def _give_back(self, shard_name: str, target: HandoffTarget) -> None:
        shard = self.backends.shards[shard_name]
        try:
            await shard.release_region(target.region_id, timeout_s=5.0)
        except grpc.aio.AioRpcError as exc:
            log.info("region_release_failed", region_id=target.region_id, code=exc.code().name)  # reclaimed at its hold
