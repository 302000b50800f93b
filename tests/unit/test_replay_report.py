"""The replay's summary from records and scraped metrics: exact shares, bounds, stage figures, what is missing."""

from __future__ import annotations

import json
import math
from pathlib import Path

from kvpool.tools.replay.engine import ReplayOptions, ReplayResult, TurnRecord
from kvpool.tools.replay.report import format_table, json_safe, summarize
from kvpool.tools.replay.workload import load_workload


def workload_of(tmp_path: Path):  # type: ignore[no-untyped-def]
    doc = {"id": "s", "block_size": 256, "hash_id_scope": "local", "tool_tokens": 0, "system_tokens": 0,
           "requests": [{"t": 0, "in": 512, "out": 8, "hash_ids": [1, 2], "think_time": 0},
                        {"t": 1, "in": 768, "out": 8, "hash_ids": [1, 2, 3], "think_time": 0}]}
    (tmp_path / "s.json").write_text(json.dumps(doc))
    return load_workload(tmp_path / "s.json", scale=1, vocab_size=1024, context=32768, max_tokens=8)


def record(turn: int, prompt: int, device: int, pool: int, computed: int, **extra: object) -> TurnRecord:
    r = TurnRecord("s", turn, None, turn, prompt, 8, completion_tokens=8, device_tokens=device, pool_tokens=pool,
                   computed_tokens=computed, ttft_s=0.5 + turn, itl_s=[0.25, 0.75], pipeline="p0")
    for key, value in extra.items():
        setattr(r, key, value)
    return r


def test_summary_of_records_and_metrics(tmp_path: Path) -> None:
    workload = workload_of(tmp_path)
    records = [record(0, 512, 0, 0, 512), record(1, 768, 0, 256, 512)]
    before = {"p0-stage0": {"kvpool_prefill_restored_bytes_total": 100.0}}
    after = {"p0-stage0": {"kvpool_prefill_restored_bytes_total": 1100.0,
                           "kvpool_prefill_restore_wait_seconds_sum": 0.5,
                           "kvpool_prefill_restore_wait_seconds_count": 2.0,
                           "kvpool_prefill_restore_seconds_sum": 0.3,
                           "kvpool_prefill_restore_seconds_count": 2.0,
                           "kvpool_prefill_admission_wait_seconds_sum": 1.0,
                           "kvpool_prefill_admission_wait_seconds_count": 4.0},
             "decode0": {"kvpool_decode_queue_seconds_sum": 0.2, "kvpool_decode_queue_seconds_count": 4.0}}
    result = ReplayResult(1, 2.0, records, before, after, {"capacity_bytes": "64", "used_bytes": "8",
                                                            "evicted_groups": "0", "evicted_bytes": "0",
                                                            "num_complete_groups": "3"}, [0.25, 0.75])
    s = summarize(result, workload, ReplayOptions(think_scale=0.0))
    assert (s["prompt_tokens"], s["output_tokens"], s["errors"]) == (1280, 16, 0)
    assert (s["prompt_tok_s"], s["output_tok_s"]) == (640.0, 8.0)
    assert (s["device_share"], s["pool_share"], s["computed_share"]) == (0.0, 256 / 1280, 1024 / 1280)
    # an unlimited cache hits chunks 1 and 2 of turn 1 (its third is new); so do the trace's blocks
    assert s["trace_bound"] == 512 / 1280
    assert s["trace_block_bound"] == 512 / 1280
    assert (s["ttft_p50_s"], s["itl_p50_s"]) == (1.0, 0.5)
    assert s["restore_bytes_per_stage"] == {"p0-stage0": 1000}
    assert s["restore_seconds_mean_per_stage"] == {"p0-stage0": 0.15}
    assert s["prefill_queue_wait_mean_s"] == 0.25
    assert (s["restore_wait_mean_s"], s["decode_queue_wait_mean_s"]) == (0.25, 0.05)
    assert (s["decode_kv_util_peak"], s["decode_kv_util_mean"]) == (0.75, 0.5)
    assert (s["pool_capacity_bytes"], s["pool_num_complete_groups"]) == (64, 3)
    assert not any("reached" in m for m in s["missing"])
    assert "first_error" not in s


