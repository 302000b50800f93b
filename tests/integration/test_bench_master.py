"""``kvpool bench master --json`` through the CLI, small: every key at each count, and what holds in any run
(the populated pool fills to its watermark, lookups hit, saves evict meanwhile). CPU figures depend on the
machine, so they are reported and only checked to be measured."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvpool import index_order

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
KEYS = {
    "index_bytes_per_object", "call_floor_cpu_ms", "lookups_per_s", "saves_per_s", "lookup_ms_p50", "lookup_ms_p99",
    "lookup_cpu_ms", "lookup_cpu_ms_legacy", "lookup_cpu_ms_full_answer", "lookup_cpu_ms_by_ids", "save_cpu_ms",
    "save_cpu_ms_legacy", "turn_cpu_ms_by_ids",
    "turn_cpu_ms", "turn_cpu_ms_legacy", "turns_per_s_per_master", "session_floor_cpu_ms", "resident_objects",
    "lookup_hit_share", "lookups_measured", "evicted_groups_during_lookups", "saves_per_s_beside",
    "master_busy_lookups",
}


def test_bench_master_small() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvpool.services.cli", "bench", "master", "--objects", "8000", "--clients", "2",
         "--seconds", "0.5", "--cost-seconds", "0.4", "--lookups", "200",
         "--heartbeat-interval-s", "0.25", "--json"],
        cwd=ROOT, capture_output=True, text=True, timeout=280, check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    (at,) = report["scales"]
    assert at["objects"] == 8000
    assert KEYS <= set(at), KEYS - set(at)
    assert at["objects"] == 8000 and at["resident_objects"] >= 7200  # filled to the high watermark
    assert at["used_share"] <= 0.9
    # the order the measured master says it ran: this checkout's (built here too where it can be)
    assert at["index_order"] == report["index_order"] == ("c" if index_order.ensure()[0] else "python")
    # every measured lookup found its whole history; the saves beside them evicted
    why = {k: at.get(k) for k in ("cost_misses_found", "refresh_refused", "unsettled")}  # said when it fails
    assert at["lookup_hit_share"] == 1.0 and set(at["cost_hit_share"].values()) == {1.0}, why
    assert at["lookups_measured"] >= 200 and at["evicted_groups_during_lookups"] > 0
    for key in ("lookup_cpu_ms", "lookup_cpu_ms_full_answer", "lookup_cpu_ms_by_ids", "save_cpu_ms", "turn_cpu_ms",
                "turn_cpu_ms_by_ids", "call_floor_cpu_ms", "session_floor_cpu_ms", "lookups_per_s", "saves_per_s"):
        assert at[key] > 0, key
    assert set(report["targets"]) == {"lookup_cpu_ms", "save_cpu_ms", "turn_cpu_ms"}
    assert all(t["at"] == 8000 and t["value"] == at[key] for key, t in report["targets"].items())
