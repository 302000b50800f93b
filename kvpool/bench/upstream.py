"""Baseline benchmarks: the raw Mooncake transfer engine and upstream Mooncake Store.

Both measurements run on one host over TCP (loopback) and are the reference
points that kvpool's own pool numbers are compared against:

* ``measure_te_raw`` -- two processes and nothing but ``TransferEngine``: a
  *target* registers a buffer, an *initiator* does ``batch_transfer_sync_write``
  and ``batch_transfer_sync_read`` against it.  This is the transport ceiling.
* ``measure_mooncake_store`` -- a ``mooncake_master``, one or more *store*
  processes that each mount a global segment, and a *client* (segment 0) that
  does ``batch_put_from`` / ``batch_get_into`` / ``batch_is_exist`` from a
  registered buffer.

Conventions shared by every number reported here:

* Throughput is in GB/s with GB = 1e9 bytes, computed per batch as
  ``batch_bytes / batch_seconds``; the reported value is the **median** of the
  per-batch throughputs.  Latencies are per-batch p50/p99 in milliseconds
  (linear-interpolated percentiles, like numpy's default).
* The first ``warmup_batches`` batches (default 1) are run and verified but not
  counted: they include the engines' lazy connection handshakes.
* Every byte is verified: each object carries a unique (batch, index) stamp on
  top of random payload, and the CRC32 of every object read back must equal the
  CRC32 of what was written.  A mismatch raises ``BenchError``.

Workers are this module re-run as ``python -m kvpool.bench.upstream <role>``.
They speak one JSON object per stdout line (``ready`` / ``result`` / ``error``);
everything else they or the engine print goes to a per-run log file.

Manual use::

    python -m kvpool.bench.upstream all --object-size 1179648 --batch-size 64 --batches 16
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import math
import mmap
import os
import queue
import random
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import uuid
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

# 256 tokens x 4 layers x 1152 bytes per token-layer: one KV block of the
# model kvpool targets.
DEFAULT_OBJECT_SIZE = 256 * 4 * 1152
DEFAULT_BATCH_SIZE = 64
DEFAULT_BATCHES = 16
DEFAULT_WARMUP_BATCHES = 1
DEFAULT_EXIST_KEYS = 64
DEFAULT_EXIST_REPS = 50
DEFAULT_TIMEOUT_S = 120.0

MODULE = "kvpool.bench.upstream"
GB = 1e9
MIB = 1 << 20
READY_TIMEOUT_S = 30.0
# polling period of the non-spinning raw measurement (as kvpool.transfer)
POLL_INTERVAL_S = 0.0002
STOP_GRACE_S = 5.0
HOST = "127.0.0.1"
# The client only uses registered caller buffers, so the engine's own staging
# buffer can stay small.
LOCAL_BUFFER_BYTES = 16 * MIB
# mooncake_master starts evicting above 90% segment use (its default
# eviction_high_watermark_ratio); auto-sized segments stay well below that so
# nothing put during a run can be evicted before it is read back.
SEGMENT_FILL_AUTO = 0.7
SEGMENT_FILL_MAX = 0.85
STAMP = struct.Struct("<QQ")


class BenchError(RuntimeError):
    """A benchmark worker failed, timed out, or returned wrong data."""


# --------------------------------------------------------------------------
# Statistics
# --------------------------------------------------------------------------


def percentile(samples: Sequence[float], q: float) -> float:
    """Return the ``q``-th percentile (0..100) with linear interpolation."""
    if not samples:
        raise ValueError("percentile of no samples")
    ordered = sorted(samples)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarize_batches(prefix: str, durations_s: Sequence[float], batch_bytes: int) -> dict[str, float]:
    """Median per-batch throughput (GB/s) and p50/p99 batch latency (ms)."""
    throughputs = [batch_bytes / d / GB for d in durations_s]
    return {
        f"{prefix}_gbps": percentile(throughputs, 50),
        f"{prefix}_p50_ms": percentile(durations_s, 50) * 1e3,
        f"{prefix}_p99_ms": percentile(durations_s, 99) * 1e3,
    }


def summarize_latency(prefix: str, durations_s: Sequence[float]) -> dict[str, float]:
    """p50/p99 latency (ms) of calls whose size is not meaningful as bytes."""
    return {
        f"{prefix}_p50_ms": percentile(durations_s, 50) * 1e3,
        f"{prefix}_p99_ms": percentile(durations_s, 99) * 1e3,
    }


# --------------------------------------------------------------------------
# Worker-side helpers: buffers, payload, protocol
# --------------------------------------------------------------------------


class Region:
    """An anonymous mmap with a stable address the engines can register."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._map = mmap.mmap(-1, size)
        self._cbuf = (ctypes.c_char * size).from_buffer(self._map)
        self.addr = ctypes.addressof(self._cbuf)

    def fill_random(self, seed: int) -> None:
        """Fill with pseudo-random bytes so the payload is not trivially compressible."""
        self._map[:] = random.Random(seed).randbytes(self.size)

    def zero(self, offset: int, length: int) -> None:
        """Clear a range so a failed read cannot pass as stale correct data."""
        ctypes.memset(self.addr + offset, 0, length)

    def stamp(self, offset: int, batch: int, index: int) -> None:
        """Make this object's bytes unique to (batch, index)."""
        self._map[offset : offset + STAMP.size] = STAMP.pack(batch, index)

    def crc(self, offset: int, length: int) -> int:
        """CRC32 of a range, read in place (no copy)."""
        with memoryview(self._map) as view:
            return zlib.crc32(view[offset : offset + length])


