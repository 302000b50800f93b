"""Admission: a request gets its place — a pipeline and a decode shard that takes it — before any prefill
work, or waits in a bounded queue.

Pure: no grpc, no I/O; time comes in as numbers from the caller's clock. The
router calls ``admit`` once per request and ``release`` once when it ends,
however it ends; these and the owners' answers (``confirmed``, ``refused``,
``room_again``) return the queued requests that got a ticket meanwhile.

    admit ─▶ Ticket (pipeline, decode shard)   a shard takes tickets now
          └▶ queued (holds nothing) ─▶ Ticket from a later call   room later
                                     └▶ expired at its deadline   ResourceExhausted
          └▶ ResourceExhausted(retry_after_s)                      queue full
          └▶ InvalidArgument(field, limit)                         never fits
    Ticket ─▶ Serve: the shard holds its room (``confirmed``) ─▶ prefill, tokens
           └▶ the shard has none now (``refused``) ─▶ queued again, in its place

Rules:
- One owner per resource: a shard counts its pages and receive arena, stage
  0 its device blocks. Admission counts neither: it knows their fixed shapes
  (``check``: a request that can never fit is refused, naming the field and
  the limit) and what a shard said it has no room for. A shard that refused a
  request (``refused``) takes no ticket for one needing as much (pages and
  region bytes) until it says room came back (``room_again``; or, for a shard
  that cannot say so, until one of this router's own tickets there ends or a
  health round finds it serving); from its refusal it takes one ticket at a
  time until one is confirmed with nobody queued (``ShardState.probing``), so
  freed room does not draw the whole queue at it. A refused request is queued
  again as if it had never left (its place, deadline and bypass credit): a
  request is never failed for lack of room, only after the queue's timeout,
  as one that never got a ticket. Queued requests leave one at a time, each
  once the shard of the one before answered, so nobody overtakes a head by
  its refusal. Stage 0 waits for its own device blocks.
- The queue's order (``kvpool.core.admission.queue``): between tenants
  fair by weight (start-time fair queuing over estimated work, unless
  ``fair`` is off); within a tenant ``FIFO`` (the default) or ``WORK``
  (least estimated work first, aging at ``max_wait_s``, and with a bypass
  budget ``max_bypass_s`` nobody overtaking a request whose credit it would
  overdraw). In either order nobody overtakes the head: a new request takes
  a ticket at once only if it would be the head (its tenant's turn, and in
  its tenant's queue, FIFO: that queue is empty; WORK: also when nobody
  there is overdue, it brings less work than its head and the budget lets
  it pass every request queued there, whose credits it then draws on), and
  a head no shard takes holds back everyone after it. So
  a big request is never starved by small ones that fit: the work order
  passes it over only until it is overdue (with a budget, also only until its
  credit is spent: then none younger goes first), and then it is the head.
- A pipeline whose device cache could never hold the prompt is left out
  (``DEVICE_CACHE_FULL`` when it is the session's own).
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
from kvpool.core.admission.room import AdmissionRequest, Locality, PipelineState, ShardShape, ShardState, Ticket
from kvpool.core.admission.tickets import TicketBook
from kvpool.core.errors import InvalidArgument, KvpoolError, ResourceExhausted, Unavailable
from kvpool.core.prefill.queue import QueueOrder
from kvpool.core.admission.routing import RoutingPolicy
from kvpool.core.sessions.prefix import matched_prefix
from kvpool.core.prefill.work_scale import bounded_factor
from kvpool.core.tenancy.shares import TenantShares

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
    """Tickets, the queue and what the owners said of their room (see the module doc).

    Invariants: a request id is queued, ticketed or unknown; ``len(queue) <= max_queue`` but for
    requests queued again after a shard refused them; the routing policy's in-flight count of a
    pipeline equals its live tickets; and the ticket book's (``TicketBook``).
    """

    def __init__(self, routing: RoutingPolicy, shard_servers: dict[str, str], pipeline_servers: dict[str, str],
                 max_queue: int, queue_timeout_s: float, locality: bool = True,
                 order: QueueOrder = QueueOrder.FIFO, max_wait_s: float = 4.0, health_wait_s: float = 0.0,
                 max_bypass_s: float = math.inf, reorder_below_s: float = math.inf,
                 shares: TenantShares | None = None, fair: bool = True) -> None:
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
        self._queue = AdmissionQueue(order, max_wait_s, max_bypass_s, reorder_below_s, shares, fair)
        self.health_wait_s = health_wait_s
        self._leaving: set[str] = set()  # ticketed from the queue, the shard's answer not in yet
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
        state = self._pipeline(pipeline)
        state.max_prompt_tokens = num_blocks * block_size
        state.work_scale = bounded_factor(work_scale) if work_scale else 1.0

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
            shard = self.shards[name]
            changed = shard.healthy != healthy
            shard.healthy = healthy
            if healthy and shard.full and not shard.watched:
                self._room_again(shard)  # it cannot tell room came back: ask again each health round
            self.routing.set_health(name, healthy)
            return changed
        return self.routing.set_health(name, healthy)

    def set_watched(self, shard: str, watched: bool, epoch: int = -1) -> None:
        """Whether the shard tells this router when room comes back (its WatchRoom stream is open; ``epoch``:
        the give-back count its new stream started at, which replaces the last: a restarted shard counts
        from 0)."""
        state = self._shard(shard)
        state.watched, state.epoch = watched, epoch
        if not watched and state.full:
            self._room_again(state)  # what it said may be lost with the stream: ask it again

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
        if missing is None and not self._leaving and self._queue.leads(work_s, now, request.tenant):  # the head
            ticket = self._try_ticket(request, 0.0, now)
            if ticket is not None:
                # the queued it passed pay its work
                self._queue.take_at_once(request, work_s, now, now + self.queue_timeout_s)
                return ticket
        if len(self._queue) >= self.max_queue:
            raise ResourceExhausted(f"router: the admission queue is full ({self.max_queue} waiting)",
                                    retry_after_s=self.retry_after_s(now))
        self._queue.push(request, work_s, now, now + self.queue_timeout_s)
        return None

    def release(self, request_id: str, now: float) -> Admitted:
        """End a request wherever it is (ticketed or queued; unknown: nothing), then admit queue heads
        that a shard takes now."""
        self._queue.remove(request_id)
        self._queue.settle(request_id)
        self._leaving.discard(request_id)
        ticket = self.book.end(request_id)
        if ticket is not None:
            self.routing.finish_pipeline(ticket.pipeline)
            shard = self.shards[ticket.shard]
            if shard.full and not shard.watched:
                self._room_again(shard)  # its own give-back: the one this router can see
        return self.poll(now)

    def prefill_ended(self, request_id: str) -> None:
        """The request's first token is out: nothing prefills it again (no move after a token)."""
        self.book.end_prefill(request_id)

    def confirmed(self, request_id: str, now: float) -> Admitted:
        """The request's shard holds its room: a probing shard takes the next ticket (and, with nobody
        queued, tickets as before it was full)."""
        self._leaving.discard(request_id)
        self._queue.settle(request_id)
        shard = self.book.confirm(request_id)
        if shard is not None and shard.probing and not self._queue:
            shard.probing = False
        return self.poll(now)

    def refused(self, request: AdmissionRequest, epoch: int | None, now: float) -> Admitted:
        """The request's shard had no room for it (``epoch``: its give-back count then; None: it did not
        say): the shard takes no ticket for as much until it says room came back — unless it already
        has, since — and the request is queued again as if it had never left: its place, its deadline
        (past it: it expires now, as any queued request at its deadline) and its bypass credit."""
        self._leaving.discard(request.request_id)
        ticket = self.book.end(request.request_id)
        if ticket is None:
            return Admitted()
        self.routing.finish_pipeline(ticket.pipeline)
        shard = self.shards[ticket.shard]
        if epoch is None or epoch >= shard.epoch:
            shard.refuse(request)
        if not self._queue.undo(request.request_id):  # its pop was settled (a shard moved it): queue it anew
            self._queue.push(request, self.work_s(request), ticket.arrived_at,
                             ticket.arrived_at + self.queue_timeout_s)
        return self.poll(now)

    def room_again(self, shard: str, epoch: int, now: float) -> Admitted:
        """The shard says room was given back (``epoch``: its give-back count now)."""
        state = self._shard(shard)
        state.epoch = max(state.epoch, epoch)
        if state.full:
            self._room_again(state)
        return self.poll(now)

    def _room_again(self, shard: ShardState) -> None:
        shard.refused.clear()  # probing stays: one ticket at a time until one is confirmed

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
        # one at a time while a shard's answer is awaited: a head it refuses goes back in front of the rest
        while not self._leaving and (queued := self._queue.head(now)) is not None:
            try:
                ticket = self._try_ticket(queued.request, now - queued.enqueued_at, queued.enqueued_at)
            except Unavailable:
                break  # nothing healthy now: the head waits for health or its deadline
            if ticket is None:
                break  # nobody overtakes the head, in either order
            self._queue.pop_head(now)
            if self.shards[ticket.shard].watched:  # (an older shard answers only after the prefill)
                self._leaving.add(ticket.request_id)
            result.tickets.append(ticket)
        return result

    def retry(self, ticket: Ticket, error: KvpoolError, num_tokens_sent: int, session_key: str,
              failed_round: int | None = None) -> Ticket | None:
        """Move a failed request to another healthy pipeline whose device cache could hold it, keeping its
        shard; None when it may not retry (``may_retry``) or there is no such pipeline (nothing changes).

        ``failed_round``: the ``health_round`` when it failed. With no other pipeline, the request
        may then go to its own again once a health round begun after the failure found that one
        serving (a stage restarted behind it, or a passing fault): prefill has no effect a client
        could see, so this is the one retry, not a repeat of anything."""
        if (not self.book.may_move(ticket)
                or retry_move(error, num_tokens_sent, ticket, at_decode=False) is not Move.PIPELINE):
            return None
        try:
            pipeline, reason = self.routing.place_pipeline(session_key, exclude={ticket.pipeline},
                                                           full=self._left_out(ticket.num_prompt_tokens))
        except Unavailable:
            if failed_round is None or self._serving_round.get(ticket.pipeline, 0) <= failed_round:
                return None
            try:  # its own again
                pipeline, reason = self.routing.place_pipeline(
                    session_key, exclude=set(self.pipelines) - {ticket.pipeline})
            except Unavailable:
                return None
        self.routing.finish_pipeline(ticket.pipeline)
        return self.book.move_pipeline(ticket, pipeline, reason)

    def retry_may_wait(self, ticket: Ticket, error: KvpoolError, num_tokens_sent: int) -> bool:
        """``retry`` may move this request once its own pipeline is seen serving again (``health_wait_s``):
        it may retry (``retry_move``) and the router waits for health rounds that long."""
        return (self.health_wait_s > 0 and self.book.may_move(ticket)
                and retry_move(error, num_tokens_sent, ticket, at_decode=False) is Move.PIPELINE)

    def move_shard(self, ticket: Ticket, request: AdmissionRequest, error: KvpoolError, num_tokens_sent: int,
                   at_decode: bool) -> Ticket | None:
        """Move a request whose decode shard failed to another shard that takes it now; the pipeline stays.
        None when it may not (``retry_move``) or no other shard takes it: the request fails with ``error``."""
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

    def _try_ticket(self, request: AdmissionRequest, queued_s: float, arrived_at: float) -> Ticket | None:
        taking = self.book.taking(request)
        if not taking:
            if not any(s.healthy for s in self.shards.values()):
                raise Unavailable("no healthy decode shard")
            return None  # every shard that could hold it said it has no room: wait until one says it has
        left_out = self._left_out(request.num_prompt_tokens)
        if all(not t.healthy or t.name in left_out for t in self.routing.pipelines.values()):
            if not any(t.healthy for t in self.routing.pipelines.values()):
                raise Unavailable("no healthy prefill pipeline")
            return None  # none known yet (its StageInfo has not answered)
        pipeline, reason = self.routing.place_pipeline(request.session_key, full=left_out,
                                                       token_ids=request.token_ids)
        shard, locality = self.book.pick_shard(taking, self.pipeline_servers[pipeline])
        return self.book.issue(Ticket(request.request_id, pipeline, reason, shard.name, locality, queued_s,
                                      arrived_at, num_prompt_tokens=request.num_prompt_tokens), shard)

    def _left_out(self, num_prompt_tokens: int) -> set[str]:
        """The pipelines a prompt may not go to: not known yet (no StageInfo: its stages and device cache
        are unknown), or whose device cache could never hold it."""
        return {p.name for p in self.pipelines.values() if not p.known or num_prompt_tokens > p.max_prompt_tokens}

    def _pipeline(self, name: str) -> PipelineState:
        if name not in self.pipelines:
            raise InvalidArgument(f"pipeline: unknown prefill pipeline {name!r}", field="pipeline")
        return self.pipelines[name]

    def _shard(self, name: str) -> ShardState:
        if name not in self.shards:
            raise InvalidArgument(f"shard: unknown decode shard {name!r}", field="shard")
        return self.shards[name]

    def tickets(self) -> list[Ticket]:
        return self.book.tickets()

    def ticket(self, request_id: str) -> Ticket | None:
        return self.book.ticket(request_id)

    def is_queued(self, request_id: str) -> bool:
        return request_id in self._queue
