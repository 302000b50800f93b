"""``kvpool bench pool``: our pool next to upstream Mooncake Store and the raw engine.

One run on one host: a master and two stores (real processes), a client
process per measurement. The same object sizes and batches go through
upstream Mooncake Store and through the bare transfer engine between two
processes (the ceiling). Then a small pool is filled to three times its
capacity with 4-member groups while readers run, and the largest occupancy
and any partial group a reader saw are reported.

Every system is held to the same rules: objects stamped with (system, batch,
index), destinations zeroed before each read, throughput = verified bytes /
seconds (``stats.throughput_gbps``), and any object not stored, missed or read
back different voids the run (``BenchError``, exit status 1).

The headline comparison (the largest batch) is run in interleaved repeats, each
repeat measuring every system once in this order, so machine noise hits all
alike. Every client is a worker process apart from the stores. Its keys differ
per batch, and its batches are many enough that the data read in one run is
``WORKING_SET_L3`` times this host's largest CPU cache (``--quick``:
``QUICK_WORKING_SET_L3`` times; ``l3_cache_bytes``):

- same host, warm (``same_host_*_gbps``): our client on its default path. The
  stores are on this host and offer their segments as shared memory, so every
  byte is a memory copy. After the untimed first batch the worker faults in
  every page of each store segment it maps, as a long-lived client's mappings
  would be; it must move every byte by memory and none by the engine.
- same host, first touch (``same_host_*_first_touch_gbps``): a fresh worker puts
  the same batches (``--put-only``: each page it writes is new to its mapping),
  then another fresh worker reads them all back (``read-back``: each page it
  reads is new to its mapping) and verifies every object.
- engine (``engine_*_gbps``): our client with ``engine_only=True``: the same
  batches by the transfer engine over loopback, no byte by memory.
- memcpy (``memcpy_gbps``): the like-for-like copy. A ``memory-owner`` process
  holds a touched ``SharedSegment`` offered by a ``SegmentShare``, as a store
  holds its segment; a worker maps it through ``SegmentMaps``, faults its pages
  in (like the warm client) and, on one thread, ``copy()``s each object of a
  batch from its own ``SharedSegment`` to fresh offsets of the mapping (put),
  then each object back into zeroed memory (get), with the same object size,
  batch size and batch count, every object verified after the clock stops.
  ``memcpy_gbps`` is the get direction (mapping to local, as a pool get copies).
  No RPC, no checksum, no lookup: the ceiling of a copy on this host.
- upstream Mooncake Store (its TCP client, two stores, prefaulted segments) and
  the bare transfer engine, with the same batches.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kvpool import service
from kvpool.tools.bench.stats import percentile
from kvpool.tools.bench.worker_protocol import BenchError, huge_page_bytes, thp_mode, total_or_none
from kvpool.tools.cluster import LocalPool
from kvpool.rpc import pool_pb2, pool_pb2_grpc
from kvpool.sizes import format_size

SMALL_OBJECT = 4096
# Small batches are timed this many times whatever --batches says: a p50 of 6 small batches
# (--quick) moved by ±30% from run to run on a quiet host (one batch of 64 × 4 KiB takes
# ~11 ms, so 60 cost under a second and pin the median within a few percent).
SMALL_BATCHES = 60
# the data one headline run reads, in multiples of the largest CPU cache: far past what caches can hold
WORKING_SET_L3 = 4
QUICK_WORKING_SET_L3 = 2
CACHE_ROOT = Path("/sys/devices/system/cpu/cpu0/cache")
UNKNOWN_CACHE_BYTES = 64 << 20  # a host that does not say: a large L3 of today
# the targets for the same-host path, reported next to what was measured
TARGETS = {"same_host_get_vs_mooncake": 2.5, "same_host_put_vs_mooncake": 2.5, "same_host_get_vs_memcpy": 0.4}
CHURN_SEGMENT = 16 << 20
CHURN_OBJECT = 256 << 10
# Huge pages are off for every side while this bench runs. Our HostBuffers (client
# buffers and store segments) madvise(MADV_HUGEPAGE) unless KVPOOL_HUGE_PAGES=0; the
# raw-engine and upstream client buffers never do; upstream's segments are allocated
# inside mooncake, which we cannot change. "Off" is the one setting all three can
# share, so every process gets the kernel's default (its THP mode is reported), and
# each side's huge-page bytes are measured and reported rather than assumed.
HUGE_PAGES_ENV = "KVPOOL_HUGE_PAGES"
HUGE_PAGES_VALUE = "0"
# per-object counts: summed over repeats, never medians
COUNTERS = frozenset({
    "objects", "stored", "not_stored", "missed", "mismatched", "verified_objects", "verified_bytes", "put_bytes",
    "mooncake_verified_objects", "mooncake_verified_bytes", "te_raw_verified_objects", "te_raw_verified_bytes",
})


def _worker(role: str, *args: str, timeout_s: float = 300.0) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "kvpool.tools.bench.pool_workload", role, *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        raise BenchError(f"{role} worker failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def l3_cache_bytes(root: Path = CACHE_ROOT) -> int:
    """The largest CPU cache this host reports (sysfs ``index*/size``, e.g. ``491520K``)."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    sizes = []
    for entry in root.glob("index*/size"):
        text = entry.read_text().strip()
        if text:
            sizes.append(int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text))
    return max(sizes, default=UNKNOWN_CACHE_BYTES)