@dataclass
class Layout:
    """Where the objects of one batch live in a worker's region."""

    object_size: int
    batch_size: int
    base: int = 0

    @property
    def batch_bytes(self) -> int:
        return self.object_size * self.batch_size

    def offsets(self) -> list[int]:
        return [self.base + i * self.object_size for i in range(self.batch_size)]


def stamp_batch(region: Region, layout: Layout, batch: int) -> list[int]:
    """Stamp every object of ``batch`` and return their CRCs."""
    crcs = []
    for index, offset in enumerate(layout.offsets()):
        region.stamp(offset, batch, index)
        crcs.append(region.crc(offset, layout.object_size))
    return crcs


def verify_batch(region: Region, layout: Layout, expected: Sequence[int], batch: int) -> int:
    """Check every object read back against its CRC; return how many were checked."""
    offsets = layout.offsets()
    bad = sum(region.crc(off, layout.object_size) != crc for off, crc in zip(offsets, expected))
    if bad:
        raise BenchError(f"batch {batch}: {bad}/{len(offsets)} objects read back differ")
    return len(offsets)


def protocol_stream() -> IO[str]:
    """Take over stdout for protocol lines; route fd 1 (C++ prints) to stderr.

    Done before the engine is imported so that nothing native can interleave
    with the JSON lines the parent parses.
    """
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return proto


def emit(stream: IO[str], event: str, **fields: Any) -> None:
    """Write one protocol line."""
    stream.write(json.dumps({"event": event, **fields}) + "\n")
    stream.flush()


def wait_for_quit() -> None:
    """Block until the parent closes our stdin (or writes a line)."""
    sys.stdin.readline()


def check_codes(what: str, codes: Sequence[int], ok: int) -> None:
    """Raise if any per-key status differs from ``ok``."""
    bad = [c for c in codes if c != ok]
    if bad:
        raise BenchError(f"{what}: {len(bad)}/{len(codes)} failed, codes {sorted(set(bad))}")


# --------------------------------------------------------------------------
# Parent-side helpers: processes, ports, logs
# --------------------------------------------------------------------------


def log_tail(path: Path, limit: int = 2000) -> str:
    """Last ``limit`` characters of a log file, for error messages."""
    try:
        return path.read_text(errors="replace")[-limit:]
    except OSError:
        return ""


@dataclass
class Worker:
    """A worker subprocess whose stdout carries JSON protocol lines."""

    name: str
    proc: subprocess.Popen[str]
    log_path: Path
    messages: queue.Queue[dict[str, Any] | None] = field(default_factory=queue.Queue)
    reader: threading.Thread | None = None

    @classmethod
    def spawn(cls, role: str, spec: dict[str, Any], log_dir: Path, name: str) -> Worker:
        """Start ``python -m kvpool.bench.upstream <role> <spec-json>``."""
        log_path = log_dir / f"{name}.log"
        with log_path.open("w") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", MODULE, role, json.dumps(spec)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
            )
        worker = cls(name, proc, log_path)
        worker.reader = threading.Thread(target=worker._pump, name=f"pump-{name}", daemon=True)
        worker.reader.start()
        return worker

    def _pump(self) -> None:
        # A thread rather than select(): lines arrive whole and EOF is explicit.
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with contextlib.suppress(json.JSONDecodeError):
                self.messages.put(json.loads(line))
        self.messages.put(None)

    def expect(self, event: str, timeout_s: float) -> dict[str, Any]:
        """Wait for the next ``event`` line; raise on error, exit or timeout."""
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = deadline - time.monotonic()
            try:
                msg = self.messages.get(timeout=max(remaining, 0.0))
            except queue.Empty:
                raise self._failure(f"no '{event}' within {timeout_s:.0f}s") from None
            if msg is None:
                self.proc.wait()
                raise self._failure(f"exited with rc={self.proc.returncode} before '{event}'")
            if msg.get("event") == "error":
                raise self._failure(f"reported error: {msg.get('message')}")
            if msg.get("event") == event:
                return msg

    def _failure(self, what: str) -> BenchError:
        tail = log_tail(self.log_path)
        return BenchError(f"{self.name} {what}\n--- {self.log_path} (tail) ---\n{tail}")

    def request_stop(self) -> None:
        """Ask the worker to quit: it exits once its stdin closes."""
        with contextlib.suppress(OSError):
            assert self.proc.stdin is not None
            self.proc.stdin.close()

    def stop(self) -> None:
        """Ask the worker to quit; kill it if it lingers."""
        self.request_stop()
        terminate(self.proc, STOP_GRACE_S, polite=False)
        if self.reader is not None:
            self.reader.join(timeout=1.0)  # the pipe hits EOF once the process is gone
        if self.proc.stdout is not None and not (self.reader and self.reader.is_alive()):
            self.proc.stdout.close()


