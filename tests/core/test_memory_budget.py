"""A service refuses to start, naming its settings, when they need more memory than the host has."""

from __future__ import annotations

from kvpool.core.supervision.memory_budget import memory_refusal


def test_fits_or_names_every_setting_and_the_numbers() -> None:
    sizes = {"kv_bytes": 3 * 2**30, "region_arena_bytes": 512 * 2**20}
    assert memory_refusal("decode", sizes, 4 * 2**30) is None
    assert memory_refusal("decode", sizes, None) is None  # unknown: no refusal
    assert memory_refusal("decode", sizes, (3 * 2**30) + (512 * 2**20)) is None  # exactly fits
    message = memory_refusal("decode", sizes, 2 * 2**30)
    assert message == ("decode: the configured memory (kv_bytes 3.0 GiB, region_arena_bytes 512 MiB: 3.5 GiB in "
                       "all) exceeds the 2.0 GiB this host has available; lower kv_bytes or region_arena_bytes")
