"""The comparison's own figures, exact: the flag, the regime, the default store size, what a kill cost.

No processes: these are the pure parts of ``kvpool.tools.replay.compare`` that the
end-to-end run in ``test_replay_topology.py`` relies on.
"""

from __future__ import annotations

import pytest

from kvpool.tools.replay.compare import (
    auto_segment_size,
    chunk_nbytes,
    fault_report,
    parse_compare,
    regime,
    working_set_bytes,
)
from kvpool.tools.replay.engine import ReplayResult, TurnRecord

MiB = 1 << 20


def test_parse_compare() -> None:
    # split: both baselines, sessions free to move and sessions kept on their home server
    assert parse_compare("pool=shared,split") == ("pool", ("shared", "split-moving", "split-strict"))
    assert parse_compare("pool=shared,split-strict") == ("pool", ("shared", "split-strict"))
    assert parse_compare("groups=on,off") == ("groups", ("on", "off"))
    assert parse_compare("locality=on,off") == ("locality", ("on", "off"))
    assert parse_compare("sched=fifo,session") == ("sched", ("fifo", "session"))
    for bad in ("pool=shared,shared", "pool=shared,both", "groups", "eviction=on,off", "pool=", "locality=on,on",
                "sched=fifo,lifo", "pool=shared,split,split-strict", "groups=on,split"):
        with pytest.raises(ValueError, match=r"expected pool=shared,split \(split: split-moving and split-strict\), "
                                             "groups=on,off, locality=on,off or sched=fifo,session"):
            parse_compare(bad)


def test_chunk_bytes_and_working_set_count_distinct_chunks() -> None:
    assert chunk_nbytes("tiny", "float32", 256) == 8 * 256 * 96 * 4
    assert chunk_nbytes("tiny", "float8_e4m3fn", 256) == 8 * 256 * 96
    a = list(range(600))  # 2 full chunks
    b = list(range(512)) + [7] * 256  # the same 2, then a third
    c = [1] + list(range(1, 300))  # a different first chunk: its own
    assert working_set_bytes([a, b, c, a], 256, 10) == 4 * 10


def test_default_store_size_puts_the_run_in_the_seeds_regime() -> None:
    working_set = 400 * MiB
    size = auto_segment_size(working_set, servers=2)
    assert size == 136 * MiB  # 1.15 × 400 MiB / (4 stores × 0.85), whole MiB up
    r = regime(working_set, size, servers=2)
    assert r["in_regime"] and not r["eviction_pressure"]
    assert r["split_pool_usable_bytes"] < r["per_server_bytes"] < r["working_set_bytes"] < r["shared_pool_usable_bytes"]
    assert "IN the seed's regime" in r["text"]
    small = regime(working_set, 32 * MiB, servers=2)
    assert not small["in_regime"] and small["eviction_pressure"]
    assert small["text"].endswith("NOT in the seed's regime; even the shared pool must evict")


def record(issued_at: float, prompt: int, reused: int, error: str | None = None, tokens: int = 2) -> TurnRecord:
    return TurnRecord("s", 0, None, 0, prompt, 2, issued_at=issued_at, completion_tokens=0 if error else tokens,
                      pool_tokens=reused, computed_tokens=prompt - reused, error=error)


def test_fault_report_counts_failed_answered_and_silently_lost() -> None:
    records = [
        record(1.0, 1000, 900),
        record(2.0, 1000, 700),
        record(9.0, 500, 0, error="HTTP 503: no backend"),  # in flight when the server went
        record(11.0, 1000, 250),
        record(12.0, 1000, 0, tokens=0),  # answered nothing and no error: lost silently
        record(13.0, 400, 0, error="RemoteProtocolError: closed"),
    ]
    report = fault_report(ReplayResult(4, 20.0, records), at_s=10.0)
    assert report["sent_after_kill"] == 3
    assert report["answered_after_kill"] == 1
    assert (report["failed_after_kill"], report["failed_in_flight_at_kill"]) == (1, 1)
    assert report["silently_lost"] == 1
    assert report["reuse_before_kill"] == pytest.approx(1600 / 2000)
    assert report["reuse_after_kill"] == pytest.approx(250 / 1000)