def headline_batches(working_set: int, object_size: int, batch_size: int, at_least: int) -> int:
    """Timed batches of the headline runs: enough that they read ``working_set`` bytes, and ``at_least``."""
    return max(at_least, math.ceil(working_set / (object_size * batch_size)))


def measure_ours(master: str, object_size: int, batch_size: int, batches: int, tag: str,
                 *flags: str) -> dict[str, Any]:
    """One fresh ``throughput`` worker; ``flags``: ``--engine-only``, ``--warm-mappings``, ``--put-only``, ..."""
    return _worker(
        "throughput", "--master", master, "--object-size", str(object_size), "--batch-size", str(batch_size),
        "--batches", str(batches), "--tag", tag, *flags,
    )


def measure_first_touch(master: str, object_size: int, batch_size: int, batches: int, tag: str,
                        workdir: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """A fresh worker puts (``--put-only``), another fresh one reads it all back: (put result, get result)."""
    crc_file = workdir / f"{tag}.crcs.json"
    put = measure_ours(master, object_size, batch_size, batches, tag, "--put-only", "--crc-file", str(crc_file))
    get = _worker("read-back", "--master", master, "--object-size", str(object_size), "--batch-size",
                  str(batch_size), "--crc-file", str(crc_file))
    crc_file.unlink()
    return put, get


def measure_memcpy(object_size: int, batch_size: int, batches: int, folder: Path) -> dict[str, Any]:
    """The like-for-like copy (module doc): an owner process offers a segment, a worker maps it and copies."""
    size = (batches + 1) * object_size * batch_size
    cmd = [sys.executable, "-m", "kvpool.tools.bench.pool_workload", "memory-owner", "--size", str(size),
           "--folder", str(folder)]
    with subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) as owner:
        try:
            line = owner.stdout.readline()
            if not line:
                raise BenchError(f"memcpy: the memory owner exited ({owner.wait(30)}) before offering its segment")
            offer = json.loads(line)
            return _worker("memcpy", "--object-size", str(object_size), "--batch-size", str(batch_size),
                           "--batches", str(batches), "--socket-path", offer["socket_path"], "--name", offer["name"],
                           "--token", offer["token"])
        finally:
            owner.stdin.close()
            owner.wait(60)


