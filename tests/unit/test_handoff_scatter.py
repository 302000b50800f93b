"""Gather on prefill, scatter on decode: every (layer, token) entry lands in its page slot, byte for byte."""

from __future__ import annotations

import pytest
import torch

from kvpool.core.handoff_layout import HandoffLayout
from kvpool.handoff import gather_stage, scatter_region

ENTRY_DIM = 8


def prefill_cache(num_layers: int, num_blocks: int, block_size: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """A stage's pages with distinct random bytes in every slot."""
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (num_layers, num_blocks, block_size, ENTRY_DIM * dtype.itemsize), generator=g, dtype=torch.uint8)
    return raw.view(dtype)


def region_from_stages(layout: HandoffLayout, caches: list[torch.Tensor], block_table: list[int]) -> torch.Tensor:
    region = torch.zeros(layout.nbytes, dtype=torch.uint8)
    for stage, cache in enumerate(caches):
        offset = layout.stage_offset(stage)
        gather_stage(cache, block_table, layout.num_tokens, region[offset : offset + layout.stage_nbytes(stage)])
    return region


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("num_tokens", [1, 7, 16, 37])
def test_scatter_puts_every_entry_of_every_layer_in_its_page(dtype: torch.dtype, num_tokens: int) -> None:
    split = ((0, 2), (2, 5), (5, 6))
    block_size, page_size = 4, 8
    caches = [prefill_cache(end - start, 16, block_size, dtype, seed=k) for k, (start, end) in enumerate(split)]
    block_table = [13, 2, 7, 0, 9, 4, 11, 5, 1, 15]  # scattered prefill blocks
    layout = HandoffLayout.of(num_tokens, split, ENTRY_DIM * dtype.itemsize)
    region = region_from_stages(layout, caches, block_table)

    pages = torch.zeros(12, page_size, 6, ENTRY_DIM * dtype.itemsize, dtype=torch.uint8).view(dtype)
    page_ids = [10, 3, 6, 1, 8]
    scatter_region(region, layout, pages, page_ids)

    sent = pages.view(torch.uint8)
    for stage, (start, end) in enumerate(split):
        cache = caches[stage].view(torch.uint8)
        for layer in range(start, end):
            for t in range(num_tokens):
                want = cache[layer - start, block_table[t // block_size], t % block_size]
                got = sent[page_ids[t // page_size], t % page_size, layer]
                assert torch.equal(got, want), (layer, t)
    # nothing outside the request's slots was written
    touched = torch.zeros(12 * page_size, dtype=torch.bool)
    for t in range(num_tokens):
        touched[page_ids[t // page_size] * page_size + t % page_size] = True
    assert not sent.reshape(12 * page_size, -1)[~touched].any()


def test_region_offsets_match_the_layout_contract() -> None:
    split = ((0, 3), (3, 4))
    caches = [prefill_cache(end - start, 4, 4, torch.float32, seed=k) for k, (start, end) in enumerate(split)]
    layout = HandoffLayout.of(10, split, ENTRY_DIM * 4)
    block_table = [3, 1, 0]
    region = region_from_stages(layout, caches, block_table)
    for layer in range(4):
        stage = 0 if layer < 3 else 1
        local = layer - split[stage][0]
        for t in range(10):
            at = layout.offset(layer, t)
            want = caches[stage].view(torch.uint8)[local, block_table[t // 4], t % 4]
            assert torch.equal(region[at : at + layout.entry_bytes], want)


def test_scatter_rejects_what_disagrees_with_the_layout() -> None:
    layout = HandoffLayout.of(10, ((0, 2), (2, 4)), ENTRY_DIM * 4)
    pages = torch.zeros(4, 4, 4, ENTRY_DIM)
    region = torch.zeros(layout.nbytes, dtype=torch.uint8)
    with pytest.raises(ValueError, match="region"):
        scatter_region(region[:-1], layout, pages, [0, 1, 2])
    with pytest.raises(ValueError, match="layers"):
        scatter_region(region, layout, torch.zeros(4, 4, 3, ENTRY_DIM), [0, 1, 2])
    with pytest.raises(ValueError, match="entries"):
        scatter_region(region, layout, torch.zeros(4, 4, 4, ENTRY_DIM, dtype=torch.bfloat16), [0, 1, 2])
    with pytest.raises(ValueError, match="page_ids"):
        scatter_region(region, layout, pages, [0, 1])
    with pytest.raises(ValueError, match="page_ids"):
        scatter_region(region, layout, pages, [0, 1, 4])
    with pytest.raises(ValueError, match="page_ids"):
        scatter_region(region, layout, pages, [0, 1, 1])
