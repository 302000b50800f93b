"""``kvpool bench prefill`` at a tiny size, with the CLI's flags: the report's structural facts.

Real processes (a master, two stores, four stages; then four stages without the
pool) replay two real sessions × two turns. Nothing here depends on the
machine's speed: only facts that must hold in any run are asserted.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvpool.services import cli_parser
from kvpool.tools.bench import prefill_bench

TRACES = prefill_bench.default_traces_dir()

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(180)]
needs_traces = pytest.mark.skipif(not TRACES.is_dir(), reason=f"real weka traces not present at {TRACES}")

ARGS = ["bench", "prefill", "--json", "--sessions", "2", "--turns", "2", "--scale", "64", "--concurrency", "2",
        "--device-cache-tokens", "2048", "--traces", str(TRACES)]

KEYS = {
    "reuse_ratio", "trace_bound", "trace_block_bound", "device_share", "pool_share", "computed_share",
    "device_share_pool_off", "pool_share_pool_off", "computed_share_pool_off", "restore_p50_ms", "restore_p90_ms",
    "restore_wait_p50_ms", "throughput_tok_s_pool_on", "throughput_tok_s_pool_off", "speedup",
    "ttft_p50_ms_pool_on", "ttft_p90_ms_pool_on", "ttft_p50_ms_pool_off", "ttft_p90_ms_pool_off",
    "logits_max_abs_diff", "greedy_match", "num_pool_chunks_lost", "scale", "sessions", "turns",
    "device_cache_tokens", "concurrency", "reuse_target_met", "speedup_target_met",
}


@pytest.fixture(scope="module")
def report() -> dict[str, Any]:
    """One run of the benchmark as the CLI parses it; its last output line, parsed.

    In this process, without ``kvpool.services.cli.main``, so the test session's logging is left alone.
    """
    if not TRACES.is_dir():
        pytest.skip(f"real weka traces not present at {TRACES}")
    args = cli_parser.build_parser().parse_args(ARGS)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert prefill_bench.main(args) == 0
    lines = out.getvalue().strip().splitlines()
    assert "think time ignored" in out.getvalue()
    return json.loads(lines[-1])


def test_missing_traces_is_a_clear_error(tmp_path: Path) -> None:
    missing = tmp_path / "no-traces"
    command = [sys.executable, "-m", "kvpool.services.cli", "bench", "prefill", "--quick", "--traces", str(missing)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert f"traces directory {missing} not found" in done.stderr
    assert "Traceback" not in done.stderr


@needs_traces
def test_report_has_every_key_and_the_settings(report: dict[str, Any]) -> None:
    assert KEYS <= report.keys()
    assert (report["scale"], report["sessions"], report["turns"], report["device_cache_tokens"],
            report["concurrency"]) == (64, 2, 2, 2048, 2)
    assert report["num_turns"] + report["num_turns_skipped"] == 2 * 2


@needs_traces
def test_shares_sum_to_one_and_pool_off_uses_no_pool(report: dict[str, Any]) -> None:
    for suffix in ("", "_pool_off"):
        parts = [report[f"{name}_share{suffix}"] for name in ("device", "pool", "computed")]
        assert all(0.0 <= p <= 1.0 for p in parts)
        assert math.isclose(sum(parts), 1.0, abs_tol=1e-9)
    assert report["pool_share_pool_off"] == 0


@needs_traces
def test_reuse_never_beats_the_unlimited_cache(report: dict[str, Any]) -> None:
    assert report["reuse_ratio"] <= report["trace_bound"] + 1e-9
    assert 0.0 <= report["trace_bound"] <= 1.0
    assert 0.0 <= report["trace_block_bound"] <= 1.0
    assert report["reuse_ratio"] == pytest.approx(1.0 - report["computed_share"], abs=1e-12)


@needs_traces
def test_restored_output_equals_computing_from_scratch(report: dict[str, Any]) -> None:
    assert report["logits_checked_turns"] == report["sessions"]
    assert report["logits_max_abs_diff"] <= 1e-4
    assert report["greedy_match"] is True


@needs_traces
def test_throughput_and_latency_are_measured(report: dict[str, Any]) -> None:
    assert report["throughput_tok_s_pool_on"] > 0
    assert report["throughput_tok_s_pool_off"] > 0
    assert report["speedup"] == pytest.approx(
        report["throughput_tok_s_pool_on"] / report["throughput_tok_s_pool_off"], rel=1e-9)
    for mode in ("pool_on", "pool_off"):
        assert 0 < report[f"ttft_p50_ms_{mode}"] <= report[f"ttft_p90_ms_{mode}"]
    assert report["num_pool_chunks_lost"] >= 0
