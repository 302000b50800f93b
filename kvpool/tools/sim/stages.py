"""A prefill pipeline's stages as a flow shop: each stage GPU does one thing at a time, requests overlap.

Stage 0 (the scheduler) admits a request when it is itself free and looks it up;
then every stage reads its share of the restore at once, as the services' do:
stage 0 sends the later stages their restores first thing in the request's
stream, and a stage's restore runs beside its compute of earlier requests
(``StageRunner.restore`` moves bytes on the engine's threads, not on the compute
lane), so a read never waits for its stage to finish another request. Each stage
then computes the request's pieces as the stage before hands them on. So while
stage 3 still computes one request, stage 0 already computes the next, and a
request's first stage starting and its last stage finishing lie further apart
as the load rises (the seed: 0.4-1.2 s).

Invariants: a stage's work never overlaps itself (``free_at`` only grows);
a stage starts a piece only after the stage before finished it; with every
stage idle the last stage ends at ``CostModel.compute_s`` after the restore.
"""

from __future__ import annotations

import math
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

    def schedule(self, read_end: float, times: StageTimes) -> list[float]:
        """Book one request whose restore has landed on every stage at ``read_end`` (stage 0's share, the
        later stages' and every remote server's bytes, read at once); each stage's compute end, in stage order.

        Stage ``s`` is ready at ``r_s`` (the read landed and its GPU free); piece ``k`` ends on it at
        ``max(its end of piece k - 1, stage s - 1's end of piece k) + p_k``. Every stage takes ``p_k`` for piece
        ``k``, so the last piece ends at ``max over j <= s of (r_j + (s - j) * max p) + sum p``: a path through
        the pieces and stages that steps down a stage on the longest piece (exact, no per-piece work).
        """
        ends = []
        ready = -math.inf  # max over the stages before of r_j + (s - j) * the longest piece
        for s in range(self.num_stages):
            # its GPU computes one request at a time (for stage 0 a no-op when it admits only when free; a
            # validation admits in the cluster's order)
            ready = max(ready + times.max_piece_s, read_end, self.free_at[s])
            end = ready + times.span_s
            self.free_at[s] = end
            ends.append(end)
        return ends
