"""A prefill pipeline's stages as a flow shop: each stage GPU does one thing at a time, requests overlap.

Stage 0 (the scheduler) admits a request when it is itself free, looks it up
and reads its share of the restore; every later stage reads its share once it
has finished the requests before (its GPU's reads and unpacks queue behind
its compute), then forwards the request's pieces as the stage before hands
them on. So while stage 3 still computes one request, stage 0 already
restores the next, and a request's first stage starting and its last stage
finishing lie further apart as the load rises (the seed: 0.4-1.2 s).

Invariants: a stage's work never overlaps itself (``free_at`` only grows);
a stage starts a piece only after the stage before finished it; with every
stage idle the last stage ends at ``CostModel.compute_s`` after the restore.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpool.tools.sim.cost_model import StageTimes


@dataclass(slots=True)
class StageFlow:
    """When each of ``num_stages`` stage GPUs is next free (simulated seconds)."""

    num_stages: int
    free_at: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.num_stages <= 0:
            raise ValueError(f"num_stages: must be positive, got {self.num_stages}")
        if not self.free_at:
            self.free_at = [0.0] * self.num_stages

    def schedule(self, read_from: float, stage0_read_end: float, read_s: float, times: StageTimes) -> list[float]:
        """Book one request; each stage's compute end, in stage order.

        ``read_from``: when the restore could start (the lookup served); ``stage0_read_end``: when stage 0's
        share (and every remote server's bytes) has landed; ``read_s``: one stage's share of the restore.
        """
        ends = []
        start = end = 0.0
        for s in range(self.num_stages):
            if s == 0:
                read_end = stage0_read_end
            else:
                read_end = max(stage0_read_end, max(read_from, self.free_at[s]) + read_s)
            if s == 0:
                # its GPU computes one request at a time (a no-op when stage 0 admits only when free; a
                # validation admits in the cluster's order)
                start = max(read_end, self.free_at[0])
                end = start + times.span_s
            else:
                start = max(read_end, start + times.first_piece_s)
                end = max(start + times.span_s, end + times.last_piece_s)
            self.free_at[s] = end
            ends.append(end)
        return ends