def test_router_only_names_what_is_missing_and_errors_count(tmp_path: Path) -> None:
    workload = workload_of(tmp_path)
    records = [record(0, 512, 0, 0, 512), record(1, 768, 0, 0, 0, error="HTTP 503: no backend")]
    s = summarize(ReplayResult(1, 1.0, records, {}, {"router": {}}), workload, ReplayOptions())
    assert (s["errors"], s["turns_ok"], s["prompt_tokens"], s["first_error"]) == (1, 1, 512, "HTTP 503: no backend")
    assert [m.split(" (")[0] for m in s["missing"]] == [
        "restore and save bytes per stage", "decode KV use and queue wait", "pool occupancy and evictions"]
    line = json.dumps(json_safe(s), allow_nan=False)  # NaN (no restore, no sampling) became null
    assert json.loads(line)["restore_wait_mean_s"] is None
    assert "first error: HTTP 503" in format_table([s], workload)


def test_histogram_quantile_interpolates_within_the_bucket_as_prometheus_does() -> None:
    from kvpool.tools.replay.probes import buckets, histogram_quantile

    # 10 observations: 4 in (0, 0.1], 4 in (0.1, 0.5], 2 above 5 (+Inf)
    scraped = {'h_bucket{le="0.1"}': 4.0, 'h_bucket{le="0.5"}': 8.0, 'h_bucket{le="5.0"}': 8.0,
               'h_bucket{le="+Inf"}': 10.0, "h_sum": 30.0, "h_count": 10.0, 'other_bucket{le="0.1"}': 99.0}
    cumulative = buckets(scraped, "h")
    assert cumulative == {0.1: 4.0, 0.5: 8.0, 5.0: 8.0, math.inf: 10.0}
    assert histogram_quantile(0.2, cumulative) == 0.05  # rank 2 of 4 in [0, 0.1]
    assert histogram_quantile(0.5, cumulative) == 0.1 + 0.4 * (5 - 4) / 4  # rank 5: first of (0.1, 0.5]
    assert histogram_quantile(0.99, cumulative) == 5.0  # in +Inf: the highest finite bound
    assert math.isnan(histogram_quantile(0.5, {0.1: 0.0, math.inf: 0.0}))
    # two label sets of one histogram add up bucket by bucket
    assert buckets({'h_bucket{stage="0",le="1.0"}': 1.0, 'h_bucket{stage="1",le="1.0"}': 2.0}, "h") == {1.0: 3.0}


def test_wait_percentiles_come_from_every_stage_s_buckets(tmp_path: Path) -> None:
    workload = workload_of(tmp_path)
    records = [record(0, 512, 0, 0, 512), record(1, 768, 0, 256, 512)]

    def stage(le_01: float, le_1: float) -> dict[str, float]:
        return {'kvpool_prefill_restore_wait_seconds_bucket{le="0.1"}': le_01,
                'kvpool_prefill_restore_wait_seconds_bucket{le="1.0"}': le_1,
                'kvpool_prefill_restore_wait_seconds_bucket{le="+Inf"}': le_1}

    before = {"p0-stage0": stage(1.0, 1.0)}  # one restore before the run: not counted
    after = {"p0-stage0": stage(3.0, 4.0), "p1-stage0": stage(1.0, 2.0),
             "router": {'kvpool_router_queue_seconds_bucket{le="0.0"}': 5.0,
                        'kvpool_router_queue_seconds_bucket{le="2.0"}': 10.0,
                        'kvpool_router_queue_seconds_bucket{le="+Inf"}': 10.0}}
    result = ReplayResult(1, 2.0, records, before, after, None, [])
    s = summarize(result, workload, ReplayOptions(think_scale=0.0))
    # moved: p0 2 in [0, 0.1] and 1 in (0.1, 1]; p1 1 and 1: together 3 and 2 of 5
    assert s["restore_wait_p50_s"] == 0.1 * 2.5 / 3
    assert s["restore_wait_p99_s"] == 0.1 + 0.9 * (4.95 - 3) / 2
    assert s["router_queue_wait_p50_s"] == 0.0  # half the requests waited nothing
    assert s["router_queue_wait_p99_s"] == 2.0 * (9.9 - 5) / 5
    assert math.isnan(s["prefill_queue_wait_p50_s"])  # no admission histogram scraped


