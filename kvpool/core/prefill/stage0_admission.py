"""Stage 0's admission of its requests over one block table, sans-I/O: the steps its scheduler and the
simulator's pipeline both take around each request's driver (``kvpool.core.prefill.driver``).

Pure: no I/O, no clock of its own. Stage 0's scheduler (services/prefill/stage0/scheduler.py) and the
simulated pipeline (kvpool/tools/sim/prefill_sim.py) run it; the order of the queue is the core's
(``PrefillQueue`` / ``FairQueue``), the admission the driver's. The steps:

- ``arrived``: a turn reached stage 0. A staging armed for its session is disarmed, one held for it
  goes to it (its blocks stay cached, the most recently used), and its session's cached blocks are
  touched (retention by session).
- ``admit``: the queue's head tries its admission. Under a gate, the sessions of the head and of the
  requests still waiting are touched first, in serving order: the next served is the last evicted.
  Then its driver starts (or, after a wait, tries again): ``Admitted`` or ``WaitForBlocks``.
- ``short_of_blocks``: the head waits for blocks: every staging held for a session's turn goes back
  first (cached, now evictable: a prefetch never makes a real request wait); when any did, the head
  tries again at once, else it waits for a free.
- ``admitted``: the request holds its blocks; the prefetch ledger counts the staged chunks it used.
- ``work_s``: the gate's estimate of a turn's work on arrival (its place in a work-aware queue), one
  decision for both: the device's cached prefix, the session's known history after it, the rest.

Invariant: a staging is held only while no request waits for blocks (``short_of_blocks`` takes every
one back before a request waits).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvpool.core.chunk_hash import ChunkHash
from kvpool.core.prefill.block_manager import BlockManager
from kvpool.core.prefill.driver import Effect, PrefillDriver, Step, WaitForBlocks
from kvpool.core.prefill.queue import WorkWeights
from kvpool.core.prefill.request import PrefillRequest
from kvpool.core.prefill.work_scale import host_work_s
from kvpool.core.sessions.prefetch import SessionPrefetch
from kvpool.core.sessions.table import SessionId


def waits_for_blocks(effects: Sequence[Effect]) -> bool:
    return any(isinstance(e, WaitForBlocks) for e in effects)


@dataclass(slots=True)
class Stage0Admission:
    """One block table's admissions; ``prefetch``: its session prefetch policy (None: none runs)."""

    blocks: BlockManager
    prefetch: SessionPrefetch | None = None

    def arrived(self, session: SessionId | None, now: float) -> str | None:
        """A turn of ``session`` reached stage 0. Returns the holder of a staging held for it, let go to it
        (its blocks are this turn's device hits now): a block event to log."""
        released = self.prefetch.turn_started(session, now) if self.prefetch is not None else None
        self.blocks.touch_session(session)
        return released

    def admit(self, driver: PrefillDriver, now: float, serving: Sequence[SessionId] | None = None) -> list[Effect]:
        """The queue's head (``driver``) tries its admission; ``serving``: under a gate, the sessions of the
        head and of those still waiting, in serving order (touched first: the next served the last evicted)."""
        if serving:
            self.blocks.touch_sessions(list(serving))
        return driver.start(now) if driver.step is Step.NEW else driver.blocks_freed(now)

    def short_of_blocks(self) -> list[str]:
        """The head waits for blocks: the held stagings go back first. Their holders (none: wait for a free;
        some: try again now)."""
        return self.prefetch.unpin_all() if self.prefetch is not None else []

    def admitted(self, request: PrefillRequest) -> tuple[int, int]:
        """The request holds its blocks: bytes (used, wasted) of its session's staged chunks."""
        return self.prefetch.admitted(request) if self.prefetch is not None else (0, 0)

    def work_s(self, hashes: Sequence[ChunkHash], num_tokens: int, session: SessionId | None,
               weights: WorkWeights, factor: float = 1.0) -> float:
        """A turn's work as stage 0 sees it on arrival, in the caller's seconds: the device's cached prefix is
        free; what else the session's last prompt shares with it is restored (the pool is taken to hold it,
        nothing is looked up) at the restores' measured time a chunk (no history is known while no prefetch
        policy runs); the rest is computed at ``weights`` times ``factor`` (the host's measured speed: stage
        0's ``WorkScale``; 1 in the simulator, whose weights are its cost model's)."""
        chunk = self.blocks.chunk_size
        num_device = self.blocks.match_prefix(hashes)
        state = self.prefetch.sessions.get(session) if self.prefetch is not None and session is not None else None
        known = 0
        for a, b in zip(state.chunk_hashes if state is not None else (), hashes):
            if a != b:
                break
            known += 1
        cached = min(max(num_device, known) * chunk, num_tokens - 1)
        restore_chunks = -(-min(cached, max(0, known - num_device) * chunk) // chunk)
        per_chunk = self.prefetch.restore_s_per_chunk if self.prefetch is not None else 0.0  # (none known)
        return host_work_s(num_tokens, cached, restore_chunks, weights, factor, per_chunk)
