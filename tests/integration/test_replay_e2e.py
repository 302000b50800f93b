"""``kvpool replay`` end to end on a real small cluster: exact device / pool / computed counts, and the CLI's JSON line.

The hand-made trace (256-token blocks at scale 1, so one trace block is one
chunk; every prompt ends in a 10-token tail without an id) against 1 pipeline
of 2 stages whose device cache holds 8 chunks, 2 stores, 1 decode shard;
concurrency 1, no think time, so the counts follow from the trace alone (a
prompt that needs blocks still held by a save waits for them, it never fails
or takes others):

    turn 0  [1,2]+tail        522: all computed
    turn 1  [1,2,3]+tail      778: chunks 1,2 still on the device (512), 266 computed
    turn 2  [10..16]+tail    1802: 8 blocks, the whole device cache: chunks 1-3 leave the device
    turn 3  [1,2,3,4]+tail   1034: chunks 1,2,3 only in the pool (768), 266 computed
    turn 4  [1,2,3,4,5]+tail 1290: chunks 1-4 on the device again (1024), 266 computed
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvpool.tools.replay import ClusterProbes, ReplayOptions, check_device_cache, load_workload, run_replay
from kvpool.tools.cluster import Cluster
from kvpool.tools.up import UpSettings, up_cluster

pytestmark = pytest.mark.cluster

ROOT = Path(__file__).resolve().parents[2]
DEVICE_CACHE_TOKENS = 2048
EXPECTED = [(0, 0, 522), (512, 0, 266), (0, 0, 1802), (0, 768, 266), (1024, 0, 266)]  # (device, pool, computed)


def write_trace(path: Path) -> Path:
    def request(t: float, ids: list[int]) -> dict[str, Any]:
        return {"t": t, "in": 256 * len(ids) + 10, "out": 4, "hash_ids": ids, "think_time": 0.5}

    doc = {"id": "handmade", "block_size": 256, "hash_id_scope": "local", "tool_tokens": 0, "system_tokens": 0,
           "requests": [request(0, [1, 2]), request(1, [1, 2, 3]), request(2, list(range(10, 17))),
                        request(3, [1, 2, 3, 4]), request(4, [1, 2, 3, 4, 5])]}
    path.write_text(json.dumps(doc))
    return path


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    settings = UpSettings(http_port=0, grpc_port=0, stages=2, stores=2, segment_size="32MiB",
                          device_cache_tokens=DEVICE_CACHE_TOKENS, workdir=str(tmp_path / "cluster"))
    started = up_cluster(settings).start()
    try:
        yield started
    finally:
        started.stop()


def probes_of(cluster: Cluster) -> ClusterProbes:
    root = {p.name: f"http://127.0.0.1:{p.ready['admin_port']}" for p in cluster.services}
    return ClusterProbes(router=root["router"], stages={n: r for n, r in root.items() if "-stage" in n},
                         decode={"decode0": root["decode0"]}, master=f"127.0.0.1:{cluster.find('master').ready['port']}")


def test_replay_of_a_hand_made_trace_counts_device_pool_and_computed_exactly(cluster: Cluster,
                                                                            tmp_path: Path) -> None:
    workload = load_workload(write_trace(tmp_path / "handmade.json"), scale=1, vocab_size=1024, context=32768,
                             max_tokens=4)
    check_device_cache(workload, DEVICE_CACHE_TOKENS, 256)
    options = ReplayOptions(concurrency=1, think_scale=0.0)
    result = asyncio.run(run_replay(cluster.http_url, workload, options, probes_of(cluster)))
    assert [r.error for r in result.records] == [None] * 5
    assert [(r.turn, r.prompt_tokens) for r in result.records] == [(0, 522), (1, 778), (2, 1802), (3, 1034),
                                                                  (4, 1290)]
    assert [(r.device_tokens, r.pool_tokens, r.computed_tokens) for r in result.records] == EXPECTED
    assert all(r.completion_tokens >= 1 and r.ttft_s > 0 for r in result.records)
    s = result.summary
    assert (s["device_tokens"], s["pool_tokens"], s["computed_tokens"], s["errors"]) == (1536, 768, 3122, 0)
    # the unlimited cache reaches what the pool did here: every chunk seen before was served
    assert s["reuse_ratio"] == s["trace_bound"] == s["trace_block_bound"] == (1536 + 768) / 5426
    # 3 chunks of 4 layers x (64 + 32) float32 entries restored on each of the two stages
    assert s["restore_bytes_per_stage"] == {"p0-stage0": 3 * 256 * 4 * 96 * 4, "p0-stage1": 3 * 256 * 4 * 96 * 4}
    assert s["pool_num_complete_groups"] == 12  # chunks 1-5 and 10-16, one group each
    assert s["pool_evicted_groups"] == 0
    assert not any("reached" in m for m in s["missing"])  # every stage, the shard and the master answered


def test_the_command_starts_its_cluster_and_ends_with_one_json_line(tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "handmade.json")
    proc = subprocess.run(
        [sys.executable, "-m", "kvpool.services.cli", "replay", str(trace), "--scale", "1", "--think-scale", "0",
         "--concurrency", "1", "--stages", "2", "--stores", "2", "--segment-size", "32MiB",
         "--device-cache-tokens", str(DEVICE_CACHE_TOKENS), "--max-tokens", "4", "--decode-pages", "512",
         "--json", "--plot", str(tmp_path / "plots")],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    last = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (last["device_tokens"], last["pool_tokens"], last["computed_tokens"]) == (1536, 768, 3122)
    assert (last["errors"], last["skipped_turns"], last["turns_ok"]) == (0, 0, 5)
    for key in ("reuse_ratio", "trace_bound", "trace_block_bound", "prompt_tok_s", "output_tok_s", "device_share",
                "pool_share", "computed_share", "ttft_p50_s", "ttft_p99_s"):
        assert isinstance(last[key], float), key
    assert last["device_share"] + last["pool_share"] + last["computed_share"] == pytest.approx(1.0)
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == ["shares_c1.png", "throughput.png", "ttft.png"]


def test_the_command_refuses_a_device_cache_smaller_than_the_longest_turn(tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "handmade.json")
    proc = subprocess.run(
        [sys.executable, "-m", "kvpool.services.cli", "replay", str(trace), "--scale", "1", "--device-cache-tokens", "1024"],
        cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert "the longest turn is 1,802 tokens at --scale 1" in proc.stderr
    assert "--device-cache-tokens 1,024" in proc.stderr
