"""A peer's client against ``kvpool up``: NVIDIA's aiperf, multi-turn streaming chat (opt-in).

Runs only with ``KVPOOL_AIPERF_TESTS=1``; ``KVPOOL_AIPERF`` names the aiperf
executable (default: ``aiperf`` on PATH; it lives best in its own venv, see
docs/benchmarks.md). The client's tokenizer is the byte-level one the
built-in models use, written as a Hugging Face directory.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpool.tools.byte_tokenizer_dir import write_byte_tokenizer
from kvpool.tools.cluster import Cluster
from kvpool.tools.up import UpSettings, up_cluster

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.skipif(os.environ.get("KVPOOL_AIPERF_TESTS") != "1", reason="opt-in: KVPOOL_AIPERF_TESTS=1"),
]

AIPERF = os.environ.get("KVPOOL_AIPERF", "aiperf")
REQUESTS = 12


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    up = up_cluster(UpSettings(stages=1, stores=0, http_port=0, grpc_port=0,
                               workdir=str(tmp_path_factory.mktemp("aiperf")))).start()
    try:
        yield up
    finally:
        up.stop()


@pytest.mark.timeout(900)
def test_aiperf_multi_turn_chat_runs_clean_and_sees_the_cache(cluster: Cluster, tmp_path: Path) -> None:
    if shutil.which(AIPERF) is None:
        pytest.fail(f"KVPOOL_AIPERF_TESTS=1 but no aiperf executable at {AIPERF!r} (set KVPOOL_AIPERF)")
    tokenizer = write_byte_tokenizer(tmp_path / "tokenizer")
    out = tmp_path / "out"
    result = subprocess.run(
        [AIPERF, "profile", "--model", "tiny", "--url", cluster.http_url, "--endpoint-type", "chat", "--streaming",
         "--tokenizer", str(tokenizer), "--use-server-token-count", "--conversation-num", "4",
         "--conversation-turn-mean", "3", "--synthetic-input-tokens-mean", "800", "--output-tokens-mean", "16",
         "--concurrency", "2", "--request-count", str(REQUESTS), "--ui-type", "simple", "--artifact-dir", str(out)],
        capture_output=True, text=True, timeout=840, env={k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"},
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    figures = json.loads((out / "profile_export_aiperf.json").read_text())
    assert figures["error_summary"] == [] and figures["is_complete"]
    assert figures["request_count"]["avg"] == REQUESTS
    assert figures["output_sequence_length"]["avg"] >= 1
    assert figures["usage_prompt_cache_read_tokens"]["sum"] > 0  # later turns of each conversation hit the cache
