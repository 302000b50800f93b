"""The baselines and our own throughput worker run end to end at tiny sizes, verified and accounted alike."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("mooncake.store", reason="mooncake-transfer-engine is not installed")

from kvpool.tools.bench import pool_bench, upstream  # noqa: E402 -- after the importorskip guard
from kvpool.tools.bench.stats import throughput_gbps  # noqa: E402
from kvpool.tools.cluster import LocalPool  # noqa: E402

OBJECT_SIZE = 64 * 1024
BATCH_SIZE = 4
BATCHES = 3


def child_pids() -> set[int]:
    """PIDs whose parent is this test process (leftover workers would show here)."""
    pids = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == os.getpid():  # fields[1] is the ppid
            pids.add(int(stat.parent.name))
    return pids


def assert_positive_finite(result: dict[str, Any], keys: list[str]) -> None:
    for key in keys:
        value = result[key]
        assert isinstance(value, float) and math.isfinite(value) and value > 0, (key, value)


def test_percentile_interpolates() -> None:
    assert upstream.percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert upstream.percentile([1.0, 2.0], 100) == 2.0
    assert upstream.percentile([7.0], 99) == 7.0


@pytest.mark.cluster
@pytest.mark.timeout(60)
def test_te_raw_baseline() -> None:
    before = child_pids()
    result = upstream.measure_te_raw(OBJECT_SIZE, BATCH_SIZE, BATCHES, timeout_s=20)
    assert_positive_finite(
        result,
        [f"te_raw_{op}_{stat}" for op in ("write", "read") for stat in ("gbps", "p50_ms", "p99_ms")]
        + ["te_raw_gbps"],
    )
    assert result["te_raw_verified"] is True
    assert result["objects"] == BATCH_SIZE * (BATCHES + 1)  # the warm-up batch is verified, not timed
    assert result["te_raw_verified_objects"] == BATCH_SIZE * (BATCHES + 1)
    assert result["te_raw_verified_bytes"] == BATCH_SIZE * BATCHES * OBJECT_SIZE
    for op in ("write", "read"):  # verified bytes / seconds, as ours
        seconds = result[f"te_raw_{op}_s"]
        assert result[f"te_raw_{op}_gbps"] == throughput_gbps(result["te_raw_verified_bytes"], [seconds])
    assert pool_bench.failures(result) == []
    assert isinstance(result["te_raw_huge_page_bytes"], int)
    assert child_pids() <= before


@pytest.mark.cluster
@pytest.mark.timeout(60)
def test_mooncake_store_baseline() -> None:
    before = child_pids()
    result = upstream.measure_mooncake_store(
        OBJECT_SIZE, BATCH_SIZE, BATCHES, 64 << 20, exist_reps=5, timeout_s=20
    )
    assert_positive_finite(
        result,
        [f"mooncake_{op}_{stat}" for op in ("put", "get") for stat in ("gbps", "p50_ms", "p99_ms")]
        + ["mooncake_exist_p50_ms", "mooncake_exist_p99_ms"],
    )
    assert result["mooncake_verified"] is True
    assert result["objects"] == BATCH_SIZE * (BATCHES + 1)
    assert result["mooncake_verified_objects"] == BATCH_SIZE * (BATCHES + 1)
    assert result["mooncake_verified_bytes"] == BATCH_SIZE * BATCHES * OBJECT_SIZE
    for op in ("put", "get"):
        assert result[f"mooncake_{op}_gbps"] == throughput_gbps(result["mooncake_verified_bytes"],
                                                                [result[f"mooncake_{op}_s"]])
    assert pool_bench.failures(result) == []
    assert isinstance(result["mooncake_huge_page_bytes"], int)
    assert result["mooncake_exist_keys"] == BATCH_SIZE * BATCHES  # all 12 put keys, fewer than 64
    assert child_pids() <= before


def test_overfull_segment_is_rejected() -> None:
    with pytest.raises(ValueError, match="segments"):
        upstream.measure_mooncake_store(OBJECT_SIZE, BATCH_SIZE, BATCHES, OBJECT_SIZE)


@pytest.mark.cluster
@pytest.mark.timeout(90)
def test_ours_is_stamped_verified_and_accounted_like_upstream(tmp_path: Path) -> None:
    with pool_bench.same_huge_pages(), LocalPool(num_stores=2, segment_size="64MiB", workdir=tmp_path) as pool:
        result = pool_bench.measure_ours(pool.master_address, OBJECT_SIZE, BATCH_SIZE, BATCHES, "accounting")
        stores_huge = [pool_bench.huge_page_bytes(s.proc.pid) for s in pool.stores]
    objects = BATCH_SIZE * (BATCHES + 1)  # the warm-up batch is verified too, only not timed
    assert {k: result[k] for k in ("objects", "stored", "not_stored", "missed", "mismatched", "verified_objects")} == {
        "objects": objects, "stored": objects, "not_stored": 0, "missed": 0, "mismatched": 0,
        "verified_objects": objects,
    }
    assert result["verified_bytes"] == BATCH_SIZE * BATCHES * OBJECT_SIZE
    for op in ("put", "get"):
        assert result[f"{op}_gbps"] == throughput_gbps(result["verified_bytes"], [result[f"{op}_s"]])
    assert pool_bench.require_clean("ours", result) is result
    # huge pages off (KVPOOL_HUGE_PAGES=0) reached our processes: none asked, so under the
    # kernel's madvise mode none hold any
    if pool_bench.thp_mode() == "madvise":
        assert result["client_huge_page_bytes"] == 0
        assert stores_huge == [0, 0]
