"""The prefill → decode handoff: where every byte of a request's KV goes, and in which writes.

Pure: no torch, no I/O. Prefill splits the model by layers, decode keeps each
sequence token-major; the handoff meets in the middle with one receive region
per request that decode reserves and every prefill stage writes into.

Region layout (``HandoffLayout``): the stages' slabs back to back in stage
order; stage k's slab is layer-major over its own layers, then token, then
entry — the byte offset of token t of global layer l (in stage k, whose
layers are ``[start_k, end_k)``) is

    stage_offset(k) + ((l - start_k) * num_tokens + t) * entry_bytes

which is exactly what ``kvpool.model.pack_kv`` writes for a token range of a
stage, so a stage's gather is one pack into a registered slab. Decode scatters
the region into its token-major pages. After the KV (at ``trailer_offset``)
come ``trailer_bytes``: the final position's float32 logits, from which
decode samples the first token.

Streaming: a stage writes each token range of its layers as soon as its
forward has passed it (``range_transfers``): the range is gathered into a
slab ``[stage layers, tokens, entry]`` and lands as one write per layer (a
run of the range's tokens, cut at ``max_transfer_bytes``) at the offsets above.

Transfers: a stage writes its slab in pieces of at most ``max_transfer_bytes``
(8 MiB): one 8,192-token, 20-layer, 576-byte-entry stage (~94 MB) is 12
writes, where a per-token-per-layer copy would be 163,840 writes of 576 bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvpool.core.errors import InvalidArgument

MAX_TRANSFER_BYTES = 8 << 20


@dataclass(frozen=True, slots=True)
class Transfer:
    """One write: ``length`` bytes from ``offset`` of a stage's slab to the same offset of its part of the region."""

    offset: int
    length: int


@dataclass(frozen=True, slots=True)
class HandoffLayout:
    """The byte layout of one request's receive region (see the module doc).

    Invariant: ``layer_split`` tiles ``[0, num_layers)`` in order, so every
    (layer, token) pair has exactly one place and the slabs never overlap.
    """

    num_tokens: int
    layer_split: tuple[tuple[int, int], ...]
    entry_bytes: int
    trailer_bytes: int = 0

    def __post_init__(self) -> None:
        if self.trailer_bytes < 0:
            raise InvalidArgument(f"trailer_bytes: must be >= 0, got {self.trailer_bytes}")
        if self.num_tokens <= 0:
            raise InvalidArgument(f"num_tokens: must be positive, got {self.num_tokens}")
        if self.entry_bytes <= 0:
            raise InvalidArgument(f"entry_bytes: must be positive, got {self.entry_bytes}")
        if not self.layer_split:
            raise InvalidArgument("layer_split: must name at least one stage")
        expected = 0
        for k, (start, end) in enumerate(self.layer_split):
            if start != expected or end <= start:
                raise InvalidArgument(
                    f"layer_split[{k}]: ({start}, {end}) does not continue the split at layer {expected}"
                )
            expected = end

    @classmethod
    def of(cls, num_tokens: int, layer_split: Sequence[Sequence[int]], entry_bytes: int,
           trailer_bytes: int = 0) -> HandoffLayout:
        return cls(num_tokens, tuple((int(s), int(e)) for s, e in layer_split), entry_bytes, trailer_bytes)

    @property
    def num_stages(self) -> int:
        return len(self.layer_split)

    @property
    def num_layers(self) -> int:
        return self.layer_split[-1][1]

    def stage_nbytes(self, stage: int) -> int:
        start, end = self._stage(stage)
        return (end - start) * self.num_tokens * self.entry_bytes

    def stage_offset(self, stage: int) -> int:
        self._stage(stage)
        return sum(self.stage_nbytes(k) for k in range(stage))

    @property
    def kv_nbytes(self) -> int:
        return self.num_layers * self.num_tokens * self.entry_bytes

    @property
    def trailer_offset(self) -> int:
        return self.kv_nbytes

    @property
    def nbytes(self) -> int:
        return self.kv_nbytes + self.trailer_bytes

    def offset(self, layer: int, token: int) -> int:
        """Byte offset of one token's entry of one (global) layer in the region."""
        if not 0 <= token < self.num_tokens:
            raise InvalidArgument(f"token: {token} is outside 0..{self.num_tokens - 1}")
        for stage, (start, end) in enumerate(self.layer_split):
            if start <= layer < end:
                return self.stage_offset(stage) + ((layer - start) * self.num_tokens + token) * self.entry_bytes
        raise InvalidArgument(f"layer: {layer} is outside 0..{self.num_layers - 1}")

    def transfers(self, stage: int, max_transfer_bytes: int = MAX_TRANSFER_BYTES) -> list[Transfer]:
        """The writes of one stage's slab, in order, each at most ``max_transfer_bytes``."""
        return transfer_plan(self.stage_nbytes(stage), max_transfer_bytes)

    def _stage(self, stage: int) -> tuple[int, int]:
        if not 0 <= stage < len(self.layer_split):
            raise InvalidArgument(f"stage: {stage} is outside 0..{len(self.layer_split) - 1}")
        return self.layer_split[stage]


@dataclass(frozen=True, slots=True)
class RangeTransfer:
    """One write of a token range: ``length`` bytes from ``slab_offset`` of the range's slab to
    ``region_offset`` of the region."""

    slab_offset: int
    region_offset: int
    length: int


def range_transfers(layout: HandoffLayout, stage: int, token_start: int, token_end: int,
                    max_transfer_bytes: int = MAX_TRANSFER_BYTES) -> list[RangeTransfer]:
    """The writes of tokens ``[token_start, token_end)`` of one stage's layers, layer by layer.

    The range's slab is layer-major (``[layers, token_end - token_start, entry]``): layer i's run
    is contiguous in both slab and region, so it is one write, or several when past
    ``max_transfer_bytes``.
    """
    start, end = layout._stage(stage)
    if not 0 <= token_start < token_end <= layout.num_tokens:
        raise InvalidArgument(f"token range: [{token_start}, {token_end}) is not inside 0..{layout.num_tokens}")
    entry = layout.entry_bytes
    run = (token_end - token_start) * entry
    base = layout.stage_offset(stage)
    out = []
    for i in range(end - start):
        region = base + (i * layout.num_tokens + token_start) * entry
        for t in transfer_plan(run, max_transfer_bytes):
            out.append(RangeTransfer(i * run + t.offset, region + t.offset, t.length))
    return out


def transfer_plan(nbytes: int, max_transfer_bytes: int = MAX_TRANSFER_BYTES) -> list[Transfer]:
    """Cut ``nbytes`` into writes of at most ``max_transfer_bytes``, all full but the last."""
    if nbytes < 0 or max_transfer_bytes <= 0:
        raise InvalidArgument(f"transfer_plan({nbytes}, {max_transfer_bytes})")
    return [Transfer(offset, min(max_transfer_bytes, nbytes - offset)) for offset in range(0, nbytes, max_transfer_bytes)]


def num_naive_writes(num_tokens: int, num_layers: int) -> int:
    """Writes a direct per-token, per-layer copy needs: one per entry."""
    return num_tokens * num_layers
