"""What the router serves: one ``GenerationRequest``, whatever API it came through, and the served
model's name and limits (``ModelLimits``), which the request checks read and the health rounds update."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class GenerationRequest:
    """What the router needs to serve one completion, whatever API it came through."""

    kind: str  # "completion" or "chat"
    model: str
    prompt_ids: list[int]
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stops: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    session_key: str = ""
    # assigned by the router at the edge (kvpool.request_id); the OpenAI ``id``
    request_id: str = ""
    # whose cache: the API key's tenant (set by the HTTP API), and the request's own salt
    tenant: str = ""
    cache_salt: str = ""
    # kvpool extensions (session-aware prefill): the session is over; its next turn in about this many s
    session_end: bool = False
    expected_next_s: float | None = None


@dataclass(slots=True)
class ModelLimits:
    """The served model's name and limits; ``context`` is what the cluster serves now (the router's health
    rounds update it, see ``kvpool.core.api.served_context``)."""

    name: str
    context: int
    vocab_size: int
    model_context: int = 0  # the model's own; 0: ``context`` as first given

    def __post_init__(self) -> None:
        self.model_context = self.model_context or self.context
    default_max_tokens: int = 512  # chat, when the client gives no limit (capped by the context left)
