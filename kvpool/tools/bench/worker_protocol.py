"""Worker processes for the baseline benchmarks: protocol, payload and run shape.

The parent launches each worker as ``python -m kvpool.tools.bench.upstream <role>
<spec-json>`` (``Worker.spawn``); a worker speaks one JSON object per stdout
line (``ready`` / ``result`` / ``error``) and everything else it or the engine
prints goes to a per-run log file.

Payload: every object carries a (system, batch, index) stamp on top of random
bytes, every destination is zeroed before its read, and the CRC32 of every
object read back must equal the CRC32 of what was written (``stamp_batch`` /
``verify_batch``); a mismatch raises ``BenchError``.  Statistics: throughput is
verified bytes over the measured batches' seconds (``stats.throughput_gbps``,
GB = 1e9 bytes), p50/p99 batch latencies in milliseconds, linear-interpolated
percentiles.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import math
import mmap
import os
import queue
import random
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from kvpool.tools.bench import stats

# 256 tokens x 4 layers x 1152 bytes per token-layer: one KV block of the
# model kvpool targets.
DEFAULT_OBJECT_SIZE = 256 * 4 * 1152
DEFAULT_BATCH_SIZE = 64
DEFAULT_BATCHES = 16
DEFAULT_WARMUP_BATCHES = 1
DEFAULT_EXIST_KEYS = 64
DEFAULT_EXIST_REPS = 50
DEFAULT_TIMEOUT_S = 120.0

# the entry module whose __main__ dispatches worker roles
MODULE = "kvpool.tools.bench.upstream"
MIB = 1 << 20
READY_TIMEOUT_S = 30.0
STOP_GRACE_S = 5.0
HOST = "127.0.0.1"
# at the head of every object: which system wrote it, batch number, object index
STAMP = struct.Struct("<8sQQ")
SYSTEM_KVPOOL = "kvpool"
SYSTEM_MOONCAKE = "mooncake"
SYSTEM_TE_RAW = "te-raw"
# /proc/<pid>/smaps_rollup lines that count memory mapped with huge pages
HUGE_PAGE_FIELDS = ("AnonHugePages", "ShmemPmdMapped", "FilePmdMapped", "Shared_Hugetlb", "Private_Hugetlb")
THP_MODE_FILE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


class BenchError(RuntimeError):
    """A benchmark worker failed, timed out, or returned wrong data."""


# ---- statistics ----------------------------------------------------------


def percentile(samples: Sequence[float], q: float) -> float:
    """Return the ``q``-th percentile (0..100) with linear interpolation.

    Unlike ``stats.percentile`` (NaN), no samples is an error here: every
    measured list must be non-empty.
    """
    if not samples:
        raise ValueError("percentile of no samples")
    return stats.percentile(samples, q)


def summarize_batches(prefix: str, durations_s: Sequence[float], verified_bytes: int) -> dict[str, float]:
    """Throughput (verified bytes / seconds, GB/s), the seconds, and p50/p99 batch latency (ms)."""
    return {
        f"{prefix}_gbps": stats.throughput_gbps(verified_bytes, durations_s),
        f"{prefix}_s": math.fsum(durations_s),
        f"{prefix}_p50_ms": percentile(durations_s, 50) * 1e3,
        f"{prefix}_p99_ms": percentile(durations_s, 99) * 1e3,
    }


def summarize_latency(prefix: str, durations_s: Sequence[float]) -> dict[str, float]:
    """p50/p99 latency (ms) of calls whose size is not meaningful as bytes."""
    return {
        f"{prefix}_p50_ms": percentile(durations_s, 50) * 1e3,
        f"{prefix}_p99_ms": percentile(durations_s, 99) * 1e3,
    }


# ---- worker side: buffers, payload, protocol -----------------------------


class Region:
    """An anonymous mmap with a stable address the engines can register.

    No madvise(MADV_HUGEPAGE), on purpose: ``kvpool bench pool`` runs our side
    with KVPOOL_HUGE_PAGES=0 so that no buffer on any side asks for huge pages.
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self._map = mmap.mmap(-1, size)
        self._cbuf = (ctypes.c_char * size).from_buffer(self._map)
        self.addr = ctypes.addressof(self._cbuf)
        self.mem = memoryview(self._map)

    def fill_random(self, seed: int) -> None:
        """Fill with pseudo-random bytes so the payload is not trivially compressible."""
        self._map[:] = random.Random(seed).randbytes(self.size)

    def zero(self, offset: int, length: int) -> None:
        """Clear a range so a failed read cannot pass as stale correct data."""
        ctypes.memset(self.addr + offset, 0, length)



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


def zero(mem: memoryview, offset: int, length: int) -> None:
    """Clear a range so a read that writes nothing cannot pass as correct data."""
    ctypes.memset((ctypes.c_char * length).from_buffer(mem, offset), 0, length)


def stamp_batch(mem: memoryview, layout: Layout, system: str, batch: int) -> list[int]:
    """Make every object of ``batch`` unique to (system, batch, index); return their CRCs.

    ``mem`` is the whole registered buffer (a Region's ``mem``, a HostBuffer's
    ``view()``), so every system is stamped and checked by the same code.
    """
    crcs = []
    for index, offset in enumerate(layout.offsets()):
        STAMP.pack_into(mem, offset, system.encode(), batch, index)
        crcs.append(zlib.crc32(mem[offset : offset + layout.object_size]))
    return crcs


def match_batch(mem: memoryview, layout: Layout, expected: Sequence[int]) -> list[bool]:
    """Per object of ``layout``: does what is there now have the CRC it was written with?"""
    size = layout.object_size
    return [zlib.crc32(mem[off : off + size]) == crc for off, crc in zip(layout.offsets(), expected, strict=True)]


def verify_batch(mem: memoryview, layout: Layout, expected: Sequence[int], batch: int) -> int:
    """Check every object read back against its CRC; return how many were checked."""
    bad = match_batch(mem, layout, expected).count(False)
    if bad:
        raise BenchError(f"batch {batch}: {bad}/{layout.batch_size} objects read back differ")
    return layout.batch_size


def huge_page_bytes(pid: int | str = "self") -> int | None:
    """Bytes a process has mapped with huge pages (THP or hugetlbfs); None if unreadable."""
    try:
        lines = Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()
    except OSError:
        return None
    kib = 0
    for line in lines:
        name, _, rest = line.partition(":")
        if name in HUGE_PAGE_FIELDS:
            kib += int(rest.split()[0])
    return kib * 1024


def total_or_none(values: Sequence[int | None]) -> int | None:
    """Sum of per-process figures; None when any process could not be read."""
    return None if any(v is None for v in values) else sum(v for v in values if v is not None)


def thp_mode() -> str:
    """The kernel's transparent-huge-page mode (always, madvise or never), or 'unknown'."""
    try:
        text = THP_MODE_FILE.read_text()
    except OSError:
        return "unknown"
    return text[text.find("[") + 1 : text.find("]")] if "[" in text else text.strip()


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


# ---- parent side: processes, logs ----------------------------------------


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
        """Start ``python -m kvpool.tools.bench.upstream <role> <spec-json>``."""
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
        # every object the run moves, each to be verified (the warm-up batches too: only their time is left out)
        "objects": batch_size * (num_batches + warmup_batches),
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
