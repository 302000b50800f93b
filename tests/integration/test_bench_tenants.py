"""``kvpool bench tenants --json`` through the CLI, small (one short flood prompt, a few turns): both sides run,
every key is there, nothing failed. The ratios depend on the machine, so they are only checked to be measured."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(400)]

ROOT = Path(__file__).resolve().parents[2]
KEYS = {"victim_ttft_p50_over_alone", "victim_ttft_p99_over_alone", "victim_ttft_p50_over_alone_fifo",
        "victim_ttft_p99_over_alone_fifo", "fair_p50_gain_over_fifo", "flooder_throughput_over_alone",
        "flooder_throughput_over_alone_fifo", "errors"}


def test_bench_tenants_small(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvpool.services.cli", "bench", "tenants", "--flood-prompts", "1", "--flood-tokens",
         "2048", "--victim-turns", "3", "--victim-rate", "4", "--victim-delay-s", "0.1", "--workdir",
         str(tmp_path), "--json"],
        cwd=ROOT, capture_output=True, text=True, timeout=380, check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert KEYS <= set(report), KEYS - set(report)
    assert report["errors"] == 0
    for key in KEYS - {"errors"}:
        assert report[key] > 0, key
    for side in ("fair", "fifo"):
        got = report["sides"][side]
        assert got["victim_alone"]["turns"] == 3 and got["victim_flood"]["turns"] >= 1
        # one round of the flood alone, then one with the victim's turns during it
        assert got["flooder_alone"]["prompts_done"] == 1 and got["flood"]["prompts_done"] == 1
    # the FIFO side ran with tenant_fair = false in its settings file
    assert "tenant_fair = false" in (tmp_path / "fifo.toml").read_text()
