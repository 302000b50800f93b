"""The restore plan: how a prompt splits into device hit → pool hit → compute.

Pure: no grpc, no torch, no I/O.

Invariants of every ``RestorePlan``:
- ``num_device_tokens + num_pool_tokens + num_computed_tokens == num_tokens``;
- hits are whole chunks, device first, the pool continuing where the device
  hit ends (a prefix counts only as far as every stage can load it);
- at least one token is computed: the last position's logits are needed, so
  hit chunks ≤ ``(num_tokens - 1) // chunk_size``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from kvpool.core.errors import InvalidArgument


@dataclass(frozen=True, slots=True)
class RestorePlan:
    num_tokens: int
    chunk_size: int
    num_device_chunks: int
    num_pool_chunks: int

    def __post_init__(self) -> None:
        if self.num_tokens <= 0 or self.chunk_size <= 0:
            raise InvalidArgument(f"num_tokens and chunk_size must be positive: {self}")
        if self.num_device_chunks < 0 or self.num_pool_chunks < 0:
            raise InvalidArgument(f"chunk counts must be non-negative: {self}")
        if self.num_hit_chunks > max_hit_chunks(self.num_tokens, self.chunk_size):
            raise InvalidArgument(f"hit leaves no token to compute: {self}")

    @property
    def num_hit_chunks(self) -> int:
        return self.num_device_chunks + self.num_pool_chunks

    @property
    def num_device_tokens(self) -> int:
        return self.num_device_chunks * self.chunk_size

    @property
    def num_pool_tokens(self) -> int:
        return self.num_pool_chunks * self.chunk_size

    @property
    def num_cached_tokens(self) -> int:
        """Tokens whose KV is not computed: device hit + pool hit."""
        return self.num_hit_chunks * self.chunk_size

    @property
    def compute_start(self) -> int:
        """Token index where computation starts (== ``num_cached_tokens``)."""
        return self.num_cached_tokens

    @property
    def num_computed_tokens(self) -> int:
        return self.num_tokens - self.compute_start

    @property
    def pool_chunk_range(self) -> range:
        """Chunk indices to restore from the pool."""
        return range(self.num_device_chunks, self.num_hit_chunks)


def max_hit_chunks(num_tokens: int, chunk_size: int) -> int:
    """Most chunks a prompt may take from caches and still compute one token."""
    return (num_tokens - 1) // chunk_size


def plan_restore(
    num_tokens: int,
    chunk_size: int,
    num_chunks_hashed: int,
    num_device_chunks: int,
    num_pool_chunks_after_device: int,
) -> RestorePlan:
    """Cap the device hit, then the pool hit after it, at the hit limit.

    ``num_device_chunks`` is the block manager's ``match_prefix``;
    ``num_pool_chunks_after_device`` counts leading chunks after the device
    hit whose whole group is in the pool (the caller's lookup ensures that).
    A device hit cut by the cap leaves its last chunk(s) to be recomputed.
    """
    if num_chunks_hashed < 0 or num_device_chunks < 0 or num_pool_chunks_after_device < 0:
        raise InvalidArgument(
            "chunk counts must be non-negative, got "
            f"{num_chunks_hashed=}, {num_device_chunks=}, {num_pool_chunks_after_device=}"
        )
    if num_tokens <= 0 or chunk_size <= 0:
        raise InvalidArgument(f"num_tokens and chunk_size must be positive, got {num_tokens}, {chunk_size}")
    limit = min(num_chunks_hashed, max_hit_chunks(num_tokens, chunk_size))
    num_device = min(num_device_chunks, limit)
    num_pool = min(num_pool_chunks_after_device, limit - num_device)
    return RestorePlan(num_tokens, chunk_size, num_device, num_pool)


# ---- one stage's share of a restore --------------------------------------------


def chunks_that_fit(num_chunks: int, chunk_nbytes: int, largest_free: int, alignment: int = 1) -> int:
    """How many of ``num_chunks`` objects one staging region can take now.

    A restore that finds its staging arena too full restores fewer chunks
    (the leading ones) and leaves the rest to be computed, rather than wait.
    The region is ``n * chunk_nbytes`` rounded up to ``alignment``.
    """
    if num_chunks < 0 or chunk_nbytes <= 0 or alignment <= 0:
        raise InvalidArgument(f"chunks_that_fit({num_chunks}, {chunk_nbytes}, alignment={alignment})")
    n = min(num_chunks, largest_free // chunk_nbytes)
    while n > 0 and -(-n * chunk_nbytes // alignment) * alignment > largest_free:
        n -= 1
    return n


def leading_count(flags: Iterable[bool]) -> int:
    """Length of the leading run of true flags: a chunk is useless without the ones before it."""
    count = 0
    for flag in flags:
        if not flag:
            break
        count += 1
    return count
