"""``kvpool bench pool`` accounting: counters summed, failures void the run, one throughput formula."""

from __future__ import annotations

import math
import os
import zlib
from pathlib import Path

import pytest

from kvpool.tools.bench import pool_bench, stats
from kvpool.tools.bench.worker_protocol import (
    STAMP,
    SYSTEM_KVPOOL,
    SYSTEM_MOONCAKE,
    BenchError,
    Layout,
    Region,
    huge_page_bytes,
    match_batch,
    stamp_batch,
    summarize_batches,
    verify_batch,
    zero,
)

OBJECT = 1 << 20


def ours_run(put_gbps: float, *, verified: int = 256, mismatched: int = 0, missed: int = 0,
             huge: int | None = 0) -> dict[str, object]:
    """One throughput worker's result, as ``pool_workload.throughput`` reports it (256 objects)."""
    return {
        "object_size": OBJECT, "batch_size": 64, "batches": 3,
        "put_gbps": put_gbps, "get_gbps": 2 * put_gbps, "put_p50_ms": 10.0, "put_s": 0.5,
        "objects": 256, "stored": 256, "not_stored": 0, "missed": missed, "mismatched": mismatched,
        "verified_objects": verified, "verified_bytes": verified * OBJECT, "client_huge_page_bytes": huge,
    }


def test_counters_are_summed_and_throughputs_are_medians() -> None:
    runs = [ours_run(1.0), ours_run(3.0, huge=4096), ours_run(2.0)]
    merged = pool_bench.merge_repeats(runs)
    assert merged["objects"] == 768
    assert merged["stored"] == 768
    assert merged["verified_objects"] == 768
    assert merged["verified_bytes"] == 768 * OBJECT
    assert merged["put_gbps"] == 2.0
    assert merged["get_gbps"] == 4.0
    assert merged["put_s"] == 0.5
    assert merged["client_huge_page_bytes"] == 4096  # the most any repeat held
    assert (merged["object_size"], merged["batch_size"], merged["batches"]) == (OBJECT, 64, 3)
    assert merged["repeats"] == 3


def test_one_mismatched_repeat_of_three_fails_the_run() -> None:
    # a median of the counters would have reported 0 mismatched here
    bad = ours_run(1.0, verified=255, mismatched=1)
    merged = pool_bench.merge_repeats([ours_run(1.0), bad, ours_run(1.0)])
    assert merged["mismatched"] == 1
    assert merged["verified_objects"] == 767
    assert pool_bench.failures(merged) == ["1 mismatched", "767/768 verified"]
    with pytest.raises(BenchError, match=r"ours: 1 mismatched, 767/768 verified; .* void"):
        pool_bench.require_clean("ours", merged)


def test_not_stored_and_misses_fail_the_run() -> None:
    result = ours_run(1.0, verified=250, missed=6) | {"stored": 254, "not_stored": 2}
    assert pool_bench.failures(result) == ["2 not stored", "6 missed", "254/256 stored", "250/256 verified"]
    with pytest.raises(BenchError, match="2 not stored, 6 missed"):
        pool_bench.require_clean("ours", result)


def test_upstream_and_raw_results_are_held_to_the_same_count() -> None:
    upstream = {"objects": 12, "mooncake_verified_objects": 11, "mooncake_put_gbps": 1.0}
    assert pool_bench.failures(upstream) == ["11/12 verified"]
    raw = {"objects": 12, "te_raw_verified_objects": 12}
    assert pool_bench.require_clean("raw", raw) is raw
    assert pool_bench.failures(ours_run(1.0)) == []


def test_one_throughput_formula() -> None:
    # verified bytes over the seconds of the measured batches, GB = 1e9
    assert stats.throughput_gbps(3_000_000_000, [0.5, 1.0, 1.5]) == 1.0
    assert stats.throughput_gbps(0, [1.0]) == 0.0
    assert math.isnan(stats.throughput_gbps(1_000, []))  # no time, no figure
    upstream = summarize_batches("mooncake_get", [0.25, 0.25, 0.5], 2_000_000_000)
    assert upstream["mooncake_get_gbps"] == 2.0
    assert upstream["mooncake_get_s"] == 1.0
    assert upstream["mooncake_get_p50_ms"] == 250.0
    # a batch that delivered half its bytes counts as half
    assert summarize_batches("x", [0.5, 0.5], 1_500_000_000)["x_gbps"] == 1.5


def test_every_object_is_stamped_apart_and_a_read_that_writes_nothing_fails() -> None:
    layout = Layout(64 << 10, 4)
    dst = Layout(layout.object_size, layout.batch_size, base=layout.batch_bytes)
    region = Region(2 * layout.batch_bytes)
    region.fill_random(7)
    crcs = stamp_batch(region.mem, layout, SYSTEM_KVPOOL, 3)
    assert STAMP.unpack_from(region.mem, 2 * layout.object_size) == (b"kvpool\0\0", 3, 2)
    assert len(set(crcs)) == 4
    assert stamp_batch(region.mem, layout, SYSTEM_KVPOOL, 4) != crcs  # the next batch differs
    assert stamp_batch(region.mem, layout, SYSTEM_MOONCAKE, 3) != crcs  # so does another system
    stamp_batch(region.mem, layout, SYSTEM_KVPOOL, 3)
    # the destination was zeroed and nothing arrived: every object differs
    zero(region.mem, dst.base, dst.batch_bytes)
    assert bytes(region.mem[dst.base : dst.base + dst.batch_bytes]) == bytes(dst.batch_bytes)
    assert match_batch(region.mem, dst, crcs) == [False] * 4
    with pytest.raises(BenchError, match="batch 3: 4/4 objects read back differ"):
        verify_batch(region.mem, dst, crcs, 3)
    # objects 0 and 2 arrive; 1 is the right object from an earlier batch, 3 never arrives
    region.mem[dst.base : dst.base + layout.batch_bytes] = region.mem[: layout.batch_bytes]
    STAMP.pack_into(region.mem, dst.base + layout.object_size, SYSTEM_KVPOOL.encode(), 2, 1)
    zero(region.mem, dst.base + 3 * layout.object_size, layout.object_size)
    assert match_batch(region.mem, dst, crcs) == [True, False, True, False]
    assert zlib.crc32(region.mem[dst.base : dst.base + layout.object_size]) == crcs[0]


