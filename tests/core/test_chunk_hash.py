"""Chunk hashing: chaining, full chunks only, namespaces, pinned values, speed."""

from __future__ import annotations

import os
import random
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import xxhash

from kvpool.core.chunk_hash import (
    ChunkHash,
    chunk_hashes,
    group_id,
    hash_root,
    namespace_fingerprint,
    object_key,
)

NS = "c599cef769c1dc6b"
REPO_ROOT = Path(__file__).resolve().parents[2]


def tokens(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(0, 129_280) for _ in range(n)]


def test_only_full_chunks_are_hashed() -> None:
    assert len(chunk_hashes(NS, tokens(600), 256)) == 2
    assert len(chunk_hashes(NS, tokens(512), 256)) == 2
    assert len(chunk_hashes(NS, tokens(511), 256)) == 1
    assert chunk_hashes(NS, tokens(255), 256) == []
    assert chunk_hashes(NS, [], 256) == []
    # the partial tail does not affect the full chunks' hashes
    assert chunk_hashes(NS, tokens(600), 256) == chunk_hashes(NS, tokens(600)[:512], 256)


def test_same_prefix_gives_same_leading_hashes() -> None:
    ids = tokens(1024)
    longer = ids + tokens(700, seed=1)
    assert chunk_hashes(NS, longer)[:4] == chunk_hashes(NS, ids)
    assert len(set(chunk_hashes(NS, longer))) == 6


@pytest.mark.parametrize("k", [0, 1, 3])
def test_changed_token_in_chunk_k_changes_hashes_from_k_on(k: int) -> None:
    ids = tokens(1024)
    changed = list(ids)
    changed[k * 256 + 17] += 1
    before, after = chunk_hashes(NS, ids), chunk_hashes(NS, changed)
    assert after[:k] == before[:k]
    assert all(a != b for a, b in zip(after[k:], before[k:], strict=True))


def test_identical_chunks_at_different_positions_differ() -> None:
    chunk = tokens(256)
    hashes = chunk_hashes(NS, chunk * 3)
    assert len(set(hashes)) == 3  # the chain names the prefix, not the chunk


def test_namespace_changes_every_hash() -> None:
    ids = tokens(768)
    other = namespace_fingerprint("m", "fp8", [(0, 4)], 256, 1)
    assert not set(chunk_hashes(NS, ids)) & set(chunk_hashes(other, ids))


def test_tenants_and_salts_never_share_a_hash() -> None:
    ids = tokens(768)
    roots = [hash_root(NS), hash_root(NS, "alice"), hash_root(NS, "bob"), hash_root(NS, "alice", "s1"),
             hash_root(NS, "", "s1"), hash_root(NS, "alice", "s2")]
    assert len(set(roots)) == len(roots)
    hashes = [set(chunk_hashes(root, ids)) for root in roots]
    assert sum(len(h) for h in hashes) == len(set().union(*hashes)) == 3 * len(roots)
    # within one tenant and salt, equal prefixes still share
    assert chunk_hashes(hash_root(NS, "alice", "s1"), ids[:512]) == chunk_hashes(hash_root(NS, "alice", "s1"), ids)[:2]


def test_the_default_tenant_keeps_the_bare_namespace() -> None:
    assert hash_root(NS) == hash_root(NS, "default") == hash_root(NS, "", "") == NS
    # pinned: pool objects of a tenant outlive processes too
    assert hash_root(NS, "alice", "s1") == f'["{NS}","alice","s1"]'
    # a separator inside a name cannot forge another tenant's root
    assert hash_root(NS, 'a","b') != hash_root(NS, "a", "b")


def test_namespace_fingerprint_covers_every_field() -> None:
    base = dict(model_id="m", kv_dtype="bf16", layer_split=[(0, 2), (2, 4)], chunk_size=256, layout_version=1)
    fingerprints = {namespace_fingerprint(**base)}
    for field, value in [
        ("model_id", "m2"),
        ("kv_dtype", "fp8"),
        ("layer_split", [(0, 1), (1, 4)]),
        ("chunk_size", 128),
        ("layout_version", 2),
    ]:
        fingerprints.add(namespace_fingerprint(**{**base, field: value}))
    assert len(fingerprints) == 6
    # tuples and lists encode the same
    assert namespace_fingerprint(**{**base, "layer_split": ((0, 2), (2, 4))}) == namespace_fingerprint(**base)
    assert len(namespace_fingerprint(**base)) == 16


def test_pinned_values() -> None:
    # pool objects outlive processes and releases: these must never change
    assert namespace_fingerprint("deepseek-v3-tiny", "bf16", [(0, 2), (2, 4)], 256, 1) == "651a1e8633d7ae93"
    assert chunk_hashes(NS, list(range(1000))) == [
        "a5f4d11bcb21970b04bde9668dbf47c6",
        "5674d18d67454941cffbdf0e479dc17f",
        "127d36c0133be4d4f633433cfed2c9f1",
    ]


def test_encoding_is_the_documented_one() -> None:
    ids = tokens(512)
    h0 = xxhash.xxh3_128_digest(NS.encode() + struct.pack("<256I", *ids[:256]))
    h1 = xxhash.xxh3_128_digest(h0 + struct.pack("<256I", *ids[256:]))
    assert chunk_hashes(NS, ids) == [h0.hex(), h1.hex()]


@pytest.mark.cluster
def test_stable_across_processes() -> None:
    code = "from kvpool.core.chunk_hash import chunk_hashes; print(chunk_hashes('ns', list(range(600)))[-1])"
    outputs = {
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            cwd=REPO_ROOT,
            env={**os.environ, "PYTHONHASHSEED": seed},
        ).stdout.strip()
        for seed in ("1", "2")
    }
    assert outputs == {chunk_hashes("ns", list(range(600)))[-1]}


def test_rejects_bad_input() -> None:
    with pytest.raises(ValueError):
        chunk_hashes(NS, [-1] * 256)
    with pytest.raises(ValueError):
        chunk_hashes(NS, [2**32] * 256)
    with pytest.raises(ValueError):
        chunk_hashes(NS, tokens(256), 0)


def test_pool_keys() -> None:
    h = chunk_hashes(NS, list(range(256)))[0]
    assert group_id(NS, h) == f"{NS}/{h}"
    assert object_key(NS, h, 3) == f"{NS}/{h}/3"


def test_a_saves_objects_are_every_stages_of_each_chunk_stage_by_stage() -> None:
    from kvpool.core.chunk_hash import save_objects

    a, b = ChunkHash("a"), ChunkHash("b")
    assert save_objects("ns", [a, b], [10, 20]) == [
        ("ns/a/0", "ns/a", 2, 10), ("ns/b/0", "ns/b", 2, 10), ("ns/a/1", "ns/a", 2, 20), ("ns/b/1", "ns/b", 2, 20)]
    assert save_objects("ns", [], [10, 20]) == []


def test_a_chain_goes_on_after_a_hash_to_the_same_hashes() -> None:
    whole = chunk_hashes(NS, tokens(1024), 256)
    assert chunk_hashes(NS, tokens(1024)[512:], 256, after=whole[1]) == whole[2:]
    assert chunk_hashes(NS, tokens(1024)[256:], 256, after=whole[0]) == whole[1:]
    assert chunk_hashes(NS, tokens(1024)[512:], 256, after=whole[0]) != whole[2:]  # a chunk skipped: another chain
