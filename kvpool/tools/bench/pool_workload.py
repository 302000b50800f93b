"""Worker processes of ``kvpool bench pool``; each prints one JSON line and exits.

Roles:
- ``throughput``: put fresh batches, each object stamped anew, then look up and
  read them back into zeroed memory; reports GB/s (verified bytes / seconds),
  per-batch and lookup latency, per-object counts (stored, not stored, missed,
  mismatched, verified) and the bytes each path moved (``bytes_by_path``).
  Its groups are removed at the end. ``--engine-only`` sends every byte by the
  transfer engine; ``--warm-mappings`` faults in every page of each store
  segment it maps after the untimed first batch (a long-lived client's state),
  so the timed batches touch no page for the first time; ``--put-only`` puts,
  writes its keys and CRCs to ``--crc-file`` and leaves the groups in the pool.
- ``read-back``: a fresh process reads what a ``--put-only`` run left, every
  page of the store segments new to its mappings (first touch), verifies every
  object and removes the groups.
- ``memory-owner``: holds a touched ``SharedSegment`` offered by a
  ``SegmentShare`` (as a store offers its segment) until stdin closes.
- ``memcpy``: the like-for-like copy: maps the owner's segment through
  ``SegmentMaps``, faults its pages in, and one thread ``copy()``s the same
  object sizes and batches between its own ``SharedSegment`` and that mapping,
  each batch to fresh offsets (put), then back into zeroed memory (get), every
  object verified.
- ``churn-writer``: fills a pool with 4-member groups, one member per batch
  (as four pipeline stages would), far past its capacity.
- ``churn-reader``: looks groups up and reads them until told to stop;
  reports partial groups seen and bytes that did not match.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from kvpool.tools.bench.stats import percentile, throughput_gbps
from kvpool.tools.bench.worker_protocol import SYSTEM_KVPOOL, Layout, huge_page_bytes, match_batch, stamp_batch, zero
from kvpool.pool.client import PoolClient
from kvpool.pool.objects import PutObject, PutResult
from kvpool.shared_memory import MappedSegment, SegmentMaps, SegmentShare, SharedSegment, copy
from kvpool.transfer import HostBuffer, TransferEngine

GROUP = 4
HOT_REPS = 50  # as upstream's batch_is_exist timing
SYSTEM_MEMCPY = "memcpy"
REMOVE_BATCH = 1024  # group ids per remove call
PAGE = 4096


def fill(buffer: HostBuffer, offset: int, size: int, seed: int) -> None:
    buffer.view(offset, size)[:] = random.Random(seed).randbytes(size)


@dataclass(slots=True)
class Counts:
    """Per-object outcomes of a throughput run; the parent sums them and fails on any but verified."""

    objects: int = 0  # every object put, warm-up batch included, each to be found, read and verified
    stored: int = 0
    not_stored: int = 0  # NOT_STORED, or EXISTS for a key this run made fresh
    missed: int = 0  # lookup did not return the group, or the client's checksum rejected the read
    mismatched: int = 0  # the client reported a good read but the bytes differ from what was put
    verified_objects: int = 0


async def _put_batches(client: PoolClient, mem: memoryview, address: int, src: Layout, prefix: str, batches: int,
                       counts: Counts, after_warmup: Callable[[], Awaitable[None]] | None = None,
                       ) -> tuple[list[float], list[list[int]]]:
    """Put every batch under fresh keys, each stamped anew; return measured seconds and CRCs.

    ``after_warmup`` runs once the untimed first batch is in."""
    put_s: list[float] = []
    crcs: list[list[int]] = []
    for b in range(batches + 1):  # batch 0 warms connections up, not counted
        crcs.append(stamp_batch(mem, src, SYSTEM_KVPOOL, b))
        objects = [PutObject(f"{prefix}/{b}/{i}/0", f"{prefix}/{b}/{i}", 1, address + off, src.object_size)
                   for i, off in enumerate(src.offsets())]
        t0 = time.perf_counter()
        results = await client.put(objects)
        elapsed = time.perf_counter() - t0
        if b:
            put_s.append(elapsed)
        elif after_warmup is not None:
            await after_warmup()
        counts.stored += results.count(PutResult.STORED)
        counts.not_stored += len(objects) - results.count(PutResult.STORED)
    return put_s, crcs


def fault_in(mapped: MappedSegment) -> int:
    """Read one byte of every page of a pinned mapping, so later copies fault none in; returns its bytes."""
    view = mapped.view()
    try:
        int(np.frombuffer(view, dtype=np.uint8)[::PAGE].sum())
    finally:
        view.release()
    return mapped.size


async def _warm_mappings(client: PoolClient) -> dict[str, int]:
    """Map every shared segment the client has learned of and fault all its pages in."""
    warmed = {"segments": 0, "bytes": 0}
    for access in list(client.accesses.values()):
        if access.shared is None:
            continue
        shared = access.shared
        mapped = await client.maps.map(shared.socket_path, shared.name, shared.token)
        with mapped.using():
            warmed["bytes"] += await asyncio.to_thread(fault_in, mapped)
        warmed["segments"] += 1
    return warmed


def path_bytes(client: PoolClient) -> dict[str, int]:
    """The client's verified bytes per (path, direction), as ``memory_read``, ``engine_write``, ..."""
    return {f"{path}_{direction}": n for (path, direction), n in client.bytes_by_path.items()}


