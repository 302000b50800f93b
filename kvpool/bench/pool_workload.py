"""Worker processes of ``kvpool bench pool``; each prints one JSON line and exits.

Roles:
- ``throughput``: put fresh batches, then look up and read them back; reports
  GB/s and per-batch latency, lookup latency, and whether bytes matched.
- ``churn-writer``: fills a pool with 4-member groups, one member per batch
  (as four pipeline stages would), far past its capacity.
- ``churn-reader``: looks groups up and reads them until told to stop;
  reports partial groups seen and bytes that did not match.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time

from kvpool.bench.stats import gbps, percentile
from kvpool.pool.client import PoolClient, PutObject, PutResult
from kvpool.transfer import HostBuffer, TransferEngine

GROUP = 4
HOT_REPS = 50  # as upstream's batch_is_exist timing


def fill(buffer: HostBuffer, offset: int, size: int, seed: int) -> None:
    buffer.view(offset, size)[:] = random.Random(seed).randbytes(size)


async def throughput(args: argparse.Namespace) -> dict[str, object]:
    n, size = args.batch_size, args.object_size
    buffer = HostBuffer(2 * n * size)
    buffer.touch()
    fill(buffer, 0, n * size, seed=1)
    client = PoolClient(args.master, TransferEngine())
    client.register(buffer.address, buffer.size)
    put_s, get_s, lookup_s = [], [], []
    stored = verified = mismatched = 0
    prefix = f"bench/{args.tag}/{os.getpid()}"
    for b in range(args.batches + 1):  # batch 0 warms connections up, not counted
        objects = [
            PutObject(f"{prefix}/{b}/{i}/0", f"{prefix}/{b}/{i}", 1, buffer.address + i * size, size) for i in range(n)
        ]
        t0 = time.perf_counter()
        results = await client.put(objects)
        elapsed = time.perf_counter() - t0
        if b:
            put_s.append(elapsed)
            stored += results.count(PutResult.STORED)
    for b in range(args.batches + 1):
        group_ids = [f"{prefix}/{b}/{i}" for i in range(n)]
        t0 = time.perf_counter()
        found = await client.lookup(group_ids)
        t1 = time.perf_counter()
        items = [
            (g.members[f"{g.group_id}/0"], buffer.address + (n + i) * size) for i, g in enumerate(found.groups)
        ]
        ok = await client.read(items)
        await client.release(found.lease_id)
        t2 = time.perf_counter()
        if b:
            lookup_s.append(t1 - t0)
            get_s.append(t2 - t0)
            verified += sum(ok)
            mismatched += int(bytes(buffer.view(0, len(items) * size)) != bytes(buffer.view(n * size, len(items) * size)))
    # back to back, as upstream's batch_is_exist is timed: the loop above measures
    # each lookup after an idle gap (the byte compare), which costs ~1.5 ms more here
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
    await client.close()
    batch_bytes = n * size
    return {
        "object_size": size,
        "batch_size": n,
        "batches": args.batches,
        "put_gbps": gbps(batch_bytes, percentile(put_s, 50)),
        "get_gbps": gbps(batch_bytes, percentile(get_s, 50)),
        "put_p50_ms": percentile(put_s, 50) * 1e3,
        "put_p99_ms": percentile(put_s, 99) * 1e3,
        "get_p50_ms": percentile(get_s, 50) * 1e3,
        "get_p99_ms": percentile(get_s, 99) * 1e3,
        "lookup_p50_ms": percentile(lookup_s, 50) * 1e3,
        "lookup_p99_ms": percentile(lookup_s, 99) * 1e3,
        "lookup_hot_p50_ms": percentile(hot_lookup_s, 50) * 1e3,
        "exists_hot_p50_ms": percentile(hot_exists_s, 50) * 1e3,
        "stored": stored,
        "verified": verified,
        "batches_mismatched": mismatched,
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
    parser = argparse.ArgumentParser(prog="python -m kvpool.bench.pool_workload")
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
