"""``kvpool up`` states its memory budget from the settings every child will read."""

from __future__ import annotations

from pathlib import Path

from kvpool.tools.up import UpSettings
from services.memory_budget import memory_budget

MiB = 1 << 20
PAGE = 16 * 8 * 96 * 4  # 16 tokens x 8 layers x 96 float32 values


def pages(kv_bytes: int) -> int:
    """Decode holds whole pages only."""
    return kv_bytes // PAGE * PAGE


def test_the_default_budget_by_role() -> None:
    # tiny, float32: 96 values x 4 bytes per token per layer; four stages of two layers each
    kv_per_stage = 32768 * 2 * 96 * 4
    # send and receive activations for the longest prompt; the handoff slab (its KV and the final logits)
    arenas_per_stage = 2 * (2 * 32768 * 256 * 4) + kv_per_stage + 1024 * 4
    assert memory_budget(UpSettings(), None) == {
        "pool segments": 2 * 512 * MiB,
        "prefill device caches": 4 * (kv_per_stage + arenas_per_stage),
        "decode pages and arenas": pages(256 * MiB) + 128 * MiB,
    }


def test_the_budget_follows_the_config_file_and_the_shape(tmp_path: Path) -> None:
    config = tmp_path / "cluster.toml"
    config.write_text('[decode]\nkv_bytes = "1GiB"\n[store]\nsegment_size = "2GiB"\n')
    budget = memory_budget(UpSettings(stores=3, decode_shards=2, segment_size="64MiB"), str(config))
    assert budget["pool segments"] == 3 * 64 * MiB  # up's flag wins over the file, as for the child
    assert budget["decode pages and arenas"] == 2 * (pages(1024 * MiB) + 128 * MiB)
    assert "pool segments" not in memory_budget(UpSettings(stores=0), None)