async def _remove(client: PoolClient, group_ids: list[str]) -> int:
    """Remove the groups (so the next measurement has room); returns how many the master removed."""
    removed = 0
    for first in range(0, len(group_ids), REMOVE_BATCH):
        removed += (await client.remove(group_ids[first:first + REMOVE_BATCH]))[0]
    return removed


def _group_ids(prefix: str, batches: int, batch_size: int) -> list[str]:
    return [f"{prefix}/{b}/{i}" for b in range(batches + 1) for i in range(batch_size)]


async def _get_batches(client: PoolClient, mem: memoryview, address: int, dst: Layout, prefix: str,
                       crcs: list[list[int]], counts: Counts) -> tuple[list[float], list[float], int]:
    """Read every batch back into a zeroed destination; return measured get and lookup seconds
    and how many of the measured objects verified."""
    get_s: list[float] = []
    lookup_s: list[float] = []
    measured_verified = 0
    for b, expected in enumerate(crcs):
        zero(mem, dst.base, dst.batch_bytes)
        t0 = time.perf_counter()
        found = await client.lookup([f"{prefix}/{b}/{i}" for i in range(dst.batch_size)])
        t1 = time.perf_counter()
        slots = zip(found.groups, dst.offsets(), strict=False)  # the leading groups found, in order
        items = [(g.members[f"{g.group_id}/0"], address + off) for g, off in slots]
        ok = await client.read(items)
        await client.release(found.lease_id)
        t2 = time.perf_counter()
        # a group the lookup did not return leaves its slot zeroed: a miss, never a match
        read = list(zip(ok, match_batch(mem, dst, expected)[: len(ok)], strict=True))
        verified = sum(good and same for good, same in read)
        counts.missed += dst.batch_size - len(items) + ok.count(False)
        counts.mismatched += sum(good and not same for good, same in read)
        counts.verified_objects += verified
        if b:  # batch 0 is checked like the others but not timed
            lookup_s.append(t1 - t0)
            get_s.append(t2 - t0)
            measured_verified += verified
    return get_s, lookup_s, measured_verified


async def _hot_lookups(client: PoolClient, prefix: str, n: int) -> tuple[list[float], list[float]]:
    """Lookup and exists back to back, as upstream's batch_is_exist is timed.

    The get loop measures each lookup after an idle gap (the byte compare),
    which costs ~1.5 ms more here.
    """
    hot_lookup_s, hot_exists_s = [], []
    group_ids = [f"{prefix}/1/{i}" for i in range(n)]
    keys = [f"{g}/0" for g in group_ids]
    for _ in range(HOT_REPS):
        t0 = time.perf_counter()
        found = await client.lookup(group_ids)
        hot_lookup_s.append(time.perf_counter() - t0)
        await client.release(found.lease_id)
        t0 = time.perf_counter()
        await client.exists(keys)
        hot_exists_s.append(time.perf_counter() - t0)
    return hot_lookup_s, hot_exists_s


