"""``kvpool replay``: real coding-agent sessions through a whole cluster's OpenAI-compatible HTTP API.

The API, for a router someone else started (or a ``--compare`` side later)::

    workload = load_workload(path, scale=16, vocab_size=1024, context=32768, max_tokens=64, sessions=4)
    check_device_cache(workload, device_cache_tokens=16384, chunk_size=256)   # raises DeviceCacheTooSmall
    result = await run_replay(url, workload, ReplayOptions(concurrency=8, think_scale=0.0), probes)
    result.summary            # flat dict: reuse_ratio, trace_bound, prompt_tok_s, ttft_p50_s, errors, ...
    result.records            # one TurnRecord per request, in issue order

Modules: ``workload`` (weka sessions as agent timelines, Mooncake JSONL as an
arrival stream, token scale, skipped turns, the device-cache check),
``schedule`` (pure: when each request is due), ``engine`` (the async HTTP
client and closed loop), ``probes`` (metrics and pool stats), ``report``
(summary, table, JSON), ``plot`` (PNG charts).
"""

from __future__ import annotations

from kvpool.tools.replay.engine import run_replay
from kvpool.tools.replay.probes import ClusterProbes
from kvpool.tools.replay.records import ReplayOptions, ReplayResult, TurnRecord
from kvpool.tools.replay.workload import (
    DeviceCacheTooSmall,
    ReplaySession,
    ReplayTurn,
    ReplayWorkload,
    check_device_cache,
    load_workload,
)

__all__ = [
    "ClusterProbes",
    "DeviceCacheTooSmall",
    "ReplayOptions",
    "ReplayResult",
    "ReplaySession",
    "ReplayTurn",
    "ReplayWorkload",
    "TurnRecord",
    "check_device_cache",
    "load_workload",
    "run_replay",
]
