"""Gather on prefill, scatter on decode: every (layer, token) entry lands in its page slot, byte for byte.

The prefill pages are the model's own (``allocate_kv_cache``, whatever its
layout), filled with noise, then the request's tokens are written through
``unpack_kv`` from a known payload ``[layers, tokens, entry bytes]``; so
what the region and decode's pages must hold is known without reading the
pages' layout here.
"""

from __future__ import annotations

import pytest
import torch

from kvpool.core.handoff.layout import HandoffLayout, range_transfers
from kvpool.handoff import gather_range, gather_stage, scatter_range, scatter_region
from kvpool.model import allocate_kv_cache, get_config, pack_kv, unpack_kv

CONFIG = get_config("tiny")
BLOCK_SIZE = 4
BLOCK_TABLE = [13, 2, 7, 0, 9, 4, 11, 5, 1, 15]  # scattered prefill blocks


def random_bytes(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def prefill_stage(num_layers: int, num_tokens: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A stage's pages (noise everywhere, the payload in the request's slots) and the payload."""
    cache = allocate_kv_cache(CONFIG, num_layers, 16, BLOCK_SIZE, dtype)
    raw = cache.view(torch.uint8).view(-1)
    raw.copy_(random_bytes((raw.numel(),), seed + 100))
    payload = random_bytes((num_layers, num_tokens, CONFIG.kv_entry_dim * dtype.itemsize), seed)
    unpack_kv(cache, BLOCK_TABLE, 0, payload.view(-1))
    return cache, payload


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("num_tokens", [1, 7, 16, 37])
def test_scatter_puts_every_entry_of_every_layer_in_its_page(dtype: torch.dtype, num_tokens: int) -> None:
    split = ((0, 2), (2, 5), (5, 6))
    entry_bytes = CONFIG.kv_entry_dim * dtype.itemsize
    layout = HandoffLayout.of(num_tokens, split, entry_bytes)
    stages = [prefill_stage(end - start, num_tokens, dtype, seed=k) for k, (start, end) in enumerate(split)]
    region = torch.zeros(layout.nbytes, dtype=torch.uint8)
    for k, (cache, payload) in enumerate(stages):
        offset = layout.stage_offset(k)
        slab = region[offset : offset + layout.stage_nbytes(k)]
        gather_stage(cache, BLOCK_TABLE, num_tokens, slab)
        assert torch.equal(slab, payload.view(-1))
        assert torch.equal(slab, pack_kv(cache, BLOCK_TABLE, 0, num_tokens))  # the layout's own packing

    page_size, num_pages = 8, 12
    pages = torch.zeros(num_pages, page_size, 6, entry_bytes, dtype=torch.uint8).view(dtype)
    page_ids = [10, 3, 6, 1, 8]
    scatter_region(region, layout, pages, page_ids)

    received = pages.view(torch.uint8)
    for k, (start, end) in enumerate(split):
        payload = stages[k][1]
        for layer in range(start, end):
            for t in range(num_tokens):
                got = received[page_ids[t // page_size], t % page_size, layer]
                assert torch.equal(got, payload[layer - start, t]), (layer, t)
    # nothing outside the request's slots was written
    touched = torch.zeros(num_pages * page_size, dtype=torch.bool)
    for t in range(num_tokens):
        touched[page_ids[t // page_size] * page_size + t % page_size] = True
    assert not received.reshape(num_pages * page_size, -1)[~touched].any()


@pytest.mark.parametrize("entry_bytes", [3, 6, 12, 576])
@pytest.mark.parametrize("misaligned", [0, 1, 4])
@pytest.mark.parametrize("num_tokens", [32, 37])
def test_scatter_moves_any_entry_size_from_any_alignment(entry_bytes: int, misaligned: int, num_tokens: int) -> None:
    # entries that no wider word tiles, and regions that start off a word boundary, take the narrower copies
    layout = HandoffLayout.of(num_tokens, ((0, 2), (2, 3)), entry_bytes)
    buffer = random_bytes((layout.nbytes + misaligned,), seed=entry_bytes)
    region = buffer[misaligned:]
    page_size, page_ids = 8, [9, 0, 4, 2, 7]
    pages = torch.zeros(10, page_size, 3, entry_bytes, dtype=torch.uint8).view(torch.float8_e4m3fn)
    scatter_region(region, layout, pages, page_ids)
    received = pages.view(torch.uint8)
    for layer in range(3):
        for t in range(num_tokens):
            at = layout.offset(layer, t)
            assert torch.equal(received[page_ids[t // page_size], t % page_size, layer], region[at : at + entry_bytes])
    touched = torch.zeros(10 * page_size, dtype=torch.bool)
    for t in range(num_tokens):
        touched[page_ids[t // page_size] * page_size + t % page_size] = True
    assert not received.reshape(10 * page_size, -1)[~touched].any()  # nothing beyond the request's slots


def test_region_offsets_match_the_layout_contract() -> None:
    split = ((0, 3), (3, 4))
    layout = HandoffLayout.of(10, split, CONFIG.kv_entry_dim * 4)
    stages = [prefill_stage(end - start, 10, torch.float32, seed=k) for k, (start, end) in enumerate(split)]
    region = torch.zeros(layout.nbytes, dtype=torch.uint8)
    for k, (cache, _) in enumerate(stages):
        offset = layout.stage_offset(k)
        gather_stage(cache, BLOCK_TABLE, 10, region[offset : offset + layout.stage_nbytes(k)])
    for layer in range(4):
        stage = 0 if layer < 3 else 1
        for t in range(10):
            at = layout.offset(layer, t)
            assert torch.equal(region[at : at + layout.entry_bytes], stages[stage][1][layer - split[stage][0], t])


def test_gather_rejects_a_bad_table_or_slab() -> None:
    cache, _ = prefill_stage(2, 10, torch.float32, seed=0)
    slab = torch.zeros(2 * 10 * CONFIG.kv_entry_dim * 4, dtype=torch.uint8)
    with pytest.raises(ValueError, match="block_table"):
        gather_stage(cache, [3, 1], 10, slab)  # 10 tokens need 3 blocks
    with pytest.raises(ValueError, match="block_table"):
        gather_stage(cache, [3, 1, 16], 10, slab)
    with pytest.raises(ValueError, match="out"):
        gather_stage(cache, [3, 1, 2], 10, slab[:-1])


def test_scatter_rejects_what_disagrees_with_the_layout() -> None:
    dim = 8
    layout = HandoffLayout.of(10, ((0, 2), (2, 4)), dim * 4)
    pages = torch.zeros(4, 4, 4, dim)
    region = torch.zeros(layout.nbytes, dtype=torch.uint8)
    with pytest.raises(ValueError, match="region"):
        scatter_region(region[:-1], layout, pages, [0, 1, 2])
    with pytest.raises(ValueError, match="layers"):
        scatter_region(region, layout, torch.zeros(4, 4, 3, dim), [0, 1, 2])
    with pytest.raises(ValueError, match="entries"):
        scatter_region(region, layout, torch.zeros(4, 4, 4, dim, dtype=torch.bfloat16), [0, 1, 2])
    with pytest.raises(ValueError, match="page_ids"):
        scatter_region(region, layout, pages, [0, 1])
    with pytest.raises(ValueError, match="page_ids"):
        scatter_region(region, layout, pages, [0, 1, 4])
    with pytest.raises(ValueError, match="page_ids"):
        scatter_region(region, layout, pages, [0, 1, 1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn])
def test_streamed_ranges_land_and_scatter_exactly_as_the_whole_region(dtype: torch.dtype) -> None:
    # a stage's part written range by range (prefix, then forward pieces, in any order), each range
    # scattered as it lands: region and pages end byte for byte as gathering and scattering it whole
    num_tokens, split = 37, ((0, 2), (2, 5), (5, 6))
    entry_bytes = CONFIG.kv_entry_dim * dtype.itemsize
    layout = HandoffLayout.of(num_tokens, split, entry_bytes)
    stages = [prefill_stage(end - start, num_tokens, dtype, seed=k) for k, (start, end) in enumerate(split)]
    whole = torch.zeros(layout.nbytes, dtype=torch.uint8)
    for k, (cache, _) in enumerate(stages):
        offset = layout.stage_offset(k)
        gather_stage(cache, BLOCK_TABLE, num_tokens, whole[offset: offset + layout.stage_nbytes(k)])
    page_size, page_ids = 8, [10, 3, 6, 1, 8]
    expected = torch.zeros(12, page_size, 6, entry_bytes, dtype=torch.uint8).view(dtype)
    scatter_region(whole, layout, expected, page_ids)

    region = torch.zeros(layout.nbytes, dtype=torch.uint8)
    pages = torch.zeros_like(expected)
    for k, (cache, _) in enumerate(stages):
        for start, end in ((8, 16), (0, 8), (16, 35), (35, 37)):  # not chunk-sized, out of order
            slab = torch.zeros((split[k][1] - split[k][0]) * (end - start) * entry_bytes, dtype=torch.uint8)
            gather_range(cache, BLOCK_TABLE, start, end, slab)
            for t in range_transfers(layout, k, start, end):  # the writes, as the engine makes them
                region[t.region_offset: t.region_offset + t.length] = slab[t.slab_offset: t.slab_offset + t.length]
            scatter_range(region, layout, pages, page_ids, k, start, end)
    assert torch.equal(region, whole)
    assert torch.equal(pages.view(torch.uint8), expected.view(torch.uint8))
