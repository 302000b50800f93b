"""Settings from defaults, a TOML file and flags; byte sizes as people write them."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvpool.settings import load_settings
from kvpool.sizes import format_size, parse_size
from kvpool.services.master.settings import MasterSettings
from kvpool.services.prefill.settings import PrefillSettings
from kvpool.services.store.settings import StoreSettings


@pytest.mark.parametrize(
    ("text", "expected"),
    [("4096", 4096), ("512MiB", 512 << 20), ("2GiB", 2 << 30), ("1.5 KiB", 1536), ("3gb", 3_000_000_000), (7, 7)],
)
def test_parse_size(text: str | int, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "lots", "12 parsecs", "-1", "0", "0MiB"])
def test_parse_size_rejects_by_field(text: str) -> None:
    with pytest.raises(ValueError, match="^segment_size: "):
        parse_size(text, "segment_size")


def test_format_size() -> None:
    assert format_size(512) == "512 B"
    assert format_size(3 << 30) == "3.0 GiB"


def test_flags_win_over_file_over_defaults(tmp_path: Path) -> None:
    config = tmp_path / "cluster.toml"
    config.write_text('[master]\nhigh_watermark = 0.8\nlow_watermark = 0.7\nport = 1234\n[store]\nsegment-size = "2GiB"\n')
    master = load_settings(MasterSettings, "master", str(config), {"port": 4321, "lease_s": None})
    assert (master.high_watermark, master.low_watermark, master.port, master.lease_s) == (0.8, 0.7, 4321, 5.0)
    store = load_settings(StoreSettings, "store", str(config), {"numa_node": 1})
    assert store.segment_size == 2 << 30
    assert (store.port, store.admin_port) == (7611, 9611)  # per-node defaults


def test_unknown_key_and_missing_file_are_errors(tmp_path: Path) -> None:
    config = tmp_path / "cluster.toml"
    config.write_text("[master]\nhigh_watermrk = 0.8\n")
    with pytest.raises(ValueError, match="unknown setting master.high_watermrk"):
        load_settings(MasterSettings, "master", str(config), {})
    with pytest.raises(ValueError, match="is not a file"):
        load_settings(MasterSettings, "master", str(tmp_path / "nope.toml"), {})
    config.write_text("[master\n")
    with pytest.raises(ValueError, match="--config"):
        load_settings(MasterSettings, "master", str(config), {})


def test_prefill_settings_check_the_pipeline_shape() -> None:
    with pytest.raises(ValueError, match="stage_addresses: stage 0 needs the 3 later stages"):
        PrefillSettings(stage=0, num_stages=4)
    with pytest.raises(ValueError, match="next_stage: stage 1 needs the address of stage 2"):
        PrefillSettings(stage=1, num_stages=4)
    with pytest.raises(ValueError, match="kv_dtype"):
        PrefillSettings(stage=0, num_stages=1, kv_dtype="int3")
    with pytest.raises(ValueError, match="model"):
        PrefillSettings(stage=0, num_stages=1, model="gpt-17")
    last = PrefillSettings(stage=3, num_stages=4)
    assert last.layers == (6, 8) and last.next_address == "" and (last.port, last.admin_port) == (7703, 9703)
    first = PrefillSettings(stage=0, num_stages=4, stage_addresses="a:1,b:2,c:3")
    assert first.stage_addresses == ["a:1", "b:2", "c:3"] and first.next_address == "a:1"
    # the namespace changes with anything that makes KV bytes incompatible
    other = PrefillSettings(stage=0, num_stages=4, stage_addresses="a:1,b:2,c:3", kv_dtype="bfloat16")
    assert first.namespace != other.namespace
    assert first.namespace == PrefillSettings(stage=3, num_stages=4).namespace
    assert first.chunk_nbytes == 2 * 256 * 96 * 4