async def throughput(args: argparse.Namespace) -> dict[str, object]:
    n, size = args.batch_size, args.object_size
    src = Layout(size, n)
    dst = Layout(size, n, base=src.batch_bytes)
    buffer = HostBuffer(2 * src.batch_bytes)
    buffer.touch()
    mem = buffer.view()
    mem[:] = random.Random(os.getpid()).randbytes(buffer.size)
    client = PoolClient(args.master, TransferEngine(), engine_only=args.engine_only)
    client.register(buffer.address, buffer.size)
    counts = Counts(objects=n * (args.batches + 1))
    prefix = f"bench/{args.tag}/{os.getpid()}"
    warmed = {"segments": 0, "bytes": 0}

    async def warm() -> None:
        warmed.update(await _warm_mappings(client))

    put_s, crcs = await _put_batches(client, mem, buffer.address, src, prefix, args.batches, counts,
                                     warm if args.warm_mappings else None)
    if args.put_only:
        Path(args.crc_file).write_text(json.dumps({"prefix": prefix, "crcs": crcs}))
        paths = path_bytes(client)
        await client.close()
        # the timed batches' bytes; they count only once a read-back has verified every object
        put_bytes = n * args.batches * size
        return {"object_size": size, "batch_size": n, "batches": args.batches,
                "put_gbps": throughput_gbps(put_bytes, put_s), "put_s": math.fsum(put_s),
                "put_p50_ms": percentile(put_s, 50) * 1e3, "objects": counts.objects, "stored": counts.stored,
                "not_stored": counts.not_stored, "bytes_by_path": paths, "put_bytes": put_bytes}
    get_s, lookup_s, measured_verified = await _get_batches(client, mem, buffer.address, dst, prefix, crcs, counts)
    hot_lookup_s, hot_exists_s = await _hot_lookups(client, prefix, n)
    huge = huge_page_bytes()
    paths = path_bytes(client)
    removed = await _remove(client, _group_ids(prefix, args.batches, n))
    await client.close()
    verified_bytes = measured_verified * size  # of the timed batches only
    return {
        "object_size": size,
        "batch_size": n,
        "batches": args.batches,
        "put_gbps": throughput_gbps(verified_bytes, put_s),
        "get_gbps": throughput_gbps(verified_bytes, get_s),
        "put_s": math.fsum(put_s),
        "get_s": math.fsum(get_s),
        "put_p50_ms": percentile(put_s, 50) * 1e3,
        "put_p99_ms": percentile(put_s, 99) * 1e3,
        "get_p50_ms": percentile(get_s, 50) * 1e3,
        "get_p99_ms": percentile(get_s, 99) * 1e3,
        "lookup_p50_ms": percentile(lookup_s, 50) * 1e3,
        "lookup_p99_ms": percentile(lookup_s, 99) * 1e3,
        "lookup_hot_p50_ms": percentile(hot_lookup_s, 50) * 1e3,
        "exists_hot_p50_ms": percentile(hot_exists_s, 50) * 1e3,
        **asdict(counts),
        "verified_bytes": verified_bytes,
        "client_huge_page_bytes": huge,
        "bytes_by_path": paths,
        "warmed_segments": warmed["segments"],
        "warmed_bytes": warmed["bytes"],
        "removed_groups": removed,
    }


