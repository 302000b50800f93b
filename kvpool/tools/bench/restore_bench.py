"""``kvpool bench restore``: restore and save throughput of the prefill stages, next to the raw engine.

One run on one host, real processes: a master, two stores and a four-stage
pipeline at the seed's KV shape (``dsv3-kv-61``, float8 e4m3: 15-16 layers
per stage, 576-byte entries, ~2.2 MB per stage object).

For each history size S (4,096 and 16,384 tokens; ``--quick``: 4,096), on a
fresh pipeline whose device cache holds S + 256 tokens:

- two prompts A and B of S + 1 tokens whose S tokens of history are
  *synthesized* into the pool by this process (valid fp8 values under the
  prompts' real chunk keys, put with the pool client; computing 16K tokens
  through 61 layers on a CPU would take many minutes). Sending A, B, A, ...
  makes every send restore all S tokens on every stage (each prompt fills the
  device cache and pushes the other out) and compute one token. Per stage:
  bytes, read ms (read and verify, straight into the pages), GB/s; aggregate: all stages' bytes over the wait
  from the first stage starting to the last finishing.
- the ceiling: four reader processes with the raw transfer engine read the
  very same objects (same sizes, count, stores) at once, each its stage's
  share, submitted at once and polled (``kvpool.tools.bench.te_raw``); aggregate =
  all bytes over first start to last end. Verified afterwards.

Correctness and save, at S = 4,096 only: a 4,096-token prompt C is computed
for real (saved from the pages on every stage), pushed off the device by A,
and sent again: 15 chunks are restored, 256 tokens computed, and its logits
must equal the computed ones. Save throughput comes from every stage's
``kvpool_prefill_saved_bytes_total`` and ``kvpool_prefill_save_seconds``.

Both byte paths, side by side in one run: every size is measured twice on the
same pool, each time with a fresh pipeline: first with the stages' default
``--pool-path auto`` (the stores are on this host and offer their segments as
shared memory, so restores and saves are memory copies), then with
``--pool-path engine`` (every byte by the transfer engine), each with the same
check of its logits. The stages' ``kvpool_prefill_pool_bytes_total{path}``,
summed, must show no byte by memory with ``engine``; with ``auto`` the share of
reads that went by memory is reported (``same_host_read_share``; below 1 means
some stage read by the engine). ``same_host_over_engine`` is the ratio of the
two aggregate restore rates at the largest size.

The last line of ``--json`` output is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import torch

from kvpool import service
from kvpool.core.chunk_hash import chunk_hashes, group_id, object_key
from kvpool.tools.cluster import LocalPipeline, LocalPool, ServiceFailed
from kvpool.model import get_config, split_layers
from kvpool.pool.client import PoolClient
from kvpool.pool.objects import PutObject, PutResult, checksum
from kvpool.rpc import prefill_pb2, prefill_pb2_grpc
from kvpool.transfer import HostBuffer, TransferEngine

CHUNK = 256
NUM_STAGES = 4
MODEL = "dsv3-kv-61"
KV_DTYPE = "float8_e4m3fn"
VOCAB = 1024
PUT_BATCH = 32  # objects per synthesized put
POOL_PATHS = ("auto", "engine")  # the stages' --pool-path, measured in this order
POOL_BYTES = "kvpool_prefill_pool_bytes_total"


def _prompt(seed: int, length: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (length,), generator=g).tolist()


def _scrape(admin_port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{admin_port}/metrics", timeout=5) as page:
        samples = {}
        for line in page.read().decode().splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                samples[name] = float(value)
        return samples


def _p50(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


async def _synthesize(client: PoolClient, staging: HostBuffer, namespace: str, token_ids: list[int],
                      object_sizes: list[int]) -> int:
    """Put every stage's object of every full chunk of ``token_ids``; returns bytes stored."""
    hashes = chunk_hashes(namespace, token_ids, CHUNK)
    stored = 0
    for stage, size in enumerate(object_sizes):
        for first in range(0, len(hashes), PUT_BATCH):
            batch = hashes[first:first + PUT_BATCH]
            objects = [PutObject(object_key(namespace, h, stage), group_id(namespace, h), NUM_STAGES,
                                 staging.address + ((first + i) % PUT_BATCH) * size, size)
                       for i, h in enumerate(batch)]
            results = await client.put(objects)
            if any(r is PutResult.NOT_STORED for r in results):
                raise RuntimeError("synthesizing history: the pool did not store every object")
            stored += sum(o.size for o in objects)
    return stored


