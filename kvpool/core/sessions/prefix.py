"""What the router remembers of a session's prompts: a length and a digest of each of the last few.

Pure. ``RoutingPolicy`` keeps them per session (forgotten with it); the
admission queue's work estimate asks which one a new prompt extends
(``kvpool.core.admission.queue``). A digest is 16 bytes whatever the prompt's
length, so a session costs at most ``MAX_SESSION_PREFIXES`` × ~40 bytes.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

MAX_SESSION_PREFIXES = 4  # a session's timelines the router tells apart (an agent and its subagents)
_TOKEN_TYPECODE = "I" if array("I").itemsize == 4 else "L"  # 4 bytes a token, as chunk hashing encodes them
_TOKEN_BYTES = array(_TOKEN_TYPECODE).itemsize


@dataclass(frozen=True, slots=True)
class PromptPrefix:
    """A prompt the router placed, as it remembers it: its length and a digest of its tokens."""

    num_tokens: int
    digest: bytes


def _digest(encoded: bytes, num_tokens: int) -> bytes:
    return xxhash.xxh3_128_digest(encoded[: num_tokens * _TOKEN_BYTES])


def _encode(token_ids: Sequence[int]) -> bytes:
    return array(_TOKEN_TYPECODE, token_ids).tobytes()


def matched_prefix(prefixes: Sequence[PromptPrefix], token_ids: Sequence[int]) -> PromptPrefix | None:
    """The longest remembered prompt that ``token_ids`` starts with (or equals); None: none does."""
    encoded = _encode(token_ids)
    best = None
    for prefix in prefixes:
        if (prefix.num_tokens <= len(token_ids) and (best is None or prefix.num_tokens > best.num_tokens)
                and _digest(encoded, prefix.num_tokens) == prefix.digest):
            best = prefix
    return best


def remember_prompt(prefixes: Sequence[PromptPrefix], token_ids: Sequence[int],
                    max_prefixes: int = MAX_SESSION_PREFIXES) -> tuple[PromptPrefix, ...]:
    """The session's prefixes once ``token_ids`` is placed, newest last: it replaces the prompt it
    extends (that timeline moved on), else it is added and the oldest beyond ``max_prefixes`` go."""
    matched = matched_prefix(prefixes, token_ids)
    new = PromptPrefix(len(token_ids), _digest(_encode(token_ids), len(token_ids)))
    kept = [p for p in prefixes if p != matched and p != new]
    return (*(kept[-(max_prefixes - 1):] if max_prefixes > 1 else ()), new)
