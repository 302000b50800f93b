"""The receive arena's control records: what a same-host writer and decode tell each other without a call.

Pure: no I/O, no clock. The records sit in shared memory after decode's
receive arena (decode owns them; a stage on the same host maps them with the
arena), one per region slot. A region's slot is its id modulo the number of
slots; decode issues ids so that no two live regions share one.

A record is 64-bit words:

- word 0, the fence: the region's id while prefill may write it, 0 otherwise.
  Decode sets it when it reserves the region and clears it when the region is
  given back, expires or is claimed by its Generate. A writer reads it right
  before each copy and copies only while it holds its region's id; a region
  given back keeps its bytes a grace period longer than a copy takes
  (``kvpool.core.decode.regions``).
- word 1, the trailer: the final logits landed.
- words 2.., one per stage: how many tokens of the stage's layers, from token
  0, have landed (the stage's landed frontier).

Words 1.. are stamped (``stamp``): the writer's nonce (16 bits), the region
id's low 24 bits and a 24-bit count. The id keeps a late write for a freed
region from reading as the next region's progress in the same slot. The nonce
names one attempt at writing the region: a request retried (a lost device
cache, a dead stage, another pipeline) writes the same region again, from token
0, under a new nonce, and decode, seeing the nonce change, scatters that stage
again from token 0 and scatters the whole region once more at Generate.

A writer rings decode's doorbell after it publishes, and decode scatters what
landed since it last looked (``Frontier`` is the writer's bookkeeping of ranges
that may finish out of order).

Invariants: a live region's slot holds its id or 0 in word 0; under one nonce
a published frontier only grows; a stamp's count fits 24 bits (no context holds
2**24 tokens); a nonce is never 0 (a cleared word is nobody's progress).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpool.core.errors import InvalidArgument

MAX_STAGES = 30  # words 2..31
RECORD_WORDS = 2 + MAX_STAGES
RECORD_BYTES = RECORD_WORDS * 8  # 256: four cache lines
COUNT_BITS = 24
COUNT_MASK = (1 << COUNT_BITS) - 1
ID_BITS = 24
ID_MASK = (1 << ID_BITS) - 1
NONCE_MASK = (1 << 16) - 1
FENCE, TRAILER, FIRST_STAGE = 0, 1, 2


@dataclass(frozen=True, slots=True)
class Progress:
    """One stage's published progress: whose attempt (``nonce``) and how far it reaches."""

    nonce: int
    count: int


def stamp(region_id: int, nonce: int, count: int) -> int:
    """A progress word: the writer's nonce, the region id's low bits, ``count``."""
    if not 0 <= count <= COUNT_MASK:
        raise InvalidArgument(f"count: {count} is outside 0..{COUNT_MASK}")
    if not 0 < nonce <= NONCE_MASK:
        raise InvalidArgument(f"nonce: {nonce} is outside 1..{NONCE_MASK}")
    return nonce << (ID_BITS + COUNT_BITS) | (region_id & ID_MASK) << COUNT_BITS | count


def unstamp(region_id: int, word: int) -> Progress | None:
    """The progress a word holds for ``region_id``; None when it is cleared or was stamped for another region."""
    nonce = word >> (ID_BITS + COUNT_BITS)
    if not nonce or (word >> COUNT_BITS) & ID_MASK != region_id & ID_MASK:
        return None
    return Progress(nonce, word & COUNT_MASK)


