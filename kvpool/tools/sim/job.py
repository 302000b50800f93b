"""One turn in flight through the simulated cluster (its own module: the pipeline, the shards and the metrics
all read it, and none of them imports another for it)."""

from __future__ import annotations

from dataclasses import dataclass

from kvpool.core.admission.request_driver import RouterRequest
from kvpool.core.admission.room import Ticket
from kvpool.core.pool.records import LookupResult
from kvpool.core.prefill.driver import PrefillDriver
from kvpool.core.prefill.request import PrefillRequest
from kvpool.core.sessions.table import SessionId
from kvpool.tools.sim.workload import SessionPlay
from kvpool.workload.weka import Turn


@dataclass(slots=True)
class Job:
    """One turn in flight, from arrival at the router to the end of decode.

    ``turn`` is the turn as played: cut to the model's context when the trace's prompt was longer
    (``kvpool.tools.sim.workload.fit_to_context``).
    """

    job_id: str
    play: SessionPlay
    turn: Turn
    arrival: float
    router: RouterRequest | None = None  # the router's driver of the turn (kvpool.core.admission.request_driver)
    ticket: Ticket | None = None  # its pipeline and decode shard, once the shard holds its room
    placed_as: str = ""  # where its server is for the session's history (``workload.placed_on``)
    request: PrefillRequest | None = None  # the driver's, once admitted
    driver: PrefillDriver | None = None  # stage 0's driver of its prefill (kvpool.core.prefill.driver)
    lookup: LookupResult | None = None  # the master's answer to its lookup
    prefill_start: float = 0.0
    restore_start: float = 0.0
    restored_at: float = 0.0  # its restore (every part) ended
    handed_off_at: float = 0.0  # the handoff's end (its KV on the decode shard)
    first_token_at: float = 0.0  # the end of its first decode step
    compute_s: float = 0.0
    handoff_parts: int = 0  # the handoff's parts still in flight (its fixed cost; the NICs' bytes)
    # its restore in flight (the pipeline's, per request: under validation stage 0 may hold several)
    lease: int = 0
    readable: int = 0  # leading planned pool chunks whose every object lives on a store still alive
    restore_timed: bool = False  # a restore was timed (a lookup that planned pool chunks)
    chain_restore: bool = False  # its forward restores on the chain (the forward's end confirms the counts)


SIM_TENANT = "sim"


def session_of(job: Job) -> SessionId:
    """The turn's session, scoped by the simulator's one tenant."""
    return SessionId(SIM_TENANT, job.play.key)
