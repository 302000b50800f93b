"""``kvpool up`` states its memory budget from the settings every child will read."""

from __future__ import annotations

from pathlib import Path

from kvpool.model import get_config, init_weights
from kvpool.settings import load_settings, read_config
from kvpool.tools.cluster import Topology
from kvpool.tools.up import UpSettings, up_topology
from kvpool.services.memory_budget import memory_budget

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
    # the tiny model's float32 weights: every stage holds its layers, the decode shard all of them
    weights = 4 * sum(t.numel() for t in init_weights(get_config("tiny")).values())
    assert memory_budget(UpSettings(), None) == {
        "pool segments": 2 * 512 * MiB,
        "prefill device caches": 4 * (kv_per_stage + arenas_per_stage),
        "prefill weights": weights,
        "decode pages and arenas": pages(256 * MiB) + 128 * MiB,
        "decode weights": weights,
    }


def test_the_budget_follows_the_config_file_and_the_shape(tmp_path: Path) -> None:
    config = tmp_path / "cluster.toml"
    config.write_text('[decode]\nkv_bytes = "1GiB"\n[store]\nsegment_size = "2GiB"\n')
    budget = memory_budget(UpSettings(stores=3, decode_shards=2, segment_size="64MiB"), str(config))
    assert budget["pool segments"] == 3 * 64 * MiB  # up's flag wins over the file, as for the child
    assert budget["decode pages and arenas"] == 2 * (pages(1024 * MiB) + 128 * MiB)
    assert "pool segments" not in memory_budget(UpSettings(stores=0), None)


def _args(topology: Topology) -> dict[str, tuple[str, ...]]:
    server = topology.servers[0]
    return {"store": server.stores[0].args, "prefill": server.pipelines[0].args, "decode": server.decode_shards[0].args}


def _value(args: tuple[str, ...], flag: str) -> str | None:
    return args[args.index(flag) + 1] if flag in args else None


def test_up_sizes_a_service_only_where_its_own_table_is_silent(tmp_path: Path) -> None:
    config = tmp_path / "cluster.toml"
    config.write_text('[prefill]\ndevice_cache_tokens = 8192\n[decode]\nregion-arena-bytes = "32MiB"\n')
    args = _args(up_topology(UpSettings(), str(config)))
    # the child reads its own table: up puts nothing on its command line that would win over it
    assert _value(args["prefill"], "--device-cache-tokens") is None
    assert _value(args["decode"], "--region-arena-bytes") is None
    assert _value(args["store"], "--segment-size") == "512MiB"  # [store] is silent: up's default
    assert memory_budget(UpSettings(), str(config))["decode pages and arenas"] == pages(256 * MiB) + 32 * MiB
    # no file: up's defaults, as before
    args = _args(up_topology(UpSettings(), None))
    assert (_value(args["prefill"], "--device-cache-tokens"), _value(args["decode"], "--region-arena-bytes"),
            _value(args["store"], "--segment-size")) == ("32768", "128MiB", "512MiB")


def test_what_the_user_gives_up_wins_over_the_service_table(tmp_path: Path) -> None:
    config = tmp_path / "cluster.toml"
    config.write_text('[up]\nregion_arena_bytes = "96MiB"\n[prefill]\ndevice_cache_tokens = 8192\n'
                      '[decode]\nregion_arena_bytes = "32MiB"\n[store]\nsegment_size = "1GiB"\n')
    settings = load_settings(UpSettings, "up", str(config), {"device_cache_tokens": 4096, "segment_size": None})
    args = _args(up_topology(settings, str(config)))
    assert _value(args["prefill"], "--device-cache-tokens") == "4096"  # up's flag
    assert _value(args["decode"], "--region-arena-bytes") == "96MiB"  # up's table
    assert _value(args["store"], "--segment-size") is None  # [store] says 1GiB; up was told nothing
    assert settings.handed(read_config(str(config))) == {
        "store": {}, "prefill": {"device_cache_tokens": 4096}, "decode": {"region_arena_bytes": "96MiB"}}


def test_up_gives_its_services_warning_unless_a_level_is_asked_for() -> None:
    """``kvpool up`` keeps its services at warning by default, and gives them the level asked for otherwise:
    ``--log-level info`` is not the default (it used to be read as one, so their info lines could not be had)."""
    from kvpool.services import cli, cli_parser

    def level(*flags: str) -> str:
        return cli.services_log_level(cli_parser.build_parser().parse_args(["up", *flags]))

    assert level() == "warning"
    assert [level("--log-level", name) for name in ("debug", "info", "warning", "error")] == [
        "debug", "info", "warning", "error"]
    assert cli_parser.build_parser().parse_args(["master"]).log_level == "info"  # other commands as before
