"""One session staging's restore as a sans-I/O state machine: events in, effects out.

Pure: no I/O, no clock of its own. Whether to stage, into which blocks, and whether to hold the staged
blocks for the session's turn is the policy's (``SessionPrefetch``); what to read is the request's
(``PrefillRequest.plan_lookup`` / ``apply_restore``). This machine orders them as a prefill's restore
path does, so stage 0's ``SessionPrefetcher`` (services/prefill/stage0/prefetch.py) and the simulator
(kvpool/tools/sim/session_sim.py) each only carry its effects out and feed the answers in:

    start ─▶ Staged(outcome)                      (nothing to stage: the policy's reason)
          ─▶ Lookup ─▶ looked_up ─▶ RestoreOnStages ─▶ read ─▶ ReleaseLease, [Freed], Staged
                                 └▶ (no pool chunk)            ReleaseLease, [Freed], Staged
    failed (any time after start): [ReleaseLease], Freed, Staged("failed")

Invariant: once ``Staged`` came, the staging's holder holds blocks only when ``Staged.held`` (the policy
holds them for the session's turn, ``SessionPrefetch.unpin_all`` takes them back); a lease it got is
released exactly once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvpool.core.prefill.driver import Freed, Lookup, ReleaseLease, RestoreOnStages
from kvpool.core.prefill.request import PrefillRequest
from kvpool.core.sessions.prefetch import SessionPrefetch
from kvpool.core.sessions.table import SessionId

FAILED = "failed"


@dataclass(frozen=True, slots=True)
class Staged:
    """The staging ended with ``outcome`` (a ``kvpool_prefetch_hints`` outcome); ``held``: its blocks are held
    for the session's turn; ``prefetched_bytes``: what it added to the ledger."""

    outcome: str
    held: bool = False
    prefetched_bytes: int = 0


StagingEffect = Lookup | RestoreOnStages | ReleaseLease | Freed | Staged


class Staging:
    """One armed staging of ``session`` (``ticket``: the policy's arming) on ``policy``'s block table."""

    def __init__(self, policy: SessionPrefetch, session: SessionId, ticket: int) -> None:
        self.policy = policy
        self.session = session
        self.ticket = ticket
        self.request: PrefillRequest | None = None
        self.lease_id = ""
        self.ended = False
        self.outcome = ""  # once ended: the ``Staged`` outcome

    def start(self, now: float, has_pool: bool = True) -> list[StagingEffect]:
        """The armed time came: look the staging's chunks up from chunk 0, or end (the policy's outcome)."""
        request = self.policy.begin(self.session, self.ticket, now, has_pool)
        if isinstance(request, str):
            return self._end(request)
        self.request = request
        if not has_pool or not request.lookup_candidates:
            request.plan(0)
            return self._applied([], 0.0)
        return [Lookup(tuple(request.lookup_candidates), request.num_device_chunks)]

    def looked_up(self, num_complete: int, lease_id: str) -> list[StagingEffect]:
        """The master found ``num_complete`` leading complete groups (a lease when ``lease_id``)."""
        assert self.request is not None and not self.ended
        self.lease_id = lease_id
        if self.request.plan_lookup(num_complete).num_pool_chunks:
            return [RestoreOnStages()]
        return self.read([], 0.0)

    def read(self, restored_per_stage: Sequence[int], read_s: float,
             corrupt_chunk_indexes: Sequence[int] = ()) -> list[StagingEffect]:
        """Every stage's read ended (the leading chunks each read, in ``read_s``): the lease goes back, the
        restore is applied, the policy holds the blocks or they go back."""
        assert self.request is not None and not self.ended
        return self._release(corrupt_chunk_indexes) + self._applied(restored_per_stage, read_s)

    def failed(self) -> list[StagingEffect]:
        """A lookup or a read failed (a staging is best effort: a miss later, never an error)."""
        if self.ended:
            return []
        effects = self._release()
        if self.request is not None:
            self.policy.blocks.free(self.request.request_id)
            effects.append(Freed((self.request.request_id,)))
        return effects + self._end(FAILED)

    def _applied(self, restored_per_stage: Sequence[int], read_s: float) -> list[StagingEffect]:
        request = self.request
        assert request is not None
        request.apply_restore(list(restored_per_stage), self.policy.blocks)
        result = self.policy.staged(self.session, request, read_s)
        effects: list[StagingEffect] = []
        if not result.hold:  # its turn came meanwhile (the blocks are its device hits), or nothing was read
            self.policy.blocks.free(request.request_id)
            effects.append(Freed((request.request_id,)))
        return effects + self._end(result.outcome, result.hold, result.prefetched_bytes)

    def _release(self, corrupt_chunk_indexes: Sequence[int] = ()) -> list[StagingEffect]:
        lease_id, self.lease_id = self.lease_id, ""
        return [ReleaseLease(lease_id, tuple(corrupt_chunk_indexes))] if lease_id else []

    def _end(self, outcome: str, held: bool = False, prefetched_bytes: int = 0) -> list[StagingEffect]:
        self.ended, self.outcome = True, outcome
        return [Staged(outcome, held, prefetched_bytes)]
