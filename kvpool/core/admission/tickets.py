"""Admission's ticket book: every decode shard's and prefill pipeline's room, and the live tickets that hold it.

Pure. ``Admission`` (``kvpool.core.admission.admission``) decides who gets a ticket
and when (the queue, health, retries); the book counts what a ticket holds,
picks its shard and moves it.

Rules:
- A ticket holds, for the request's whole life, ``pages_for_request`` pages
  and one receive region (``region_bytes``) on its shard, and an in-flight
  slot on its pipeline (``RoutingPolicy`` counts those). Until its first
  token is out (``Admission.prefill_ended``: no move prefills it again) it
  also holds its prompt's device blocks on its pipeline (``num_blocks``,
  every chunk counted, shared prefix or not). The sums over live tickets
  never exceed a shard's pages or arena, nor a pipeline's device cache, so
  the shard and stage 0 always have the room the router promised: an
  admitted request is never failed for lack of room. (Stage 0 may still
  wait, briefly, for blocks a finished request's pool saves read: those end
  within the saves' own bounds.)
- A request that can never fit (its prompt beyond every pipeline's device
  cache, or prompt + max_tokens beyond every shard's context, pages or
  arena) is refused (``check``) with the field and the limit named.
- Locality: the shard on the pipeline's own server while it has room, else
  the one with the most free pages; the reason is a metric label.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

from kvpool.core.admission.room import AdmissionRequest, Locality, PipelineRoom, ShardRoom, Ticket
from kvpool.core.decode.pages import pages_for_request
from kvpool.core.errors import InvalidArgument
from kvpool.core.admission.routing import PipelineReason


class TicketBook:
    """Rooms and live tickets (see the module doc).

    Invariants: for every shard, ``used_pages``/``used_bytes``/``num_tickets``
    are the sums over its live tickets and never exceed its shape; for every
    pipeline, ``used_blocks`` is the sum of ``num_blocks`` over its tickets
    still prefilling and never exceeds its ``num_blocks``.
    """

    def __init__(self, shard_servers: dict[str, str], pipeline_servers: dict[str, str], locality: bool) -> None:
        self.shards = {name: ShardRoom(name, server) for name, server in shard_servers.items()}
        self.pipeline_servers = dict(pipeline_servers)
        self.pipelines = {name: PipelineRoom(name) for name in pipeline_servers}
        self.locality = locality
        self._tickets: dict[str, Ticket] = {}
        self._prefilling: set[str] = set()  # tickets whose blocks their pipeline still counts

    @property
    def pipeline_max_prompt(self) -> dict[str, int]:
        """The longest prompt each known pipeline's device cache holds."""
        return {name: p.max_prompt_tokens for name, p in self.pipelines.items() if p.known}

    def check(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """InvalidArgument naming the field and the limit unless the request could ever fit."""
        if num_prompt_tokens <= 0:
            raise InvalidArgument(f"prompt: must hold at least one token, got {num_prompt_tokens}", field="prompt")
        if max_tokens <= 0:
            raise InvalidArgument(f"max_tokens: must be positive, got {max_tokens}", field="max_tokens")
        if limits := self.pipeline_max_prompt:
            limit = max(limits.values())
            if num_prompt_tokens > limit:
                raise InvalidArgument(f"prompt: {num_prompt_tokens} tokens, a prefill device cache holds "
                                      f"{limit} at most", field="prompt")
        shapes = [s.shape for s in self.shards.values() if s.shape is not None]
        if not shapes:
            return  # nothing known yet: the shards check it themselves
        context = max(s.max_context for s in shapes)
        if num_prompt_tokens + max_tokens > context:
            raise InvalidArgument(f"max_tokens: a {num_prompt_tokens}-token prompt plus {max_tokens} tokens "
                                  f"exceeds the model's context of {context}", field="max_tokens")
        if not any(pages_for_request(num_prompt_tokens, max_tokens, s.page_size) <= s.num_pages for s in shapes):
            limit = max(s.num_pages * s.page_size for s in shapes)
            raise InvalidArgument(f"max_tokens: a {num_prompt_tokens}-token prompt plus {max_tokens} tokens "
                                  f"exceeds every decode shard's {limit} KV tokens", field="max_tokens")
        if not any(s.region_bytes(num_prompt_tokens) <= s.arena_bytes for s in shapes):
            limit = max(s.max_prompt_tokens for s in shapes)
            raise InvalidArgument(f"prompt: {num_prompt_tokens} tokens, a decode receive arena takes "
                                  f"{limit} at most", field="prompt")

    # ---- tickets -------------------------------------------------------------

    def ticket(self, request_id: str) -> Ticket | None:
        return self._tickets.get(request_id)

    def tickets(self) -> list[Ticket]:
        return list(self._tickets.values())

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._tickets

    def __len__(self) -> int:
        return len(self._tickets)

    def is_prefilling(self, request_id: str) -> bool:
        return request_id in self._prefilling

    def may_move(self, ticket: Ticket) -> bool:
        """The ticket is live as it is (not ended, not moved since) and its request still prefilling
        (no first token yet): a retry may move it."""
        return self._tickets.get(ticket.request_id) == ticket and ticket.request_id in self._prefilling

    def fitting(self, request: AdmissionRequest) -> list[ShardRoom]:
        """The healthy shards with room for ``request`` now."""
        return [s for s in self.shards.values() if s.healthy and s.shape is not None
                and s.fits(pages_for_request(request.num_prompt_tokens, request.max_tokens, s.shape.page_size),
                           s.shape.region_bytes(request.num_prompt_tokens))]

    def issue(self, ticket: Ticket, shard: ShardRoom, request: AdmissionRequest) -> Ticket:
        """A new ticket, prefilling, with ``shard``'s room for ``request``."""
        self.start_prefill(ticket)
        return self.hold(ticket, shard, request)

    def end(self, request_id: str) -> Ticket | None:
        """The request ended: its ticket (None: it had none) and all the room it held go back."""
        ticket = self._tickets.pop(request_id, None)
        if ticket is not None:
            self.end_prefill(ticket)
            self._give_back_shard(ticket)
        return ticket

    def start_prefill(self, ticket: Ticket) -> None:
        self.pipelines[ticket.pipeline].used_blocks += ticket.num_blocks
        self._prefilling.add(ticket.request_id)

    def end_prefill(self, ticket: Ticket) -> None:
        if ticket.request_id in self._prefilling:
            self._prefilling.discard(ticket.request_id)
            self.pipelines[ticket.pipeline].used_blocks -= ticket.num_blocks

    def move_pipeline(self, ticket: Ticket, pipeline: str, reason: PipelineReason) -> Ticket:
        """The ticket on ``pipeline`` instead, prefilling there (one more try); its shard's room stays."""
        self.end_prefill(ticket)
        room = self.pipelines[pipeline]
        moved = replace(ticket, pipeline=pipeline, pipeline_reason=reason, tries=ticket.tries + 1,
                        num_blocks=room.blocks_for(ticket.num_prompt_tokens))
        self.start_prefill(moved)
        self._tickets[ticket.request_id] = moved
        return moved

    def move_shard(self, ticket: Ticket, request: AdmissionRequest) -> Ticket | None:
        """The ticket on another healthy shard with room now, taking that room and giving the old back
        (one more try); None when no other shard has room (nothing changes)."""
        fitting = [s for s in self.fitting(request) if s.name != ticket.shard]
        if not fitting:
            return None
        self._give_back_shard(ticket)
        shard, locality = self.pick_shard(fitting, self.pipeline_servers[ticket.pipeline])
        moved = self.hold(replace(ticket, shard=shard.name, locality=locality, shard_tries=ticket.shard_tries + 1),
                          shard, request)
        return moved

    def hold(self, ticket: Ticket, shard: ShardRoom, request: AdmissionRequest) -> Ticket:
        """The ticket with ``shard``'s room for ``request``, counted there and live."""
        assert shard.shape is not None  # fitting shards have a shape
        ticket = replace(ticket, num_pages=pages_for_request(request.num_prompt_tokens, request.max_tokens,
                                                             shard.shape.page_size),
                         region_bytes=shard.shape.region_bytes(request.num_prompt_tokens))
        shard.used_pages += ticket.num_pages
        shard.used_bytes += ticket.region_bytes
        shard.num_tickets += 1
        self._tickets[request.request_id] = ticket
        return ticket

    def pick_shard(self, fitting: list[ShardRoom], server: str) -> tuple[ShardRoom, Locality]:
        """Of ``fitting``, the shard for a pipeline on ``server``, and why (the locality rule)."""
        def most_free(shards: Iterable[ShardRoom]) -> ShardRoom:
            return min(shards, key=lambda s: (-s.free_pages, s.num_tickets, s.name))

        if not self.locality:
            return most_free(fitting), Locality.OFF
        local = [s for s in fitting if s.server == server]
        if local:
            return most_free(local), Locality.SAME_SERVER
        has_local = any(s.healthy and s.server == server for s in self.shards.values())
        return most_free(fitting), Locality.LOCAL_FULL if has_local else Locality.NO_LOCAL_SHARD

    def _give_back_shard(self, ticket: Ticket) -> None:
        shard = self.shards[ticket.shard]
        shard.used_pages -= ticket.num_pages
        shard.used_bytes -= ticket.region_bytes
        shard.num_tickets -= 1
