"""Which parts of a receive region have landed: decode starts a request only once all have.

Pure: no torch, no I/O. Prefill stages write a region in token ranges of
their layers as their forward passes them (``kvpool.core.handoff.layout``),
and tell decode after each range's last byte arrived. ``LandedParts`` keeps,
per stage, the token ranges landed so far (merged), and whether the trailer
(the final logits) has.

Invariants: a stage's landed ranges are disjoint, sorted and merged, and lie
inside ``[0, num_tokens)``; ``complete`` is true exactly when every stage
covers ``[0, num_tokens)`` and the trailer, if the layout has one, landed.
A range may land twice (a retried notice): landing is idempotent.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpool.core.errors import InvalidArgument
from kvpool.core.handoff.layout import HandoffLayout


@dataclass(slots=True)
class LandedParts:
    """Landed token ranges per stage of one region (see the module doc)."""

    layout: HandoffLayout
    ranges: list[list[tuple[int, int]]] = field(default_factory=list)
    trailer_landed: bool = False

    def __post_init__(self) -> None:
        if not self.ranges:
            self.ranges = [[] for _ in range(self.layout.num_stages)]

    def check(self, stage: int, token_start: int, token_end: int, trailer: bool) -> None:
        """Raise InvalidArgument naming the field unless the notice fits the layout."""
        if not 0 <= stage < self.layout.num_stages:
            raise InvalidArgument(f"stage: {stage} is outside 0..{self.layout.num_stages - 1}")
        if (token_start, token_end) != (0, 0) and not 0 <= token_start < token_end <= self.layout.num_tokens:
            raise InvalidArgument(
                f"token_end: [{token_start}, {token_end}) is not a token range inside 0..{self.layout.num_tokens}")
        if trailer and not self.layout.trailer_bytes:
            raise InvalidArgument("trailer: the region has no trailer")

    def land(self, stage: int, token_start: int, token_end: int, trailer: bool = False) -> None:
        """Record that tokens ``[token_start, token_end)`` of ``stage`` (and the trailer) landed."""
        self.check(stage, token_start, token_end, trailer)
        if trailer:
            self.trailer_landed = True
        if token_start == token_end:
            return
        merged: list[tuple[int, int]] = []
        start, end = token_start, token_end
        for a, b in self.ranges[stage]:
            if b < start or a > end:
                merged.append((a, b))
            else:
                start, end = min(a, start), max(b, end)
        merged.append((start, end))
        self.ranges[stage] = sorted(merged)

    def forget(self, stage: int) -> None:
        """Forget what landed of ``stage`` (it is being written again)."""
        self.ranges[stage] = []

    def frontier(self, stage: int) -> int:
        """How far ``stage``'s landed tokens reach from token 0 without a gap."""
        ranges = self.ranges[stage]
        return ranges[0][1] if ranges and ranges[0][0] == 0 else 0

    def stage_complete(self, stage: int) -> bool:
        return self.ranges[stage] == [(0, self.layout.num_tokens)]

    @property
    def complete(self) -> bool:
        trailer = self.trailer_landed or not self.layout.trailer_bytes
        return trailer and all(self.stage_complete(k) for k in range(self.layout.num_stages))

    @property
    def any_landed(self) -> bool:
        return self.trailer_landed or any(self.ranges)
