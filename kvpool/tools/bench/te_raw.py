"""Raw Mooncake transfer engine: the transport ceiling, two processes and nothing else.

A *target* registers a buffer; an *initiator* does ``batch_transfer_sync_write``
and ``batch_transfer_sync_read`` against it (or, ``polled``, submits every
object asynchronously and polls without spinning, over one or more targets).
Numbers follow the conventions of ``kvpool.tools.bench.worker_protocol``.
"""

from __future__ import annotations

import contextlib
import random
import time
from typing import IO, Any

from kvpool.tools.bench.worker_protocol import (
    DEFAULT_BATCH_SIZE,
    DEFAULT_BATCHES,
    DEFAULT_OBJECT_SIZE,
    DEFAULT_TIMEOUT_S,
    DEFAULT_WARMUP_BATCHES,
    HOST,
    SYSTEM_TE_RAW,
    BenchError,
    Layout,
    Region,
    config_fields,
    emit,
    huge_page_bytes,
    run_dir,
    spawn_ready,
    stamp_batch,
    stop_all,
    summarize_batches,
    total_or_none,
    validate_shape,
    verify_batch,
    wait_for_quit,
    zero,
)

# polling period of the non-spinning raw measurement (as kvpool.transfer)
POLL_INTERVAL_S = 0.0002


def new_engine() -> Any:
    """A TCP transfer engine with P2P handshake (no metadata server)."""
    from mooncake.engine import TransferEngine

    engine = TransferEngine()
    rc = engine.initialize(HOST, "P2PHANDSHAKE", "tcp", "")
    if rc != 0:
        raise BenchError(f"TransferEngine.initialize returned {rc}")
    return engine


def te_target_main(spec: dict[str, Any], out: IO[str]) -> None:
    """Register a buffer, publish its address and port, serve until told to quit."""
    engine = new_engine()
    region = Region(spec["size"])
    rc = engine.register_memory(region.addr, region.size)
    if rc != 0:
        raise BenchError(f"register_memory returned {rc}")
    emit(out, "ready", addr=region.addr, port=engine.get_rpc_port())
    wait_for_quit()
    engine.unregister_memory(region.addr)


def _polled_move(engine: Any, write: bool, targets: list[str], local: list[int], remote: list[int],
                 sizes: list[int]) -> int:
    """Submit every object as its own transfer, then poll them with short sleeps.

    The sync batch calls spin a core until the last byte lands; this is the
    engine's non-spinning way, the one kvpool's client uses for big moves.
    Returns 0, or the first failing status.
    """
    submit = engine.batch_transfer_async_write if write else engine.batch_transfer_async_read
    ids = [submit(targets[i], [local[i]], [remote[i]], [sizes[i]]) for i in range(len(sizes))]
    for batch_id in ids:
        if batch_id in (0, -1, (1 << 64) - 1):
            return -1
        while (status := engine.transfer_check_status(batch_id)) == 0:
            time.sleep(POLL_INTERVAL_S)
        if status != 1:
            return status
    return 0