def failures(result: dict[str, Any], path: str | None = None) -> list[str]:
    """What went wrong in one system's (merged) result; empty when all verified.

    Per object: not stored, missed, different. With ``path`` (``memory`` or ``engine``), the worker's
    ``bytes_by_path`` must show bytes by that path and none by the other."""
    objects = result["objects"]
    problems = [f"{result[k]} {k.replace('_', ' ')}" for k in ("not_stored", "missed", "mismatched") if result.get(k)]
    if result.get("stored", objects) != objects:
        problems.append(f"{result['stored']}/{objects} stored")
    for key in ("verified_objects", "mooncake_verified_objects", "te_raw_verified_objects"):
        if key in result and result[key] != objects:
            problems.append(f"{result[key]}/{objects} verified")
    if path is not None:
        moved = result.get("bytes_by_path", {})
        problems += [f"{n} bytes by {k.replace('_', ' ')}" for k, n in sorted(moved.items())
                     if n and not k.startswith(f"{path}_")]
        if not any(n for k, n in moved.items() if k.startswith(f"{path}_")):
            problems.append(f"no byte by {path}")
    return problems


def require_clean(name: str, result: dict[str, Any], path: str | None = None) -> dict[str, Any]:
    """Void the run, loudly, unless every object was stored, found and read back identical (by ``path``)."""
    problems = failures(result, path)
    if problems:
        raise BenchError(f"{name}: {', '.join(problems)}; every object must be stored, found and read back "
                         "identical, so this run's figures are void")
    return result