async def read_back(args: argparse.Namespace) -> dict[str, object]:
    """A fresh client reads what a ``--put-only`` run left: every store page is new to its mappings."""
    n, size = args.batch_size, args.object_size
    written = json.loads(Path(args.crc_file).read_text())
    dst = Layout(size, n)
    buffer = HostBuffer(dst.batch_bytes)
    buffer.touch()
    client = PoolClient(args.master, TransferEngine())
    client.register(buffer.address, buffer.size)
    counts = Counts(objects=n * len(written["crcs"]))
    get_s, lookup_s, measured_verified = await _get_batches(
        client, buffer.view(), buffer.address, dst, written["prefix"], written["crcs"], counts)
    paths = path_bytes(client)
    removed = await _remove(client, _group_ids(written["prefix"], len(written["crcs"]) - 1, n))
    await client.close()
    verified_bytes = measured_verified * size
    return {
        "object_size": size, "batch_size": n, "batches": len(written["crcs"]) - 1,
        "get_gbps": throughput_gbps(verified_bytes, get_s), "get_s": math.fsum(get_s),
        "get_p50_ms": percentile(get_s, 50) * 1e3, "lookup_p50_ms": percentile(lookup_s, 50) * 1e3,
        **asdict(counts), "stored": counts.objects, "verified_bytes": verified_bytes, "bytes_by_path": paths,
        "removed_groups": removed,
    }


async def memory_owner(args: argparse.Namespace) -> dict[str, object]:
    """Offer one touched segment, as a store does, until stdin closes; prints where to map it first."""
    segment = SharedSegment(args.size, "kvpool-bench-memcpy")
    segment.touch()
    share = SegmentShare(Path(args.folder), f"memcpy-{os.getpid()}")
    share.add("segment", segment)
    socket_path = await share.start()
    sys.stdout.write(json.dumps({"socket_path": str(socket_path), "name": "segment", "token": segment.token}) + "\n")
    sys.stdout.flush()
    await asyncio.to_thread(sys.stdin.read)
    await share.close()
    segment.close()
    return {"size": args.size}


def _copy_batches(local: SharedSegment, mapped: MappedSegment, src: Layout, dst: Layout,
                  batches: int) -> tuple[list[float], list[float], Counts]:
    """One thread: each batch's objects to fresh offsets of the mapping, then each back; every object checked."""
    mem = local.view()
    size = src.object_size
    counts = Counts(objects=src.batch_size * (batches + 1))
    put_s: list[float] = []
    get_s: list[float] = []
    crcs = []
    for b in range(batches + 1):  # batch 0 is checked like the others but not timed
        crcs.append(stamp_batch(mem, src, SYSTEM_MEMCPY, b))
        remote = mapped.address + b * src.batch_bytes
        t0 = time.perf_counter()
        for i, off in enumerate(src.offsets()):
            copy(remote + i * size, local.address + off, size)
        if b:
            put_s.append(time.perf_counter() - t0)
    counts.stored = counts.objects
    for b, expected in enumerate(crcs):
        zero(mem, dst.base, dst.batch_bytes)
        remote = mapped.address + b * src.batch_bytes
        t0 = time.perf_counter()
        for i, off in enumerate(dst.offsets()):
            copy(local.address + off, remote + i * size, size)
        elapsed = time.perf_counter() - t0
        same = match_batch(mem, dst, expected)
        counts.mismatched += same.count(False)
        counts.verified_objects += same.count(True)
        if b:
            get_s.append(elapsed)
    mem.release()
    return put_s, get_s, counts


async def memcpy(args: argparse.Namespace) -> dict[str, object]:
    n, size = args.batch_size, args.object_size
    src = Layout(size, n)
    dst = Layout(size, n, base=src.batch_bytes)
    local = SharedSegment(2 * src.batch_bytes, "kvpool-bench-memcpy-local")
    local.touch()
    local.view()[:] = random.Random(os.getpid()).randbytes(local.size)
    maps = SegmentMaps()
    mapped = await maps.map(args.socket_path, args.name, args.token)
    if mapped.size < (args.batches + 1) * src.batch_bytes:
        raise SystemExit(f"the owner's segment ({mapped.size} bytes) is smaller than the run's batches")
    with mapped.using():
        fault_in(mapped)
        put_s, get_s, counts = _copy_batches(local, mapped, src, dst, args.batches)
    await maps.close()
    local.close()
    verified_bytes = min(counts.verified_objects, n * args.batches) * size
    return {
        "object_size": size, "batch_size": n, "batches": args.batches,
        "memcpy_put_gbps": throughput_gbps(verified_bytes, put_s),
        "memcpy_get_gbps": throughput_gbps(verified_bytes, get_s),
        "memcpy_put_p50_ms": percentile(put_s, 50) * 1e3, "memcpy_get_p50_ms": percentile(get_s, 50) * 1e3,
        **asdict(counts), "verified_bytes": verified_bytes,
    }


