"""kvpool bench decode runs end to end and its last line is the JSON the issue asks for."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.cluster


def test_bench_decode_json_line() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvpool.services.cli", "bench", "decode", "--json", "--concurrency", "1,16",
         "--prompt-tokens", "16", "--max-tokens", "4", "--repeats", "1"],
        capture_output=True, text=True, timeout=240, check=True,
    ).stdout
    summary = json.loads(out.strip().splitlines()[-1])
    assert set(summary["tok_s_by_concurrency"]) == {"1", "16"}
    assert summary["batching_gain"] == round(summary["tok_s_by_concurrency"]["16"] / summary["tok_s_by_concurrency"]["1"], 2)
    for run in summary["runs"]:
        assert run["tokens"] == run["concurrency"] * 4
        assert run["pages_used_after"] == 0  # every sequence freed its pages
        # 16 + 4 - 1 = 19 entries: 2 pages of 16 tokens per sequence, at most all at once
        assert run["pages_used_peak"] <= 2 * run["concurrency"]
