"""The room admission counts — each decode shard's pages and receive arena, each prefill pipeline's device
blocks — and the tickets that hold it.

Pure. ``TicketBook`` (``kvpool.core.admission.tickets``) holds one room per
shard and per pipeline; their ``used_*`` fields are the sums over its live tickets.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvpool.core.decode.regions import REGION_ALIGNMENT
from kvpool.core.admission.routing import PipelineReason


class Locality(enum.Enum):
    """Why a request's decode shard is where it is (a metric label)."""

    SAME_SERVER = "same_server"  # the pipeline's own server had room
    LOCAL_FULL = "local_full"  # the pipeline's server has shards, none with room now
    NO_LOCAL_SHARD = "no_local_shard"  # no healthy shard on the pipeline's server
    OFF = "off"  # locality disabled: most free pages


@dataclass(frozen=True, slots=True)
class AdmissionRequest:
    request_id: str
    session_key: str
    num_prompt_tokens: int
    max_tokens: int
    # the prompt itself, for the queue's work estimate (the session's remembered prompts it extends)
    token_ids: Sequence[int] = field(default=(), compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class Ticket:
    """Room held for one request until ``release``."""

    request_id: str
    pipeline: str
    pipeline_reason: PipelineReason
    shard: str
    locality: Locality
    num_pages: int
    region_bytes: int
    queued_s: float
    tries: int = 1  # pipelines tried
    shard_tries: int = 1  # decode shards tried
    num_blocks: int = 0  # the pipeline's device blocks, held until ``prefill_ended``
    num_prompt_tokens: int = 0


@dataclass(frozen=True, slots=True)
class ShardShape:
    """What admission must know of a shard (from its Stats)."""

    num_pages: int
    page_size: int
    arena_bytes: int
    region_bytes_per_token: int  # every layer's KV entry of one prompt token
    region_trailer_bytes: int  # what follows the KV in a region (the final position's logits)
    max_context: int

    @property
    def max_prompt_tokens(self) -> int:
        """The longest prompt whose region fits the empty arena."""
        usable = self.arena_bytes // REGION_ALIGNMENT * REGION_ALIGNMENT - self.region_trailer_bytes
        return max(0, usable // max(1, self.region_bytes_per_token))

    def region_bytes(self, num_prompt_tokens: int) -> int:
        """A region's size in the arena (rounded as the arena rounds it)."""
        nbytes = num_prompt_tokens * self.region_bytes_per_token + self.region_trailer_bytes
        return -(-nbytes // REGION_ALIGNMENT) * REGION_ALIGNMENT


@dataclass(slots=True)
class ShardRoom:
    """One shard as admission counts it."""

    name: str
    server: str
    shape: ShardShape | None = None  # unknown until its first Stats
    healthy: bool = True
    used_pages: int = 0
    used_bytes: int = 0
    num_tickets: int = 0

    @property
    def free_pages(self) -> int:
        return self.shape.num_pages - self.used_pages if self.shape else 0

    def fits(self, num_pages: int, region_bytes: int) -> bool:
        return (self.shape is not None and num_pages <= self.free_pages
                and self.used_bytes + region_bytes <= self.shape.arena_bytes)


@dataclass(slots=True)
class PipelineRoom:
    """One prefill pipeline's device cache (stage 0's block table, mirrored by every stage) as admission
    counts it: ``used_blocks`` is the sum of ``blocks_for`` over the tickets still prefilling there.

    Counting every block of a prompt, shared prefix or not, is an upper bound of what stage 0 takes
    (a device hit shares blocks), so tickets that fit here always fit there at once.
    """

    name: str
    num_blocks: int = 0  # 0: unknown until its StageInfo
    block_size: int = 0
    used_blocks: int = 0
    work_scale: float = 1.0  # its seconds per second of estimated work, from its StageInfo

    @property
    def known(self) -> bool:
        return self.num_blocks > 0

    @property
    def max_prompt_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def blocks_for(self, num_prompt_tokens: int) -> int:
        """Stage 0's blocks of a prompt: every chunk, the partial last one included."""
        return -(-num_prompt_tokens // self.block_size) if self.block_size else 0

    def fits(self, num_prompt_tokens: int) -> bool:
        return self.known and self.used_blocks + self.blocks_for(num_prompt_tokens) <= self.num_blocks
