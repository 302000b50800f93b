"""What one prefill did: the scheduler's answer, which stage 0's servicer sends as a ``PrefillResponse``."""

from __future__ import annotations

from dataclasses import dataclass

from kvpool.core.handoff.target import HandoffFigures
from kvpool.core.prefill.restore_figures import StageRestoreFigures


@dataclass(slots=True, frozen=True)
class PrefillFigures:
    """Where a prompt's tokens came from and what each phase cost; the token counts sum to
    ``num_prompt_tokens``."""

    num_prompt_tokens: int
    num_device_tokens: int
    num_pool_tokens: int
    num_computed_tokens: int
    num_pool_chunks_lost: int  # chunks the plan wanted from the pool that a stage could not restore
    restore: tuple[StageRestoreFigures, ...]  # each stage's, as pool_restore reports them
    restore_wait_ms: float
    compute_ms: float
    lookup_ms: float
    total_ms: float
    stage_compute_ms: tuple[float, ...]


@dataclass(slots=True, frozen=True)
class PrefillResult:
    """A finished prefill: nothing is held on the pipeline once it is made."""

    first_token: int  # the final position's argmax (greedy)
    request_id: str
    logits: bytes  # with return_logits only
    figures: PrefillFigures
    block_table: tuple[int, ...]
    block_size: int
    handoff: HandoffFigures | None = None  # with a target: what writing into decode's region cost, per stage
