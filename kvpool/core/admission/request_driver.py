"""A request's life at the router as a sans-I/O state machine over ``Admission``: events in, effects out.

Pure: no grpc, no I/O; time comes in with the events. The router (``services/router/router.py``) carries
the effects out — a ``Serve`` call to the ticket's shard, a wait in the queue, a wait for health rounds —
and feeds back what happened; every decision is here and in ``Admission``:

    admit ─▶ Serve(ticket) ─▶ reserved ─▶ (prefilled, tokens) ─▶ end
          └▶ WaitForTicket ─▶ ticketed ─▶ Serve
    Serve ─▶ refused (the shard has no room) ─▶ WaitForTicket (queued again as if it never left)
          └▶ failed before a token ─▶ Serve(moved) (another pipeline or shard, once each, as
             ``kvpool.core.admission.retry`` says) ─▶ ...
                                     └▶ WaitForHealth ─▶ health_round ─▶ Serve(moved) or Failed
                                     └▶ Failed (the error as it came)
          └▶ failed after a token ─▶ Failed (never hidden, never retried)

Every ``Admitted`` admission answers (tickets for other queued requests, expiries) comes out as an
``Apply`` effect: the router hands those to their waiters. ``end`` releases the ticket, however the request
ended. With ``log`` set to a list, every event's effects are kept there as (event, effect), in order: what
the request record keeps and ``kvpool simulate --validate`` compares (``effect_fields``).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpool.core.admission.admission import Admission, Admitted, AdmissionRequest, Ticket
from kvpool.core.admission.retry import PIPELINE_FIELD
from kvpool.core.errors import FailedPrecondition, KvpoolError


@dataclass(frozen=True, slots=True)
class Serve:
    """Call the ticket's shard: it takes the room, has the pipeline prefill into it, decodes."""

    ticket: Ticket


@dataclass(frozen=True, slots=True)
class WaitForTicket:
    """Wait in the queue (holding nothing) until ``ticketed``, or a refusal the queue answers."""


@dataclass(frozen=True, slots=True)
class WaitForHealth:
    """Wait for health rounds (each ``health_round``) until ``deadline``: the failed pipeline may come back."""

    deadline: float


@dataclass(frozen=True, slots=True)
class Apply:
    """What admission answered meanwhile, for the other requests' waiters."""

    admitted: Admitted


@dataclass(frozen=True, slots=True)
class Moved:
    """The request goes to another ``kind`` ("pipeline" or "shard") before any token: ``to`` (a retry)."""

    kind: str
    came_from: str
    to: str


@dataclass(frozen=True, slots=True)
class Failed:
    """The request ends with ``error`` (as it came)."""

    error: KvpoolError


Effect = Serve | WaitForTicket | WaitForHealth | Apply | Moved | Failed


def effect_fields(effect: Effect) -> dict[str, object]:
    """An effect as plain fields (its kind under "effect"), what a record keeps and a comparison reads: a
    ticket by why it went where it did (its pipeline's reason, its shard's locality, its tries), not by
    the names, which are each deployment's own; admission's answers by how many of each; a failure by its
    kind; times left out."""
    fields: dict[str, object] = {"effect": type(effect).__name__}
    if isinstance(effect, Serve):
        t = effect.ticket
        fields.update(pipeline_reason=t.pipeline_reason.value, locality=t.locality.value, tries=t.tries,
                      shard_tries=t.shard_tries)
    elif isinstance(effect, Apply):
        a = effect.admitted
        fields.update(tickets=len(a.tickets), expired=len(a.expired), unavailable=len(a.unavailable))
    elif isinstance(effect, Moved):
        fields["kind"] = effect.kind
    elif isinstance(effect, Failed):
        fields["error"] = type(effect.error).__name__
    return fields