def _raw_reader(items: list[tuple[str, int, int, int]], repeats: int, barrier: Any, results: Any) -> None:
    """One reader process: read ``items`` (endpoint, address, size, checksum) ``repeats`` times."""
    from kvpool.tools.bench.te_raw import _polled_move, new_engine

    engine = new_engine()
    total = sum(size for _, _, size, _ in items)
    buffer = HostBuffer(total)
    buffer.touch()
    if engine.register_memory(buffer.address, total) != 0:
        raise RuntimeError("register_memory failed")
    local, offset = [], 0
    for _, _, size, _ in items:
        local.append(buffer.address + offset)
        offset += size
    spans = []
    for _ in range(repeats):
        barrier.wait()
        t0 = time.monotonic()  # CLOCK_MONOTONIC: comparable across processes
        rc = _polled_move(engine, False, [e for e, _, _, _ in items], local, [a for _, a, _, _ in items],
                          [s for _, _, s, _ in items])
        spans.append((t0, time.monotonic(), rc))
    verified = sum(size for (_, _, size, want), address in zip(items, local) if checksum(address, size) == want)
    results.put({"spans": spans, "bytes": total, "verified_bytes": verified})
    engine.unregister_memory(buffer.address)


def _raw_ceiling(per_stage: list[list[tuple[str, int, int, int]]], repeats: int) -> dict[str, Any]:
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(len(per_stage)), ctx.Queue()
    procs = [ctx.Process(target=_raw_reader, args=(items, repeats, barrier, results)) for items in per_stage]
    for p in procs:
        p.start()
    outs = [results.get(timeout=600) for _ in procs]
    for p in procs:
        p.join(30)
    total = sum(o["bytes"] for o in outs)
    rates = []
    for rep in range(repeats):
        spans = [o["spans"][rep] for o in outs]
        if any(rc != 0 for _, _, rc in spans):
            continue
        rates.append(total / (max(e for _, e, _ in spans) - min(s for s, _, _ in spans)) / 1e9)
    return {"te_raw_gbps_aggregate": _p50(rates), "te_raw_runs": rates, "te_raw_bytes": total,
            "te_raw_verified_bytes": sum(o["verified_bytes"] for o in outs) // 1}


async def _send(front: prefill_pb2_grpc.PrefillStub, token_ids: list[int]) -> prefill_pb2.PrefillResponse:
    return await front.Prefill(prefill_pb2.PrefillRequest(token_ids=token_ids, return_logits=True), timeout=1800)


def pool_bytes_by_path(samples: list[dict[str, float]]) -> dict[str, float]:
    """Every stage's ``kvpool_prefill_pool_bytes_total`` summed per ``path_direction`` (``memory_read``, ...)."""
    total: dict[str, float] = {}
    for metrics in samples:
        for name, value in metrics.items():
            if name.startswith(POOL_BYTES + "{"):
                labels = dict(part.split("=", 1) for part in name[len(POOL_BYTES) + 1:-1].split(","))
                key = f"{labels['path'].strip(chr(34))}_{labels['direction'].strip(chr(34))}"
                total[key] = total.get(key, 0.0) + value
    return total


def memory_read_share(by_path: dict[str, float]) -> float | None:
    """The share of the stages' pool reads that went by memory; None when they read nothing."""
    memory, engine = by_path.get("memory_read", 0.0), by_path.get("engine_read", 0.0)
    return memory / (memory + engine) if memory + engine else None


def check_path(pool_path: str, by_path: dict[str, float]) -> None:
    """Raise unless the stages read from the pool, and with ``--pool-path engine`` by the engine alone.

    ``auto`` is not held to a share: it is what the stages choose, and ``memory_read_share`` reports it."""
    share = memory_read_share(by_path)
    if share is None or (pool_path == "engine" and share > 0):
        raise RuntimeError(f"--pool-path {pool_path}: the stages' bytes by path were {by_path}")


async def _measure_size(pool: LocalPool, size: int, repeats: int, check: bool, workdir: Path,
                        engine: TransferEngine, pool_path: str) -> dict[str, Any]:
    stage_args = ["--model", MODEL, "--kv-dtype", KV_DTYPE, "--device-cache-tokens", str(size + CHUNK),
                  "--log-level", "warning", "--pool-path", pool_path]
    result: dict[str, Any] = {"history_tokens": size, "pool_path": pool_path}
    with LocalPipeline(num_stages=NUM_STAGES, master=pool.master_address,
                       workdir=workdir / f"stages-{size}-{pool_path}", stage_args=stage_args) as pipeline:
        namespace = pipeline.stages[0].ready["namespace"]
        client = PoolClient(pool.master_address, engine)
        async with service.channel(pipeline.address) as channel:
            front = prefill_pb2_grpc.PrefillStub(channel)
            # object sizes per stage from one chunk's layers (15 or 16 layers at 576 bytes, fp8)
            config = get_config(MODEL)
            object_sizes = [(end - start) * CHUNK * config.kv_entry_dim  # fp8: one byte a value
                            for start, end in split_layers(config.num_hidden_layers, NUM_STAGES)]
            staging = HostBuffer(PUT_BATCH * max(object_sizes))
            g = torch.Generator().manual_seed(size)
            fp8 = (torch.randn(staging.size, generator=g) * 0.5).to(torch.float8_e4m3fn).view(torch.uint8)
            torch.frombuffer(staging.view(), dtype=torch.uint8).copy_(fp8)
            client.register(staging.address, staging.size)
            prompts = [_prompt(size * 10 + k, size + 1) for k in range(2)]
            for p in prompts:
                await _synthesize(client, staging, namespace, p, object_sizes)
            if check:
                # a prompt of its own per path: one the other path saved would be restored, not computed
                computed = _prompt(size * 10 + 7 + POOL_PATHS.index(pool_path), 4096)
                first = await _send(front, computed)
                await _wait_saved(client, namespace, computed)
                await _send(front, prompts[1])  # pushes the computed prompt off the device
                again = await _send(front, computed)
                diff = (torch.frombuffer(bytearray(again.logits), dtype=torch.float32)
                        - torch.frombuffer(bytearray(first.logits), dtype=torch.float32)).abs().max()
                result["check"] = {
                    "restored_tokens": again.figures.num_pool_tokens, "computed_tokens": again.figures.num_computed_tokens,
                    "logits_max_abs_diff": float(diff), "same_first_token": again.first_token == first.first_token,
                }
                result["save"] = _save_figures(pipeline)
            runs = []
            for i in range(repeats + 1):  # the first is a warm-up
                response = await _send(front, prompts[i % 2])
                f = response.figures
                if f.num_pool_tokens != size:
                    raise RuntimeError(f"expected {size} restored tokens, got {f.num_pool_tokens}")
                if i:
                    runs.append(response)
            result |= _restore_figures(runs)
            result["pool_bytes_by_path"] = pool_bytes_by_path(
                [_scrape(proc.ready["admin_port"]) for proc in pipeline.stages])
            check_path(pool_path, result["pool_bytes_by_path"])
            result["memory_read_share"] = memory_read_share(result["pool_bytes_by_path"])
            # the ceiling: the same objects of prompt 0 read by four raw-engine processes at once
            found = await client.lookup([group_id(namespace, h) for h in chunk_hashes(namespace, prompts[0], CHUNK)])
            try:
                per_stage = [[(m.endpoint, m.address, m.size, m.checksum)
                              for g2 in found.groups for k, m in g2.members.items() if k.endswith(f"/{stage}")]
                             for stage in range(NUM_STAGES)]
                result |= await asyncio.to_thread(_raw_ceiling, per_stage, repeats)
            finally:
                await client.release(found.lease_id)
        await client.close()
    return result


async def _wait_saved(client: PoolClient, namespace: str, token_ids: list[int]) -> None:
    groups = [group_id(namespace, h) for h in chunk_hashes(namespace, token_ids, CHUNK)]
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        found = await client.lookup(groups)
        await client.release(found.lease_id)
        if found.num_complete == len(groups):
            return
        await asyncio.sleep(0.2)
    raise RuntimeError("the computed prompt's groups never all reached the pool")


def _save_figures(pipeline: LocalPipeline) -> dict[str, Any]:
    stages = []
    for s, proc in enumerate(pipeline.stages):
        m = _scrape(proc.ready["admin_port"])
        nbytes, seconds = m.get("kvpool_prefill_saved_bytes_total"), m.get("kvpool_prefill_save_seconds_sum")
        stages.append({"stage": s, "bytes": nbytes, "put_s": seconds,
                       "gbps": nbytes / seconds / 1e9 if nbytes and seconds else None})
    rates = [st["gbps"] for st in stages]
    # stages save one after another as the pipeline computes: the sum of their rates is what four
    # concurrent saves would move, each at its measured rate
    return {"stages": stages, "save_gbps_aggregate": sum(rates) if all(rates) else None}


def _restore_figures(runs: list[prefill_pb2.PrefillResponse]) -> dict[str, Any]:
    per_stage: list[dict[str, Any]] = []
    for s in range(NUM_STAGES):
        figs = [r.figures.restore[s] for r in runs]
        read = [f.read_ms for f in figs]
        gbps = [f.bytes / f.read_ms / 1e6 for f in figs if f.read_ms > 0]
        per_stage.append({"stage": s, "bytes": figs[0].bytes, "read_ms_p50": _p50(read), "gbps_p50": _p50(gbps)})
    aggregate = [sum(f.bytes for f in r.figures.restore) / r.figures.restore_wait_ms / 1e6 for r in runs]
    all_read = [f.read_ms for r in runs for f in r.figures.restore]
    return {
        "stages": per_stage, "restore_gbps_aggregate": _p50(aggregate), "restore_runs_gbps": aggregate,
        "restore_wait_ms_p50": _p50([r.figures.restore_wait_ms for r in runs]),
        "read_ms_p50": _p50(all_read),
        "bytes_verified": sum(f.bytes for r in runs for f in r.figures.restore),
    }


async def run(sizes: list[int], repeats: int) -> dict[str, Any]:
    engine = TransferEngine()
    results = []
    with tempfile.TemporaryDirectory(prefix="kvpool-bench-restore-") as tmp:
        total = sum(2 * (s // CHUNK) * 61 * CHUNK * 576 for s in sizes) + 16 * 61 * CHUNK * 576
        segment = f"{max(256, -(-total // 2 // (1 << 20)) + 256)}MiB"
        with LocalPool(num_stores=2, segment_size=segment, workdir=Path(tmp) / "pool") as pool:
            for size in sizes:
                by_path = {path: await _measure_size(pool, size, repeats, size == 4096, Path(tmp), engine, path)
                           for path in POOL_PATHS}
                # the default path's figures stay where they were; the engine path's sit beside them
                results.append(by_path["auto"] | {"engine": by_path["engine"]})
    return _summary(results)


def _summary(results: list[dict[str, Any]]) -> dict[str, Any]:
    main = results[-1]  # the largest history: closest to the seed's
    checked = next((r for r in results if "check" in r), {})
    summary = {
        "model": MODEL, "kv_dtype": KV_DTYPE, "num_stages": NUM_STAGES, "history_tokens": main["history_tokens"],
        "restore_gbps_aggregate": main["restore_gbps_aggregate"], "te_raw_gbps_aggregate": main["te_raw_gbps_aggregate"],
        "read_ms_p50": main["read_ms_p50"],
        "save_gbps_aggregate": checked.get("save", {}).get("save_gbps_aggregate"),
        "bytes_verified": sum(figures[k] for r in results for figures in (r, r["engine"])
                              for k in ("bytes_verified", "te_raw_verified_bytes")),
        "logits_max_abs_diff": checked.get("check", {}).get("logits_max_abs_diff"),
        "engine_restore_gbps_aggregate": main["engine"]["restore_gbps_aggregate"],
        "engine_read_ms_p50": main["engine"]["read_ms_p50"],
        "engine_logits_max_abs_diff": checked.get("engine", {}).get("check", {}).get("logits_max_abs_diff"),
        "pool_bytes_by_path": {"auto": main["pool_bytes_by_path"], "engine": main["engine"]["pool_bytes_by_path"]},
        # of the auto run's pool reads, the share that went by memory (1.0: every stage on the same-host path)
        "same_host_read_share": main["memory_read_share"],
        "sizes": results,
    }
    if summary["restore_gbps_aggregate"] and summary["te_raw_gbps_aggregate"]:
        summary["restore_over_te_raw"] = summary["restore_gbps_aggregate"] / summary["te_raw_gbps_aggregate"]
    if summary["restore_gbps_aggregate"] and summary["engine_restore_gbps_aggregate"]:
        summary["same_host_over_engine"] = summary["restore_gbps_aggregate"] / summary["engine_restore_gbps_aggregate"]
    return summary


def format_report(summary: dict[str, Any]) -> str:
    lines = [f"restore bench: {summary['model']} {summary['kv_dtype']}, {summary['num_stages']} stages"]
    for r in summary["sizes"]:
        for figures in (r, r["engine"]):
            lines.append(f"  history {figures['history_tokens']} tokens, --pool-path {figures['pool_path']}: restore "
                         f"{figures['restore_gbps_aggregate']:.2f} GB/s aggregate (raw engine "
                         f"{figures['te_raw_gbps_aggregate'] or 0:.2f} GB/s), wait p50 "
                         f"{figures['restore_wait_ms_p50']:.0f} ms; bytes by path {figures['pool_bytes_by_path']}")
            for st in figures["stages"]:
                lines.append(f"    stage {st['stage']}: {st['bytes'] / 2**20:.1f} MiB read {st['read_ms_p50']:.0f} ms "
                             f"= {st['gbps_p50'] or 0:.2f} GB/s")
            if "check" in figures:
                lines.append(f"    check: {figures['check']}")
                lines.append(f"    save: {figures['save']}")
    if "same_host_over_engine" in summary:
        lines.append(f"  same host over engine at {summary['history_tokens']} tokens: "
                     f"×{summary['same_host_over_engine']:.2f}; auto's reads by memory: "
                     f"{summary['same_host_read_share']:.0%}")
    if summary["same_host_read_share"] < 1:
        lines.append("  WARNING: with --pool-path auto some stages read by the engine, though every store is on "
                     "this host: the auto figures mix both paths")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    """``kvpool bench restore``: the report; with ``--json`` the last line is one JSON object."""
    sizes = [int(s) for s in (args.sizes or ("4096" if args.quick else "4096,16384")).split(",")]
    if any(s % CHUNK or s < 4096 for s in sizes):
        raise SystemExit("kvpool bench restore: --sizes must be multiples of 256, at least 4096")
    started = time.monotonic()
    try:
        summary = asyncio.run(run(sizes, args.repeats or (3 if args.quick else 5)))
    except (ServiceFailed, RuntimeError) as exc:
        raise SystemExit(f"kvpool bench restore: {exc}") from None
    summary["wall_s"] = time.monotonic() - started
    print(format_report(summary))
    if args.json:
        print(json.dumps(summary))
    return 0

