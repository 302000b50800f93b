"""``kvpool bench handoff`` at a small size, through the command: the report's structural facts.

Two real processes with real engines; the bench itself fails unless decode's
pages equal the sender's byte for byte after every run. Nothing here depends
on the machine's speed: only facts that must hold in any run are asserted.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from kvpool.core.handoff.layout import MAX_TRANSFER_BYTES

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(180)]

KEYS = {
    "naive_writes", "gathered_writes", "naive_seconds", "gathered_seconds", "speedup", "bytes", "bytes_verified",
    "naive_bytes_verified", "gather_seconds", "write_seconds", "scatter_seconds", "tokens", "layers", "entry_bytes",
    "same_host_seconds", "same_host_bytes_verified", "same_host_over_engine",
}


def bench(*args: str) -> tuple[str, dict[str, object]]:
    done = subprocess.run([sys.executable, "-m", "kvpool.services.cli", "bench", "handoff", "--json", *args],
                          check=False, capture_output=True, text=True, timeout=170)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    return "\n".join(lines[:-1]), json.loads(lines[-1])


def test_small_handoff_bench_verifies_every_byte_and_counts_writes_from_sizes() -> None:
    # 1,000 tokens: a partial prefill block (256) and a partial decode page (16); 11.52 MB: two writes
    table, summary = bench("--tokens", "1000", "--layers", "20", "--entry-bytes", "576", "--repeats", "1")
    assert KEYS <= summary.keys()
    nbytes = 1000 * 20 * 576
    assert summary["bytes"] == nbytes
    assert summary["bytes_verified"] == nbytes
    assert summary["naive_bytes_verified"] == nbytes
    assert summary["naive_writes"] == 20_000
    assert summary["gathered_writes"] == math.ceil(nbytes / MAX_TRANSFER_BYTES) == 2
    assert summary["speedup"] == pytest.approx(summary["naive_seconds"] / summary["gathered_seconds"])
    assert summary["same_host_bytes_verified"] == nbytes
    assert summary["same_host_over_engine"] == pytest.approx(summary["gathered_seconds"] / summary["same_host_seconds"])
    assert "naive" in table and "gathered" in table and "same host" in table and "speedup" in table


def test_other_shapes_keep_the_counts_exact() -> None:
    _, summary = bench("--quick", "--tokens", "77", "--layers", "3", "--entry-bytes", "100", "--repeats", "2")
    assert (summary["tokens"], summary["layers"], summary["entry_bytes"]) == (77, 3, 100)
    assert summary["naive_writes"] == 77 * 3
    assert summary["gathered_writes"] == 1
    verified = (summary["bytes_verified"], summary["naive_bytes_verified"], summary["same_host_bytes_verified"])
    assert verified == (77 * 3 * 100,) * 3

# bad arguments: tests/unit/test_bench_arguments.py (refused before any process starts)
