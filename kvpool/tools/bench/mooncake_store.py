"""Upstream Mooncake Store: a ``mooncake_master``, store processes, one client.

Each *store* process mounts a global segment; the *client* (segment 0) does
``batch_put_from`` / ``batch_get_into`` / ``batch_is_exist`` from a registered
buffer.  Numbers follow the conventions of ``kvpool.tools.bench.worker_protocol``.
"""

from __future__ import annotations

import contextlib
import math
import random
import shutil
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import IO, Any

from kvpool.tools.bench.worker_protocol import (
    DEFAULT_BATCH_SIZE,
    DEFAULT_BATCHES,
    DEFAULT_EXIST_KEYS,
    DEFAULT_EXIST_REPS,
    DEFAULT_OBJECT_SIZE,
    DEFAULT_TIMEOUT_S,
    DEFAULT_WARMUP_BATCHES,
    HOST,
    MIB,
    READY_TIMEOUT_S,
    STOP_GRACE_S,
    SYSTEM_MOONCAKE,
    BenchError,
    Layout,
    Region,
    check_codes,
    config_fields,
    emit,
    huge_page_bytes,
    log_tail,
    run_dir,
    spawn_ready,
    stamp_batch,
    stop_all,
    summarize_batches,
    summarize_latency,
    terminate,
    total_or_none,
    validate_shape,
    verify_batch,
    wait_for_quit,
    zero,
)

# The client only uses registered caller buffers, so the engine's own staging
# buffer can stay small.
LOCAL_BUFFER_BYTES = 16 * MIB
# mooncake_master starts evicting above 90% segment use (its default
# eviction_high_watermark_ratio); auto-sized segments stay well below that so
# nothing put during a run can be evicted before it is read back.
SEGMENT_FILL_AUTO = 0.7
SEGMENT_FILL_MAX = 0.85


# ---- mooncake_master -----------------------------------------------------


def free_port() -> int:
    """A TCP port the kernel just reported free on the loopback interface."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def find_mooncake_master() -> Path:
    """The ``mooncake_master`` next to this interpreter, else on PATH."""
    beside = shutil.which("mooncake_master", path=str(Path(sys.executable).parent))
    found = beside or shutil.which("mooncake_master")
    if found is None:
        raise BenchError(
            "mooncake_master not found next to "
            f"{sys.executable} or on PATH; install mooncake-transfer-engine(-non-cuda)"
        )
    return Path(found)


def wait_for_port(proc: subprocess.Popen[Any], port: int, timeout_s: float, log_path: Path) -> None:
    """Readiness probe: return once ``port`` accepts connections."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise BenchError(f"mooncake_master exited rc={proc.returncode}\n{log_tail(log_path)}")
        with contextlib.suppress(OSError), socket.create_connection((HOST, port), timeout=0.5):
            return
        time.sleep(0.05)  # probe interval, not a readiness guess
    raise BenchError(
        f"mooncake_master not listening on {port} within {timeout_s:.0f}s\n{log_tail(log_path)}"
    )


def start_master(log_dir: Path, stack: contextlib.ExitStack) -> str:
    """Launch ``mooncake_master`` on a free port; return its ``host:port``."""
    binary = find_mooncake_master()
    port = free_port()
    log_path = log_dir / "mooncake_master.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            [
                str(binary),
                f"--rpc_port={port}",
                f"--rpc_address={HOST}",
                # Port 0: an ephemeral metrics port, so parallel runs never clash on 9003.
                f"--metrics_host={HOST}",
                "--metrics_port=0",
                "--enable_http_metadata_server=false",
                "--enable_metric_reporting=false",
            ],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    stack.callback(terminate, proc, STOP_GRACE_S)
    wait_for_port(proc, port, READY_TIMEOUT_S, log_path)
    return f"{HOST}:{port}"


# ---- store and client workers --------------------------------------------


def new_store(master_addr: str, segment_bytes: int) -> Any:
    """A MooncakeDistributedStore over TCP, contributing ``segment_bytes`` (0: none)."""
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    rc = store.setup(HOST, "P2PHANDSHAKE", segment_bytes, LOCAL_BUFFER_BYTES, "tcp", "", master_addr)
    if rc != 0:
        raise BenchError(f"MooncakeDistributedStore.setup returned {rc}")
    return store


def mc_store_main(spec: dict[str, Any], out: IO[str]) -> None:
    """Mount a global segment (setup returns once it is mounted), hold it until told to quit."""
    store = new_store(spec["master"], spec["segment_bytes"])
    emit(out, "ready")
    wait_for_quit()
    store.close()


