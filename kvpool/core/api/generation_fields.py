"""The fields of one generation request, checked once for every API (OpenAI HTTP and gRPC ``Generate``).

Pure. Each API names its fields its own way (``FieldNames``); the ranges and
their meaning are the same, so a value the HTTP API refuses is refused over
gRPC too, naming the field as that API spells it. Every refusal is an
``InvalidArgument`` whose ``field`` is that name. Values the wire formats
below cannot carry are normalized here, with the same effect on the output:

- a seed is any signed or unsigned 64-bit integer; it is kept as its
  unsigned 64-bit pattern (decode's ``uint64``);
- ``top_k`` 0 or -1 is off, and so is any value past the vocabulary;
- a temperature below ``MIN_TEMPERATURE`` is greedy (float32 would round
  it to 0 on the way to decode);
- a ``top_p`` below ``MIN_TOP_P`` keeps only the top token, as ``MIN_TOP_P`` does.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from kvpool.core.errors import InvalidArgument

MIN_SEED = -(2**63)
MAX_SEED = 2**64 - 1
MAX_TEMPERATURE = 2.0
MIN_TEMPERATURE = 1e-5
MIN_TOP_P = 1e-6
MAX_SESSION_KEY_BYTES = 256  # UTF-8 bytes, as prefill's scheduler counts them


@dataclass(frozen=True, slots=True)
class FieldNames:
    """How one API spells each field, for error messages."""

    prompt: str
    max_tokens: str
    temperature: str
    top_p: str
    top_k: str
    seed: str
    session_key: str
    stop_token_ids: str


OPENAI_FIELDS = FieldNames("prompt", "max_tokens", "temperature", "top_p", "top_k", "seed", "prompt_cache_key",
                           "stop_token_ids")
GRPC_FIELDS = FieldNames("token_ids", "sampling.max_tokens", "sampling.temperature", "sampling.top_p",
                         "sampling.top_k", "sampling.seed", "session_key", "sampling.stop_token_ids")


@dataclass(frozen=True, slots=True)
class Sampling:
    """Checked sampling fields: 0 <= temperature <= 2 (0 greedy), 0 < top_p <= 1, 0 <= top_k < vocab (0 off),
    seed None or 0 <= seed < 2**64."""

    temperature: float
    top_p: float
    top_k: int
    seed: int | None


def fail(field: str, message: str) -> InvalidArgument:
    return InvalidArgument(f"{field}: {message}", field=field)


def check_sampling(temperature: float, top_p: float, top_k: int, seed: int | None, vocab_size: int,
                   names: FieldNames) -> Sampling:
    if not math.isfinite(temperature) or not 0.0 <= temperature <= MAX_TEMPERATURE:
        raise fail(names.temperature, f"must be a number in [0, {MAX_TEMPERATURE:g}], got {temperature!r}")
    if not math.isfinite(top_p) or not 0.0 < top_p <= 1.0:
        raise fail(names.top_p, f"must be a number in (0, 1], got {top_p!r}")
    if top_k < -1:
        raise fail(names.top_k, f"must be >= 0 (0 or -1: off), got {top_k}")
    if seed is not None and not MIN_SEED <= seed <= MAX_SEED:
        raise fail(names.seed, f"must be a 64-bit integer ({MIN_SEED}..{MAX_SEED}), got {seed}")
    return Sampling(
        temperature=0.0 if temperature < MIN_TEMPERATURE else float(temperature),
        top_p=max(float(top_p), MIN_TOP_P),
        top_k=0 if top_k < 0 or top_k >= vocab_size else int(top_k),
        seed=None if seed is None else seed % 2**64,
    )


def check_token_ids(token_ids: Sequence[int], vocab_size: int, field: str) -> None:
    for i, token in enumerate(token_ids):
        if not 0 <= token < vocab_size:
            raise fail(f"{field}[{i}]" if field != "prompt" else field,
                       f"token id {token} at [{i}] is outside the vocabulary 0..{vocab_size - 1}")


def check_length(num_prompt_tokens: int, max_tokens: int, context: int, prompt_field: str,
                 max_tokens_field: str) -> None:
    """The prompt and every token it may make fit the context the cluster serves."""
    if max_tokens < 1:
        raise fail(max_tokens_field, f"must be at least 1, got {max_tokens}")
    if num_prompt_tokens >= context:
        raise fail(prompt_field, f"the prompt has {num_prompt_tokens} tokens; this server serves at most "
                   f"{context} tokens of prompt plus output, so at most {context - 1} prompt tokens")
    if num_prompt_tokens + max_tokens > context:
        raise fail(max_tokens_field, f"{max_tokens} is too many: the prompt's {num_prompt_tokens} tokens plus "
                   f"{max_tokens} exceed the {context} tokens this server serves; at most "
                   f"{context - num_prompt_tokens}")


def check_prompt_text(num_chars: int, max_token_bytes: int, context: int, prompt_field: str) -> None:
    """Prompt text longer than the context could hold, refused before it is tokenized (tokenizing tens of
    megabytes takes seconds of CPU): a token stands for at most ``max_token_bytes`` bytes, so for at most as
    many characters, and more than ``(context - 1) * max_token_bytes`` characters make more tokens than the
    context holds. (A tokenizer with an unknown-word token could map a long unknown word to one token; such
    text is refused all the same, as a limit of this server.)"""
    limit = (context - 1) * max_token_bytes
    if num_chars > limit:
        raise fail(prompt_field, f"the prompt's text has {num_chars} characters; this server serves at most "
                   f"{context - 1} prompt tokens, and no token here stands for more than {max_token_bytes} "
                   f"character{'s' if max_token_bytes > 1 else ''}, so at most {limit} characters")


def check_text(text: str, field: str) -> str:
    """Text that UTF-8 can carry (JSON may hold lone surrogates such as ``\\ud800``; no tokenizer takes them)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise fail(field, f"holds a lone surrogate {text[exc.start]!r} at character {exc.start}, "
                   "which is not valid Unicode text") from None
    return text


def check_session_key(key: str, field: str) -> str:
    check_text(key, field)
    if len(key.encode()) > MAX_SESSION_KEY_BYTES:
        raise fail(field, f"longer than {MAX_SESSION_KEY_BYTES} bytes of UTF-8 ({len(key.encode())})")
    return key
