"""Sessions as prefill sees them: when each was last active, when its next turn is expected, and prefetch.

Pure: no grpc, no I/O; time comes in as numbers from the caller's clock.

A session is named by ``SessionId(tenant, key)``: two tenants using the same
``session_key`` are two sessions (tenants never share or probe each other's
cache, so they never share a session either).

``SessionTable`` (invariants): a session is *active* from ``turn_started`` to
``turn_ended``; ``idle_order`` runs the sessions with no turn in flight, the
ended ones first (``end=True``: nothing of theirs will be asked for again),
then by the time their last turn ended, idle longest first; the table holds
at most ``max_sessions`` (the one idle longest is forgotten first).

Prefetch (its policy: ``kvpool.core.sessions.prefetch``): when a turn ends, the
session's next prompt will begin with this one's full chunks. What of it the
device cache lost can be staged from the pool ahead of the next turn
(``prefetch_lead_s`` before it), at low priority: it takes only blocks that cache
nothing, or the cached blocks of idle sessions expected back after it
(``donors``), never a session's with a turn in flight or without a hint
(``prefetch_budget``). ``PrefetchLedger`` counts its bytes: prefetched, used (a later
turn's device hit covered them) and wasted (evicted or cancelled before use,
or the session ended).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from kvpool.core.chunk_hash import ChunkHash
from kvpool.core.errors import InvalidArgument

MAX_EXPECTED_NEXT_S = 86_400.0  # a day: an hint beyond it says nothing useful about staging


@dataclass(frozen=True, slots=True, order=True)
class SessionId:
    """A session key scoped by its tenant (``tenant_name``: "" is the default tenant)."""

    tenant: str
    key: str


def check_expected_next_s(value: float | None) -> None:
    """InvalidArgument naming ``expected_next_s`` unless absent or in [0, a day]."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= MAX_EXPECTED_NEXT_S:
        raise InvalidArgument(f"expected_next_s: must be a number of seconds in [0, {MAX_EXPECTED_NEXT_S:g}], "
                              f"got {value!r}", field="expected_next_s")


@dataclass(slots=True)
class SessionState:
    session: SessionId
    last_active: float
    turns_in_flight: int = 0
    ended: bool = False
    expected_at: float | None = None  # when its next turn is expected (a hint), else None
    chunk_hashes: list[ChunkHash] = field(default_factory=list)  # the last turn's full chunks
    pipeline: str = ""


class SessionTable:
    """Every session's activity (see the module doc for the invariants)."""

    def __init__(self, max_sessions: int = 100_000) -> None:
        if max_sessions < 1:
            raise InvalidArgument(f"max_sessions: must be >= 1, got {max_sessions}")
        self.max_sessions = max_sessions
        self._idle: OrderedDict[SessionId, SessionState] = OrderedDict()  # idle longest first; ended at the front
        self._active: dict[SessionId, SessionState] = {}

    def __len__(self) -> int:
        return len(self._idle) + len(self._active)

    def get(self, session: SessionId) -> SessionState | None:
        return self._active.get(session) or self._idle.get(session)

    def turn_started(self, session: SessionId, now: float, pipeline: str = "") -> SessionState:
        state = self._idle.pop(session, None) or self._active.get(session) or SessionState(session, now)
        state.turns_in_flight += 1
        state.last_active = now
        state.ended = False
        state.expected_at = None
        if pipeline:
            state.pipeline = pipeline
        self._active[session] = state
        self._bound()
        return state

    def turn_ended(self, session: SessionId, now: float, chunk_hashes: Sequence[ChunkHash] = (),
                   expected_next_s: float | None = None, end: bool = False) -> SessionState:
        """The turn's last token went out; ``end``: the client says the session is over."""
        check_expected_next_s(expected_next_s)
        state = self._active.get(session)
        if state is None:
            raise InvalidArgument(f"session_key: {session.key!r} of tenant {session.tenant!r} has no turn in flight",
                                  field="session_key")
        state.turns_in_flight -= 1
        state.last_active = now
        state.ended = end
        state.expected_at = None if end or expected_next_s is None else now + expected_next_s
        if chunk_hashes:
            state.chunk_hashes = list(chunk_hashes)
        if state.turns_in_flight == 0:
            del self._active[session]
            self._idle[session] = state
            if end:
                self._idle.move_to_end(session, last=False)
        return state

    def expect(self, session: SessionId, now: float, expected_next_s: float) -> None:
        """The client's hint came after the turn ended: its next turn is expected at ``now + expected_next_s``."""
        check_expected_next_s(expected_next_s)
        state = self.get(session)
        if state is not None and not state.turns_in_flight and not state.ended:
            state.expected_at = now + expected_next_s

    def forget(self, session: SessionId) -> SessionState | None:
        return self._active.pop(session, None) or self._idle.pop(session, None)

    def idle_order(self) -> list[SessionId]:
        """Sessions with no turn in flight: ended first, then idle longest first."""
        return list(self._idle)

    def donors(self, session: SessionId, due_at: float, keep: Callable[[SessionId], bool] = lambda s: False
               ) -> list[SessionId]:
        """Idle sessions whose cached blocks a staging for ``session`` (due at ``due_at``) may take: those
        whose next turn is expected after it, the latest expected first (Belady's rule: give up what is
        wanted furthest ahead). Never one with a turn in flight, one with no hint (it may be back any
        moment: its hint comes when its last token went out), the staged one, nor one ``keep`` names
        (say, one whose own staging is on the device, waiting for its turn)."""
        hinted = [(state.expected_at, s) for s, state in self._idle.items()
                  if state.expected_at is not None and state.expected_at > due_at and s != session and not keep(s)]
        return [s for _, s in sorted(hinted, key=lambda e: -e[0])]

    def _bound(self) -> None:
        while len(self) > self.max_sessions and self._idle:
            self._idle.popitem(last=False)


