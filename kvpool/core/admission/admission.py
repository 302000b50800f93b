"""Admission: a request gets its decode room before any prefill work, or waits in a bounded queue.

Pure: no grpc, no I/O; time comes in as numbers from the caller's clock. The
router calls ``admit`` once per request and ``release`` once when it ends,
however it ends; both return the queued requests that got a ticket meanwhile.

    admit ─▶ Ticket (pipeline, decode shard, pages, region bytes, blocks)   room now
          └▶ queued (holds nothing) ─▶ Ticket from a later release   room later
                                     └▶ expired at its deadline      ResourceExhausted
          └▶ ResourceExhausted(retry_after_s)                         queue full
          └▶ InvalidArgument(field, limit)                            never fits

Rules:
- A ticket holds its shard's and its pipeline's room for the request
  (``kvpool.core.admission.tickets``, which also refuses a request that can
  never fit and picks the shard by locality): an admitted request is never
  failed for lack of room.
- The queue's order (``kvpool.core.admission.queue``): ``FIFO`` (the
  default) or ``WORK`` (least estimated work first, aging at ``max_wait_s``,
  and with a bypass budget ``max_bypass_s`` nobody overtaking a request whose
  credit it would overdraw). In either order nobody overtakes the head: a new
  request takes a ticket at once only if it would be the head (FIFO: the
  queue is empty; WORK: also when nobody is overdue, it brings less work than
  the head and the budget lets it pass every queued request, whose credits it
  then draws on), and a head that does not fit holds back everyone after
  it. So a big request is never starved by small ones that fit: the work
  order passes it over only until it is overdue (with a budget, also only
  until its credit is spent: then none younger goes first), and then it is
  the head and waits only for room (which ``check`` says can come).
- A pipeline whose device cache has no room for the request now is left out
  (``DEVICE_CACHE_FULL`` when it is the session's own); none with room: queued.
- A part missing (no healthy pipeline, or no healthy shard: one is
  restarting): with ``health_wait_s`` > 0 a request queues as if for room
  and gets ``Admitted.unavailable`` after waiting that long with the part
  still missing; with 0 (or a full queue) it is refused at once.
- Retry (``kvpool.core.admission.retry``), only for an UNAVAILABLE part,
  only before any token reached the client, once per kind of part: another
  pipeline (``retry``, ``retry_may_wait``) or another shard (``move_shard``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvpool.core.admission.queue import AdmissionQueue, admission_work_s
from kvpool.core.admission.retry import Move, retry_move
from kvpool.core.admission.room import AdmissionRequest, Locality, PipelineRoom, ShardRoom, ShardShape, Ticket
from kvpool.core.admission.tickets import TicketBook
from kvpool.core.errors import InvalidArgument, KvpoolError, ResourceExhausted, Unavailable
from kvpool.core.prefill.queue import QueueOrder
from kvpool.core.admission.routing import RoutingPolicy
from kvpool.core.sessions.prefix import matched_prefix
from kvpool.core.prefill.work_scale import bounded_factor

__all__ = ["Admission", "AdmissionRequest", "Admitted", "Locality", "QueueOrder", "ShardShape", "Ticket"]


@dataclass(slots=True)
class Admitted:
    """What a call changed: tickets for queued requests, queued requests that expired waiting for
    room, and queued requests that waited ``health_wait_s`` with a part missing (``unavailable``:
    request id → which part, e.g. "no healthy prefill pipeline")."""

    tickets: list[Ticket] = field(default_factory=list)
    expired: list[str] = field(default_factory=list)
    unavailable: dict[str, str] = field(default_factory=dict)


class Admission:
    """Tickets, the queue and the room they count (see the module doc).

    Invariants: a request id is queued, ticketed or unknown;
    ``len(queue) <= max_queue``; the routing policy's in-flight count of a
    pipeline equals its live tickets; and the ticket book's (``TicketBook``:
    each room's use is the sum over its live tickets, within its shape).
    """

    def __init__(self, routing: RoutingPolicy, shard_servers: dict[str, str], pipeline_servers: dict[str, str],
                 max_queue: int, queue_timeout_s: float, locality: bool = True,
                 order: QueueOrder = QueueOrder.FIFO, max_wait_s: float = 4.0, health_wait_s: float = 0.0,
                 max_bypass_s: float = math.inf, reorder_below_s: float = math.inf) -> None:
        if not health_wait_s >= 0:
            raise InvalidArgument(f"health_wait_s: must be >= 0, got {health_wait_s}")
        if max_queue < 0:
            raise InvalidArgument(f"max_queue: must be >= 0, got {max_queue}")
        if queue_timeout_s <= 0:
            raise InvalidArgument(f"queue_timeout_s: must be positive, got {queue_timeout_s}")
        if set(shard_servers) != set(routing.shards) or set(pipeline_servers) != set(routing.pipelines):
            raise InvalidArgument("servers: every pipeline and shard needs its server, and only those")
        self.routing = routing
        self.book = TicketBook(shard_servers, pipeline_servers, locality)
        self.shards, self.pipelines = self.book.shards, self.book.pipelines  # the book's rooms
        self.pipeline_servers = self.book.pipeline_servers
        self.max_queue = max_queue
        self.queue_timeout_s = queue_timeout_s
        self._queue = AdmissionQueue(order, max_wait_s, max_bypass_s, reorder_below_s)
        self.health_wait_s = health_wait_s
        self._missing_since: float | None = None  # since when no pipeline or no shard has been healthy
        self.health_round = 0  # health rounds begun (``begin_health_round``)
        self._serving_round: dict[str, int] = {}  # pipeline -> the last round that found it healthy

    # ---- what the router sees ------------------------------------------------

    def set_shard_shape(self, shard: str, shape: ShardShape) -> None:
        self._shard(shard).shape = shape

    def set_pipeline_shape(self, pipeline: str, num_blocks: int, block_size: int, work_scale: float = 1.0) -> None:
        """The pipeline's device cache and measured speed (from its StageInfo): until known, it takes no ticket.
        ``work_scale``: its seconds per second of estimated work (``kvpool.core.prefill.work_scale``; 0, an older
        stage that does not say: 1)."""
        if num_blocks <= 0 or block_size <= 0:
            raise InvalidArgument(f"num_blocks, block_size: must be positive, got {num_blocks}, {block_size}")
        if not (work_scale >= 0 and math.isfinite(work_scale)):
            raise InvalidArgument(f"work_scale: must be a number >= 0, got {work_scale}", field="work_scale")
        room = self._pipeline(pipeline)
        room.num_blocks, room.block_size = num_blocks, block_size
        room.work_scale = bounded_factor(work_scale) if work_scale else 1.0

    @property
    def work_scale(self) -> float:
        """The known pipelines' mean measured speed (1 while none is known): the queue's estimates are
        scaled by it, so they and its bypass budget are in the pipelines' seconds."""
        known = [p.work_scale for p in self.pipelines.values() if p.known]
        return sum(known) / len(known) if known else 1.0

    @property
    def pipeline_max_prompt(self) -> dict[str, int]:
        """The longest prompt each known pipeline's device cache holds."""
        return self.book.pipeline_max_prompt

    def begin_health_round(self) -> int:
        """A round of health checks starts: what it finds (``set_health``) is counted as this round's."""
        self.health_round += 1
        return self.health_round

    def set_health(self, name: str, healthy: bool) -> bool:
        if healthy and name in self.pipelines:
            self._serving_round[name] = self.health_round
        if name in self.shards:
            changed = self.shards[name].healthy != healthy
            self.shards[name].healthy = healthy
            self.routing.set_health(name, healthy)
            return changed
        return self.routing.set_health(name, healthy)

    @property
    def num_queued(self) -> int:
        return len(self._queue)

    @property
    def num_admitted(self) -> int:
        return len(self.book)

    def queued_ids(self) -> list[str]:
        """In arrival order (not the order they will leave in)."""
        return self._queue.ids()

    @property
    def queue(self) -> AdmissionQueue:
        return self._queue

    def work_s(self, request: AdmissionRequest) -> float:
        """The queue's estimate of the request's prefill work (``admission_work_s``, in the pipelines'
        measured seconds: ``work_scale``)."""
        matched = matched_prefix(self.routing.session_prefixes(request.session_key), request.token_ids)
        return admission_work_s(request.num_prompt_tokens,
                                matched.num_tokens if matched is not None else 0) * self.work_scale

    # ---- decisions -----------------------------------------------------------

    def check(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """InvalidArgument naming the field and the limit unless the request could ever fit (``TicketBook.check``)."""
        self.book.check(num_prompt_tokens, max_tokens)

    def admit(self, request: AdmissionRequest, now: float) -> Ticket | None:
        """A ticket now, or None (queued; its ticket comes from a later call's ``Admitted``).

        Raises InvalidArgument (never fits), ResourceExhausted (queue full,
        with ``retry_after_s``) or Unavailable (no healthy pipeline or shard).
        """
        if request.request_id in self._queue or request.request_id in self.book:
            raise InvalidArgument(f"request_id: {request.request_id!r} is already admitted or queued",
                                  field="request_id")
        self.check(request.num_prompt_tokens, request.max_tokens)
        missing = self._missing(now)
        if missing is not None and (self.health_wait_s == 0 or len(self._queue) >= self.max_queue):
            raise Unavailable(missing)
        work_s = self.work_s(request)
        if missing is None and self._queue.leads(work_s, now):  # it would be the head: it may go now
            ticket = self._try_ticket(request, 0.0)
            if ticket is not None:
                self._queue.take_at_once(request.request_id, work_s, now)  # the queued it passed pay its work
                return ticket
        if len(self._queue) >= self.max_queue:
            raise ResourceExhausted(f"router: the admission queue is full ({self.max_queue} waiting)",
                                    retry_after_s=self.retry_after_s(now))
        self._queue.push(request, work_s, now, now + self.queue_timeout_s)
        return None

    def release(self, request_id: str, now: float) -> Admitted:
        """End a request wherever it is (ticketed or queued; unknown: nothing), freeing its room,
        then admit queue heads that fit now."""
        self._queue.remove(request_id)
        ticket = self.book.end(request_id)
        if ticket is not None:
            self.routing.finish_pipeline(ticket.pipeline)
        return self.poll(now)

    def prefill_ended(self, request_id: str, now: float) -> Admitted:
        """The request's first token is out, so nothing prefills it again (no move after a token):
        its pipeline's device blocks go back, then queue heads that fit now get tickets."""
        ticket = self.book.ticket(request_id)
        if ticket is not None:
            self.book.end_prefill(ticket)
        return self.poll(now)

    def is_prefilling(self, request_id: str) -> bool:
        return self.book.is_prefilling(request_id)

    def poll(self, now: float) -> Admitted:
        """Expire queued requests past their deadline, or waiting ``health_wait_s`` for a missing part,
        then ticket queue heads while they fit."""
        result = Admitted()
        for request_id in self._queue.expired(now):
            self._queue.remove(request_id)
            result.expired.append(request_id)
        missing = self._missing(now)
        if (missing is not None and self.health_wait_s > 0 and self._missing_since is not None
                and now - self._missing_since >= self.health_wait_s):
            for request_id in self._queue.enqueued_before(now - self.health_wait_s):  # each waited that long
                self._queue.remove(request_id)
                result.unavailable[request_id] = missing
        while (queued := self._queue.head(now)) is not None:
            try:
                ticket = self._try_ticket(queued.request, now - queued.enqueued_at)
            except Unavailable:
                break  # nothing healthy now: the head waits for health or its deadline
            if ticket is None:
                break  # nobody overtakes the head, in either order
            self._queue.pop_head(now)
            result.tickets.append(ticket)
        return result

    def retry(self, ticket: Ticket, error: KvpoolError, num_tokens_sent: int, session_key: str,
              failed_round: int | None = None) -> Ticket | None:
        """Move a failed request to another healthy pipeline with device room for it now, keeping
        its shard and room there; None when it may not retry (``may_retry``) or no other pipeline
        is healthy and has room (nothing changes).

        ``failed_round``: the ``health_round`` when it failed. With no other pipeline, the request
        may then go to its own again once a health round begun after the failure found that one
        serving (a stage restarted behind it, or a passing fault): prefill has no effect a client
        could see, so this is the one retry, not a repeat of anything."""
        if (not self.book.may_move(ticket)
                or retry_move(error, num_tokens_sent, ticket, at_decode=False) is not Move.PIPELINE):
            return None
        num_tokens = ticket.num_prompt_tokens
        full = {p.name for p in self.pipelines.values() if not p.fits(num_tokens)}
        try:
            pipeline, reason = self.routing.place_pipeline(session_key, exclude={ticket.pipeline}, full=full)
        except Unavailable:
            if failed_round is None or self._serving_round.get(ticket.pipeline, 0) <= failed_round:
                return None
            try:  # its own again: the blocks it holds there are its room
                pipeline, reason = self.routing.place_pipeline(
                    session_key, exclude=set(self.pipelines) - {ticket.pipeline})
            except Unavailable:
                return None
        self.routing.finish_pipeline(ticket.pipeline)
        return self.book.move_pipeline(ticket, pipeline, reason)

    def retry_may_wait(self, ticket: Ticket, error: KvpoolError, num_tokens_sent: int,
                       own_too: bool = False) -> bool:
        """``retry`` may move this request once another pipeline has device room: it may retry
        (``retry_move``) and some other healthy pipeline's cache could hold it, only not now. The
        request then waits for room (a first token or a release frees blocks), keeping its shard's.
        ``own_too`` (with ``health_wait_s``): or once its own pipeline is seen serving again."""
        if (not self.book.may_move(ticket)
                or retry_move(error, num_tokens_sent, ticket, at_decode=False) is not Move.PIPELINE):
            return False
        if own_too and self.health_wait_s > 0:
            return True
        return any(t.healthy and t.name != ticket.pipeline
                   and ticket.num_prompt_tokens <= self.pipelines[t.name].max_prompt_tokens
                   for t in self.routing.pipelines.values())

    def move_shard(self, ticket: Ticket, request: AdmissionRequest, error: KvpoolError, num_tokens_sent: int,
                   at_decode: bool) -> Ticket | None:
        """Move a request whose decode shard failed to another healthy shard with room now, taking
        that room and giving the old back; the pipeline stays. None when it may not
        (``retry_move``) or no other shard has room: the request fails with ``error``."""
        if (not self.book.may_move(ticket)
                or retry_move(error, num_tokens_sent, ticket, at_decode) is not Move.SHARD):
            return None
        return self.book.move_shard(ticket, request)

    def retry_after_s(self, now: float) -> float:
        """When a refused caller should try again: when the queue's head times out at the latest."""
        if not self._queue:
            return 1.0
        return max(1.0, math.ceil(self._queue.oldest().deadline - now))

    # ---- internals -----------------------------------------------------------

    def _missing(self, now: float) -> str | None:
        """The part no request can be served without, when none of it is healthy (and since when)."""
        missing = None
        if not any(s.healthy for s in self.shards.values()):
            missing = "no healthy decode shard"
        elif not any(p.healthy for p in self.routing.pipelines.values()):
            missing = "no healthy prefill pipeline"
        if missing is None:
            self._missing_since = None
        elif self._missing_since is None:
            self._missing_since = now
        return missing

    def _try_ticket(self, request: AdmissionRequest, queued_s: float) -> Ticket | None:
        fitting = self.book.fitting(request)
        if not fitting:
            if not any(s.healthy for s in self.shards.values()):
                raise Unavailable("no healthy decode shard")
            return None
        full = {p.name for p in self.pipelines.values() if not p.fits(request.num_prompt_tokens)}
        if all(not t.healthy or t.name in full for t in self.routing.pipelines.values()):
            if not any(t.healthy for t in self.routing.pipelines.values()):
                raise Unavailable("no healthy prefill pipeline")
            return None  # no device cache has room now: stage 0 would only wait for it
        pipeline, reason = self.routing.place_pipeline(request.session_key, full=full,
                                                       token_ids=request.token_ids)
        shard, locality = self.book.pick_shard(fitting, self.pipeline_servers[pipeline])
        ticket = Ticket(request.request_id, pipeline, reason, shard.name, locality, 0, 0, queued_s,
                        num_blocks=self.pipelines[pipeline].blocks_for(request.num_prompt_tokens),
                        num_prompt_tokens=request.num_prompt_tokens)
        return self.book.issue(ticket, shard, request)

    def _pipeline(self, name: str) -> PipelineRoom:
        if name not in self.pipelines:
            raise InvalidArgument(f"pipeline: unknown prefill pipeline {name!r}", field="pipeline")
        return self.pipelines[name]

    def _shard(self, name: str) -> ShardRoom:
        if name not in self.shards:
            raise InvalidArgument(f"shard: unknown decode shard {name!r}", field="shard")
        return self.shards[name]

    def tickets(self) -> list[Ticket]:
        return self.book.tickets()

    def ticket(self, request_id: str) -> Ticket | None:
        return self.book.ticket(request_id)

    def is_queued(self, request_id: str) -> bool:
        return request_id in self._queue