def mc_put_all(
    store: Any, region: Region, layout: Layout, keys: list[list[str]], warmup: int
) -> tuple[list[float], list[list[int]]]:
    """Put every batch under fresh keys; return measured durations and per-batch CRCs."""
    addrs = [region.addr + off for off in layout.offsets()]
    sizes = [layout.object_size] * layout.batch_size
    durations: list[float] = []
    crcs: list[list[int]] = []
    for batch, batch_keys in enumerate(keys):
        crcs.append(stamp_batch(region.mem, layout, SYSTEM_MOONCAKE, batch))
        t0 = time.perf_counter()
        codes = store.batch_put_from(batch_keys, addrs, sizes)
        elapsed = time.perf_counter() - t0
        check_codes(f"batch_put_from batch {batch}", codes, 0)
        if batch >= warmup:
            durations.append(elapsed)
    return durations, crcs


def mc_get_all(
    store: Any, region: Region, layout: Layout, keys: list[list[str]], crcs: list[list[int]], warmup: int
) -> tuple[list[float], int, int]:
    """Get every batch back into a zeroed buffer; return timed durations, objects verified in
    the timed batches and in all (the warm-up batch is verified too, only not timed)."""
    addrs = [region.addr + off for off in layout.offsets()]
    sizes = [layout.object_size] * layout.batch_size
    durations: list[float] = []
    verified = timed_verified = 0
    for batch, batch_keys in enumerate(keys):
        zero(region.mem, layout.base, layout.batch_bytes)
        t0 = time.perf_counter()
        got = store.batch_get_into(batch_keys, addrs, sizes)
        elapsed = time.perf_counter() - t0
        check_codes(f"batch_get_into batch {batch}", got, layout.object_size)
        verified += verify_batch(region.mem, layout, crcs[batch], batch)
        if batch >= warmup:
            durations.append(elapsed)
            timed_verified += layout.batch_size
    return durations, timed_verified, verified


def mc_exist(store: Any, keys: list[str], reps: int) -> list[float]:
    """Time ``batch_is_exist`` on keys that were all put; each must report 1."""
    check_codes("batch_is_exist warmup", store.batch_is_exist(keys), 1)
    durations = []
    for _ in range(reps):
        t0 = time.perf_counter()
        codes = store.batch_is_exist(keys)
        durations.append(time.perf_counter() - t0)
        check_codes("batch_is_exist", codes, 1)
    return durations


def mc_prefault(store: Any, region: Region, layout: Layout, num_batches: int, run: str) -> None:
    """Put then force-remove as many objects as the run will store.

    Why: a fresh segment's first touch is page faults in the store process;
    on VMs whose memory is lazily backed by the host that can cost several
    times the transfer itself.  Freed ranges are reused by the allocator, so
    afterwards puts land in memory that is already resident.
    """
    addrs = [region.addr + off for off in layout.offsets()]
    sizes = [layout.object_size] * layout.batch_size
    all_keys: list[str] = []
    # Everything first, then remove: removing per batch would just recycle one range.
    for batch in range(num_batches):
        keys = [f"{run}/prefault/b{batch}/o{i}" for i in range(layout.batch_size)]
        check_codes("prefault batch_put_from", store.batch_put_from(keys, addrs, sizes), 0)
        all_keys += keys
    check_codes("prefault batch_remove", store.batch_remove(all_keys, True), 0)


def mc_client_main(spec: dict[str, Any], out: IO[str]) -> None:
    """Put, then get, then exist-check: the upstream client path, verified end to end."""
    src = Layout(spec["object_size"], spec["batch_size"])
    dst = Layout(src.object_size, src.batch_size, base=src.batch_bytes)
    store = new_store(spec["master"], 0)
    region = Region(2 * src.batch_bytes)
    region.fill_random(spec["seed"])
    rc = store.register_buffer(region.addr, region.size)
    if rc != 0:
        raise BenchError(f"register_buffer returned {rc}")
    emit(out, "ready")

    warmup = spec["warmup_batches"]
    run = uuid.uuid4().hex[:8]
    batches = range(warmup + spec["num_batches"])
    keys = [[f"{run}/b{b}/o{i}" for i in range(src.batch_size)] for b in batches]
    if spec["prefault_segment"]:
        mc_prefault(store, region, src, len(keys), run)
    put_s, crcs = mc_put_all(store, region, src, keys, warmup)
    get_s, timed_verified, verified = mc_get_all(store, region, dst, keys, crcs, warmup)
    exist_keys = [k for batch in keys[warmup:] for k in batch][: spec["exist_keys"]]
    exist_s = mc_exist(store, exist_keys, spec["exist_reps"])
    huge = huge_page_bytes()
    store.unregister_buffer(region.addr)
    store.close()
    emit(
        out,
        "result",
        put_s=put_s,
        get_s=get_s,
        exist_s=exist_s,
        exist_keys=len(exist_keys),
        verified_objects=verified,
        timed_verified_objects=timed_verified,
        huge_page_bytes=huge,
    )


