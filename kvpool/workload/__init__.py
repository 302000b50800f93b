"""Workload: real coding-agent traces (weka format), their token ids, and reuse bounds."""

from __future__ import annotations

from kvpool.workload.bounds import BoundResult, chunk_prefix_bound, trace_block_bound
from kvpool.workload.tokens import (
    scaled_block_tokens,
    scaled_prompt_tokens,
    session_token_ids,
    shared_prefix_tokens,
    turn_token_ids,
)
from kvpool.workload.weka import (
    Session,
    Turn,
    load_session,
    load_sessions,
    parse_session,
)

__all__ = [
    "BoundResult",
    "Session",
    "Turn",
    "chunk_prefix_bound",
    "load_session",
    "load_sessions",
    "parse_session",
    "scaled_block_tokens",
    "scaled_prompt_tokens",
    "session_token_ids",
    "shared_prefix_tokens",
    "trace_block_bound",
    "turn_token_ids",
]