def test_huge_pages_are_off_while_the_bench_runs_and_restored_after() -> None:
    before = os.environ.get(pool_bench.HUGE_PAGES_ENV)
    with pool_bench.same_huge_pages():
        assert os.environ[pool_bench.HUGE_PAGES_ENV] == "0"
    assert os.environ.get(pool_bench.HUGE_PAGES_ENV) == before
    assert huge_page_bytes(0) is None  # no such process: unknown, never a reassuring 0
    assert isinstance(huge_page_bytes(), int)


def test_the_working_set_is_sized_from_the_largest_cache(tmp_path: Path) -> None:
    for index, size in (("index0", "48K"), ("index2", "2048K"), ("index3", "491520K")):
        (tmp_path / index).mkdir()
        (tmp_path / index / "size").write_text(size + "\n")
    assert pool_bench.l3_cache_bytes(tmp_path) == 491520 << 10
    assert pool_bench.l3_cache_bytes(tmp_path / "missing") == pool_bench.UNKNOWN_CACHE_BYTES
    # 4 x 480 MiB read in batches of 64 x 1.125 MiB: 27 batches, never fewer than asked for
    assert pool_bench.headline_batches(4 * (491520 << 10), 1179648, 64, 16) == 27
    assert pool_bench.headline_batches(1 << 20, 1179648, 64, 16) == 16


def test_a_run_that_moved_bytes_by_the_wrong_path_fails() -> None:
    by_memory = ours_run(1.0) | {"bytes_by_path": {"memory_read": 5, "memory_write": 5, "engine_read": 0,
                                                   "engine_write": 0}}
    assert pool_bench.failures(by_memory, "memory") == []
    assert pool_bench.failures(by_memory, "engine") == ["5 bytes by memory read", "5 bytes by memory write",
                                                        "no byte by engine"]
    mixed = by_memory | {"bytes_by_path": by_memory["bytes_by_path"] | {"engine_read": 7}}
    with pytest.raises(BenchError, match="same host: 7 bytes by engine read"):
        pool_bench.require_clean("same host", mixed, "memory")


def test_first_touch_and_memcpy_repeats_merge_like_the_others() -> None:
    put = {"objects": 256, "stored": 256, "not_stored": 0, "put_bytes": 192 * OBJECT, "put_gbps": 3.0}
    merged = pool_bench.merge_repeats([put, put | {"put_gbps": 1.0}, put | {"put_gbps": 2.0}])
    assert (merged["put_bytes"], merged["put_gbps"], merged["stored"]) == (3 * 192 * OBJECT, 2.0, 768)
    copy = {"objects": 256, "stored": 256, "mismatched": 0, "verified_objects": 256, "memcpy_get_gbps": 9.0,
            "memcpy_put_gbps": 6.0}
    merged = pool_bench.merge_repeats([copy, copy | {"memcpy_get_gbps": 5.0, "verified_objects": 255,
                                                     "mismatched": 1}])
    assert merged["memcpy_get_gbps"] == 7.0
    assert pool_bench.failures(merged) == ["1 mismatched", "511/512 verified"]


def test_same_host_summary_reports_each_ratio_against_its_target() -> None:
    report = {
        "ours": {"kv_batch64": ours_run(5.0), "kv_batch4": ours_run(1.0)},
        "same_host_first_touch_put": {"put_gbps": 2.0},
        "same_host_first_touch_get": {"get_gbps": 4.0, "verified_objects": 256},
        "engine_only": {"put_gbps": 1.0, "get_gbps": 1.6, "verified_objects": 256},
        "memcpy": {"memcpy_get_gbps": 12.5, "memcpy_put_gbps": 10.0, "verified_objects": 256},
        "headline_batches": 3, "read_bytes_per_run": 192 * OBJECT, "l3_cache_bytes": 1 << 20,
    }
    summary = {"put_gbps": 5.0, "get_gbps": 10.0, "mooncake_put_gbps": 2.5, "mooncake_get_gbps": 2.0}
    figures = pool_bench.same_host_summary(report, summary)
    assert figures["same_host_get_gbps"] == 10.0
    assert figures["same_host_put_first_touch_gbps"] == 2.0
    assert figures["same_host_get_first_touch_gbps"] == 4.0
    assert figures["same_host_get_vs_mooncake"] == 5.0
    assert figures["same_host_put_vs_mooncake"] == 2.0
    assert figures["same_host_get_vs_memcpy"] == 0.8
    assert figures["same_host_get_vs_engine"] == 10.0 / 1.6
    assert figures["targets_met"] == {"same_host_get_vs_mooncake": True, "same_host_put_vs_mooncake": False,
                                      "same_host_get_vs_memcpy": True}
    assert figures["same_host_verified_objects"] == 512  # the warm run and the first-touch read-back
    # no upstream in the run (--skip-upstream): its ratios are not numbers and count as not met
    figures = pool_bench.same_host_summary(report, summary | {"mooncake_get_gbps": math.nan})
    assert math.isnan(figures["same_host_get_vs_mooncake"])
    assert not figures["targets_met"]["same_host_get_vs_mooncake"]
