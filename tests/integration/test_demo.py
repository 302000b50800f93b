"""``kvpool up --demo`` on a fresh clone (the synthetic sessions): every revisit restores its history from the pool."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.cluster


def test_demo_interleaves_two_sessions_and_every_revisit_comes_from_the_pool(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "kvpool.services.cli", "up", "--demo", "--trace", "synthetic", "--turns", "2",
         "--http-port", "0", "--grpc-port", "0", "--segment-size", "64MiB", "--workdir", str(tmp_path)],
        capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    assert "kvpool up: memory budget" in out
    rows = [line.split() for line in out.splitlines() if line.strip().startswith("synthetic-")]
    # session, turn, prompt, device, pool, computed, out, TTFT ms: A1 B1 A2 B2
    assert [(r[0], int(r[1])) for r in rows] == [("synthetic-A", 0), ("synthetic-B", 0), ("synthetic-A", 1),
                                                  ("synthetic-B", 1)]
    for session, turn, prompt, device, pool, computed, *_ in rows:
        assert int(device) + int(pool) + int(computed) == int(prompt)
        if int(turn) == 0:
            assert int(computed) == int(prompt)  # a first visit computes everything
        else:
            assert int(pool) > 0, out  # the other session pushed this one's history off the device
    assert "the pool served" in out and "computing those tokens instead would have added about" in out
