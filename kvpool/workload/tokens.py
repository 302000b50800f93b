"""Deterministic token ids for trace prompts, with a token scale factor.

A trace gives per-block hash ids, not text. Each block becomes
``scaled_block_tokens(block_size, scale)`` token ids that are a pure function of
``(session_id, hash_id)`` (ids are local to a session file, so the session id
namespaces them). Invariants:
- the same ``(session_id, hash_id)`` always gives the same tokens, in every
  process and run (xxh3, no Python ``hash``);
- two prompts of a session with equal leading hash ids have equal token
  prefixes of exactly those blocks (and, with overwhelming probability, differ
  right after);
- token 0 never occurs (ids are in ``[1, vocab_size)``);
- the scaled prompt length is ``full_blocks * block_tokens + ceil(rem * block_tokens / block_size)``
  ≈ ``input_tokens / scale``, where ``rem = input_tokens % block_size``.

The last partial block: if the trace gives it an id (``ceil`` ids) its tokens are
the first tokens of that id's block; if not (the real files give only full
blocks) it is made from ``(session_id, last id, input_tokens)``, i.e. content no
other prompt of different length shares.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator, Sequence
from functools import lru_cache

import xxhash

from kvpool.workload.weka import Session

_TOKENS_PER_DIGEST = 4  # an xxh3-128 digest is four uint32
_SHARED_PREFIX_SEED = xxhash.xxh3_64_intdigest(b"kvpool.workload.shared-prefix")
_BLOCK_DOMAIN = b"B"
_TAIL_DOMAIN = b"T"


def scaled_block_tokens(block_size: int, scale: int) -> int:
    """Tokens one trace block becomes at ``scale``: ``max(1, block_size // scale)``."""
    if block_size < 1 or scale < 1:
        raise ValueError(f"block_size and scale must be >= 1, got {block_size} and {scale}")
    return max(1, block_size // scale)


def _stream(seed: int, key: bytes, length: int, vocab_size: int) -> list[int]:
    """``length`` token ids in ``[1, vocab_size)`` from xxh3-128 of ``key || counter``.

    Position-wise, so a shorter stream of the same key is a prefix of a longer one.
    """
    digests = b"".join(
        xxhash.xxh3_128_digest(key + counter.to_bytes(4, "little"), seed)
        for counter in range(-(-length // _TOKENS_PER_DIGEST))
    )
    words = array("I")
    words.frombytes(digests)
    span = vocab_size - 1
    return [1 + w % span for w in words[:length]]  # modulo bias < vocab/2^32: irrelevant here


@lru_cache(maxsize=4096)
def _session_seed(session_id: str) -> int:
    return xxhash.xxh3_64_intdigest(session_id.encode())


@lru_cache(maxsize=1 << 17)  # ~ the live blocks of tens of concurrent 130K-token sessions
def _block_tokens(seed: int, hash_id: int, length: int, vocab_size: int) -> tuple[int, ...]:
    key = _BLOCK_DOMAIN + hash_id.to_bytes(16, "little", signed=True)
    return tuple(_stream(seed, key, length, vocab_size))


def _check(scale: int, vocab_size: int) -> None:
    if scale < 1:
        raise ValueError(f"scale must be >= 1, got {scale}")
    if vocab_size < 2:
        raise ValueError(f"vocab_size must be >= 2 (token 0 is avoided), got {vocab_size}")


def scaled_prompt_tokens(input_tokens: int, block_size: int, scale: int) -> int:
    """Length of ``turn_token_ids`` without shared prefix (see the module invariants)."""
    block_tokens = scaled_block_tokens(block_size, scale)
    full_blocks, rem = divmod(input_tokens, block_size)
    return full_blocks * block_tokens + -(-rem * block_tokens // block_size)


def turn_token_ids(
    session_id: str,
    hash_ids: Sequence[int],
    input_tokens: int,
    block_size: int,
    scale: int,
    vocab_size: int,
    shared_prefix: Sequence[int] = (),
) -> list[int]:
    """Token ids of one prompt: ``shared_prefix`` then one run per block (see module doc).

    ``hash_ids`` must hold ``input_tokens // block_size`` ids (full blocks only) or
    ``ceil(input_tokens / block_size)`` (the last one partial).
    """
    _check(scale, vocab_size)
    block_tokens = scaled_block_tokens(block_size, scale)
    full_blocks, rem = divmod(input_tokens, block_size)
    if input_tokens < 0 or len(hash_ids) not in (full_blocks, full_blocks + (rem > 0)):
        raise ValueError(f"{len(hash_ids)} hash ids for {input_tokens} tokens in blocks of {block_size}")
    tail_tokens = -(-rem * block_tokens // block_size)  # ceil: a partial block keeps >= 1 token
    seed = _session_seed(session_id)
    tokens = list(shared_prefix)
    for hash_id in hash_ids[:full_blocks]:
        tokens.extend(_block_tokens(seed, hash_id, block_tokens, vocab_size))
    if tail_tokens and len(hash_ids) > full_blocks:
        tokens.extend(_block_tokens(seed, hash_ids[-1], block_tokens, vocab_size)[:tail_tokens])
    elif tail_tokens:
        last = hash_ids[-1] if hash_ids else -1
        key = _TAIL_DOMAIN + last.to_bytes(16, "little", signed=True) + input_tokens.to_bytes(8, "little")
        tokens.extend(_stream(seed, key, tail_tokens, vocab_size))
    return tokens


@lru_cache(maxsize=64)
def _shared_prefix(length: int, vocab_size: int) -> tuple[int, ...]:
    return tuple(_stream(_SHARED_PREFIX_SEED, b"", length, vocab_size))


def shared_prefix_tokens(num_tokens: int, scale: int, vocab_size: int) -> list[int]:
    """The system+tool prompt shared by all sessions: ``ceil(num_tokens / scale)`` ids from a fixed seed.

    Independent of any session; a shorter prefix is a prefix of a longer one.
    """
    _check(scale, vocab_size)
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    return list(_shared_prefix(-(-num_tokens // scale), vocab_size))


def session_token_ids(
    session: Session, scale: int, vocab_size: int, with_shared_prefix: bool = False
) -> Iterator[list[int]]:
    """The prompts of ``session`` in turn order; optionally each led by its shared prefix."""
    prefix = (
        shared_prefix_tokens(session.shared_prefix_tokens, scale, vocab_size) if with_shared_prefix else []
    )
    for turn in session.turns:
        yield turn_token_ids(
            session.id, turn.hash_ids, turn.input_tokens, session.block_size, scale, vocab_size, prefix
        )