class RouterRequest:
    """One request at the router (see the module doc). ``request.session_key`` is scoped by tenant."""

    def __init__(self, admission: Admission, request: AdmissionRequest) -> None:
        self.admission = admission
        self.request = request
        self.ticket: Ticket | None = None
        self.first_token = False
        self.ended = False
        self._error: KvpoolError | None = None  # the failure a health wait may still undo
        self._failed_round = 0
        self.arrived_at = 0.0  # (the caller's clock) its queue deadline counts from here, refused or not
        self.log: list[tuple[str, Effect]] | None = None  # set to a list: every event's effects, kept

    @property
    def request_id(self) -> str:
        return self.request.request_id

    def admit(self, now: float) -> list[Effect]:
        """The request arrives: a ticket now or a place in the queue (``Admission.admit`` raises what it
        refuses: never fits, queue full, a part missing)."""
        self.arrived_at = now
        ticket = self.admission.admit(self.request, now)
        if ticket is None:
            return self._out("admit", [WaitForTicket()])
        self.ticket = ticket
        return self._out("admit", [Serve(ticket)])

    def ticketed(self, ticket: Ticket) -> list[Effect]:
        self.ticket = ticket
        return self._out("ticketed", [Serve(ticket)])

    def reserved(self, now: float) -> list[Effect]:
        """The ticket's shard holds the room."""
        return self._out("reserved", [Apply(self.admission.confirmed(self.request_id, now))])

    def token(self) -> list[Effect]:
        """A token reached the client: nothing moves the request now."""
        if not self.first_token:
            self.first_token = True
            self.admission.prefill_ended(self.request_id)
        return self._out("token", [])

    def refused(self, epoch: int | None, now: float) -> list[Effect]:
        """The shard had no room (``epoch``: its give-back count then): queued again as if it never left."""
        self.ticket = None
        return self._out("refused", [Apply(self.admission.refused(self.request, epoch, now)), WaitForTicket()])

    def failed(self, error: KvpoolError, now: float) -> list[Effect]:
        """The Serve call failed: another pipeline or shard when the core allows it, else the end."""
        return self._out("failed", self._failed(error, now))

    def _failed(self, error: KvpoolError, now: float) -> list[Effect]:
        current = self.admission.ticket(self.request_id) or self.ticket
        if current is None:
            raise FailedPrecondition(f"request {self.request_id}: failed without a ticket")
        tokens = 1 if self.first_token else 0
        if error.field == PIPELINE_FIELD:
            self._failed_round = self.admission.health_round
            moved = self.admission.retry(current, error, tokens, self.request.session_key)
            if moved is not None:
                return self._moved("pipeline", current.pipeline, moved)
            if self.admission.retry_may_wait(current, error, tokens):
                self._error = error
                return [WaitForHealth(now + self.admission.health_wait_s)]
            return [Failed(error)]
        moved = self.admission.move_shard(current, self.request, error, tokens, at_decode=True)
        if moved is not None:
            return self._moved("shard", current.shard, moved)
        return [Failed(error)]

    def health_round(self, now: float, deadline: float) -> list[Effect]:
        """While waiting for health: a round ended (or the wait's ``deadline`` came)."""
        return self._out("health_round", self._health_round(now, deadline))

    def _health_round(self, now: float, deadline: float) -> list[Effect]:
        error, current = self._error, self.admission.ticket(self.request_id) or self.ticket
        if error is None or current is None:
            return []
        moved = self.admission.retry(current, error, 0, self.request.session_key, self._failed_round)
        if moved is not None:
            self._error = None
            return self._moved("pipeline", current.pipeline, moved)
        if now >= deadline or not self.admission.retry_may_wait(current, error, 0):
            self._error = None
            return [Failed(error)]
        return []

    def end(self, now: float) -> list[Effect]:
        """The request ended, however: its ticket (or place in the queue) goes back."""
        if self.ended:
            return []
        self.ended = True
        return self._out("end", [Apply(self.admission.release(self.request_id, now))])

    def _out(self, event: str, effects: list[Effect]) -> list[Effect]:
        if self.log is not None:
            self.log.extend((event, effect) for effect in effects)
        return effects

    def _moved(self, kind: str, came_from: str, moved: Ticket) -> list[Effect]:
        self.ticket = moved
        return [Moved(kind, came_from, moved.pipeline if kind == "pipeline" else moved.shard), Serve(moved)]