def merge_repeats(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One result from repeats: counters summed, throughputs and timings as medians, flags all-true.

    Huge-page bytes are the largest seen; the run shape is the same in every repeat.
    """
    merged = dict(runs[0])
    for key, value in runs[0].items():
        values = [r[key] for r in runs]
        if key in COUNTERS:
            merged[key] = sum(values)
        elif key.endswith("huge_page_bytes"):
            merged[key] = None if None in values else max(values)
        elif isinstance(value, bool):
            merged[key] = all(values)
        elif key.endswith(("_gbps", "_ms", "_s")):
            merged[key] = percentile([float(v) for v in values], 50)
    merged["repeats"] = len(runs)
    return merged


@contextlib.contextmanager
def same_huge_pages() -> Iterator[None]:
    """Run our processes (they inherit the environment) with huge pages off, as the others."""
    before = os.environ.get(HUGE_PAGES_ENV)
    os.environ[HUGE_PAGES_ENV] = HUGE_PAGES_VALUE
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(HUGE_PAGES_ENV, None)
        else:
            os.environ[HUGE_PAGES_ENV] = before


async def _poll_used(master: str, stop: asyncio.Event) -> tuple[int, int, float, float]:
    """Sample the master's occupancy until ``stop``; returns (max used, capacity, high, low)."""
    max_used = capacity = 0
    high = low = math.nan
    async with service.channel(master) as channel:
        stub = pool_pb2_grpc.PoolMasterStub(channel)
        while not stop.is_set():
            stats = await stub.Stats(pool_pb2.StatsRequest(), timeout=5)
            max_used = max(max_used, stats.used_bytes)
            capacity, high, low = stats.capacity_bytes, stats.high_watermark, stats.low_watermark
            await asyncio.sleep(0.002)
    return max_used, capacity, high, low


async def _churn(master: str, groups: int, readers: int, workdir: Path) -> dict[str, Any]:
    stop_file = workdir / "churn.stop"
    common = ["--master", master, "--object-size", str(CHURN_OBJECT), "--groups", str(groups)]
    mod = [sys.executable, "-m", "kvpool.tools.bench.pool_workload"]
    reader_procs = [
        await asyncio.create_subprocess_exec(*mod, "churn-reader", *common, "--stop-file", str(stop_file),
                                             stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL)
        for _ in range(readers)
    ]
    writer = await asyncio.create_subprocess_exec(*mod, "churn-writer", *common, stdout=asyncio.subprocess.PIPE,
                                                  stderr=asyncio.subprocess.PIPE)
    stop = asyncio.Event()
    poller = asyncio.create_task(_poll_used(master, stop))
    out, err = await writer.communicate()
    stop.set()
    stop_file.touch()
    max_used, capacity, high, low = await poller
    if writer.returncode != 0:
        raise RuntimeError(f"churn writer failed:\n{err.decode()[-3000:]}")
    reader_results = [json.loads((await p.communicate())[0].decode().strip().splitlines()[-1]) for p in reader_procs]
    return {
        "writer": json.loads(out.decode().strip().splitlines()[-1]),
        "readers": reader_results,
        "capacity_bytes": capacity,
        "max_used_bytes": max_used,
        "max_used_ratio": max_used / capacity if capacity else math.nan,
        "high_watermark": high,
        "low_watermark": low,
        # a put may cross the high watermark by one batch (one object here) before eviction catches up
        "bound_ratio": high + CHURN_OBJECT / capacity if capacity else math.nan,
        "partial_groups_seen": sum(r["partial_groups_seen"] for r in reader_results),
        "wrong_bytes": sum(r["wrong_bytes"] for r in reader_results),
        "reader_hits": sum(r["hits"] for r in reader_results),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    batches = args.batches or (6 if args.quick else 16)
    repeats = 2 if args.quick else 3
    size = args.object_size
    largest = max(batch_sizes)
    cache = l3_cache_bytes()
    working_set = args.working_set_bytes or cache * (QUICK_WORKING_SET_L3 if args.quick else WORKING_SET_L3)
    top = headline_batches(working_set, size, largest, batches)
    # room for every batch without eviction, so puts measure placement and transfer, not churn; each run
    # removes its groups when done, so one headline run's batches are in the pool at a time
    volume = ((batches + 1) * size * sum(b for b in batch_sizes if b != largest) + (top + 1) * size * largest
              + (SMALL_BATCHES + 1) * 64 * SMALL_OBJECT)
    segment = max(256 << 20, volume // 2 * 3 // 2)
    report: dict[str, Any] = {"object_size": size, "batches": batches, "headline_batches": top,
                              "l3_cache_bytes": cache, "read_bytes_per_run": top * size * largest,
                              "segment_bytes": segment, "ours": {}}
    upstream = None
    if not args.skip_upstream:
        from kvpool.tools.bench import upstream
    with same_huge_pages(), tempfile.TemporaryDirectory(prefix="kvpool-bench-") as tmp:
        workdir = Path(tmp)
        with LocalPool(num_stores=2, segment_size=str(segment), workdir=workdir / "pool") as pool:
            for b in batch_sizes:
                if b != largest:
                    report["ours"][f"kv_batch{b}"] = require_clean(
                        f"ours, batch {b}", measure_ours(pool.master_address, size, b, batches, f"kv{b}"))
            report["ours"]["small_batch64"] = require_clean(
                "ours, small objects", measure_ours(pool.master_address, SMALL_OBJECT, 64, SMALL_BATCHES, "small"))
            # the headline comparison, interleaved so machine noise hits every system alike (module doc)
            ours, put_first, get_first, engine, memcpy, mooncake, te_raw, te_polled = ([] for _ in range(8))
            master = pool.master_address
            for r in range(repeats):
                ours.append(require_clean("ours, same host", measure_ours(
                    master, size, largest, top, f"kv{largest}r{r}", "--warm-mappings"), "memory"))
                if ours[-1]["warmed_segments"] != len(pool.stores):
                    raise BenchError(f"the warm client faulted in {ours[-1]['warmed_segments']} store segments, "
                                     f"not all {len(pool.stores)}: its figures would mix warm and first touch")
                put, get = measure_first_touch(master, size, largest, top, f"first{r}", workdir)
                put_first.append(require_clean("ours, same host, first-touch put", put, "memory"))
                get_first.append(require_clean("ours, same host, first-touch get", get, "memory"))
                engine.append(require_clean("ours, engine only", measure_ours(
                    master, size, largest, top, f"engine{r}", "--engine-only"), "engine"))
                memcpy.append(require_clean("memcpy", measure_memcpy(size, largest, top, workdir / "shm")))
                if upstream is not None:
                    # same topology as ours (two stores); our stores fault their segments in
                    # at start, so the like-for-like upstream run prefaults too
                    mooncake.append(upstream.measure_mooncake_store(
                        size, largest, top, num_stores=2, prefault_segment=True))
                    te_raw.append(upstream.measure_te_raw(size, largest, top))
                    # the engine's non-spinning way against two targets: what our
                    # client does against two stores, so the fair ceiling
                    te_polled.append(upstream.measure_te_raw(size, largest, top, num_targets=2, polled=True))
            report["ours"][f"kv_batch{largest}"] = require_clean(f"ours, batch {largest}", merge_repeats(ours))
            report["ours_repeats"] = ours
            report["same_host_first_touch_put"] = merge_repeats(put_first)
            report["same_host_first_touch_get"] = merge_repeats(get_first)
            report["engine_only"] = merge_repeats(engine)
            report["memcpy"] = merge_repeats(memcpy)
            report["ours_stores_huge_page_bytes"] = total_or_none([huge_page_bytes(s.proc.pid) for s in pool.stores])
        if upstream is not None:
            report["mooncake"] = require_clean("upstream Mooncake Store", merge_repeats(mooncake))
            report["mooncake_repeats"] = mooncake
            report["te_raw"] = require_clean("raw engine", merge_repeats(te_raw))
            report["te_raw_polled"] = require_clean("raw engine, polled", merge_repeats(te_polled))
            fresh = require_clean("upstream, fresh segment",
                                  upstream.measure_mooncake_store(size, largest, top, num_stores=2))
            report["mooncake"]["mooncake_put_fresh_gbps"] = fresh["mooncake_put_gbps"]
        report["huge_pages"] = huge_page_report(report, largest)
        with LocalPool(num_stores=2, segment_size=str(CHURN_SEGMENT), workdir=workdir / "churn") as pool:
            groups = 3 * 2 * CHURN_SEGMENT // (4 * CHURN_OBJECT)
            report["churn"] = asyncio.run(_churn(pool.master_address, groups, readers=2, workdir=workdir))
    return report


def huge_page_report(report: dict[str, Any], largest: int) -> dict[str, Any]:
    """The huge-page setting every side ran with, and the huge-page bytes each side's processes held."""
    measured = {
        "ours_stores": report["ours_stores_huge_page_bytes"],
        "ours_client": report["ours"][f"kv_batch{largest}"]["client_huge_page_bytes"],
    }
    if "mooncake" in report:
        measured["mooncake"] = report["mooncake"]["mooncake_huge_page_bytes"]
        measured["te_raw"] = report["te_raw"]["te_raw_huge_page_bytes"]
        measured["te_raw_polled"] = report["te_raw_polled"]["te_raw_huge_page_bytes"]
    return {
        "setting": "off",
        HUGE_PAGES_ENV: HUGE_PAGES_VALUE,
        "thp_mode": thp_mode(),
        "measured_bytes": measured,
        # off for all means none of them should hold any; anything else is reported as not aligned
        "aligned": all(v == 0 for v in measured.values()),
    }


def summarize(report: dict[str, Any], largest_batch: int) -> dict[str, Any]:
    kv = report["ours"][f"kv_batch{largest_batch}"]
    churn = report["churn"]
    te = report.get("te_raw", {})
    tp = report.get("te_raw_polled", {})
    mc = report.get("mooncake", {})
    nan = math.nan
    summary = {
        "put_gbps": kv["put_gbps"],
        "get_gbps": kv["get_gbps"],
        "put_p50_ms": kv["put_p50_ms"],
        "put_p99_ms": kv["put_p99_ms"],
        "get_p50_ms": kv["get_p50_ms"],
        "get_p99_ms": kv["get_p99_ms"],
        "mooncake_put_gbps": mc.get("mooncake_put_gbps", nan),
        "mooncake_get_gbps": mc.get("mooncake_get_gbps", nan),
        "mooncake_put_fresh_segment_gbps": mc.get("mooncake_put_fresh_gbps", nan),
        "te_raw_gbps": te.get("te_raw_gbps", nan),
        "te_raw_write_gbps": te.get("te_raw_write_gbps", nan),
        "te_raw_read_gbps": te.get("te_raw_read_gbps", nan),
        "te_raw_polled_write_gbps": tp.get("te_raw_write_gbps", nan),
        "te_raw_polled_read_gbps": tp.get("te_raw_read_gbps", nan),
        "lookup_p50_ms": kv["lookup_p50_ms"],
        "lookup_p99_ms": kv["lookup_p99_ms"],
        # back to back, timed like upstream's batch_is_exist
        "lookup_hot_p50_ms": kv["lookup_hot_p50_ms"],
        "exists_hot_p50_ms": kv["exists_hot_p50_ms"],
        "mooncake_exist_p50_ms": mc.get("mooncake_exist_p50_ms", nan),
        "small_put_p50_ms": report["ours"]["small_batch64"]["put_p50_ms"],
        "small_get_p50_ms": report["ours"]["small_batch64"]["get_p50_ms"],
        "max_used_ratio": churn["max_used_ratio"],
        "occupancy_bound_ratio": churn["bound_ratio"],
        "partial_groups_seen": churn["partial_groups_seen"],
        "wrong_bytes_seen": churn["wrong_bytes"],
        # the run fails before it gets here unless every one of these verified
        "throughput_formula": "verified bytes / elapsed seconds",
        "verified_objects": kv["verified_objects"],
        "verified_objects_all_rows": sum(r["verified_objects"] for r in report["ours"].values()),
        "mooncake_verified_objects": mc.get("mooncake_verified_objects", 0),
        "te_raw_verified_objects": te.get("te_raw_verified_objects", 0),
        "te_raw_polled_verified_objects": tp.get("te_raw_verified_objects", 0),
        "huge_pages": report["huge_pages"]["setting"],
        "thp_mode": report["huge_pages"]["thp_mode"],
        "huge_pages_aligned": report["huge_pages"]["aligned"],
        "huge_page_bytes": report["huge_pages"]["measured_bytes"],
    }
    summary |= same_host_summary(report, summary)
    summary["put_vs_mooncake"] = summary["put_gbps"] / summary["mooncake_put_gbps"]
    summary["get_vs_mooncake"] = summary["get_gbps"] / summary["mooncake_get_gbps"]
    # the ceiling is the better of the two raw ways to move the same bytes
    summary["te_ceiling_write_gbps"] = max(summary["te_raw_write_gbps"], summary["te_raw_polled_write_gbps"])
    summary["te_ceiling_read_gbps"] = max(summary["te_raw_read_gbps"], summary["te_raw_polled_read_gbps"])
    summary["put_vs_te_raw_write"] = summary["put_gbps"] / summary["te_ceiling_write_gbps"]
    summary["get_vs_te_raw_read"] = summary["get_gbps"] / summary["te_ceiling_read_gbps"]
    return summary


def same_host_summary(report: dict[str, Any], summary: dict[str, Any]) -> dict[str, Any]:
    """The same-host keys: our default path (warm and first touch) next to the engine path, upstream and memcpy,
    the ratios with targets, and whether each was met in this run."""
    put_first, get_first = report["same_host_first_touch_put"], report["same_host_first_touch_get"]
    engine, memcpy = report["engine_only"], report["memcpy"]
    figures = {
        "same_host_get_gbps": summary["get_gbps"],
        "same_host_put_gbps": summary["put_gbps"],
        "same_host_get_first_touch_gbps": get_first["get_gbps"],
        "same_host_put_first_touch_gbps": put_first["put_gbps"],
        "engine_get_gbps": engine["get_gbps"],
        "engine_put_gbps": engine["put_gbps"],
        "memcpy_gbps": memcpy["memcpy_get_gbps"],
        "memcpy_put_gbps": memcpy["memcpy_put_gbps"],
        "headline_batches": report["headline_batches"],
        "read_bytes_per_run": report["read_bytes_per_run"],
        "l3_cache_bytes": report["l3_cache_bytes"],
        "same_host_verified_objects": (report["ours"][f"kv_batch{max_batch(report)}"]["verified_objects"]
                                       + get_first["verified_objects"]),
        "engine_verified_objects": engine["verified_objects"],
        "memcpy_verified_objects": memcpy["verified_objects"],
    }
    figures["same_host_get_vs_mooncake"] = figures["same_host_get_gbps"] / summary["mooncake_get_gbps"]
    figures["same_host_put_vs_mooncake"] = figures["same_host_put_gbps"] / summary["mooncake_put_gbps"]
    figures["same_host_get_vs_memcpy"] = figures["same_host_get_gbps"] / figures["memcpy_gbps"]
    figures["same_host_get_vs_engine"] = figures["same_host_get_gbps"] / figures["engine_get_gbps"]
    figures["same_host_put_vs_engine"] = figures["same_host_put_gbps"] / figures["engine_put_gbps"]
    figures["targets"] = dict(TARGETS)
    figures["targets_met"] = {key: figures[key] >= target for key, target in TARGETS.items()}
    return figures


def max_batch(report: dict[str, Any]) -> int:
    """The headline batch size: the largest ``kv_batchN`` row."""
    return max(int(name.removeprefix("kv_batch")) for name in report["ours"] if name.startswith("kv_batch"))


def format_report(report: dict[str, Any], summary: dict[str, Any]) -> str:
    lines = [
        f"kvpool bench pool — objects of {format_size(report['object_size'])}, {report['batches']} batches each "
        f"({SMALL_BATCHES} of {format_size(SMALL_OBJECT)} objects); GB/s = verified bytes / elapsed seconds "
        "for every system; the largest-batch rows are medians of interleaved repeats"
    ]
    lines.append(
        f"headline ({report['headline_batches']} batches of {max_batch(report)}: "
        f"{format_size(report['read_bytes_per_run'])} read per run, L3 {format_size(report['l3_cache_bytes'])})")
    lines.append(f"{'':22}{'put GB/s':>10}{'get GB/s':>10}{'put p50':>10}{'get p50':>10}{'lookup p50':>12}")
    for name, r in report["ours"].items():
        lines.append(
            f"  ours {name:16}{r['put_gbps']:>10.2f}{r['get_gbps']:>10.2f}{r['put_p50_ms']:>8.1f}ms"
            f"{r['get_p50_ms']:>8.1f}ms{r['lookup_p50_ms']:>10.2f}ms"
        )
    if "mooncake" in report:
        mc = report["mooncake"]
        lines.append(
            f"  upstream Mooncake Store{mc['mooncake_put_gbps']:>8.2f}{mc['mooncake_get_gbps']:>10.2f}"
            f"{mc['mooncake_put_p50_ms']:>8.1f}ms{mc['mooncake_get_p50_ms']:>8.1f}ms"
            f"{mc['mooncake_exist_p50_ms']:>10.2f}ms (is_exist)"
        )
        lines.append(f"  upstream put into a fresh (not prefaulted) segment: {mc['mooncake_put_fresh_gbps']:.2f} GB/s")
    if "te_raw" in report:
        te = report["te_raw"]
        tp = report["te_raw_polled"]
        lines.append(f"  raw engine, polled ×2 {tp['te_raw_write_gbps']:>8.2f}{tp['te_raw_read_gbps']:>10.2f}"
                     "   (every object submitted at once, polled; two targets)")
        lines.append(f"  raw transfer engine   {te['te_raw_write_gbps']:>8.2f}{te['te_raw_read_gbps']:>10.2f}"
                     "   (one sync batch, one target)")
    lines.append(
        f"  same host: warm put {summary['same_host_put_gbps']:.2f} get {summary['same_host_get_gbps']:.2f} GB/s; "
        f"first touch put {summary['same_host_put_first_touch_gbps']:.2f} get "
        f"{summary['same_host_get_first_touch_gbps']:.2f}; engine only put {summary['engine_put_gbps']:.2f} get "
        f"{summary['engine_get_gbps']:.2f}; memcpy (one thread, shared to shared) put {summary['memcpy_put_gbps']:.2f} "
        f"get {summary['memcpy_gbps']:.2f}")
    lines.append(
        "  targets: " + ", ".join(
            f"{key} {summary[key]:.2f} (≥ {target}: {'met' if summary['targets_met'][key] else 'MISSED'})"
            for key, target in summary["targets"].items()))
    lines.append(
        f"  ours vs upstream: put ×{summary['put_vs_mooncake']:.2f}, get ×{summary['get_vs_mooncake']:.2f}; "
        f"vs the better raw engine: put {summary['put_vs_te_raw_write']:.0%}, get {summary['get_vs_te_raw_read']:.0%}"
    )
    lines.append(
        f"  back-to-back calls, 64 keys: lookup p50 {summary['lookup_hot_p50_ms']:.2f} ms, exists p50 "
        f"{summary['exists_hot_p50_ms']:.2f} ms (upstream is_exist {summary['mooncake_exist_p50_ms']:.2f} ms)"
    )
    lines.append(
        "  verified objects (stamped with system, batch and index; read into zeroed memory), compared runs: "
        f"ours {summary['verified_objects']}, upstream {summary['mooncake_verified_objects']}, raw "
        f"{summary['te_raw_verified_objects']} and {summary['te_raw_polled_verified_objects']}; all of ours' rows "
        f"{summary['verified_objects_all_rows']}; none missing, none different"
    )
    lines += _huge_page_lines(report["huge_pages"])
    churn = report["churn"]
    lines.append(
        f"churn: filled {format_size(churn['capacity_bytes'])} with {churn['writer']['groups']} groups of 4 "
        f"(3× capacity) while 2 readers ran: max occupancy {churn['max_used_ratio']:.1%} "
        f"(bound {churn['bound_ratio']:.1%}), partial groups seen {churn['partial_groups_seen']}, "
        f"wrong bytes {churn['wrong_bytes']}, reader hits {churn['reader_hits']}"
    )
    return "\n".join(lines)


def _bytes(value: int | None) -> str:
    return "unreadable" if value is None else format_size(value)


def _huge_page_lines(hp: dict[str, Any]) -> list[str]:
    held = ", ".join(f"{name.replace('_', ' ')} {_bytes(v)}" for name, v in hp["measured_bytes"].items())
    lines = [
        f"  huge pages: {hp['setting']} for every side ({HUGE_PAGES_ENV}={hp[HUGE_PAGES_ENV]} for ours; the raw-engine "
        "and upstream client buffers never madvise; upstream's segments are allocated by mooncake, unchanged); "
        f"kernel THP mode: {hp['thp_mode']}",
        f"  huge-page bytes held: {held}",
    ]
    if not hp["aligned"]:
        lines.append("  WARNING: huge pages NOT aligned: some side holds huge pages (or could not be read) although "
                     "none asked for them; compare with care")
    return lines


def main(args: argparse.Namespace) -> int:
    started = time.monotonic()
    try:
        report = run(args)
    except BenchError as exc:
        print(f"kvpool bench pool FAILED: {exc}", file=sys.stderr)
        return 1
    largest = max(int(b) for b in args.batch_sizes.split(","))
    summary = summarize(report, largest)
    summary["wall_s"] = time.monotonic() - started
    print(format_report(report, summary))
    if args.json:
        print(json.dumps({"detail": report}))
        print(json.dumps(summary))
    return 0
