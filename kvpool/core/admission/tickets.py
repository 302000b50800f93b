"""Admission's ticket book: what it knows of every decode shard and prefill pipeline, and the live tickets.

Pure. ``Admission`` (``kvpool.core.admission.admission``) decides who gets a ticket
and when (the queue, health, retries); the book holds the tickets, picks a
ticket's shard and moves it.

Rules:
- A ticket places a request: a pipeline and a shard. The room is the
  owners': the shard takes the request's pages and receive region when its
  Serve arrives (or refuses it at once, and the request queues again), and
  stage 0 takes its device blocks (waiting for them itself). The book counts
  only its own tickets (``num_tickets``, ``unconfirmed``).
- A request that can never fit (its prompt beyond every pipeline's device
  cache, or prompt + max_tokens beyond every shard's context, pages or
  arena) is refused (``check``) with the field and the limit named.
- Locality: a shard on the pipeline's own server while one takes tickets,
  else the one with the fewest tickets; the reason is a metric label.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

from kvpool.core.admission.room import AdmissionRequest, Locality, PipelineState, ShardState, Ticket
from kvpool.core.decode.pages import pages_for_request
from kvpool.core.errors import InvalidArgument
from kvpool.core.admission.routing import PipelineReason


class TicketBook:
    """Shards, pipelines and live tickets (see the module doc).

    Invariants: a shard's ``num_tickets`` is the number of live tickets on it and its ``unconfirmed``
    the ids of those its Serve has not answered yet; a request id has at most one ticket.
    """

    def __init__(self, shard_servers: dict[str, str], pipeline_servers: dict[str, str], locality: bool) -> None:
        self.shards = {name: ShardState(name, server) for name, server in shard_servers.items()}
        self.pipeline_servers = dict(pipeline_servers)
        self.pipelines = {name: PipelineState(name) for name in pipeline_servers}
        self.locality = locality
        self._tickets: dict[str, Ticket] = {}
        self._prefilling: set[str] = set()  # tickets whose request has no first token yet (it may still move)

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

    def taking(self, request: AdmissionRequest) -> list[ShardState]:
        """The shards a ticket for ``request`` may go to now (``ShardState.takes``)."""
        return [s for s in self.shards.values() if s.takes(request)]

    def issue(self, ticket: Ticket, shard: ShardState) -> Ticket:
        """A new ticket on ``shard``, prefilling, its Serve not answered yet."""
        self._prefilling.add(ticket.request_id)
        return self._hold(ticket, shard)

    def end(self, request_id: str) -> Ticket | None:
        """The request ended or was refused: its ticket (None: it had none) leaves the book."""
        ticket = self._tickets.pop(request_id, None)
        if ticket is not None:
            self._prefilling.discard(request_id)
            self._leave_shard(ticket)
        return ticket

    def end_prefill(self, request_id: str) -> None:
        self._prefilling.discard(request_id)

    def confirm(self, request_id: str) -> ShardState | None:
        """The ticket's shard answered that it holds the request's room: that shard (None: no such
        unconfirmed ticket)."""
        ticket = self._tickets.get(request_id)
        if ticket is None or request_id not in self.shards[ticket.shard].unconfirmed:
            return None
        shard = self.shards[ticket.shard]
        shard.unconfirmed.discard(request_id)
        return shard

    def move_pipeline(self, ticket: Ticket, pipeline: str, reason: PipelineReason) -> Ticket:
        """The ticket on ``pipeline`` instead (one more try); its shard stays."""
        moved = replace(ticket, pipeline=pipeline, pipeline_reason=reason, tries=ticket.tries + 1)
        self._tickets[ticket.request_id] = moved
        return moved

    def move_shard(self, ticket: Ticket, request: AdmissionRequest) -> Ticket | None:
        """The ticket on another shard that takes it now (one more try); None when none does (nothing
        changes)."""
        taking = [s for s in self.taking(request) if s.name != ticket.shard]
        if not taking:
            return None
        self._leave_shard(ticket)
        shard, locality = self.pick_shard(taking, self.pipeline_servers[ticket.pipeline])
        return self._hold(replace(ticket, shard=shard.name, locality=locality, shard_tries=ticket.shard_tries + 1),
                          shard)

    def pick_shard(self, taking: list[ShardState], server: str) -> tuple[ShardState, Locality]:
        """Of ``taking``, the shard for a pipeline on ``server``, and why (the locality rule)."""
        def fewest(shards: Iterable[ShardState]) -> ShardState:
            return min(shards, key=lambda s: (s.num_tickets, s.name))

        if not self.locality:
            return fewest(taking), Locality.OFF
        local = [s for s in taking if s.server == server]
        if local:
            return fewest(local), Locality.SAME_SERVER
        has_local = any(s.healthy and s.server == server for s in self.shards.values())
        return fewest(taking), Locality.LOCAL_FULL if has_local else Locality.NO_LOCAL_SHARD

    def _hold(self, ticket: Ticket, shard: ShardState) -> Ticket:
        shard.num_tickets += 1
        shard.unconfirmed.add(ticket.request_id)
        self._tickets[ticket.request_id] = ticket
        return ticket

    def _leave_shard(self, ticket: Ticket) -> None:
        shard = self.shards[ticket.shard]
        shard.num_tickets -= 1
        shard.unconfirmed.discard(ticket.request_id)
