"""Each service refuses to start, naming its settings, when they need more memory than the host has available."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.cluster

HUGE = "100TiB"


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["store", "--segment-size", HUGE, "--port", "0", "--admin-port", "0", "--master", "127.0.0.1:1"],
         ["kvpool store:", "segment_size 100.0 TiB"]),
        (["decode", "--kv-bytes", HUGE, "--port", "0", "--admin-port", "0"],
         ["kvpool decode:", "kv_bytes", "region_arena_bytes 64 MiB", "lower kv_bytes or region_arena_bytes"]),
        (["prefill", "--num-stages", "1", "--no-pool", "--device-cache-tokens", str(10**11), "--port", "0",
          "--admin-port", "0"], ["kvpool prefill stage 0:", "device_cache_tokens"]),
    ],
)
def test_a_service_whose_memory_cannot_fit_refuses_to_start_naming_the_settings(args: list[str],
                                                                                 named: list[str]) -> None:
    result = subprocess.run([sys.executable, "-m", "kvpool.services.cli", *args], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode != 0
    assert "exceeds the" in result.stderr and "this host has available" in result.stderr, result.stderr[-2000:]
    for text in named:
        assert text in result.stderr, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
