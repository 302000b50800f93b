"""A peer's client against ``kvpool up``: NVIDIA's aiperf, multi-turn streaming chat and a mooncake trace (opt-in).

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
from typing import Any

import pytest

from kvpool.tools.byte_tokenizer_dir import HUB_NAME, write_byte_tokenizer, write_hub_cache_entry
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


def aiperf(cluster: Cluster, tmp_path: Path, tokenizer: str, *flags: str, env: dict[str, str]) -> dict[str, Any]:
    """Run ``aiperf profile`` against the cluster with the byte-level tokenizer; its figures (JSON export)."""
    if shutil.which(AIPERF) is None:
        pytest.fail(f"KVPOOL_AIPERF_TESTS=1 but no aiperf executable at {AIPERF!r} (set KVPOOL_AIPERF)")
    out = tmp_path / "out"
    result = subprocess.run(
        [AIPERF, "profile", "--model", "tiny", "--url", cluster.http_url, "--endpoint-type", "chat", "--streaming",
         "--tokenizer", tokenizer, "--use-server-token-count", *flags, "--ui-type", "simple",
         "--artifact-dir", str(out)],
        capture_output=True, text=True, timeout=840, env=env,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    figures: dict[str, Any] = json.loads((out / "profile_export_aiperf.json").read_text())
    assert figures["error_summary"] == [] and figures["is_complete"]
    return figures


@pytest.mark.timeout(900)
def test_aiperf_multi_turn_chat_runs_clean_and_sees_the_cache(cluster: Cluster, tmp_path: Path) -> None:
    tokenizer = str(write_byte_tokenizer(tmp_path / "tokenizer"))
    figures = aiperf(cluster, tmp_path, tokenizer, "--conversation-num", "4", "--conversation-turn-mean", "3",
                     "--synthetic-input-tokens-mean", "800", "--output-tokens-mean", "16", "--concurrency", "2",
                     "--request-count", str(REQUESTS),
                     env={k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"})
    assert figures["request_count"]["avg"] == REQUESTS
    assert figures["output_sequence_length"]["avg"] >= 1
    assert figures["usage_prompt_cache_read_tokens"]["sum"] > 0  # later turns of each conversation hit the cache


def write_mooncake_trace(path: Path) -> Path:
    """Two sessions, six requests each, 300 ms apart: each request resends its session's 64-token blocks
    (``hash_ids``) and adds one, as the Mooncake traces record an agent's growing context. Twelve requests: aiperf
    decodes ten or more in worker processes, the path that needs the tokenizer as a Hub cache entry."""
    rows = [{"timestamp": i * 300, "input_length": 64 * (4 + i // 2), "output_length": 4,
             "hash_ids": [i % 2 * 100 + k for k in range(4 + i // 2)]} for i in range(12)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.mark.timeout(900)
def test_aiperf_mooncake_trace_with_the_tokenizer_as_a_hub_cache_entry_runs_clean_and_sees_the_cache(
    cluster: Cluster, tmp_path: Path
) -> None:
    """aiperf's decode workers force HF_HUB_OFFLINE=1 and then read any tokenizer name as a Hub cache entry (a
    directory path fails there), so the tokenizer is one: ``kvpool/byte-tokenizer`` in a cache under HF_HOME."""
    write_hub_cache_entry(tmp_path / "hf")
    trace = write_mooncake_trace(tmp_path / "trace.jsonl")
    figures = aiperf(cluster, tmp_path, HUB_NAME, "--input-file", str(trace), "--custom-dataset-type",
                     "mooncake_trace", "--isl-block-size", "64",
                     env={**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"})
    assert figures["request_count"]["avg"] == 12
    # the trace's lengths, each plus the chat template's 4 tokens
    assert figures["usage_prompt_tokens"]["sum"] == 12 * 4 + 64 * 2 * (4 + 5 + 6 + 7 + 8 + 9) == 5040
    # a revisit reuses whole 256-token chunks of its session's previous prompt: 1, 1, 1, 1, then 2 per session
    assert 0 < figures["usage_prompt_cache_read_tokens"]["sum"] <= 2 * 256 * (1 + 1 + 1 + 1 + 2)
