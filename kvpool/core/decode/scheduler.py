"""Decode policy: admission queue, page reservation, the running batch, stop rules.

Pure: no torch, grpc or I/O; time from an injectable clock. The decode shard
(``services/decode/``) and any simulator run this same policy.

Lifecycle of a sequence: ``submit`` (validated, queued) → ``admit`` (pages
reserved, joins the running batch) → one ``on_step`` per decode step →
``release`` (finished, cancelled or failed; pages freed at once). A request
the router admitted takes its pages before prefill starts: ``reserve``
(pages now, or ResourceExhausted) → ``submit`` (queued for a batch slot
only) → the same life from there.

Rules:
- Refuse up front, never preempt: admission reserves pages for the whole
  life of the sequence — ``num_prompt_tokens + max_tokens - 1`` KV entries
  (every output token but the last is fed back and cached) — so a running
  sequence can never outgrow the shard and nothing is ever evicted. A
  request that could not fit even in an empty shard is refused at submit.
- Admission is FIFO without overtaking: the head of the queue waits until
  its pages and a batch slot are free, and everything behind it waits too
  (deterministic, and a long request is never starved by short ones).
- Every running sequence is in every step (continuous batching: sequences
  join at admission and leave at release, between steps).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from kvpool.core.decode.pages import PageAllocator, kv_capacity, pages_for, pages_for_request
from kvpool.core.errors import InvalidArgument, ResourceExhausted

Clock = Callable[[], float]

FINISH_STOP = "stop"  # a stop token was made
FINISH_LENGTH = "length"  # max_tokens were made
FINISH_CONTEXT = "context"  # the model's context is full


def finish_reason(token_id: int, num_output_tokens: int, stop_token_ids: frozenset[int], max_tokens: int,
                  num_prompt_tokens: int, max_context: int) -> str | None:
    """Whether the ``num_output_tokens``-th output token (``token_id``) ends its sequence, and why.

    One rule for every token, the first included (decode samples it too): a
    stop token ends it (and is the last token sent); else ``max_tokens``
    made; else the model's context full.
    """
    if token_id in stop_token_ids:
        return FINISH_STOP
    if num_output_tokens >= max_tokens:
        return FINISH_LENGTH
    if num_prompt_tokens + num_output_tokens >= max_context:
        return FINISH_CONTEXT
    return None


@dataclass(slots=True)
class DecodeSequence:
    """One request on a shard.

    Invariant while running: ``len(page_ids) == pages_for(kv_capacity, page_size)``
    and ``num_cached_tokens == num_prompt_tokens + num_output_tokens - 1``
    after each step (all outputs but the newest are in the KV pages).
    """

    seq_id: str
    num_prompt_tokens: int
    max_tokens: int
    stop_token_ids: frozenset[int]
    submitted_at: float
    admitted_at: float | None = None
    page_ids: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    finish_reason: str | None = None

    @property
    def kv_capacity(self) -> int:
        """KV entries this sequence can ever need."""
        return kv_capacity(self.num_prompt_tokens, self.max_tokens)

    @property
    def position(self) -> int:
        """Position of the token the next step feeds (its KV goes there)."""
        return self.num_cached_tokens


class DecodeScheduler:
    """Admission queue, page reservations and the running batch of one shard.

    Invariants: a sequence is reserved, waiting or running, never two of
    them; reserved and running sequences (and waiting ones that came through
    ``reserve``) hold disjoint pages, and ``pages used == sum of their pages``;
    ``len(running) <= max_batch_size``; other waiting sequences hold no pages.
    """

    def __init__(
        self, num_pages: int, page_size: int, max_batch_size: int, max_context: int, clock: Clock
    ) -> None:
        for name, value in (("page_size", page_size), ("max_batch_size", max_batch_size),
                            ("max_context", max_context)):
            if value <= 0:
                raise InvalidArgument(f"{name}: must be positive, got {value}")
        self.pages = PageAllocator(num_pages)
        self.page_size = page_size
        self.max_batch_size = max_batch_size
        self.max_context = max_context
        self._clock = clock
        self._reserved: dict[str, DecodeSequence] = {}
        self._waiting: OrderedDict[str, DecodeSequence] = OrderedDict()
        self._running: OrderedDict[str, DecodeSequence] = OrderedDict()

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_pages_used(self) -> int:
        return self.pages.num_used

    def waiting(self) -> list[DecodeSequence]:
        return list(self._waiting.values())

    def reserved(self) -> list[DecodeSequence]:
        return list(self._reserved.values())

    def running(self) -> list[DecodeSequence]:
        return list(self._running.values())

    @property
    def num_reserved(self) -> int:
        return len(self._reserved)

    def get(self, seq_id: str) -> DecodeSequence | None:
        return self._running.get(seq_id) or self._waiting.get(seq_id) or self._reserved.get(seq_id)

    def check(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """Raise InvalidArgument (naming the field) unless such a request could ever run here."""
        if num_prompt_tokens <= 0:
            raise InvalidArgument(f"prompt_token_ids: must hold at least one token, got {num_prompt_tokens}")
        if max_tokens <= 0:
            raise InvalidArgument(f"max_tokens: must be positive, got {max_tokens}")
        if num_prompt_tokens + max_tokens > self.max_context:
            raise InvalidArgument(
                f"max_tokens: a {num_prompt_tokens}-token prompt plus {max_tokens} tokens exceeds "
                f"the model's context of {self.max_context}"
            )
        needed = pages_for_request(num_prompt_tokens, max_tokens, self.page_size)
        if needed > self.pages.num_pages:
            raise InvalidArgument(
                f"max_tokens: a {num_prompt_tokens}-token prompt plus {max_tokens} tokens needs {needed} "
                f"pages, the shard has {self.pages.num_pages}"
            )

    def reserve(self, seq_id: str, num_prompt_tokens: int, max_tokens: int) -> DecodeSequence:
        """Take a sequence's pages now, before its prefill (validated first; nothing changes on
        error); ResourceExhausted when they are not free now."""
        if self.get(seq_id) is not None:
            raise InvalidArgument(f"seq_id: {seq_id!r} is already on this shard")
        self.check(num_prompt_tokens, max_tokens)
        needed = pages_for_request(num_prompt_tokens, max_tokens, self.page_size)
        page_ids = self.pages.allocate(needed)
        if page_ids is None:
            raise ResourceExhausted(f"decode pages: {needed} needed, {self.pages.num_free} free now")
        seq = DecodeSequence(seq_id, num_prompt_tokens, max_tokens, frozenset(), self._clock(), page_ids=page_ids)
        self._reserved[seq_id] = seq
        return seq

    def submit(
        self, seq_id: str, num_prompt_tokens: int, max_tokens: int, stop_token_ids: Iterable[int] = ()
    ) -> DecodeSequence:
        """Queue a sequence (validated first; nothing changes on error). A reserved one keeps
        its pages and must come with the counts it reserved."""
        reserved = self._reserved.get(seq_id)
        if reserved is not None:
            if (reserved.num_prompt_tokens, reserved.max_tokens) != (num_prompt_tokens, max_tokens):
                raise InvalidArgument(
                    f"max_tokens: {num_prompt_tokens} prompt tokens and max_tokens {max_tokens} differ from the "
                    f"reservation's {reserved.num_prompt_tokens} and {reserved.max_tokens}"
                )
            del self._reserved[seq_id]
            reserved.stop_token_ids = frozenset(stop_token_ids)
            self._waiting[seq_id] = reserved
            return reserved
        if self.get(seq_id) is not None:
            raise InvalidArgument(f"seq_id: {seq_id!r} is already on this shard")
        self.check(num_prompt_tokens, max_tokens)
        seq = DecodeSequence(seq_id, num_prompt_tokens, max_tokens, frozenset(stop_token_ids), self._clock())
        self._waiting[seq_id] = seq
        return seq

    def admit(self) -> list[DecodeSequence]:
        """Move queue heads into the running batch while pages and slots last; the admitted, in order.

        An admitted sequence holds its pages and counts its prompt as cached:
        the caller fills those pages (the handoff scatter) before the next step.
        """
        admitted = []
        while self._waiting and len(self._running) < self.max_batch_size:
            seq = next(iter(self._waiting.values()))
            if not seq.page_ids:  # not reserved before its prefill
                page_ids = self.pages.allocate(pages_for(seq.kv_capacity, self.page_size))
                if page_ids is None:
                    break  # FIFO: nobody overtakes the head
                seq.page_ids = page_ids
            del self._waiting[seq.seq_id]
            seq.num_cached_tokens = seq.num_prompt_tokens
            seq.admitted_at = self._clock()
            self._running[seq.seq_id] = seq
            admitted.append(seq)
        return admitted

    def on_token(self, seq_id: str, token_id: int) -> str | None:
        """Count an output token of a running sequence; its finish reason, if this token ends it."""
        seq = self._running_seq(seq_id)
        seq.num_output_tokens += 1
        seq.finish_reason = finish_reason(token_id, seq.num_output_tokens, seq.stop_token_ids, seq.max_tokens,
                                          seq.num_prompt_tokens, self.max_context)
        return seq.finish_reason

    def on_step(self, seq_id: str) -> None:
        """A step wrote the KV of the sequence's newest token (at ``position``)."""
        seq = self._running_seq(seq_id)
        if seq.num_cached_tokens >= seq.kv_capacity:
            raise InvalidArgument(f"seq_id: {seq_id!r} has no reserved page left for position {seq.position}")
        seq.num_cached_tokens += 1

    def release(self, seq_id: str) -> DecodeSequence | None:
        """Drop a sequence wherever it is, freeing its pages at once; None if unknown (idempotent)."""
        seq = self._waiting.pop(seq_id, None) or self._reserved.pop(seq_id, None) or self._running.pop(seq_id, None)
        if seq is not None:
            self.pages.free(seq.page_ids)
            seq.page_ids = []
        return seq

    def _running_seq(self, seq_id: str) -> DecodeSequence:
        seq = self._running.get(seq_id)
        if seq is None:
            raise InvalidArgument(f"seq_id: {seq_id!r} is not running")
        return seq