class ControlRecords:
    """The records over ``words`` (a writable memoryview of 64-bit words, ``slots * RECORD_WORDS`` of them)."""

    def __init__(self, words: memoryview, slots: int) -> None:
        if slots <= 0:
            raise InvalidArgument(f"slots: must be positive, got {slots}")
        if words.format != "Q" or len(words) < slots * RECORD_WORDS:
            raise InvalidArgument(f"words: need {slots * RECORD_WORDS} unsigned 64-bit words")
        self.words = words
        self.slots = slots

    @staticmethod
    def nbytes(slots: int) -> int:
        return slots * RECORD_BYTES

    def slot(self, region_id: int) -> int:
        return region_id % self.slots

    def record_offset(self, region_id: int) -> int:
        """The record's first byte, from the records' first."""
        return self.slot(region_id) * RECORD_BYTES

    def _base(self, region_id: int) -> int:
        return self.slot(region_id) * RECORD_WORDS

    def in_use(self, region_id: int) -> bool:
        """Whether a region whose id lands in this slot is open now."""
        return self.words[self._base(region_id) + FENCE] != 0

    def open(self, region_id: int) -> None:
        """A reserved region: progress cleared, then its fence up."""
        if region_id <= 0:
            raise InvalidArgument(f"region_id: must be positive, got {region_id}")
        base = self._base(region_id)
        if self.words[base + FENCE] not in (0, region_id):
            raise InvalidArgument(f"region_id: slot {self.slot(region_id)} is held by region "
                                  f"{self.words[base + FENCE]}")
        for i in range(1, RECORD_WORDS):
            self.words[base + i] = 0
        self.words[base + FENCE] = region_id

    def close(self, region_id: int) -> None:
        """No more writes into the region (given back, expired or claimed); idempotent."""
        base = self._base(region_id)
        if self.words[base + FENCE] == region_id:
            self.words[base + FENCE] = 0

    def fence_up(self, region_id: int) -> bool:
        """Whether prefill may write ``region_id`` now."""
        return region_id > 0 and self.words[self._base(region_id) + FENCE] == region_id

    def publish(self, region_id: int, stage: int, nonce: int, frontier: int, trailer: bool = False) -> None:
        """A writer's progress: ``stage``'s tokens ``[0, frontier)`` landed (and the trailer), in attempt
        ``nonce``."""
        if not 0 <= stage < MAX_STAGES:
            raise InvalidArgument(f"stage: {stage} is outside 0..{MAX_STAGES - 1}")
        base = self._base(region_id)
        self.words[base + FIRST_STAGE + stage] = stamp(region_id, nonce, frontier)
        if trailer:
            self.words[base + TRAILER] = stamp(region_id, nonce, 1)

    def progress(self, region_id: int, stage: int) -> Progress | None:
        """``stage``'s published progress for ``region_id``, if any."""
        return unstamp(region_id, self.words[self._base(region_id) + FIRST_STAGE + stage])

    def landed(self, region_id: int, num_stages: int) -> tuple[list[Progress | None], bool]:
        """Each stage's published progress for ``region_id`` (None where nothing is stamped for it) and whether
        the trailer landed."""
        base = self._base(region_id)
        progress = [unstamp(region_id, self.words[base + FIRST_STAGE + s]) for s in range(min(num_stages, MAX_STAGES))]
        trailer = unstamp(region_id, self.words[base + TRAILER])
        return progress, trailer is not None and trailer.count == 1


def fresh_nonce(previous: Progress | None, draw: int) -> int:
    """A writer's nonce for a new attempt: from ``draw`` (any random integer), never 0 and never the nonce of
    the progress already published for its stage, so decode always sees the attempt change."""
    nonce = draw % NONCE_MASK + 1
    if previous is not None and nonce == previous.nonce:
        nonce = nonce % NONCE_MASK + 1
    return nonce


@dataclass(slots=True)
class Frontier:
    """A writer's landed ranges of one stage, which may finish out of order; ``value`` is how far from token 0
    they reach without a gap."""

    value: int = 0
    pending: list[tuple[int, int]] = field(default_factory=list)

    def land(self, start: int, end: int) -> int:
        """Record ``[start, end)`` landed; the frontier after it."""
        if start < end:
            self.pending.append((start, end))
        self.pending.sort()
        while self.pending and self.pending[0][0] <= self.value:
            self.value = max(self.value, self.pending.pop(0)[1])
        return self.value
