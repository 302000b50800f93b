"""The router in simulated time: the core's request driver (``RouterRequest``) over ``Admission``, each ticket
answered by its decode shard's own ledger (``ShardRoom``), as the router and the shards do.

A turn arrives: its driver admits it (a ticket now, or a place in the queue holding nothing). A ticket is a
``Serve``: the ticket's shard holds the turn's pages for its whole life, or refuses at once; held, the turn
goes to the ticket's pipeline (``on_served``); refused, it queues again in its place and the shard takes no
ticket for as much until a give-back rings (``room_again``, as its WatchRoom stream says). The first token
makes the turn unmovable (``first_token``); its end releases the ticket and the room (``ended``). A turn
refused at the door or past the queue's timeout leaves unserved (``on_unserved``). No decision is made
here; the simulator fails no pipeline or shard, so no retry is played.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from kvpool.core.admission.admission import Admission, Admitted, AdmissionRequest
from kvpool.core.admission.request_driver import Apply, Effect, RouterRequest, Serve, WaitForTicket, effect_fields
from kvpool.core.decode.shard_room import ShardRoom
from kvpool.core.errors import KvpoolError, ResourceExhausted
from kvpool.tools.sim.events import EventLoop
from kvpool.tools.sim.job import SIM_TENANT, Job


@dataclass(slots=True)
class RouterSim:
    """The router's drivers of the turns in flight; ``rooms``: each shard's ledger, by name."""

    loop: EventLoop
    admission: Admission
    rooms: dict[str, ShardRoom]
    on_served: Callable[[Job], None]
    on_unserved: Callable[[Job, KvpoolError], None]
    jobs: dict[str, Job] = field(default_factory=dict)  # turns with a driver, not yet ended
    effects: dict[str, list[dict[str, object]]] | None = None  # the validation: each turn's driver effects

    def arrive(self, job: Job, session_key: str) -> None:
        request = AdmissionRequest(job.job_id, session_key, job.turn.input_tokens, max(1, job.turn.output_tokens),
                                   tenant=SIM_TENANT)
        driver = job.router = RouterRequest(self.admission, request)
        if self.effects is not None:
            driver.log = []
        self.jobs[job.job_id] = job
        try:
            effects = driver.admit(self.loop.now)
        except KvpoolError as error:  # never fits (InvalidArgument), the queue is full (ResourceExhausted)
            self._unserved(job, error)
            return
        self._carry(job, effects)

    def _carry(self, job: Job, effects: list[Effect]) -> None:
        for effect in effects:
            if isinstance(effect, Serve):
                self._serve(job, effect)
            elif isinstance(effect, Apply):
                self._apply(effect.admitted)
            elif isinstance(effect, WaitForTicket):  # its deadline counts from its arrival, refused or not
                assert job.router is not None
                self.loop.at(job.router.arrived_at + self.admission.queue_timeout_s, self._poll)

    def _serve(self, job: Job, serve: Serve) -> None:
        """The ticket's shard holds the turn's room, or has none now (the turn queues again)."""
        assert job.router is not None
        ticket = serve.ticket
        epoch = self.rooms[ticket.shard].reserve(job.job_id, job.turn.input_tokens, max(1, job.turn.output_tokens))
        if epoch is not None:
            self._carry(job, job.router.refused(epoch, self.loop.now))
            return
        job.ticket = ticket
        effects = job.router.reserved(self.loop.now)
        self.on_served(job)  # the shard calls the pipeline at once; the tickets admission gave others follow
        self._carry(job, effects)

    def _apply(self, admitted: Admitted) -> None:
        """Admission's answers for the other turns: tickets to serve, expiries to end."""
        for request_id in [*admitted.expired, *admitted.unavailable]:
            expired = ResourceExhausted("router: no decode room within the queue's timeout")
            self._unserved(self.jobs[request_id], expired)
        for ticket in admitted.tickets:
            job = self.jobs[ticket.request_id]
            assert job.router is not None
            self._carry(job, job.router.ticketed(ticket))

    def _poll(self) -> None:
        self._apply(self.admission.poll(self.loop.now))

    def first_token(self, job: Job) -> None:
        assert job.router is not None
        self._carry(job, job.router.token())

    def ended(self, job: Job) -> None:
        """The turn's last token: its ticket goes back, then its shard's room (which may ring)."""
        assert job.router is not None and job.ticket is not None
        shard = job.ticket.shard
        self._end(job)
        room = self.rooms[shard]
        if room.end(job.job_id):
            self._apply(self.admission.room_again(shard, room.epoch, self.loop.now))

    def _unserved(self, job: Job, error: KvpoolError) -> None:
        self._end(job)
        self.on_unserved(job, error)

    def _end(self, job: Job) -> None:
        assert job.router is not None
        self.jobs.pop(job.job_id, None)
        self._carry(job, job.router.end(self.loop.now))
        if self.effects is not None and job.router.log is not None:
            self.effects[job.job_id] = [{"event": event, **effect_fields(e)} for event, e in job.router.log]
