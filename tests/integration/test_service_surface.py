"""What an operator touches: --help, settings errors, metrics, pool stats, a TOML file."""

from __future__ import annotations

import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvpool.tools.cluster import LocalPool
from kvpool.pool.client import PoolClient
from kvpool.pool.objects import PutObject
from kvpool.transfer import HostBuffer
from tests.integration.conftest import eventually

pytestmark = pytest.mark.cluster


def scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}


def kvpool(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvpool.services.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_help_names_every_role_and_flag() -> None:
    top = kvpool("--help")
    assert top.returncode == 0
    for role in ("master", "store", "pool", "bench"):
        assert role in top.stdout
    store = kvpool("store", "--help")
    for flag in ("--segment-size", "--numa-node", "--master", "--config", "--protocol"):
        assert flag in store.stdout


def test_bad_settings_exit_2_naming_the_setting(tmp_path: Path) -> None:
    bad = kvpool("master", "--high-watermark", "0.5", "--low-watermark", "0.9", "--port", "0")
    assert bad.returncode != 0 and "watermarks must satisfy" in bad.stderr
    config = tmp_path / "cluster.toml"
    config.write_text("[store]\nsegment_sise = '1GiB'\n")
    typo = kvpool("store", "--config", str(config))
    assert typo.returncode != 0 and "unknown setting store.segment_sise" in typo.stderr
    size = kvpool("store", "--segment-size", "lots")
    assert size.returncode != 0 and "segment_size: 'lots' is not a size" in size.stderr


def test_toml_settings_are_applied(tmp_path: Path) -> None:
    config = tmp_path / "cluster.toml"
    config.write_text("[master]\nhigh_watermark = 0.7\nlow_watermark = 0.6\n")
    with LocalPool(num_stores=1, segment_size="8MiB", master_args=["--config", str(config)],
                   workdir=tmp_path / "run") as pool:
        stats = kvpool("pool", "stats", "--master", pool.master_address, "--json")
        assert stats.returncode == 0, stats.stderr
        assert '"high_watermark": 0.7' in stats.stdout and '"low_watermark": 0.6' in stats.stdout


async def test_metrics_and_stats_reflect_the_pool(tmp_path: Path, engine, buffer: HostBuffer) -> None:  # type: ignore[no-untyped-def]
    with LocalPool(num_stores=2, segment_size="8MiB", workdir=tmp_path) as pool:
        client = PoolClient(pool.master_address, engine)
        client.register(buffer.address, buffer.size)
        await client.put([PutObject(f"ns/m{i}/0", f"ns/m{i}", 1, buffer.address + i * 4096, 4096) for i in range(3)])
        await client.close()
        assert pool.master is not None
        admin = pool.master.ready["admin_port"]
        # the master refreshes gauges once a second; read until they show our objects
        await eventually(lambda: scrape(admin).get("kvpool_pool_objects") == 3, timeout_s=10,
                         what="the master's gauges to count 3 objects")
        master = scrape(admin)
        assert master["kvpool_pool_objects"] == 3
        assert master["kvpool_pool_capacity_bytes"] == 16 << 20
        assert master["kvpool_pool_used_bytes"] == 3 * 4096
        assert master["kvpool_pool_segments"] == 2
        store = scrape(pool.stores[0].ready["admin_port"])
        assert store["kvpool_store_segment_bytes"] == 8 << 20
        assert store["kvpool_store_mounted"] == 1
        table = kvpool("pool", "stats", "--master", pool.master_address)
        assert table.returncode == 0
        assert "objects    3" in table.stdout and "segments   2" in table.stdout