def stop_all(workers: Sequence[Worker]) -> None:
    """Stop workers concurrently: engine teardown takes ~1-2 s per process."""
    for worker in workers:
        worker.request_stop()
    for worker in workers:
        worker.stop()


def terminate(proc: subprocess.Popen[Any], grace_s: float, polite: bool = True) -> None:
    """Stop ``proc``: SIGTERM if ``polite``, then SIGKILL after ``grace_s``."""
    if proc.poll() is not None:
        return
    if polite:
        proc.terminate()
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@contextlib.contextmanager
def run_dir(prefix: str) -> Iterator[Path]:
    """A temp dir for worker logs: removed on success, kept (and named in the error) on failure."""
    path = Path(tempfile.mkdtemp(prefix=f"kvpool-{prefix}-"))
    try:
        yield path
    except BaseException as exc:
        exc.add_note(f"worker logs kept in {path}")
        raise
    else:
        shutil.rmtree(path, ignore_errors=True)


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


def spawn_ready(
    stack: contextlib.ExitStack, log_dir: Path, role: str, spec: dict[str, Any], name: str
) -> tuple[Worker, dict[str, Any]]:
    """Spawn a worker, register its teardown, and wait for its ready line."""
    worker = Worker.spawn(role, spec, log_dir, name)
    stack.callback(worker.stop)
    return worker, worker.expect("ready", READY_TIMEOUT_S)


def config_fields(
    object_size: int, batch_size: int, num_batches: int, warmup_batches: int
) -> dict[str, int]:
    """The run shape, echoed into every result."""
    return {
        "object_size": object_size,
        "batch_size": batch_size,
        "num_batches": num_batches,
        "warmup_batches": warmup_batches,
        "batch_bytes": object_size * batch_size,
    }


def validate_shape(object_size: int, batch_size: int, num_batches: int) -> None:
    """Reject shapes that cannot produce a measurement."""
    if object_size < STAMP.size or batch_size < 1 or num_batches < 1:
        raise ValueError(f"need object_size >= {STAMP.size}, batch_size >= 1, num_batches >= 1")


