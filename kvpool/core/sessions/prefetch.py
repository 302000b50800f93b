"""Session prefetch as one policy: when to stage a session's history, into which blocks, how long to hold them.

Pure: no grpc, no asyncio, no I/O; time comes in as numbers from the caller's clock. Stage 0's
``SessionPrefetcher`` (services/prefill/stage0/prefetch.py) and the simulator's pipelines
(kvpool/tools/sim/session_sim.py) run it unchanged: they time it and do the reads.

One ``SessionPrefetch`` per device block table. A session's life, as its shell reports it:

- ``turn_started``: a turn of the session reached this block table. A staging armed for it is
  disarmed (its turn came first); one held for it is let go (``free``: its blocks stay cached, the
  most recently used, and the turn finds them as device hits); the session's cached blocks are
  touched (retention by session).
- ``admitted``: the turn got its blocks; the ledger counts the staged chunks its device hit used,
  and those the device lost meanwhile as wasted.
- ``turn_ended``: the turn's full chunks are what the session's next prompt begins with.
- ``hint``: the client's hint after a turn. ``session_end`` lets the held staging go, uncaches the
  session's cached blocks (``BlockManager.end_session``), counts its pending chunks wasted and
  forgets it (the shell demotes its pool groups). Otherwise it arms a staging ``lead_s`` before
  ``expected_next_s`` (at once without one): ``Armed(at, ticket)``, the latest arming only.
- ``begin(session, ticket, now)`` when the armed time comes: nothing when the ticket is stale
  (``CANCELLED``), the session's turn came or it is gone (``TURN_CAME``), the device holds the
  whole history (``ON_DEVICE``), or there is no room (``PRESSURE``). Room is the blocks that cache
  nothing, less a reserve (``reserve_share`` of the device) and the staging's own last position,
  then the cached blocks of idle sessions expected back after this one (``SessionTable.donors``,
  the one wanted last giving first, its history's tail first); never a session's with a turn in
  flight, without a hint, or with a staging pending. Else the staging request (``holder``
  ``prefetch/N``), admitted: the shell restores it through the prefill restore path.
- ``staged`` when that read ended: a staging that restored something for a session still idle is
  *held* (its blocks stay referenced until the session's turn, or until ``unpin_all``); otherwise
  the shell frees it. The read's time feeds the restore estimate the lead uses.
- ``unpin_all``: a real request is short of blocks: every held staging goes back to the cache
  (cached, now evictable), so a prefetch never makes a real request wait. A read in flight is never
  cancelled (the stages write into its blocks); it holds its few blocks only for that read.

Invariants: at most one held staging per session, each a holder the block table holds, and only
for a session with no turn in flight; at most one armed ticket per session; the ledger's used +
wasted + pending bytes equal its prefetched bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpool.core.prefill.block_manager import BlockManager
from kvpool.core.chunk_hash import ChunkHash
from kvpool.core.errors import InvalidArgument
from kvpool.core.prefill.request import PrefillRequest, try_admit
from kvpool.core.sessions.table import (
    PrefetchLedger,
    SessionId,
    SessionTable,
    check_expected_next_s,
    prefetch_budget,
    prefetch_lead_s,
)

# outcomes of a hint or a staging (the services' ``kvpool_prefetch_hints{outcome}``)
STAGED = "staged"
ON_DEVICE = "on_device"
PRESSURE = "pressure"
POOL_MISS = "pool_miss"
TURN_CAME = "turn_came"
CANCELLED = "cancelled"  # a stale ticket: re-armed or disarmed after it was timed
ARMED = "armed"  # a hint armed a staging (its outcome comes from ``begin`` and ``staged``)
SESSION_END = "session_end"
UNKNOWN = "unknown"


@dataclass(frozen=True, slots=True)
class PrefetchSettings:
    """``lead_margin_s``: a staging ends this long before the expected turn (its lookup's RPCs, the hint's);
    ``first_restore_s_per_chunk``: the restore estimate until one was measured (one chunk, every stage);
    ``restore_mean_weight``: the moving mean's weight of each new measurement;
    ``reserve_share``: of the device's blocks a staging always leaves free."""

    lead_margin_s: float = 0.1
    first_restore_s_per_chunk: float = 0.02
    restore_mean_weight: float = 0.2
    reserve_share: float = 0.02

    def __post_init__(self) -> None:
        for name in ("lead_margin_s", "first_restore_s_per_chunk"):
            if not getattr(self, name) >= 0:
                raise InvalidArgument(f"{name}: must be >= 0, got {getattr(self, name)}", field=name)
        for name in ("restore_mean_weight", "reserve_share"):
            if not 0 <= getattr(self, name) <= 1:
                raise InvalidArgument(f"{name}: must be in [0, 1], got {getattr(self, name)}", field=name)


