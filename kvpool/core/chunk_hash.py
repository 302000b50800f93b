"""Chunk hashing: the names that device blocks and pool objects share.

Pure: no grpc, no torch, no I/O.

Invariants:
- only full chunks are hashed: ``len(chunk_hashes(ns, ids, n)) == len(ids) // n``;
- hashes chain, ``h_i = H(h_{i-1}, tokens of chunk i)`` with root = the
  namespace, so ``h_i`` names the whole prefix ``ids[: (i + 1) * n]``: equal
  prefixes give equal leading hashes, and a token changed in chunk k changes
  hashes k.. and none before;
- a hash is a pure function of its inputs, stable across processes, machines
  and releases (pinned in the tests): pool objects outlive processes;
- tenants never share a hash: the chain's root is ``hash_root(namespace,
  tenant, cache_salt)``, so a tenant (or a request with a ``cache_salt``) can
  neither hit nor probe another's chunks, in the device cache or the pool.
"""

from __future__ import annotations

import json
import sys
from array import array
from collections.abc import Sequence
from typing import NewType

import xxhash

# hex, because it is used inside pool keys
ChunkHash = NewType("ChunkHash", str)

CHUNK_SIZE = 256

# canonical token encoding: little-endian uint32 ("I" is 4 bytes on every mainstream ABI)
_TOKEN_TYPECODE = "I" if array("I").itemsize == 4 else "L"


def namespace_fingerprint(
    model_id: str,
    kv_dtype: str,
    layer_split: Sequence[tuple[int, int]],
    chunk_size: int,
    layout_version: int,
) -> str:
    """A 16-hex-digit id of everything that makes KV bytes incompatible.

    ``layer_split`` is one ``(start, end)`` layer range per prefill stage, in
    stage order. Two deployments share pool objects iff their fingerprints match.
    """
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    # canonical: JSON with fixed separators, tuples as lists, ints as ints
    canonical = json.dumps(
        {
            "model_id": model_id,
            "kv_dtype": kv_dtype,
            "layer_split": [[int(start), int(end)] for start, end in layer_split],
            "chunk_size": int(chunk_size),
            "layout_version": int(layout_version),
        },
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=True,
    )
    return xxhash.xxh3_64_hexdigest(canonical.encode("ascii"))


DEFAULT_TENANT = "default"


def hash_root(namespace: str, tenant: str = "", cache_salt: str = "") -> str:
    """The root of a request's hash chain: the namespace, its tenant's and its salt's.

    The default tenant ("" or ``"default"``) without a salt keeps the bare
    namespace, so an open cluster's hashes (and pool objects) are unchanged.
    Otherwise the root is canonical JSON of the three, so no choice of tenant
    and salt can equal another's root.
    """
    tenant = "" if tenant == DEFAULT_TENANT else tenant
    if not tenant and not cache_salt:
        return namespace
    return json.dumps([namespace, tenant, cache_salt], separators=(",", ":"), ensure_ascii=True)


def chunk_hashes(namespace: str, token_ids: Sequence[int], chunk_size: int = CHUNK_SIZE,
                 after: ChunkHash | None = None) -> list[ChunkHash]:
    """Chained xxh3_128 hashes of the full chunks of ``token_ids``.

    ``H(parent, chunk) = xxh3_128(parent_bytes || uint32le(chunk))`` where
    ``parent_bytes`` is the UTF-8 root (the namespace, or ``hash_root``'s) for chunk 0 and the previous
    16-byte digest after that. The trailing partial chunk is not hashed.
    Token ids must fit in uint32 (``ValueError`` otherwise).
    ``after``: the chain goes on after that chunk's hash (``token_ids`` are the tokens after its chunk), so a
    prompt that extends a hashed one hashes only its new chunks, to the same hashes.
    """
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    num_chunks = len(token_ids) // chunk_size
    if num_chunks == 0:
        return []
    try:
        tokens = array(_TOKEN_TYPECODE, token_ids[: num_chunks * chunk_size])
    except (OverflowError, TypeError) as exc:
        raise ValueError(f"token ids must be integers in [0, 2**32): {exc}") from None
    if sys.byteorder == "big":  # pragma: no cover - canonical encoding is little-endian
        tokens.byteswap()
    data = memoryview(tokens).cast("B")
    chunk_bytes = 4 * chunk_size
    parent = namespace.encode("utf-8") if after is None else bytes.fromhex(after)
    hashes: list[ChunkHash] = []
    for i in range(num_chunks):
        hasher = xxhash.xxh3_128(parent)
        hasher.update(data[i * chunk_bytes : (i + 1) * chunk_bytes])
        parent = hasher.digest()
        hashes.append(ChunkHash(parent.hex()))
    return hashes


def group_id(namespace: str, chunk_hash: ChunkHash) -> str:
    """Pool group of one chunk: every stage's object of it, evicted as a whole."""
    return f"{namespace}/{chunk_hash}"


def object_key(namespace: str, chunk_hash: ChunkHash, stage: int) -> str:
    """Pool key of one stage's layers of one chunk."""
    return f"{namespace}/{chunk_hash}/{stage}"


def save_objects(namespace: str, chunk_hashes: Sequence[ChunkHash], stage_sizes: Sequence[int]
                 ) -> list[tuple[str, str, int, int]]:
    """A save's one put: every stage's object of each chunk, stage by stage, as (key, group id, group size,
    size); stage 0 reserves them so, and the simulator's saves too."""
    num_stages = len(stage_sizes)
    return [(object_key(namespace, h, stage), group_id(namespace, h), num_stages, stage_sizes[stage])
            for stage in range(num_stages) for h in chunk_hashes]
