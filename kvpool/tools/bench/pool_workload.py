"""Worker processes of ``kvpool bench pool``; each prints one JSON line and exits.

Roles:
- ``throughput``: put fresh batches, each object stamped anew, then look up and
  read them back into zeroed memory; reports GB/s (verified bytes / seconds),
  per-batch and lookup latency, and per-object counts: stored, not stored,
  missed, mismatched, verified.
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
from dataclasses import asdict, dataclass

from kvpool.tools.bench.stats import percentile, throughput_gbps
from kvpool.tools.bench.worker_protocol import SYSTEM_KVPOOL, Layout, huge_page_bytes, match_batch, stamp_batch, zero
from kvpool.pool.client import PoolClient
from kvpool.pool.objects import PutObject, PutResult
from kvpool.transfer import HostBuffer, TransferEngine

GROUP = 4
HOT_REPS = 50  # as upstream's batch_is_exist timing


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


async def _put_batches(client: PoolClient, mem: memoryview, address: int, src: Layout, prefix: str,
                       batches: int, counts: Counts) -> tuple[list[float], list[list[int]]]:
    """Put every batch under fresh keys, each stamped anew; return measured seconds and CRCs."""
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
        counts.stored += results.count(PutResult.STORED)
        counts.not_stored += len(objects) - results.count(PutResult.STORED)
    return put_s, crcs


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
    client = PoolClient(args.master, TransferEngine())
    client.register(buffer.address, buffer.size)
    counts = Counts(objects=n * (args.batches + 1))
    prefix = f"bench/{args.tag}/{os.getpid()}"
    put_s, crcs = await _put_batches(client, mem, buffer.address, src, prefix, args.batches, counts)
    get_s, lookup_s, measured_verified = await _get_batches(client, mem, buffer.address, dst, prefix, crcs, counts)
    hot_lookup_s, hot_exists_s = await _hot_lookups(client, prefix, n)
    huge = huge_page_bytes()
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


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m kvpool.tools.bench.pool_workload")
    parser.add_argument("role", choices=["throughput", "churn-writer", "churn-reader"])
    parser.add_argument("--master", required=True)
    parser.add_argument("--object-size", type=int, required=True)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--batches", type=int, default=1)
    parser.add_argument("--groups", type=int, default=1)
    parser.add_argument("--tag", default="t")
    parser.add_argument("--stop-file", default="")
    args = parser.parse_args()
    role = {"throughput": throughput, "churn-writer": churn_writer, "churn-reader": churn_reader}[args.role]
    result = asyncio.run(role(args))
    sys.stdout.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
