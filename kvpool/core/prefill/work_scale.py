"""Work estimates in this host's seconds: the reference GPUs' estimate times a measured factor.

Pure: no grpc, no I/O; times come in as numbers.

``prefill_work_s`` (kvpool.core.prefill.queue) estimates a prompt's work with
``WorkWeights``, the seed's GPUs' speed. An order needs only its ratios, but the
bypass budget (``--sched-max-bypass-s``) and the response-ratio order mix it
with seconds of the wall clock, so on any other hardware they meant another
host's seconds. ``WorkScale`` measures the factor: stage 0 reports each forward
piece's compute time against the estimate of the same piece, and the factor is
the ratio of the two sums, each decayed by half every ``half_life`` pieces (so
it follows a host whose load changes, and one slow piece moves it little).
Until ``min_estimated_s`` of estimated work was observed the factor is 1 (the
reference speed: what the estimates meant before). ``host_work_s`` then gives a
prompt's work as this host takes it: the computed tokens' estimate times the
factor, plus the restore at the restore time measured per chunk (reads are not
compute, so the compute factor does not apply to them). The router scales its
own estimates by the pipelines' factors (their StageInfo). The simulator's
pipelines estimate with their cost model's own weights
(kvpool/tools/sim/engine.py), so their factor is 1 by construction and their
restore is the cost model's.

Invariants: ``factor`` is finite and within [MIN_FACTOR, MAX_FACTOR]; it is 1
until enough was observed; observations with a non-finite or negative time, or
no estimate, are refused (InvalidArgument), never folded in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvpool.core.errors import InvalidArgument
from kvpool.core.prefill.queue import WorkWeights, prefill_work_s

REFERENCE_WEIGHTS = WorkWeights()  # the seed's GPUs: what an estimate means before any is measured
MIN_FACTOR = 1e-3  # 1,000x faster than the reference GPUs
MAX_FACTOR = 1e4  # 10,000x slower (a CPU running a real model's shape)


def bounded_factor(factor: float) -> float:
    """A factor within [MIN_FACTOR, MAX_FACTOR] (measured here, or reported by a pipeline)."""
    return min(MAX_FACTOR, max(MIN_FACTOR, factor))


@dataclass(slots=True)
class WorkScale:
    half_life: float = 64.0  # pieces
    min_estimated_s: float = 0.01  # of reference-GPU work observed before the factor moves from 1
    _measured: float = field(default=0.0, init=False)  # decayed sums
    _estimated: float = field(default=0.0, init=False)
    estimated_total_s: float = field(default=0.0, init=False)  # every estimate observed, undecayed
    num_observed: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        if not (self.half_life > 0 and math.isfinite(self.half_life)):
            raise InvalidArgument(f"half_life: must be a positive number, got {self.half_life}")
        if not (self.min_estimated_s >= 0 and math.isfinite(self.min_estimated_s)):
            raise InvalidArgument(f"min_estimated_s: must be >= 0, got {self.min_estimated_s}")

    def observe(self, estimated_s: float, measured_s: float) -> None:
        """One piece: its estimate at the reference speed and what its compute took here."""
        if not (estimated_s > 0 and math.isfinite(estimated_s)):
            raise InvalidArgument(f"estimated_s: must be a positive number, got {estimated_s}")
        if not (measured_s >= 0 and math.isfinite(measured_s)):
            raise InvalidArgument(f"measured_s: must be >= 0, got {measured_s}")
        keep = 0.5 ** (1.0 / self.half_life)
        self._measured = self._measured * keep + measured_s
        self._estimated = self._estimated * keep + estimated_s
        self.estimated_total_s += estimated_s
        self.num_observed += 1

    def observe_piece(self, start: int, stop: int, measured_s: float,
                      weights: WorkWeights = REFERENCE_WEIGHTS) -> None:
        """A forward piece of tokens [start, stop) (at their context) took ``measured_s`` on one stage."""
        if not 0 <= start < stop:
            raise InvalidArgument(f"piece: [{start}, {stop}) holds no tokens")
        self.observe(prefill_work_s(stop, start, 0, weights), measured_s)

    @property
    def factor(self) -> float:
        """This host's seconds per reference second of compute (1 until enough was observed)."""
        if not self.num_observed or self.estimated_total_s < self.min_estimated_s:
            return 1.0
        return bounded_factor(self._measured / self._estimated)


def host_work_s(num_tokens: int, num_cached_tokens: int, num_restore_chunks: int, weights: WorkWeights,
                factor: float, restore_s_per_chunk: float) -> float:
    """A prompt's work in this host's seconds: computing tokens ``[num_cached_tokens, num_tokens)`` (the
    reference estimate times ``factor``) plus restoring ``num_restore_chunks`` at the measured time a chunk."""
    if not (factor > 0 and math.isfinite(factor)) or not (
            restore_s_per_chunk >= 0 and math.isfinite(restore_s_per_chunk)):
        raise InvalidArgument(f"host_work_s: factor {factor}, restore_s_per_chunk {restore_s_per_chunk}")
    if num_restore_chunks < 0:
        raise InvalidArgument(f"num_restore_chunks: must be >= 0, got {num_restore_chunks}")
    return prefill_work_s(num_tokens, num_cached_tokens, 0, weights) * factor + num_restore_chunks * restore_s_per_chunk