def test_the_queues_pops_that_aging_the_budget_or_the_backlog_decided_are_counted_over_the_run(tmp_path: Path) -> None:
    workload = workload_of(tmp_path)
    records = [record(0, 512, 0, 0, 512)]

    def gate(aging: float, budget: float, backlog: float = 0.0) -> dict[str, float]:
        return {'kvpool_prefill_gate_pops_total{decided_by="aging"}': aging,
                'kvpool_prefill_gate_pops_total{decided_by="budget"}': budget,
                'kvpool_prefill_gate_pops_total{decided_by="backlog"}': backlog}

    before = {"p0-stage0": gate(1.0, 2.0, 5.0), "router": {"kvpool_router_queue_overdue_total": 4.0,
                                                            "kvpool_router_queue_backlog_total": 1.0}}
    after = {"p0-stage0": gate(3.0, 7.0, 9.0), "p1-stage0": gate(0.0, 1.0, 2.0),
             "router": {"kvpool_router_queue_overdue_total": 10.0, "kvpool_router_queue_budget_total": 2.0,
                        "kvpool_router_queue_backlog_total": 4.0}}
    s = summarize(ReplayResult(1, 2.0, records, before, after, None, []), workload, ReplayOptions(think_scale=0.0))
    # the run's own: p0 2 by aging and 5 by the budget, p1 1 by the budget; the router 6 and 2
    assert (s["prefill_gate_pops_aging"], s["prefill_gate_pops_budget"]) == (2, 6)
    assert (s["router_queue_pops_aging"], s["router_queue_pops_budget"]) == (6, 2)
    assert (s["prefill_gate_pops_backlog"], s["router_queue_pops_backlog"]) == (6, 3)  # p0 4 and p1 2; 3
    fifo = summarize(ReplayResult(1, 2.0, records, {}, {"p0-stage0": {}, "router": {}}, None, []), workload,
                     ReplayOptions(think_scale=0.0))
    assert (fifo["prefill_gate_pops_aging"], fifo["router_queue_pops_budget"], fifo["prefill_gate_pops_backlog"],
            fifo["router_queue_pops_backlog"]) == (0, 0, 0, 0)  # no gate, no series


def test_pool_bytes_are_summed_by_path_and_direction_over_the_stages(tmp_path: Path) -> None:
    workload = workload_of(tmp_path)
    records = [record(0, 512, 0, 0, 512)]
    memory_read = 'kvpool_prefill_pool_bytes_total{direction="read",path="memory"}'
    engine_read = 'kvpool_prefill_pool_bytes_total{direction="read",path="engine"}'
    engine_write = 'kvpool_prefill_pool_bytes_total{direction="write",path="engine"}'
    before = {"p0-stage0": {memory_read: 10.0}, "p1-stage0": {engine_read: 5.0}}
    after = {"p0-stage0": {memory_read: 110.0, engine_write: 7.0}, "p1-stage0": {engine_read: 45.0},
             "decode0": {}}
    result = ReplayResult(1, 1.0, records, before, after, {}, [])
    s = summarize(result, workload, ReplayOptions(think_scale=0.0))
    assert s["pool_bytes_by_path"] == {"memory_read": 100, "memory_write": 0, "engine_read": 40, "engine_write": 7}
