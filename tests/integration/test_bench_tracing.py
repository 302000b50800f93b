"""``kvpool bench tracing`` in small: a master per mode, and every traced call reaches its exporter, one span
each, whether written to the file or sent to the collector (flushed when the master stops)."""

from __future__ import annotations

import argparse

import pytest

from kvpool.tools.bench.tracing_bench import MODES, run

pytestmark = pytest.mark.cluster


def test_every_traced_call_reaches_the_file_and_the_collector() -> None:
    report = run(argparse.Namespace(calls=20, rounds=1, quick=True, json=True))
    # the master's spans: a warm-up lookup, release and Exists, then 20 Exists and 20 lookups with releases
    assert report["file_spans"] == report["otlp_spans_received"] == 3 + 20 + 40
    for mode in MODES:  # the master's CPU is read in clock ticks: 20 calls may round to none
        assert report[f"unary_client_cpu_ms_{mode}"] > 0 and report[f"session_client_cpu_ms_{mode}"] > 0
        assert report[f"unary_master_cpu_ms_{mode}"] >= 0 and report[f"session_master_cpu_ms_{mode}"] >= 0
    assert {"unary_extra_cpu_ms_file", "session_extra_cpu_ms_otlp"} <= set(report)
