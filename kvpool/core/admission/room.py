"""What admission knows of each decode shard and prefill pipeline, and the tickets that place requests.

Pure. The owners count their room: a shard its pages and receive arena, stage 0 its device blocks.
Admission keeps their fixed shapes (to refuse a request that could never fit) and whether a shard said
it has no room now; ``TicketBook`` (``kvpool.core.admission.tickets``) holds the live tickets.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvpool.core.decode.pages import pages_for_request
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
    tenant: str = ""  # the API key's: the queue shares its order between tenants by weight


@dataclass(frozen=True, slots=True)
class Ticket:
    """A request's placement, until ``release``: its shard holds the room (the shard counts it, the
    router does not), its pipeline the device blocks."""

    request_id: str
    pipeline: str
    pipeline_reason: PipelineReason
    shard: str
    locality: Locality
    queued_s: float
    arrived_at: float  # when it reached admission (the caller's clock): a refused one queues again by it
    tries: int = 1  # pipelines tried
    shard_tries: int = 1  # decode shards tried
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
class ShardState:
    """What admission knows of a shard: its shape (fixed while it lives), its health, and what it said it has
    no room for — never a count of its pages or arena, which only the shard holds.

    ``refused``: the needs (pages, region bytes) of the requests it refused since it last said room came
    back (``epoch``: the latest give-back count it told), the smallest kept: a request needing as much as
    one of them in both takes no ticket there until it says so; a smaller one may ask. ``probing``: it
    refused a request, so one ticket at a time goes there (``unconfirmed``: tickets whose Serve has not
    answered yet) until one is confirmed with nobody queued, and freed room does not draw the whole
    queue at it.
    """

    name: str
    server: str
    shape: ShardShape | None = None  # unknown until its first Stats
    healthy: bool = True
    num_tickets: int = 0
    refused: list[tuple[int, int]] = field(default_factory=list)
    probing: bool = False
    epoch: int = -1
    watched: bool = False  # it tells room given back (WatchRoom); else the router's own releases and health do
    unconfirmed: set[str] = field(default_factory=set)

    @property
    def full(self) -> bool:
        """It refused a request and has not said room came back since."""
        return bool(self.refused)

    def needs(self, request: AdmissionRequest) -> tuple[int, int]:
        """The request's pages and region bytes here."""
        assert self.shape is not None
        return (pages_for_request(request.num_prompt_tokens, request.max_tokens, self.shape.page_size),
                self.shape.region_bytes(request.num_prompt_tokens))

    def refuse(self, request: AdmissionRequest) -> None:
        """It had no room for ``request``: nor for any request needing as much in both."""
        pages, nbytes = self.needs(request)
        self.refused = [(p, b) for p, b in self.refused if p < pages or b < nbytes] + [(pages, nbytes)]
        self.probing = True

    def can_ever_hold(self, num_prompt_tokens: int, max_tokens: int) -> bool:
        shape = self.shape
        return (shape is not None and num_prompt_tokens + max_tokens <= shape.max_context
                and pages_for_request(num_prompt_tokens, max_tokens, shape.page_size) <= shape.num_pages
                and shape.region_bytes(num_prompt_tokens) <= shape.arena_bytes)

    def takes(self, request: AdmissionRequest) -> bool:
        """A ticket for ``request`` may go here now (the shard itself decides whether it has the room)."""
        if not (self.healthy and not (self.probing and self.unconfirmed)
                and self.can_ever_hold(request.num_prompt_tokens, request.max_tokens)):
            return False
        pages, nbytes = self.needs(request)
        return not any(pages >= p and nbytes >= b for p, b in self.refused)


@dataclass(slots=True)
class PipelineState:
    """What admission knows of a prefill pipeline: the longest prompt its device cache holds (fixed while
    stage 0 lives) and its measured speed. Stage 0 owns its device blocks and waits for them itself."""

    name: str
    max_prompt_tokens: int = 0  # 0: unknown until its StageInfo
    work_scale: float = 1.0  # its seconds per second of estimated work, from its StageInfo

    @property
    def known(self) -> bool:
        return self.max_prompt_tokens > 0