def segment_size_for(stored_bytes: int, num_stores: int) -> int:
    """Per-store segment that keeps the run below the eviction watermark."""
    per_store = math.ceil(stored_bytes / num_stores / SEGMENT_FILL_AUTO)
    return (per_store // MIB + 32) * MIB  # +32 MiB slack for tiny runs


def measure_mooncake_store(
    object_size: int = DEFAULT_OBJECT_SIZE,
    batch_size: int = DEFAULT_BATCH_SIZE,
    num_batches: int = DEFAULT_BATCHES,
    segment_bytes: int | None = None,
    *,
    num_stores: int = 1,
    warmup_batches: int = DEFAULT_WARMUP_BATCHES,
    exist_keys: int = DEFAULT_EXIST_KEYS,
    exist_reps: int = DEFAULT_EXIST_REPS,
    prefault_segment: bool = False,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> dict[str, Any]:
    """Upstream Mooncake Store put/get/exist over TCP on one host.

    ``segment_bytes`` is each store process's global segment (``None``: sized
    so every object of the run fits below the eviction watermark).  All
    batches are put under fresh keys into fresh segments, then all are read
    back, then ``batch_is_exist`` is timed ``exist_reps`` times on
    ``exist_keys`` put keys.  ``prefault_segment`` first puts and removes the
    same volume untimed, so puts measure transfer into resident memory rather
    than the store's first-touch page faults (see ``mc_prefault``).
    """
    validate_shape(object_size, batch_size, num_batches)
    batch_bytes = object_size * batch_size
    stored = batch_bytes * (num_batches + warmup_batches)
    segment = segment_bytes or segment_size_for(stored, num_stores)
    if stored > SEGMENT_FILL_MAX * segment * num_stores:
        raise ValueError(
            f"{stored} bytes would fill {num_stores}x{segment}-byte segments past "
            f"{SEGMENT_FILL_MAX:.0%}; the master would evict or reject puts"
        )
    with run_dir("mooncake") as log_dir, contextlib.ExitStack() as stack:
        master = start_master(log_dir, stack)
        store_spec = {"master": master, "segment_bytes": segment}
        stores = [
            spawn_ready(stack, log_dir, "mc-store", store_spec, f"mc_store{n}")[0]
            for n in range(num_stores)
        ]
        spec = {
            "master": master,
            "object_size": object_size,
            "batch_size": batch_size,
            "num_batches": num_batches,
            "warmup_batches": warmup_batches,
            "exist_keys": exist_keys,
            "exist_reps": exist_reps,
            "prefault_segment": prefault_segment,
            "seed": random.getrandbits(32),
        }
        client, _ = spawn_ready(stack, log_dir, "mc-client", spec, "mc_client")
        raw = client.expect("result", timeout_s)
        store_huge = [huge_page_bytes(s.proc.pid) for s in stores]
        # Before the master goes: stores unmount their segments through it.
        stop_all([client, *stores])
    result: dict[str, Any] = config_fields(object_size, batch_size, num_batches, warmup_batches)
    result |= {
        "num_stores": num_stores,
        "segment_bytes": segment,
        "prefault_segment": prefault_segment,
    }
    verified_bytes = raw["timed_verified_objects"] * object_size
    result |= summarize_batches("mooncake_put", raw["put_s"], verified_bytes)
    result |= summarize_batches("mooncake_get", raw["get_s"], verified_bytes)
    result |= summarize_latency("mooncake_exist", raw["exist_s"])
    result["mooncake_exist_keys"] = raw["exist_keys"]
    result["mooncake_verified_objects"] = raw["verified_objects"]
    result["mooncake_verified_bytes"] = verified_bytes
    result["mooncake_verified"] = raw["verified_objects"] == result["objects"]
    result["mooncake_huge_page_bytes"] = total_or_none([raw["huge_page_bytes"], *store_huge])
    return result
