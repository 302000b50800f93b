"""A prefill request's life on stage 0, as a small state object with pure transitions.

Pure: no grpc, no torch, no I/O; time comes in as numbers from the caller's
clock. The scheduler does the I/O between the transitions:

    admit ─▶ plan ─▶ [expect_restore ─▶] apply_restore ─▶ finish_compute ─▶ (handoff, then free)

- ``admit`` takes device blocks: the cached prefix (up to the hit limit)
  shared, fresh blocks for the rest. It changes nothing when they do not fit.
- ``plan`` splits the prompt into device hit → pool hit → computed, from the
  number of leading pool groups the lookup found complete. ``plan_lookup``
  does the same from a lookup that started at chunk 0: device-hit chunks
  whose group the pool no longer has are written back (saved again from the
  device pages) before the device can drop them.
- ``apply_restore`` takes what each stage restored: a prefix counts only as
  far as every stage restored it, and only those chunks become device hits
  for later requests.
- ``expect_restore`` comes first when the restore rides the forward's chain:
  the forward is planned past every planned pool chunk before any stage has
  restored it (each stage restores before it computes, and fails the forward
  when it falls short); ``apply_restore`` then only confirms, and refuses
  (``RestoreFellShort``) a stage short of the plan, so nothing unrestored is
  ever cached.
- ``finish_compute`` marks the computed chunks cached; ``chunks_to_save``
  names them (write-through of every chunk that was not already in the pool,
  the written-back device hits first).
- Nothing is held past the request's Prefill call: decode's region was
  reserved before it started, so the handoff runs inside the call and the
  blocks are freed when it returns.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvpool.core.prefill.block_manager import BlockManager, NoFreeBlocks
from kvpool.core.chunk_hash import DEFAULT_TENANT, ChunkHash
from kvpool.core.errors import FailedPrecondition, ResourceExhausted, RestoreFellShort
from kvpool.core.prefill.planner import RestorePlan, max_hit_chunks, plan_restore
from kvpool.core.sessions.table import SessionId


class Phase(enum.Enum):
    NEW = "new"
    ADMITTED = "admitted"
    PLANNED = "planned"
    RESTORING = "restoring"  # the forward is planned past the pool chunks; the stages confirm them after it
    RESTORED = "restored"
    COMPUTED = "computed"


@dataclass(slots=True)
class PrefillRequest:
    """One prompt's way through the scheduler (see the module doc).

    Invariant: ``num_device_chunks + num_restored_chunks`` never exceeds the
    hit limit, so at least one token is computed.
    """

    request_id: str
    num_tokens: int
    chunk_size: int
    chunk_hashes: list[ChunkHash]
    phase: Phase = Phase.NEW
    block_table: list[int] = field(default_factory=list)
    num_device_chunks: int = 0
    restore_plan: RestorePlan | None = None
    num_restored_chunks: int = 0
    # leading device-hit chunks known to be in the pool; the rest are written back
    num_device_chunks_in_pool: int = 0
    # whose request: its share of the device cache decides whose cached blocks its fresh ones reuse
    tenant: str = DEFAULT_TENANT
    # whose turn (scoped by tenant): its freed blocks are that session's cached blocks (retention by session)
    session: SessionId | None = None

    @property
    def hit_limit(self) -> int:
        """Most leading chunks that may come from device or pool."""
        return min(len(self.chunk_hashes), max_hit_chunks(self.num_tokens, self.chunk_size))

    # ---- transitions ----------------------------------------------------

    def admit(self, blocks: BlockManager) -> None:
        """Take device blocks; ``NoFreeBlocks`` (nothing changed) when they do not fit now."""
        self._expect(Phase.NEW)
        num_device = blocks.match_prefix(self.chunk_hashes[: self.hit_limit])
        self.block_table = blocks.allocate(self.request_id, self.chunk_hashes, self.num_tokens, num_device,
                                           self.tenant, self.session)
        self.num_device_chunks = num_device
        self.phase = Phase.ADMITTED

    @property
    def pool_candidates(self) -> list[ChunkHash]:
        """Chunks after the device hit that the pool may serve: the lookup's groups, in order."""
        return self.chunk_hashes[self.num_device_chunks : self.hit_limit]

    @property
    def lookup_candidates(self) -> list[ChunkHash]:
        """Every chunk that may be a hit, from the head: a lookup of these also tells
        which device hits still have their pool copy (``plan_lookup``)."""
        return self.chunk_hashes[: self.hit_limit]

    def plan(self, num_pool_chunks: int) -> RestorePlan:
        """Device hit, then the leading ``num_pool_chunks`` complete pool groups after it.

        The device hits are taken to be in the pool already (nothing written back).
        """
        self._expect(Phase.ADMITTED)
        self.restore_plan = plan_restore(
            self.num_tokens, self.chunk_size, len(self.chunk_hashes), self.num_device_chunks, num_pool_chunks
        )
        self.num_device_chunks_in_pool = self.num_device_chunks
        self.phase = Phase.PLANNED
        return self.restore_plan

    def plan_lookup(self, num_complete: int) -> RestorePlan:
        """Plan from a lookup of ``lookup_candidates``: ``num_complete`` leading groups
        from chunk 0 are in the pool.

        Device hits past them lost their pool copy (evicted, or a save that never
        landed): they are saved again from the device pages (write-back), and no
        pool hit follows them, since a lookup reports a leading run only.
        """
        in_pool = min(num_complete, self.num_device_chunks)
        plan = self.plan(max(0, num_complete - self.num_device_chunks))
        self.num_device_chunks_in_pool = in_pool
        return plan

    @property
    def num_write_back_chunks(self) -> int:
        """Device-hit chunks saved again because the pool lost them."""
        return self.num_device_chunks - self.num_device_chunks_in_pool

    def restore_targets(self, blocks: BlockManager | None = None) -> list[tuple[int, int]]:
        """``(chunk_index, block_id)`` of every planned pool chunk, in order.

        With ``blocks``, checks that each target is private to this request
        (``BlockManager.is_private``): a restore writes straight into the
        pages, so it must never land in a block another request reads.
        """
        plan = self._plan()
        targets = [(i, self.block_table[i]) for i in plan.pool_chunk_range]
        if blocks is not None:
            shared = [b for _, b in targets if not blocks.is_private(self.request_id, b)]
            if shared:
                raise FailedPrecondition(f"request {self.request_id}: restore targets {shared} are not private")
        return targets

    @property
    def save_block_ids(self) -> list[int]:
        """Blocks the save reads from (``chunks_to_save``, in order)."""
        first = self.save_first_chunk
        return self.block_table[first : first + len(self.chunks_to_save)]

    def expect_restore(self) -> int:
        """The restore rides the forward's chain: plan the forward past every planned pool chunk now
        (``compute_start`` moves past them); ``apply_restore`` confirms them. Returns their count."""
        self._expect(Phase.PLANNED)
        self.num_restored_chunks = self._plan().num_pool_chunks
        self.phase = Phase.RESTORING
        return self.num_restored_chunks

    def apply_restore(self, restored_per_stage: Sequence[int], blocks: BlockManager) -> int:
        """Count the leading chunks every stage restored; mark them cached. Returns that count. After
        ``expect_restore``, every stage must have restored every planned chunk: ``RestoreFellShort``
        otherwise (the forward computed over chunks some stage lacks), with nothing cached."""
        plan = self._plan()
        restored = min(restored_per_stage, default=0) if plan.num_pool_chunks else 0
        if self.phase is Phase.RESTORING:
            if restored < self.num_restored_chunks:
                raise RestoreFellShort(f"request {self.request_id}: a stage restored {restored} of the "
                                       f"{self.num_restored_chunks} chunks its forward was planned past")
            restored = self.num_restored_chunks
        else:
            self._expect(Phase.PLANNED)
        self.num_restored_chunks = max(0, min(restored, plan.num_pool_chunks))
        if self.num_restored_chunks:
            first = self.num_device_chunks
            blocks.commit_chunks(self.request_id, first, self.chunk_hashes[first : first + self.num_restored_chunks])
        self.phase = Phase.RESTORED
        return self.num_restored_chunks

    @property
    def compute_start(self) -> int:
        """First token computed: after the device hit and what every stage restored."""
        return (self.num_device_chunks + self.num_restored_chunks) * self.chunk_size

    @property
    def save_first_chunk(self) -> int:
        """First chunk to save: the first device hit the pool lost, else the first computed.

        Contiguous with the computed chunks: a write-back leaves no pool hit
        after the device hit (see ``plan_lookup``).
        """
        if self.num_write_back_chunks:
            return self.num_device_chunks_in_pool
        return self.compute_start // self.chunk_size

    @property
    def chunks_to_save(self) -> list[ChunkHash]:
        """Full chunks this request computes, after the device hits it writes back."""
        return self.chunk_hashes[self.save_first_chunk :]

    def finish_compute(self, blocks: BlockManager) -> None:
        """The computed chunks are now cached on the device for later requests."""
        self._expect(Phase.RESTORED)
        first = self.compute_start // self.chunk_size
        blocks.commit_chunks(self.request_id, first, self.chunk_hashes[first:])
        self.phase = Phase.COMPUTED

    # ---- figures --------------------------------------------------------

    @property
    def num_device_tokens(self) -> int:
        return self.num_device_chunks * self.chunk_size

    @property
    def num_pool_tokens(self) -> int:
        return self.num_restored_chunks * self.chunk_size

    @property
    def num_computed_tokens(self) -> int:
        return self.num_tokens - self.compute_start

    @property
    def num_pool_chunks_lost(self) -> int:
        """Planned pool chunks that some stage could not restore (they were computed)."""
        plan = self.restore_plan
        return (plan.num_pool_chunks if plan is not None else 0) - self.num_restored_chunks

    # ---- internals ------------------------------------------------------

    def _plan(self) -> RestorePlan:
        if self.restore_plan is None:
            raise FailedPrecondition(f"request {self.request_id}: no restore plan yet")
        return self.restore_plan

    def _expect(self, phase: Phase) -> None:
        if self.phase is not phase:
            raise FailedPrecondition(f"request {self.request_id}: is {self.phase.value}, expected {phase.value}")


def try_admit(request: PrefillRequest, blocks: BlockManager, now: float, deadline: float) -> bool:
    """Admission policy: admit now (True), or wait for freed blocks (False) until the deadline.

    Past the deadline a request that still does not fit is refused with
    ``ResourceExhausted``; one that can never fit was refused at validation.
    """
    try:
        request.admit(blocks)
        return True
    except NoFreeBlocks as exc:
        if now >= deadline:
            raise ResourceExhausted(f"device cache: {exc}") from None
        return False
