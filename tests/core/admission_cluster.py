"""Admission with its owners, for the core's tests: each decode shard's own room counted by the core the shard
runs (its page scheduler, region table and give-back count), answering every ticket as the shard's Serve
answers it — it holds the room (``Admission.confirmed``) or has none now (``Admission.refused``) — and
ringing, as its WatchRoom stream does, when a give-back follows a refusal (``Admission.room_again``).
"""

from __future__ import annotations

from kvpool.core.admission.admission import Admission, Admitted, AdmissionRequest, ShardShape, Ticket
from kvpool.core.decode.pages import pages_for_request
from kvpool.core.decode.scheduler import DecodeScheduler
from kvpool.core.decode.shard_room import ShardRoom


class ShardOwner(ShardRoom):
    """One decode shard's room, as the shard counts it: the core's ``ShardRoom`` over the shape's pages and
    arena, named for these tests (``serve`` answers a ticket; ``region_of`` the requests holding a region)."""

    def __init__(self, shape: ShardShape) -> None:
        super().__init__(DecodeScheduler(shape.num_pages, shape.page_size, 64, shape.max_context, lambda: 0.0),
                         shape)

    def serve(self, request: AdmissionRequest) -> int | None:
        """Reserve the request's region and pages (None), or refuse it: the epoch the refusal names."""
        return self.reserve(request.request_id, request.num_prompt_tokens, request.max_tokens)

    @property
    def region_of(self) -> dict[str, int]:
        return self._region_of


class Cluster:
    """Admission and one owner per shard; every ticket admission hands out is served at once."""

    def __init__(self, admission: Admission, shapes: dict[str, ShardShape], watched: bool = True) -> None:
        self.a = admission
        self.owners = {name: ShardOwner(shape) for name, shape in shapes.items()}
        self.requests: dict[str, AdmissionRequest] = {}
        self.refusals: list[tuple[str, str]] = []  # (request id, shard)
        self.log: list[Ticket] = []  # every ticket a shard confirmed, in order
        for name, shape in shapes.items():
            admission.set_shard_shape(name, shape)
            if watched:
                admission.set_watched(name, True, 0)

    def __getattr__(self, name: str) -> object:
        return getattr(self.a, name)  # the rest of admission, as it is

    def admit(self, request: AdmissionRequest, now: float) -> Ticket | None:
        """The request's ticket once its shard holds its room; None: it waits in the queue (also when a shard
        refused the ticket admission gave it)."""
        self.requests[request.request_id] = request
        ticket = self.a.admit(request, now)
        if ticket is None:
            return None
        served = self.answer(Admitted(tickets=[ticket]), now)
        return next((t for t in served.tickets if t.request_id == request.request_id), None)

    def release(self, request_id: str, now: float) -> Admitted:
        """The request ended: the router releases its ticket and the shard its room (ringing, if it refused
        someone since)."""
        ticket = self.a.ticket(request_id)
        admitted = self.a.release(request_id, now)
        if ticket is not None and self.owners[ticket.shard].end(request_id):
            merge(admitted, self.a.room_again(ticket.shard, self.owners[ticket.shard].room.epoch, now))
        return self.answer(admitted, now)

    def poll(self, now: float) -> Admitted:
        return self.answer(self.a.poll(now), now)

    def answer(self, admitted: Admitted, now: float) -> Admitted:
        """Serve every ticket in ``admitted`` at its shard until none is left unanswered: the tickets the
        shards hold, and every expired or unavailable request on the way."""
        done = Admitted(expired=list(admitted.expired), unavailable=dict(admitted.unavailable))
        pending = list(admitted.tickets)
        while pending:
            ticket = pending.pop(0)
            if self.a.ticket(ticket.request_id) != ticket:
                continue  # released or moved meanwhile
            request = self.requests[ticket.request_id]
            epoch = self.owners[ticket.shard].serve(request)
            if epoch is None:
                done.tickets.append(ticket)
                self.log.append(ticket)
                more = self.a.confirmed(ticket.request_id, now)
            else:
                self.refusals.append((ticket.request_id, ticket.shard))
                more = self.a.refused(request, epoch, now)
            done.expired += more.expired
            done.unavailable.update(more.unavailable)
            pending += more.tickets
        return done


def merge(into: Admitted, more: Admitted) -> None:
    into.tickets += more.tickets
    into.expired += more.expired
    into.unavailable.update(more.unavailable)


def owner_fits(owner: ShardOwner, request: AdmissionRequest) -> bool:
    """Whether the shard has the room for ``request`` now (without taking it)."""
    shape = owner.shape
    pages = pages_for_request(request.num_prompt_tokens, request.max_tokens, shape.page_size)
    assert owner.regions is not None
    allocator = owner.regions._allocator  # what the shard's region table allocates from
    return (pages <= owner.scheduler.pages.num_free
            and allocator.rounded_size(shape.region_bytes(request.num_prompt_tokens)) <= allocator.largest_free)
