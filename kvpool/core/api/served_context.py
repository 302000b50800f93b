"""The context a cluster serves: what ``/v1/models`` advertises and the front door enforces.

Pure. The model's context is only an upper bound: a request also needs its
prompt in a prefill pipeline's device cache, its whole KV in a decode
shard's pages, and its prompt's KV in that shard's receive arena. The served
context is the largest ``C`` such that any request with
``prompt + max_tokens <= C`` (and at least one of each) fits every pipeline
and every shard, so a request within it is never refused for size wherever
the router places it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from kvpool.core.decode.regions import REGION_ALIGNMENT


@dataclass(frozen=True, slots=True)
class ShardLimits:
    """What bounds one decode shard's requests (from its Stats)."""

    max_context: int
    num_pages: int
    page_size: int
    arena_bytes: int
    region_bytes_per_token: int  # every layer's KV entry of one prompt token
    region_trailer_bytes: int = 0  # what follows the KV in a region

    def max_prompt_in_arena(self) -> int:
        """The longest prompt whose region (rounded as the arena rounds it) fits the arena."""
        usable = self.arena_bytes // REGION_ALIGNMENT * REGION_ALIGNMENT - self.region_trailer_bytes
        return max(0, usable // max(1, self.region_bytes_per_token))

    def max_kv_tokens(self) -> int:
        return self.num_pages * self.page_size


def served_context(model_context: int, pipeline_prompt_limits: Iterable[int], shards: Iterable[ShardLimits]) -> int:
    """min over every limit; a prompt limit P allows a context of P + 1 (the prompt plus one output token), and
    decode caches every token but the last, so ``num_pages * page_size`` KV entries allow one more."""
    context = model_context
    for limit in pipeline_prompt_limits:
        context = min(context, limit + 1)
    for shard in shards:
        context = min(context, shard.max_context, shard.max_kv_tokens() + 1, shard.max_prompt_in_arena() + 1)
    return max(context, 0)