def te_initiator_main(spec: dict[str, Any], out: IO[str]) -> None:
    """Write then read back each batch against the target(s); time both, verify all.

    ``polled``: objects are spread round robin over the targets and moved with
    ``_polled_move``; otherwise one sync batch against the single target.
    """
    layout = Layout(spec["object_size"], spec["batch_size"])
    src, dst = layout, Layout(layout.object_size, layout.batch_size, base=layout.batch_bytes)
    engine = new_engine()
    region = Region(2 * layout.batch_bytes)
    region.fill_random(spec["seed"])
    rc = engine.register_memory(region.addr, region.size)
    if rc != 0:
        raise BenchError(f"register_memory returned {rc}")
    emit(out, "ready")

    peers = spec["targets"]  # [[port, remote_addr], ...]
    n = len(peers)
    targets = [f"{HOST}:{peers[i % n][0]}" for i in range(layout.batch_size)]
    remote = [peers[i % n][1] + (i // n) * layout.object_size for i in range(layout.batch_size)]
    src_addrs = [region.addr + off for off in src.offsets()]
    dst_addrs = [region.addr + off for off in dst.offsets()]
    sizes = [layout.object_size] * layout.batch_size
    writes: list[float] = []
    reads: list[float] = []
    verified = timed_verified = 0
    for batch in range(spec["warmup_batches"] + spec["num_batches"]):
        crcs = stamp_batch(region.mem, src, SYSTEM_TE_RAW, batch)
        zero(region.mem, dst.base, dst.batch_bytes)
        t0 = time.perf_counter()
        if spec["polled"]:
            rc_w = _polled_move(engine, True, targets, src_addrs, remote, sizes)
            t1 = time.perf_counter()
            rc_r = _polled_move(engine, False, targets, dst_addrs, remote, sizes)
        else:
            rc_w = engine.batch_transfer_sync_write(targets[0], src_addrs, remote, sizes)
            t1 = time.perf_counter()
            rc_r = engine.batch_transfer_sync_read(targets[0], dst_addrs, remote, sizes)
        t2 = time.perf_counter()
        if rc_w != 0 or rc_r != 0:
            raise BenchError(f"batch {batch}: write rc={rc_w}, read rc={rc_r}")
        verified += verify_batch(region.mem, dst, crcs, batch)
        if batch >= spec["warmup_batches"]:
            writes.append(t1 - t0)
            reads.append(t2 - t1)
            timed_verified += layout.batch_size
    huge = huge_page_bytes()
    engine.unregister_memory(region.addr)
    emit(out, "result", write_s=writes, read_s=reads, verified_objects=verified, timed_verified_objects=timed_verified,
         huge_page_bytes=huge)


def measure_te_raw(
    object_size: int = DEFAULT_OBJECT_SIZE,
    batch_size: int = DEFAULT_BATCH_SIZE,
    num_batches: int = DEFAULT_BATCHES,
    *,
    num_targets: int = 1,
    polled: bool = False,
    warmup_batches: int = DEFAULT_WARMUP_BATCHES,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> dict[str, Any]:
    """Raw TransferEngine throughput between local processes over TCP.

    One initiator against ``num_targets`` target processes: a sync batch per
    direction (one target), or with ``polled`` every object submitted at once
    and polled without spinning (objects round robin over the targets).
    Returns ``te_raw_write_*`` and ``te_raw_read_*`` (``_gbps`` verified
    bytes over the measured batches' seconds, ``_p50_ms``/``_p99_ms``
    per-batch latency) and
    ``te_raw_gbps``, the **mean** of the write and read medians: one ceiling
    figure for a workload that moves as many bytes in as out.
    """
    validate_shape(object_size, batch_size, num_batches)
    if num_targets < 1 or (num_targets > 1 and not polled):
        raise ValueError("num_targets: more than one target needs polled=True")
    with run_dir("te-raw") as log_dir, contextlib.ExitStack() as stack:
        target_workers, peers = [], []
        for t in range(num_targets):
            per_target = -(-batch_size // num_targets) * object_size
            worker, target = spawn_ready(stack, log_dir, "te-target", {"size": per_target}, f"te_target{t}")
            target_workers.append(worker)
            peers.append([target["port"], target["addr"]])
        spec = {
            "object_size": object_size,
            "batch_size": batch_size,
            "num_batches": num_batches,
            "warmup_batches": warmup_batches,
            "targets": peers,
            "polled": polled,
            "seed": random.getrandbits(32),
        }
        initiator, _ = spawn_ready(stack, log_dir, "te-initiator", spec, "te_initiator")
        raw = initiator.expect("result", timeout_s)
        target_huge = [huge_page_bytes(w.proc.pid) for w in target_workers]
        stop_all([initiator, *target_workers])
    result: dict[str, Any] = config_fields(object_size, batch_size, num_batches, warmup_batches)
    verified_bytes = raw["timed_verified_objects"] * object_size
    result |= summarize_batches("te_raw_write", raw["write_s"], verified_bytes)
    result |= summarize_batches("te_raw_read", raw["read_s"], verified_bytes)
    result["te_raw_gbps"] = (result["te_raw_write_gbps"] + result["te_raw_read_gbps"]) / 2
    result["te_raw_verified_objects"] = raw["verified_objects"]
    result["te_raw_verified_bytes"] = verified_bytes
    result["te_raw_huge_page_bytes"] = total_or_none([raw["huge_page_bytes"], *target_huge])
    result["te_raw_verified"] = raw["verified_objects"] == result["objects"]
    result["te_raw_targets"] = num_targets
    result["te_raw_polled"] = polled
    return result