async def churn_writer(args: argparse.Namespace) -> dict[str, object]:
    size = args.object_size
    buffer = HostBuffer(GROUP * size)
    client = PoolClient(args.master, TransferEngine())
    client.register(buffer.address, buffer.size)
    counts = {r: 0 for r in PutResult}
    for g in range(args.groups):
        group_id = f"churn/{g}"
        for m in range(GROUP):
            fill(buffer, m * size, size, seed=g * GROUP + m)
        for m in range(GROUP):  # one member per batch, like one stage each
            obj = PutObject(f"{group_id}/{m}", group_id, GROUP, buffer.address + m * size, size)
            counts[(await client.put([obj]))[0]] += 1
    await client.close()
    return {"groups": args.groups, **{f"put_{r.value}": c for r, c in counts.items()}}


async def churn_reader(args: argparse.Namespace) -> dict[str, object]:
    size = args.object_size
    buffer = HostBuffer(2 * GROUP * size)
    client = PoolClient(args.master, TransferEngine())
    client.register(buffer.address, buffer.size)
    rng = random.Random(os.getpid())
    lookups = hits = partial = reads_ok = wrong = 0
    stop_file = args.stop_file
    while not os.path.exists(stop_file):
        g = rng.randrange(args.groups)
        found = await client.lookup([f"churn/{g}"])
        lookups += 1
        if not found.num_complete:
            continue
        hits += 1
        members = found.groups[0].members
        if len(members) != GROUP:
            partial += 1
        items = [(loc, buffer.address + i * size) for i, loc in enumerate(members.values())]
        ok = await client.read(items)
        await client.release(found.lease_id)
        for good, (loc, addr) in zip(ok, items):
            if good:
                reads_ok += 1
                m = int(loc.key.rsplit("/", 1)[1])
                expected = random.Random(g * GROUP + m).randbytes(size)
                wrong += int(bytes(buffer.view(addr - buffer.address, size)) != expected)
    await client.close()
    return {"lookups": lookups, "hits": hits, "partial_groups_seen": partial, "reads_ok": reads_ok,
            "wrong_bytes": wrong}


ROLES = {"throughput": throughput, "read-back": read_back, "memory-owner": memory_owner, "memcpy": memcpy,
         "churn-writer": churn_writer, "churn-reader": churn_reader}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m kvpool.tools.bench.pool_workload")
    parser.add_argument("role", choices=list(ROLES))
    parser.add_argument("--master", default="")
    parser.add_argument("--object-size", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--batches", type=int, default=1)
    parser.add_argument("--groups", type=int, default=1)
    parser.add_argument("--tag", default="t")
    parser.add_argument("--stop-file", default="")
    parser.add_argument("--engine-only", action="store_true", help="every byte by the transfer engine")
    parser.add_argument("--warm-mappings", action="store_true", help="fault store segments in before timing")
    parser.add_argument("--put-only", action="store_true", help="put, write --crc-file, leave the groups")
    parser.add_argument("--crc-file", default="")
    parser.add_argument("--size", type=int, default=0, help="memory-owner: segment bytes")
    parser.add_argument("--folder", default="", help="memory-owner: the share's private folder")
    parser.add_argument("--socket-path", default="")
    parser.add_argument("--name", default="")
    parser.add_argument("--token", default="")
    args = parser.parse_args()
    result = asyncio.run(ROLES[args.role](args))
    sys.stdout.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
