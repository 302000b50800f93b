"""``kvpool bench prefill``: replay real coding-agent sessions through the prefill pipeline.

One run on one host. The first ``--sessions`` weka traces, their first
``--turns`` turns each, become token ids at ``--scale`` (deterministic, see
``kvpool.workload.tokens``). They are replayed as a closed loop of
``--concurrency`` concurrent sessions (each session's turns in order, the next
turn sent as soon as the previous answered; think time is ignored) twice, on
fresh clusters each time:

- pool on: a master, two stores and a four-stage pipeline saving to and
  restoring from the pool;
- pool off: the same pipeline with ``--no-pool`` (device cache only).

The device cache is smaller than the sessions' working set, so the device
alone cannot keep every history. Reported next to each other: prompt-token
reuse and the bounds an unlimited cache would reach, the share of prompt
tokens served by device / pool / compute, restore times, TTFT, prompt
throughput, and the logits of each session's last turn (pool on) against a
from-scratch computation in this process. Every number is measured in this run.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from kvpool.tools.bench.prefill_replay import run_pool_off, run_pool_on
from kvpool.tools.bench.prefill_report import format_report, json_safe, summarize
from kvpool.tools.bench.prefill_workload import (
    BenchSettings,
    TracesMissing,
    Workload,
    build_workload,
    default_traces_dir,
    settings_from_args,
)
from kvpool.tools.cluster import ServiceFailed

__all__ = ["BenchSettings", "TracesMissing", "default_traces_dir", "main", "run", "settings_from_args"]


def run(settings: BenchSettings, workdir: Path | None = None) -> tuple[dict[str, Any], Workload]:
    """Both passes on fresh clusters; returns the summary and the workload."""
    workload = build_workload(settings)
    if not workload.prompts:
        raise ValueError("no turn fits the device cache and the model's context; raise --device-cache-tokens "
                         "or --scale")
    with tempfile.TemporaryDirectory(prefix="kvpool-bench-prefill-") as tmp:
        base = workdir or Path(tmp)
        on = run_pool_on(workload, settings, base)
        off = run_pool_off(workload, settings, base)
    return summarize(workload, settings, on, off), workload


def main(args: argparse.Namespace) -> int:
    """``kvpool bench prefill``: print the summary; with ``--json`` the last line is one JSON object."""
    started = time.monotonic()
    try:
        settings = settings_from_args(args)
        summary, workload = run(settings)
    except (TracesMissing, ValueError, ServiceFailed) as exc:
        raise SystemExit(f"kvpool bench prefill: {exc}") from None
    summary["wall_s"] = time.monotonic() - started
    print(format_report(summary, workload))
    if args.json:
        print(json.dumps(json_safe(summary)))
    return 0