# ---- prefetch ----------------------------------------------------------------


def prefetch_budget(num_uncached_free_blocks: int, num_blocks_wanted: int, reserve_blocks: int,
                    num_donor_blocks: int = 0) -> int:
    """Blocks a prefetch may take: free blocks that cache nothing, plus the cached free blocks of
    sessions expected back after the staged one (``num_donor_blocks``, ``SessionTable.donors``), less
    what queued requests want (``num_blocks_wanted``) and a reserve. Zero under pressure: a prefetch
    never makes a real request wait for blocks and never evicts a chunk wanted before its own."""
    return max(0, num_uncached_free_blocks + num_donor_blocks - num_blocks_wanted - reserve_blocks)


def prefetch_lead_s(num_chunks: int, restore_s_per_chunk: float, margin_s: float) -> float:
    """How long before the expected next turn to stage ``num_chunks``: their restore (at
    ``restore_s_per_chunk``, as measured) plus ``margin_s``. Later is better, so long as it ends in
    time: the later it stages, the less the device can lose of it again before the turn."""
    if num_chunks < 0 or restore_s_per_chunk < 0 or margin_s < 0:
        raise InvalidArgument(f"prefetch_lead_s({num_chunks}, {restore_s_per_chunk}, {margin_s})")
    return margin_s + num_chunks * restore_s_per_chunk


@dataclass(slots=True)
class PrefetchLedger:
    """Bytes prefetched, used and wasted, and the chunks still pending per session.

    Invariants: ``used + wasted + pending == prefetched`` (bytes); a chunk is
    pending for one session at most once.
    """

    chunk_bytes: int
    prefetched_bytes: int = 0
    used_bytes: int = 0
    wasted_bytes: int = 0
    _pending: dict[SessionId, set[ChunkHash]] = field(default_factory=dict)

    @property
    def pending_bytes(self) -> int:
        return sum(len(p) for p in self._pending.values()) * self.chunk_bytes

    def staged(self, session: SessionId, chunk_hashes: Iterable[ChunkHash]) -> int:
        """Chunks a prefetch put in the device cache; returns how many were new."""
        pending = self._pending.setdefault(session, set())
        before = len(pending)
        pending.update(chunk_hashes)
        added = len(pending) - before
        self.prefetched_bytes += added * self.chunk_bytes
        return added

    def turn_started(self, session: SessionId, device_hit: Iterable[ChunkHash],
                     cached: Callable[[ChunkHash], bool]) -> tuple[int, int]:
        """A turn of the session found ``device_hit`` on the device: pending chunks among them were
        used; pending chunks the device no longer caches (``cached`` says) were evicted unused, wasted;
        the rest stay pending (this turn did not reach them: a sub-agent's branch, say). Returns bytes
        (used, wasted)."""
        pending = self._pending.get(session)
        if not pending:
            return 0, 0
        hit = pending.intersection(device_hit)
        lost = {h for h in pending - hit if not cached(h)}
        pending -= hit | lost
        if not pending:
            del self._pending[session]
        used, wasted = len(hit) * self.chunk_bytes, len(lost) * self.chunk_bytes
        self.used_bytes += used
        self.wasted_bytes += wasted
        return used, wasted

    def is_pending(self, session: SessionId) -> bool:
        """Chunks staged for the session wait for its next turn."""
        return bool(self._pending.get(session))

    def dropped(self, session: SessionId) -> int:
        """The session ended or its prefetch was cancelled: its pending chunks are wasted (bytes)."""
        pending = self._pending.pop(session, None)
        wasted = len(pending) * self.chunk_bytes if pending else 0
        self.wasted_bytes += wasted
        return wasted

    @property
    def wasted_share(self) -> float:
        """Wasted over prefetched bytes (0 when nothing was prefetched)."""
        return self.wasted_bytes / self.prefetched_bytes if self.prefetched_bytes else 0.0
