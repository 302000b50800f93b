"""``kvpool replay --chaos`` end to end, small: three store faults on a supervised cluster (kill, slow, corrupt;
the master, stage and decode-shard kills are test_operations' and test_router_faults'), the JSON's shape, and
no answer that differs from the clean run's (the full run with every fault is in docs/benchmarks.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.cluster

TRACES = Path(__file__).resolve().parents[2] / ".." / "shared" / "traces" / "agentx-weka"


@pytest.mark.skipif(not TRACES.is_dir(), reason="needs ../shared/traces")
def test_chaos_run_kills_slows_and_corrupts_stores_without_a_wrong_answer(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "kvpool.services.cli", "replay", str(TRACES / "trace_0001.json"),
               "--chaos", "kill:store0@2s,slow:store1=200ms@3s,corrupt:store1@4s", "--sessions", "1", "--concurrency", "1",
               "--scale", "128", "--max-tokens", "4", "--think-scale", "0", "--duration", "8",
               "--pipelines", "1", "--stages", "1", "--decode-shards", "1", "--segment-size", "32MiB",
               "--device-cache-tokens", "4096", "--workdir", str(tmp_path), "--json"]
    out = subprocess.run(command, capture_output=True, text=True, timeout=300, env={**os.environ})
    assert out.returncode in (0, 1), out.stderr[-2000:]  # 1: a fault not recovered within a short run
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(report) >= {"wrong_outputs", "lost_silently", "failed", "faults", "recovered_all"}
    assert [f["fault"] for f in report["faults"]] == ["kill:store0@2s", "slow:store1=200ms@3s", "corrupt:store1@4s"]
    assert report["turns"] > 0 and report["clean_errors"] == 0
    assert report["wrong_outputs"] == 0 and report["lost_silently"] == 0, report
    for fault in report["faults"]:
        assert set(fault) >= {"failed", "statuses", "lost_silently", "wrong_outputs", "reuse_lost_tokens",
                              "recovered_s"}


def test_a_bad_spec_exits_2_naming_its_part_before_anything_starts() -> None:
    out = subprocess.run([sys.executable, "-m", "kvpool.services.cli", "replay", "--chaos", "kill:store0@30s,boom@1s"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "'boom@1s': no kind" in out.stderr
