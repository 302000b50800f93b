"""A prefill's life at stage 0 as a sans-I/O state machine: events in, effects out.

Pure: no grpc, no torch, no I/O, no clock of its own (times come in with the
events). Stage 0's scheduler (``services/prefill/stage0/scheduler.py``) carries
the effects out and feeds the events in; every decision of the request's way
is made here, on the core's ``PrefillRequest`` and ``BlockManager``:

    start ─▶ [WaitForBlocks ─▶ blocks_freed]* ─▶ (admitted)
          ─▶ Lookup ─▶ looked_up           (pool candidates only; else planned at once)
          ─▶ [RestoreOnStages ─▶ restored] (later stages that take no restore on the chain)
          ─▶ Forward ─▶ forward_ended      ─▶ Prefilled ─▶ (release) ─▶ Freed
                     └▶ forward_failed     ─▶ Freed, then start again as the retry policy says
                                              (without device hits, without the pool) or Failed
    beside: ReleaseLease (a lease's end, nobody waits for it), SavesThenFree ─▶ saves_ended ─▶ Freed

Rules:
- Blocks: ``start`` and ``blocks_freed`` admit the request (its cached prefix
  shared, fresh blocks for the rest) or say ``WaitForBlocks`` until the
  admission deadline; past it, ``Failed`` (ResourceExhausted).
- The lookup asks for every candidate from chunk 0 (a device hit whose pool
  copy is gone is written back); its lease is released once the restore is
  over (at once when it planned no pool chunk), off the request's path.
- With ``restore_on_chain`` the forward is planned past the pool chunks
  before any stage read them, and the stages' counts confirm them
  (``RestoreFellShort`` otherwise); without, ``RestoreOnStages`` comes first.
- A save holds its blocks (``save_holder``) from before the forward until
  every stage's save ended (``SavesThenFree``), whether the forward ended or
  failed; a new attempt of the same request waits for that first.
- A failed forward is planned again at most ``MAX_REPLANS`` times
  (``kvpool.core.admission.retry.replan``): a stage that restarted
  (``DeviceCacheLost``) drops the pipeline's cached blocks and plans without
  device hits; a stage short of its restore (``RestoreFellShort``) plans
  without the pool. Any other failure fails the request.
- ``cancel``: the caller went away. Nothing held: it ends at once. Otherwise
  the I/O in flight (a lookup, a restore, a forward: the stages write this
  request's blocks) ends first, and then everything it held goes back.

Invariant: after ``Prefilled`` and ``release``, or ``Failed``, and every
``SavesThenFree`` answered, the request holds no block (``BlockManager``
has neither its holder nor its save's).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from kvpool.core.admission import retry as retry_policy
from kvpool.core.chunk_hash import DEFAULT_TENANT, ChunkHash
from kvpool.core.errors import DeviceCacheLost, FailedPrecondition, KvpoolError, RestoreFellShort, Unavailable
from kvpool.core.prefill.block_manager import BlockManager
from kvpool.core.prefill.request import Phase, PrefillRequest, try_admit
from kvpool.core.sessions.table import SessionId


def save_holder(request_id: str) -> str:
    """The block manager's holder id of a request's save (its blocks' extra reference)."""
    return f"{request_id}/save"


# ---- effects -----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class WaitForBlocks:
    """Wait for blocks another holder frees (then ``blocks_freed``), at most until ``deadline``."""

    deadline: float


@dataclass(frozen=True, slots=True)
class Admitted:
    """The request holds its device blocks (attempt ``attempt``, from 1)."""

    attempt: int


@dataclass(frozen=True, slots=True)
class Lookup:
    """Ask the pool's master for the leading complete groups of ``candidates`` (then ``looked_up``). The
    first ``held`` are the device's own hits: counted and touched, neither leased nor located."""

    candidates: tuple[ChunkHash, ...]
    held: int = 0


@dataclass(frozen=True, slots=True)
class RestoreOnStages:
    """Every stage reads its objects of the planned pool chunks now, by its own call (then ``restored``)."""


@dataclass(frozen=True, slots=True)
class Forward:
    """Run the forward through every stage (then ``forward_ended`` or ``forward_failed``); ``restore``:
    the planned pool chunks ride its first message (each stage reads its own before it computes)."""

    compute_start: int
    save_first_chunk: int
    save_chunk_hashes: tuple[ChunkHash, ...]
    restore: bool


@dataclass(frozen=True, slots=True)
class ReleaseLease:
    """End the lookup's lease (nobody waits for it), reporting the chunks some stage found corrupt."""

    lease_id: str
    corrupt_chunk_indexes: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class SavesThenFree:
    """Wait for every stage's save of the request to end, then ``saves_ended``."""

    holder: str


@dataclass(frozen=True, slots=True)
class Freed:
    """These holders' blocks went back: wake whoever waits for blocks."""

    holders: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class PlannedAgain:
    """A failed forward is planned again (``how``: a ``retry_policy.Replan`` value)."""

    how: str
    reason: str


@dataclass(frozen=True, slots=True)
class Prefilled:
    """The forward ended: the request's figures are final; its blocks go back at ``release``."""


@dataclass(frozen=True, slots=True)
class Failed:
    """The request ends with ``error`` (every block it held is freed by then, or by its saves' end)."""

    error: KvpoolError | None  # None: cancelled


Effect = (WaitForBlocks | Admitted | Lookup | RestoreOnStages | Forward | ReleaseLease | SavesThenFree | Freed
          | PlannedAgain | Prefilled | Failed)


def effect_fields(effect: Effect) -> dict[str, object]:
    """An effect as plain fields (its kind under "effect"), what a record keeps and a comparison reads: a
    lease by whether there is one (its id is the master's, not the request's), a failure by its kind."""
    fields: dict[str, object] = {"effect": type(effect).__name__}
    if isinstance(effect, Lookup):
        fields.update(candidates=len(effect.candidates), held=effect.held)
    elif isinstance(effect, Forward):
        fields.update(compute_start=effect.compute_start, save_first_chunk=effect.save_first_chunk,
                      save_chunks=len(effect.save_chunk_hashes), restore=effect.restore)
    elif isinstance(effect, ReleaseLease):
        fields["corrupt_chunk_indexes"] = list(effect.corrupt_chunk_indexes)
    elif isinstance(effect, (SavesThenFree,)):
        fields["holder"] = effect.holder
    elif isinstance(effect, Freed):
        fields["holders"] = list(effect.holders)
    elif isinstance(effect, Admitted):
        fields["attempt"] = effect.attempt
    elif isinstance(effect, PlannedAgain):
        fields["how"] = effect.how
    elif isinstance(effect, Failed):
        fields["error"] = type(effect.error).__name__ if effect.error is not None else "cancelled"
    return fields


class Step(enum.Enum):
    NEW = "new"
    WAITING_BLOCKS = "waiting_blocks"
    WAITING_SAVES = "waiting_saves"  # a new attempt waits for the last one's saves to let go of its blocks
    LOOKING_UP = "looking_up"
    RESTORING = "restoring"
    FORWARDING = "forwarding"
    PREFILLED = "prefilled"
    ENDED = "ended"


class PrefillDriver:
    """One request at stage 0 (see the module doc). ``pool``: a pool is configured; ``saving``: the stages
    save to it; ``restore_on_chain``: every later stage takes its restore on the forward's first message."""

    def __init__(self, request_id: str, num_tokens: int, chunk_size: int, chunk_hashes: Sequence[ChunkHash],
                 blocks: BlockManager, admission_timeout_s: float, *, tenant: str = DEFAULT_TENANT,
                 session: SessionId | None = None, pool: bool = True, saving: bool = True,
                 restore_on_chain: bool = True) -> None:
        self.request_id = request_id
        self.num_tokens = num_tokens
        self.chunk_size = chunk_size
        self.chunk_hashes = list(chunk_hashes)
        self.blocks = blocks
        self.admission_timeout_s = admission_timeout_s
        self.tenant = tenant
        self.session = session
        self.pool = pool
        self.saving = pool and saving
        self.restore_on_chain = restore_on_chain
        self.step = Step.NEW
        self.attempt = 0
        self.replans = 0
        self.use_pool = True
        self.cancelled = False
        self.request = self._new_request()
        self.lease_id = ""
        self._deadline = 0.0
        self._saves_pending = False  # a SavesThenFree of this request is not answered yet
        self._held = False  # the request's own blocks are held

    # ---- events ----------------------------------------------------------------

    def start(self, now: float) -> list[Effect]:
        """The request arrives (its turn came: the gate's slot, if any)."""
        self._expect(Step.NEW)
        self._deadline = now + self.admission_timeout_s
        return self._admit(now)

    def blocks_freed(self, now: float) -> list[Effect]:
        """Blocks went back (or the wait's deadline came): try the admission again."""
        if self.step is not Step.WAITING_BLOCKS:
            return []
        return self._admit(now)

    def looked_up(self, num_complete: int, lease_id: str) -> list[Effect]:
        """The master found ``num_complete`` leading complete groups of the candidates (a lease when any)."""
        self._expect(Step.LOOKING_UP)
        self.lease_id = lease_id
        if self.cancelled:
            return self._end_cancelled()
        plan = self.request.plan_lookup(num_complete)
        if self.restore_on_chain:  # the stages' counts confirm the plan after the forward (none: nothing)
            self.request.expect_restore()
        if not plan.num_pool_chunks:
            if not self.restore_on_chain:
                self.request.apply_restore([], self.blocks)
            return self._release_lease() + self._forward()
        if self.restore_on_chain:
            return self._forward()
        self.step = Step.RESTORING
        return [RestoreOnStages()]

    def restored(self, restored_per_stage: Sequence[int], corrupt_chunk_indexes: Sequence[int] = ()) -> list[Effect]:
        """Every stage's ``Restore`` call ended (``restored_per_stage``: the leading chunks each read)."""
        self._expect(Step.RESTORING)
        effects = self._release_lease(corrupt_chunk_indexes)
        if self.cancelled:
            return effects + self._end_cancelled()
        self.request.apply_restore(restored_per_stage, self.blocks)
        return effects + self._forward()

    def forward_ended(self, now: float, restored_per_stage: Sequence[int] = (),
                      corrupt_chunk_indexes: Sequence[int] = ()) -> list[Effect]:
        """Every stage computed, wrote its handoff and (on the chain) says what it restored."""
        self._expect(Step.FORWARDING)
        effects = self._release_lease(corrupt_chunk_indexes) + self._saves_then_free()
        if self.request.phase is Phase.RESTORING:
            try:
                self.request.apply_restore(restored_per_stage, self.blocks)
            except RestoreFellShort as exc:
                return effects + self._failed_forward(exc, now)
        self.request.finish_compute(self.blocks)
        if self.cancelled:
            return effects + self._end_cancelled()
        self.step = Step.PREFILLED
        return effects + [Prefilled()]

    def forward_failed(self, error: KvpoolError, now: float, corrupt_chunk_indexes: Sequence[int] = ()
                       ) -> list[Effect]:
        """The forward failed (every stage's writes of this request's pages have ended)."""
        self._expect(Step.FORWARDING)
        effects = self._release_lease(corrupt_chunk_indexes) + self._saves_then_free()
        return effects + self._failed_forward(error, now)

    def saves_ended(self, holder: str, now: float) -> list[Effect]:
        """Every stage's save of ``holder`` ended: its blocks go back (and a new attempt waiting for them
        goes on)."""
        if holder != save_holder(self.request_id) or not self._saves_pending:
            return []
        self._saves_pending = False
        effects = self._free(holder)
        if self.step is Step.WAITING_SAVES:
            return effects + self._again(now)
        return effects

    def release(self) -> list[Effect]:
        """After ``Prefilled``: the request's answer is out; its blocks go back."""
        self._expect(Step.PREFILLED)
        self.step = Step.ENDED
        return self._free_request()

    def cancel(self) -> list[Effect]:
        """The caller went away: end now when nothing but saves is in flight, else once it ended (a lookup,
        a restore, a forward: the stages write this request's blocks)."""
        if self.step is Step.ENDED:
            return []
        if self.step is Step.PREFILLED:
            return self.release()
        self.cancelled = True
        if self.step in (Step.NEW, Step.WAITING_BLOCKS, Step.WAITING_SAVES):
            self.step = Step.ENDED  # (saves still running end by ``saves_ended``)
            return [Failed(None)]
        return []

    @property
    def ended(self) -> bool:
        return self.step is Step.ENDED

    @property
    def holds_blocks(self) -> bool:
        return self._held or self._saves_pending

    @property
    def save_held(self) -> bool:
        """Its save's blocks are held: from before the forward until ``saves_ended``."""
        return self._saves_pending

    # ---- internals -------------------------------------------------------------

    def _new_request(self) -> PrefillRequest:
        return PrefillRequest(self.request_id, self.num_tokens, self.chunk_size, self.chunk_hashes,
                              tenant=self.tenant, session=self.session)

    def _admit(self, now: float) -> list[Effect]:
        try:
            admitted = try_admit(self.request, self.blocks, now, self._deadline)
        except KvpoolError as exc:  # past the deadline
            self.step = Step.ENDED
            return [Failed(exc)]
        if not admitted:
            self.step = Step.WAITING_BLOCKS
            return [WaitForBlocks(self._deadline)]
        self._held = True
        self.attempt += 1
        candidates = self.request.lookup_candidates if self.pool and self.use_pool else []
        if candidates:
            self.step = Step.LOOKING_UP
            return [Admitted(self.attempt), Lookup(tuple(candidates), self.request.num_device_chunks)]
        self.request.plan(0)
        if self.restore_on_chain:
            self.request.expect_restore()
        else:
            self.request.apply_restore([], self.blocks)
        return [Admitted(self.attempt)] + self._forward()

    def _again(self, now: float) -> list[Effect]:
        """The next attempt: admitted afresh, with its own admission deadline."""
        self.request = self._new_request()
        self._deadline = now + self.admission_timeout_s
        return self._admit(now)

    def _forward(self) -> list[Effect]:
        request = self.request
        saves = tuple(request.chunks_to_save) if self.saving else ()
        if saves:  # every stage's put reads these pages: they are not reused until all puts ended
            self.blocks.hold(save_holder(self.request_id), request.save_block_ids)
            self._saves_pending = True
        self.step = Step.FORWARDING
        return [Forward(request.compute_start, request.save_first_chunk, saves,
                        restore=request.phase is Phase.RESTORING and request.num_restored_chunks > 0)]

    def _release_lease(self, corrupt_chunk_indexes: Sequence[int] = ()) -> list[Effect]:
        lease, self.lease_id = self.lease_id, ""
        return [ReleaseLease(lease, tuple(corrupt_chunk_indexes))] if lease else []

    def _saves_then_free(self) -> list[Effect]:
        return [SavesThenFree(save_holder(self.request_id))] if self._saves_pending else []

    def _failed_forward(self, error: KvpoolError, now: float) -> list[Effect]:
        effects: list[Effect] = []
        if isinstance(error, DeviceCacheLost):
            # a later stage restarted: its device KV is gone, so no device hit holds on this pipeline
            self.blocks.forget_cached()
        effects += self._free_request()
        if self.cancelled:
            return effects + self._end_cancelled()
        how = retry_policy.replan(error, self.replans) if isinstance(error, (DeviceCacheLost, RestoreFellShort)) \
            else None
        if how is None:
            self.step = Step.ENDED
            failure = error if not isinstance(error, (DeviceCacheLost, RestoreFellShort)) \
                else Unavailable(f"prefill: {error}")
            return effects + [Failed(failure)]
        self.replans += 1
        self.use_pool = self.use_pool and how is not retry_policy.Replan.WITHOUT_POOL
        effects.append(PlannedAgain(how.value, str(error)))
        if self._saves_pending:  # the last attempt's saves let go of its blocks first
            self.step = Step.WAITING_SAVES
            return effects
        return effects + self._again(now)

    def _end_cancelled(self) -> list[Effect]:
        effects = self._release_lease() + self._free_request()
        self.step = Step.ENDED
        return effects + [Failed(None)]

    def _free_request(self) -> list[Effect]:
        if not self._held:
            return []
        self._held = False
        return self._free(self.request_id)

    def _free(self, holder: str) -> list[Effect]:
        self.blocks.free(holder)
        return [Freed((holder,))]

    def _expect(self, step: Step) -> None:
        if self.step is not step:
            raise FailedPrecondition(f"request {self.request_id}: is {self.step.value}, expected {step.value}")
