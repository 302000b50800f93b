"""The same-host handoff's gather: each range packed straight into a stage's part of a region (a strided view of
memory at an address, as a stage sees decode's mapped arena) ends the region byte for byte as the engine path's
slab-and-writes do, trailer included."""

from __future__ import annotations

import pytest
import torch

from kvpool.core.handoff.layout import HandoffLayout
from kvpool.handoff import gather_range_into, gather_stage, memory_tensor, region_range
from tests.unit.test_handoff_scatter import BLOCK_TABLE, CONFIG, prefill_stage, random_bytes


@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn])
def test_ranges_gathered_into_a_mapped_region_equal_the_whole_region(dtype: torch.dtype) -> None:
    num_tokens, split = 37, ((0, 2), (2, 5), (5, 6))
    entry_bytes = CONFIG.kv_entry_dim * dtype.itemsize
    layout = HandoffLayout.of(num_tokens, split, entry_bytes, trailer_bytes=40)
    stages = [prefill_stage(end - start, num_tokens, dtype, seed=k) for k, (start, end) in enumerate(split)]
    trailer = random_bytes((40,), 9)
    whole = torch.zeros(layout.nbytes, dtype=torch.uint8)
    for k, (cache, _) in enumerate(stages):
        offset = layout.stage_offset(k)
        gather_stage(cache, BLOCK_TABLE, num_tokens, whole[offset: offset + layout.stage_nbytes(k)])
    whole[layout.trailer_offset:] = trailer

    arena = torch.zeros(layout.nbytes + 4096, dtype=torch.uint8)  # the region starts 4096 bytes into its arena
    region = memory_tensor(arena.data_ptr() + 4096, layout.nbytes)
    for k, (cache, _) in enumerate(stages):
        for start, end in ((8, 16), (0, 8), (16, 35), (35, 37)):  # not chunk-sized, out of order
            gather_range_into(cache, BLOCK_TABLE, start, end, region_range(region, layout, k, start, end))
    region[layout.trailer_offset:].copy_(trailer)
    assert torch.equal(arena[4096:], whole)
    assert not arena[:4096].any()  # nothing outside the region


def test_a_destination_of_the_wrong_shape_is_refused_by_name() -> None:
    cache, _ = prefill_stage(2, 10, torch.float32, seed=0)
    layout = HandoffLayout.of(10, ((0, 2),), CONFIG.kv_entry_dim * 4)
    region = torch.zeros(layout.nbytes, dtype=torch.uint8)
    with pytest.raises(ValueError, match="^slab: "):
        gather_range_into(cache, BLOCK_TABLE, 0, 5, region_range(region, layout, 0, 0, 4))