@dataclass(frozen=True, slots=True)
class Armed:
    """Stage the session at ``at`` (the caller's clock), presenting ``ticket`` to ``begin``."""

    at: float
    ticket: int


@dataclass(frozen=True, slots=True)
class HintResult:
    """What a hint did: ``known`` (the session is in the table); ``released`` blocks and ``wasted_bytes``
    (session_end); ``demote`` (session_end: its last prompt's chunks, for the pool); ``armed``."""

    outcome: str
    known: bool
    released: int = 0
    wasted_bytes: int = 0
    demote: tuple[ChunkHash, ...] = ()
    armed: Armed | None = None


@dataclass(frozen=True, slots=True)
class StagedResult:
    """``hold``: the policy holds the staging for the session's turn (else the caller frees its holder);
    ``prefetched_bytes``: newly staged chunks' bytes (every stage)."""

    outcome: str
    hold: bool
    prefetched_bytes: int


@dataclass(slots=True)
class SessionPrefetch:
    """One block table's session prefetch (see the module doc for the invariants)."""

    blocks: BlockManager
    chunk_bytes: int  # one chunk, every stage
    settings: PrefetchSettings = field(default_factory=PrefetchSettings)
    max_sessions: int = 10_000
    sessions: SessionTable = field(init=False)
    ledger: PrefetchLedger = field(init=False)
    restore_s_per_chunk: float = field(init=False)  # a moving mean of what restores took here
    pinned: dict[SessionId, str] = field(default_factory=dict)  # held stagings' holder ids, by session
    num_unpinned: int = 0  # held stagings ``unpin_all`` took back
    _armed: dict[SessionId, int] = field(default_factory=dict)
    _serial: int = 0

    def __post_init__(self) -> None:
        self.sessions = SessionTable(self.max_sessions)
        self.ledger = PrefetchLedger(self.chunk_bytes)
        self.restore_s_per_chunk = self.settings.first_restore_s_per_chunk

    # ---- a turn's life ----------------------------------------------------------

    def turn_started(self, session: SessionId | None, now: float) -> str | None:
        """The session's turn arrived. Returns the holder of its held staging, released to this turn
        (None: none was held), so a caller that logs its block events can log this one."""
        if session is None:
            return None
        self._armed.pop(session, None)  # its turn came first
        self.sessions.turn_started(session, now)
        released = self._unpin(session)  # its staged blocks go to this turn: cached, most recently used
        self.blocks.touch_session(session)
        return released

    def admitted(self, request: PrefillRequest) -> tuple[int, int]:
        """The turn got its blocks: bytes (used, wasted) of its session's staged chunks."""
        if request.session is None:
            return 0, 0
        cached = self.blocks.cached_block_id
        return self.ledger.turn_started(request.session, request.chunk_hashes[: request.num_device_chunks],
                                        lambda h: cached(h) is not None)

    def turn_ended(self, session: SessionId | None, now: float, chunk_hashes: list[ChunkHash]) -> None:
        if session is not None and self.sessions.get(session) is not None:
            self.sessions.turn_ended(session, now, chunk_hashes)

    def observe_restore(self, num_chunks: int, seconds: float) -> None:
        """A restore of ``num_chunks`` took ``seconds`` (first stage start to last end): the lead's estimate."""
        if num_chunks > 0:
            self.restore_s_per_chunk += self.settings.restore_mean_weight * (
                seconds / num_chunks - self.restore_s_per_chunk)

    def lead_s(self, num_chunks: int) -> float:
        """How long before the expected turn a staging of ``num_chunks`` starts."""
        return prefetch_lead_s(num_chunks, self.restore_s_per_chunk, self.settings.lead_margin_s)

    # ---- hints ------------------------------------------------------------------

    def hint(self, session: SessionId, now: float, session_end: bool, expected_next_s: float | None) -> HintResult:
        """The client's hint for the session (InvalidArgument naming a bad ``expected_next_s``)."""
        check_expected_next_s(expected_next_s)
        state = self.sessions.get(session)
        if state is None or not session.key:
            return HintResult(UNKNOWN, False)
        self._armed.pop(session, None)
        if session_end:
            self._unpin(session)
            released = self.blocks.end_session(session)
            wasted = self.ledger.dropped(session)
            self.sessions.forget(session)
            return HintResult(SESSION_END, True, released, wasted, tuple(state.chunk_hashes))
        delay = 0.0
        if expected_next_s is not None:
            self.sessions.expect(session, now, expected_next_s)
            delay = max(0.0, expected_next_s - self.lead_s(len(state.chunk_hashes)))
        self._serial += 1
        self._armed[session] = self._serial
        return HintResult(ARMED, True, armed=Armed(now + delay, self._serial))

    # ---- staging ------------------------------------------------------------------

    def begin(self, session: SessionId, ticket: int, now: float, has_pool: bool = True) -> PrefillRequest | str:
        """The armed time came: the admitted staging request to restore, or the outcome why none."""
        if self._armed.get(session) != ticket:
            return CANCELLED
        del self._armed[session]  # reading now: no longer cancellable
        state = self.sessions.get(session)
        if state is None or state.turns_in_flight:
            return TURN_CAME
        blocks, hashes = self.blocks, state.chunk_hashes
        num_device = blocks.match_prefix(hashes)
        if num_device >= len(hashes):
            return ON_DEVICE
        # room: blocks that cache nothing, then those of idle sessions expected back after this one
        due_at = state.expected_at if state.expected_at is not None else now
        donors = self.sessions.donors(session, due_at, keep=self.ledger.is_pending)
        donor_blocks = [(d, len(blocks.session_blocks(d))) for d in donors]
        reserve = int(blocks.num_blocks * self.settings.reserve_share)
        # one extra block for the last position every request computes (it caches nothing)
        budget = prefetch_budget(blocks.num_uncached_free_blocks, 1, reserve, sum(n for _, n in donor_blocks))
        end = min(len(hashes), num_device + budget)
        if end <= num_device or not has_pool:
            return PRESSURE
        short = (end - num_device) - max(0, blocks.num_uncached_free_blocks - 1 - reserve)
        for donor, owned in donor_blocks:  # the session wanted last gives first, its history's tail first
            if short <= 0:
                break
            short -= blocks.end_session(donor, min(owned, short))
        self._serial += 1
        request = PrefillRequest(f"prefetch/{self._serial}", end * blocks.chunk_size + 1, blocks.chunk_size,
                                 list(hashes[:end]), tenant=session.tenant, session=session)
        if not try_admit(request, blocks, now, now + 1.0):
            return PRESSURE
        return request

    def staged(self, session: SessionId, request: PrefillRequest, read_s: float) -> StagedResult:
        """The staging's read ended (``read_s``, first stage start to last end) and its restore was applied."""
        restored = request.num_restored_chunks
        state = self.sessions.get(session)
        hold = bool(restored) and state is not None and not state.turns_in_flight
        if hold:
            self._unpin(session)
            self.pinned[session] = request.request_id  # held for its turn (``unpin_all`` takes it back)
        self.observe_restore(restored, read_s)
        first = request.num_device_chunks
        added = self.ledger.staged(session, request.chunk_hashes[first: first + restored])
        return StagedResult(STAGED if restored else POOL_MISS, hold, added * self.chunk_bytes)

    def unpin_all(self) -> list[str]:
        """A real request is short of blocks: every held staging goes back to the cache (still cached,
        now evictable). Returns their holders (none: nothing was held); the caller tries its admission again."""
        released = [holder for session in list(self.pinned) if (holder := self._unpin(session)) is not None]
        self.num_unpinned += len(released)
        return released

    def _unpin(self, session: SessionId) -> str | None:
        """Free the session's held staging, if any; returns its holder."""
        holder = self.pinned.pop(session, None)
        if holder is not None:
            self.blocks.free(holder)
        return holder

    @property
    def num_armed(self) -> int:
        return len(self._armed)