# --------------------------------------------------------------------------
# Raw transfer engine
# --------------------------------------------------------------------------


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
    verified = 0
    for batch in range(spec["warmup_batches"] + spec["num_batches"]):
        crcs = stamp_batch(region, src, batch)
        region.zero(dst.base, dst.batch_bytes)
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
        matched = verify_batch(region, dst, crcs, batch)
        if batch >= spec["warmup_batches"]:
            writes.append(t1 - t0)
            reads.append(t2 - t1)
            verified += matched
    engine.unregister_memory(region.addr)
    emit(out, "result", write_s=writes, read_s=reads, verified_objects=verified)


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
    Returns ``te_raw_write_*`` and ``te_raw_read_*`` (``_gbps`` median
    per-batch GB/s, ``_p50_ms``/``_p99_ms`` per-batch latency) and
    ``te_raw_gbps``, the **mean** of the write and read medians: one ceiling
    figure for a workload that moves as many bytes in as out.
    """
    validate_shape(object_size, batch_size, num_batches)
    if num_targets < 1 or (num_targets > 1 and not polled):
        raise ValueError("num_targets: more than one target needs polled=True")
    batch_bytes = object_size * batch_size
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
        stop_all([initiator, *target_workers])
    result: dict[str, Any] = config_fields(object_size, batch_size, num_batches, warmup_batches)
    result |= summarize_batches("te_raw_write", raw["write_s"], batch_bytes)
    result |= summarize_batches("te_raw_read", raw["read_s"], batch_bytes)
    result["te_raw_gbps"] = (result["te_raw_write_gbps"] + result["te_raw_read_gbps"]) / 2
    result["te_raw_verified_objects"] = raw["verified_objects"]
    result["te_raw_verified"] = raw["verified_objects"] == batch_size * num_batches
    result["te_raw_targets"] = num_targets
    result["te_raw_polled"] = polled
    return result


# --------------------------------------------------------------------------
# Upstream Mooncake Store
# --------------------------------------------------------------------------


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
        crcs.append(stamp_batch(region, layout, batch))
        t0 = time.perf_counter()
        codes = store.batch_put_from(batch_keys, addrs, sizes)
        elapsed = time.perf_counter() - t0
        check_codes(f"batch_put_from batch {batch}", codes, 0)
        if batch >= warmup:
            durations.append(elapsed)
    return durations, crcs


def mc_get_all(
    store: Any, region: Region, layout: Layout, keys: list[list[str]], crcs: list[list[int]], warmup: int
) -> tuple[list[float], int]:
    """Get every batch back into a zeroed buffer; return durations and verified-object count."""
    addrs = [region.addr + off for off in layout.offsets()]
    sizes = [layout.object_size] * layout.batch_size
    durations: list[float] = []
    verified = 0
    for batch, batch_keys in enumerate(keys):
        region.zero(layout.base, layout.batch_bytes)
        t0 = time.perf_counter()
        got = store.batch_get_into(batch_keys, addrs, sizes)
        elapsed = time.perf_counter() - t0
        check_codes(f"batch_get_into batch {batch}", got, layout.object_size)
        matched = verify_batch(region, layout, crcs[batch], batch)
        if batch >= warmup:
            durations.append(elapsed)
            verified += matched
    return durations, verified


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
    get_s, verified = mc_get_all(store, region, dst, keys, crcs, warmup)
    exist_keys = [k for batch in keys[warmup:] for k in batch][: spec["exist_keys"]]
    exist_s = mc_exist(store, exist_keys, spec["exist_reps"])
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
        # Before the master goes: stores unmount their segments through it.
        stop_all([client, *stores])
    result: dict[str, Any] = config_fields(object_size, batch_size, num_batches, warmup_batches)
    result |= {
        "num_stores": num_stores,
        "segment_bytes": segment,
        "prefault_segment": prefault_segment,
    }
    result |= summarize_batches("mooncake_put", raw["put_s"], batch_bytes)
    result |= summarize_batches("mooncake_get", raw["get_s"], batch_bytes)
    result |= summarize_latency("mooncake_exist", raw["exist_s"])
    result["mooncake_exist_keys"] = raw["exist_keys"]
    result["mooncake_verified_objects"] = raw["verified_objects"]
    result["mooncake_verified"] = raw["verified_objects"] == batch_size * num_batches
    return result


# --------------------------------------------------------------------------
# Entry points
# --------------------------------------------------------------------------

WORKER_ROLES = {
    "te-target": te_target_main,
    "te-initiator": te_initiator_main,
    "mc-store": mc_store_main,
    "mc-client": mc_client_main,
}


def worker_main(role: str, spec_json: str) -> int:
    """Run one worker role; any failure becomes an ``error`` protocol line."""
    out = protocol_stream()
    try:
        WORKER_ROLES[role](json.loads(spec_json), out)
    except Exception as exc:  # noqa: BLE001 -- reported to the parent, not swallowed
        emit(out, "error", message=f"{type(exc).__name__}: {exc}")
        return 1
    return 0


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """CLI: ``all`` | ``te-raw`` | ``store`` with the run shape."""
    parser = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.split("\n")[0])
    parser.add_argument("what", choices=["all", "te-raw", "store"])
    parser.add_argument("--object-size", type=int, default=DEFAULT_OBJECT_SIZE)
    parser.add_argument("--batch-size", type=int, default=DEFAULT_BATCH_SIZE)
    parser.add_argument("--batches", type=int, default=DEFAULT_BATCHES)
    parser.add_argument("--warmup-batches", type=int, default=DEFAULT_WARMUP_BATCHES)
    parser.add_argument("--segment-bytes", type=int, default=None, help="per store; default: auto")
    parser.add_argument("--num-stores", type=int, default=1)
    parser.add_argument(
        "--prefault-segment",
        action="store_true",
        help="put+remove the run's volume first (see mc_prefault)",
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Worker dispatch, or the manual CLI that prints one JSON object last."""
    args_in = list(sys.argv[1:] if argv is None else argv)
    if args_in and args_in[0] in WORKER_ROLES:
        return worker_main(args_in[0], args_in[1])
    args = parse_args(args_in)
    shape = (args.object_size, args.batch_size, args.batches)
    result: dict[str, Any] = {}
    if args.what in ("all", "te-raw"):
        result |= measure_te_raw(*shape, warmup_batches=args.warmup_batches)
    if args.what in ("all", "store"):
        result |= measure_mooncake_store(
            *shape,
            args.segment_bytes,
            num_stores=args.num_stores,
            warmup_batches=args.warmup_batches,
            prefault_segment=args.prefault_segment,
        )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
