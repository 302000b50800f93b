"""What a stage's restore of one request got and cost: ``RestoreFigures`` as the stage's runner counts
them, ``StageRestoreFigures`` the same tagged with the stage, as stage 0 collects them from every stage."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class RestoreFigures:
    num_chunks_requested: int
    num_chunks_restored: int = 0
    bytes: int = 0
    read_ms: float = 0.0  # reading and verifying: objects land straight in the pages
    # chunks whose object arrived but failed its checksum (stage 0 names their groups to the master)
    corrupt_chunk_indexes: list[int] = field(default_factory=list)


@dataclass(slots=True, frozen=True)
class StageRestoreFigures:
    """What one stage's restore of one request got and cost, as stage 0 collects them."""

    stage: int
    num_chunks_requested: int
    num_chunks_restored: int = 0
    bytes: int = 0
    read_ms: float = 0.0
    corrupt_chunk_indexes: tuple[int, ...] = ()  # chunks whose object failed its checksum

    @classmethod
    def of(cls, stage: int, figures: RestoreFigures) -> StageRestoreFigures:
        return cls(stage, figures.num_chunks_requested, figures.num_chunks_restored, figures.bytes,
                   figures.read_ms, tuple(figures.corrupt_chunk_indexes))
