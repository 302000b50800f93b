"""Upper bounds on prompt-token reuse for a replay, to report next to measured reuse.

- ``trace_block_bound``: the trace's own bound at its block granularity (any
  earlier occurrence of a block id in the session counts, prefix or not).
- ``chunk_prefix_bound``: what an unlimited PREFIX cache reaches at the serving
  system's chunk granularity on the token ids actually sent.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvpool.core.chunk_hash import ChunkHash, chunk_hashes
from kvpool.core.prefill.planner import max_hit_chunks
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


def chunk_prefix_bound(prompts: Iterable[Sequence[int]], chunk_size: int, namespace: str = "") -> BoundResult:
    """Reuse of an unlimited prefix cache of ``chunk_size``-token chunks, one cache for all prompts.

    For each prompt in order: hit = the leading full chunks whose chained hash
    was inserted before, capped at ``max_hit_chunks`` (at least one token is
    computed, as the hit planner does); then every full chunk of the prompt is
    inserted. Hit tokens are ``hit_chunks * chunk_size``. The hashes are the
    system's own (``kvpool.core.chunk_hash``); with the serving namespace they
    equal the pool's chunk names hash for hash.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    cache: set[ChunkHash] = set()
    hit_tokens: list[int] = []
    total = 0
    for prompt in prompts:
        hashes = chunk_hashes(namespace, prompt, chunk_size)
        cap = max_hit_chunks(len(prompt), chunk_size) if prompt else 0
        hits = 0
        while hits < cap and hashes[hits] in cache:
            hits += 1
        cache.update(hashes)
        hit_tokens.append(hits * chunk_size)
        total += len(prompt)
    return BoundResult(sum(hit_tokens) / total if total else 0.0, hit_tokens, total)
