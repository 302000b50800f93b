"""``kvpool up --master-standbys 1``: the demo served under --secure (etcd over mutual TLS), and a replay
through the leader's kill -9 (every turn with the clean run's answer). Whole clusters of processes; the parts
are test_master_standby.py's."""

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
def test_the_leader_killed_mid_replay_every_turn_completes_with_the_right_answer(tmp_path: Path) -> None:
    # kvpool up --master-standbys 1 under a replay; the first candidate (the leader) killed with -9 mid-run
    command = [sys.executable, "-m", "kvpool.services.cli", "replay", str(TRACES / "trace_0001.json"),
               "--chaos", "kill:master@2s", "--master-standbys", "1", "--sessions", "1", "--concurrency", "1",
               "--scale", "128", "--max-tokens", "4", "--think-scale", "0", "--duration", "6",
               "--pipelines", "1", "--stages", "1", "--decode-shards", "1", "--segment-size", "32MiB",
               "--device-cache-tokens", "4096", "--workdir", str(tmp_path), "--json"]
    out = subprocess.run(command, capture_output=True, text=True, timeout=300, env={**os.environ})
    assert out.returncode in (0, 1), out.stderr[-2000:]  # 1: a fault not recovered within a short run
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert [f["fault"] for f in report["faults"]] == ["kill:master@2s"]
    assert report["turns"] > 0 and report["clean_errors"] == 0
    # every turn completed, each with the clean run's answer: requests waited or computed, none failed
    assert report["failed"] == 0 and report["wrong_outputs"] == 0 and report["lost_silently"] == 0, report
    # a new leader took over (the standby, or the killed one back first): the stores re-mounted to it
    logs = [p.read_text() for p in (tmp_path / "chaos").glob("store*.log")]
    assert logs and all('"master_restarted_remounted"' in text for text in logs)


def test_kvpool_up_secure_with_a_standby_runs_etcd_over_mutual_tls(tmp_path: Path) -> None:
    workdir = tmp_path / "up"
    result = subprocess.run(
        [sys.executable, "-m", "kvpool.services.cli", "up", "--log-level", "info", "--secure", "--master-standbys", "1",
         "--demo", "--trace", "synthetic", "--turns", "2", "--http-port", "0", "--grpc-port", "0",
         "--segment-size", "64MiB", "--workdir", str(workdir)],
        capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "master-standby1" in result.stdout  # both candidates listed among the processes
    rows = [line.split() for line in result.stdout.splitlines() if line.strip().startswith("synthetic-")]
    assert len(rows) == 4 and all(int(r[4]) > 0 for r in rows if int(r[1]) == 1), result.stdout  # pool hits
    # stage 0 found the leader as it started, not with its first request (whose lookup would have missed)
    (stage0,) = [t for t in (p.read_text() for p in workdir.rglob("*.log")) if '"prefill_admitted"' in t]
    assert 0 <= stage0.find('"pool_master_leader_reached"') < stage0.find('"prefill_admitted"')
    etcd_log = (workdir / "etcd" / "etcd.log").read_text()
    # clients over TLS only, each with a certificate of the cluster's CA (the masters' and stores' own)
    assert '"listen-client-urls":["https://' in etcd_log and "client-cert-auth = true" in etcd_log
    assert (workdir / "certs" / "etcd.pem").exists()
