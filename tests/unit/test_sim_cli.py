"""``kvpool simulate --quick --json``: the last line is one JSON object with the seed's comparisons."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TRACES = ROOT.parent / "shared" / "traces" / "agentx-weka"


@pytest.mark.skipif(not TRACES.is_dir(), reason="needs ../shared/traces/agentx-weka")
def test_quick_json_line_has_the_keys() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "services.cli", "simulate", "--quick", "--json", "--traces", str(TRACES),
         "--only", "seed-shared-16,seed-split-16", "--jobs", "1"],
        capture_output=True, text=True, cwd=ROOT, timeout=240,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert "tok/s/GPU" in lines[0]  # the table first
    final = json.loads(lines[-1])
    assert set(final["shared_over_split"]) == {"16"} and final["shared_over_split"]["16"] > 0
    assert final["sessions_per_server"] == 16
    for key in ("reuse_ratio", "trace_bound", "pool_share", "device_share", "computed_share"):
        assert 0.0 <= final[key] <= 1.0, key
    # device + pool + computed is every prompt token
    assert final["device_share"] + final["pool_share"] + final["computed_share"] == pytest.approx(1.0)
    # reuse can never pass what an unlimited cache would reach on the same turns
    assert final["reuse_ratio"] <= final["trace_bound"] + 1e-9
    assert final["sim_speed"] > 0


def test_only_with_no_match_fails_naming_the_flag() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "services.cli", "simulate", "--quick", "--json", "--traces", str(ROOT),
         "--only", "nothing"], capture_output=True, text=True, cwd=ROOT, timeout=60,
    )
    assert result.returncode != 0
    assert "--only matched no run" in result.stderr
