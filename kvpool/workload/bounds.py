"""Upper bounds on prompt-token reuse for a replay, to report next to measured reuse.

- ``trace_block_bound``: the trace's own bound at its block granularity (any
  earlier occurrence of a block id in the session counts, prefix or not).
- ``chunk_prefix_bound``: what an unlimited PREFIX cache reaches at the serving
  system's chunk granularity on the token ids actually sent.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import xxhash

from kvpool.workload.weka import Session


def trace_block_bound(sessions: Iterable[Session]) -> float:
    """Share of input tokens in blocks whose hash id appeared in an earlier turn of the same session.

    Tokens per block: ``block_size``, except a last partial block (``ceil`` ids)
    which has ``input_tokens % block_size``. An id-less tail (``floor`` ids, as
    in the real files) is never counted as reused. The denominator is the sum of
    ``input_tokens`` over all turns. Turns are taken in ``Session.turns`` order
    (absolute time, subagents flattened in). Returns 0.0 for no input.
    """
    reused = total = 0
    for session in sessions:
        block_size = session.block_size
        seen: set[int] = set()
        for turn in session.turns:
            total += turn.input_tokens
            last = len(turn.hash_ids) - 1
            for i, hash_id in enumerate(turn.hash_ids):
                if hash_id in seen:
                    reused += block_size if i < last else turn.input_tokens - block_size * last
            seen.update(turn.hash_ids)  # after the turn: only earlier turns count
    return reused / total if total else 0.0


@dataclass(slots=True, frozen=True)
class BoundResult:
    """``ratio = sum(hit_tokens) / total_tokens``; ``hit_tokens[i]`` is prompt i's hit."""

    ratio: float
    hit_tokens: list[int]
    total_tokens: int


def chunk_hashes(tokens: Sequence[int], chunk_size: int) -> list[bytes]:
    """Chained hashes of the full chunks: ``h_i = xxh3_128(h_{i-1} || uint32 tokens of chunk i)``.

    ``h_i`` depends on the whole prefix up to chunk i, so equal prefixes ↔ equal
    hashes (up to 128-bit collisions). A trailing partial chunk has no hash.
    """
    words = array("I", tokens).tobytes()  # raises OverflowError for ids outside uint32
    step = 4 * chunk_size
    hashes: list[bytes] = []
    previous = b""
    for start in range(0, len(tokens) // chunk_size * step, step):
        previous = xxhash.xxh3_128_digest(previous + words[start : start + step])
        hashes.append(previous)
    return hashes


def chunk_prefix_bound(prompts: Iterable[Sequence[int]], chunk_size: int) -> BoundResult:
    """Reuse of an unlimited prefix cache of ``chunk_size``-token chunks, one cache for all prompts.

    For each prompt in order: hit = the leading full chunks whose chained hash
    was inserted before, capped at ``(len(prompt) - 1) // chunk_size`` chunks so
    at least one token is computed; then every full chunk of the prompt is
    inserted. Hit tokens are ``hit_chunks * chunk_size``.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    cache: set[bytes] = set()
    hit_tokens: list[int] = []
    total = 0
    for prompt in prompts:
        hashes = chunk_hashes(prompt, chunk_size)
        cap = max(0, (len(prompt) - 1) // chunk_size)
        hits = 0
        while hits < cap and hashes[hits] in cache:
            hits += 1
        cache.update(hashes)
        hit_tokens.append(hits * chunk_size)
        total += len(prompt)
    return BoundResult(sum(hit_tokens) / total if total else 0.0, hit_tokens, total)
