"""The prefill → decode handoff's byte moves: gather, write, scatter.

The layout and the write plan are ``kvpool.core.handoff.layout`` (the
contract); this module does the moves with torch and the transfer engine, no
gRPC. One request's KV goes:

1. ``gather_stage``: each prefill stage packs its layers of the request's
   tokens from its paged cache into one registered staging slab (exactly the
   stage's part of the region, layer-major: what ``kvpool.model.pack_kv``
   writes);
   (streaming: ``gather_range`` packs one token range as the forward passes it);
2. ``write_slab``: the stage writes the slab in the plan's transfers (at most
   8 MiB each) to the same offsets of its part of decode's receive region;
   (same host: ``gather_range_into`` packs a range straight into decode's
   region, mapped as shared memory (``memory_tensor``, ``region_range``): the
   gather is the move, and there is no slab);
3. ``scatter_region``: decode copies the region into its token-major pages
   (``scatter_range``: one landed part, as it lands).

``write_naive`` is the direct per-token-per-layer copy (prefill page slot
to decode page slot, no gather, no scatter) that the gathered path
replaces, kept for the benchmark that compares the two.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvpool.core.handoff.layout import HandoffLayout, Transfer
from kvpool.model.kv_cache import (
    BlockTable,
    as_block_table,
    block_bytes,
    block_nbytes,
    check_block_table,
    pack_kv,
    token_slots,
)
from kvpool.transfer import TransferEngine, TransferError

# Entries per batch of the naive path: one batch_transfer_sync_write of 4,096
# entries failed (-1) where 1,024 worked, so batches stay at 1,024.
NAIVE_BATCH = 1024


@dataclass(frozen=True, slots=True)
class WriteReport:
    """What one slab write (or one naive copy) did: ``transfers`` writes of ``nbytes`` bytes in total."""

    transfers: int
    nbytes: int
    seconds: float


def gather_stage(kv_cache: torch.Tensor, block_table: BlockTable, num_tokens: int, out: torch.Tensor) -> torch.Tensor:
    """Pack tokens ``[0, num_tokens)`` of every layer of one stage's cache into ``out``.

    ``out`` is a contiguous uint8 tensor of exactly the stage's slab size
    (``HandoffLayout.stage_nbytes``); it ends up byte for byte what
    ``pack_kv`` writes, which is the region's layout. Block by block: a
    block's bytes already are its tokens packed (``block_bytes``), so each
    block is one strided copy, where ``pack_kv`` indexes every token.
    """
    table = as_block_table(block_table, kv_cache.device)
    check_block_table(kv_cache, table, num_tokens)
    block_size, entry_bytes = kv_cache.shape[2], kv_cache.shape[-1] * kv_cache.element_size()
    num_layers = block_nbytes(kv_cache) // (block_size * entry_bytes)
    if out.dtype != torch.uint8 or not out.is_contiguous() or out.numel() != num_layers * num_tokens * entry_bytes:
        raise ValueError(f"out: must be a contiguous uint8 tensor of {num_layers * num_tokens * entry_bytes} bytes")
    slab = out.view(num_layers, num_tokens, entry_bytes)
    for i, block_id in enumerate(table[: -(-num_tokens // block_size)].tolist()):
        first = i * block_size
        count = min(block_size, num_tokens - first)
        block = block_bytes(kv_cache, block_id).view(num_layers, block_size, entry_bytes)
        slab[:, first : first + count].copy_(block[:, :count])
    return out


def gather_range(kv_cache: torch.Tensor, block_table: BlockTable, token_start: int, token_end: int,
                 out: torch.Tensor) -> torch.Tensor:
    """Pack tokens ``[token_start, token_end)`` of every layer of one stage's cache into ``out``.

    ``out``: a contiguous uint8 tensor of ``layers × (token_end - token_start) × entry`` bytes,
    layer-major (the slab ``kvpool.core.handoff.layout.range_transfers`` writes). One strided
    copy per block the range touches.
    """
    block_size, entry_bytes = kv_cache.shape[2], kv_cache.shape[-1] * kv_cache.element_size()
    num_layers = block_nbytes(kv_cache) // (block_size * entry_bytes)
    n = token_end - token_start
    if out.dtype != torch.uint8 or not out.is_contiguous() or out.numel() != num_layers * n * entry_bytes:
        raise ValueError(f"out: must be a contiguous uint8 tensor of {num_layers * n * entry_bytes} bytes")
    return gather_range_into(kv_cache, block_table, token_start, token_end, out.view(num_layers, n, entry_bytes))


def gather_range_into(kv_cache: torch.Tensor, block_table: BlockTable, token_start: int, token_end: int,
                      slab: torch.Tensor) -> torch.Tensor:
    """Pack tokens ``[token_start, token_end)`` of every layer of one stage's cache into ``slab``.

    ``slab``: a uint8 ``[layers, token_end - token_start, entry bytes]`` tensor, strided as it
    likes (``region_range`` of decode's mapped region, or a contiguous slab). One strided copy
    per block the range touches.
    """
    table = as_block_table(block_table, kv_cache.device)
    check_block_table(kv_cache, table, token_end)
    block_size, entry_bytes = kv_cache.shape[2], kv_cache.shape[-1] * kv_cache.element_size()
    num_layers = block_nbytes(kv_cache) // (block_size * entry_bytes)
    n = token_end - token_start
    if not 0 <= token_start < token_end:
        raise ValueError(f"token range: [{token_start}, {token_end}) is empty or negative")
    if slab.dtype != torch.uint8 or tuple(slab.shape) != (num_layers, n, entry_bytes):
        raise ValueError(f"slab: must be a uint8 tensor of shape {(num_layers, n, entry_bytes)}, "
                         f"got {slab.dtype} {tuple(slab.shape)}")
    ids = table.tolist()
    t = token_start
    while t < token_end:
        block, slot = divmod(t, block_size)
        count = min(block_size - slot, token_end - t)
        source = block_bytes(kv_cache, ids[block]).view(num_layers, block_size, entry_bytes)
        slab[:, t - token_start: t - token_start + count].copy_(source[:, slot: slot + count])
        t += count
    return slab


def memory_tensor(address: int, nbytes: int) -> torch.Tensor:
    """A uint8 tensor over ``nbytes`` of memory at ``address`` (a mapping the caller keeps pinned while the
    tensor lives); it exports no buffer of the mapping, so it never holds the mapping's unmap up."""
    return torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(address), dtype=torch.uint8)


def region_range(region: torch.Tensor, layout: HandoffLayout, stage: int, token_start: int,
                 token_end: int) -> torch.Tensor:
    """Where tokens ``[token_start, token_end)`` of one stage's layers go in a region: a strided
    ``[stage layers, tokens, entry bytes]`` view of ``region`` (uint8, at least ``layout.nbytes``)."""
    start, end = layout.layer_split[stage]
    offset = layout.stage_offset(stage)
    slab = region[offset: offset + layout.stage_nbytes(stage)].view(end - start, layout.num_tokens,
                                                                     layout.entry_bytes)
    return slab[:, token_start:token_end]


def scatter_range(region: torch.Tensor, layout: HandoffLayout, pages: torch.Tensor, page_ids: BlockTable,
                  stage: int, token_start: int, token_end: int) -> None:
    """Copy tokens ``[token_start, token_end)`` of one stage's layers from a region into decode's pages.

    The same placement as ``scatter_region`` (token t of layer l to
    ``pages[page_ids[t // page_size], t % page_size, l]``), for one landed part:
    one indexed copy. The caller checked the range against the layout.
    """
    num_pages, page_size, num_layers, entry_dim = pages.shape
    entry_bytes = entry_dim * pages.element_size()
    start, end = layout.layer_split[stage]
    offset = layout.stage_offset(stage)
    word = _word_dtype(entry_bytes, region, pages)
    words = entry_bytes // word.itemsize
    rows = pages.view(torch.uint8).view(num_pages * page_size, num_layers, entry_bytes).view(word)
    slab = region[offset: offset + layout.stage_nbytes(stage)].view(word).view(end - start, layout.num_tokens, words)
    slots = token_slots(as_block_table(page_ids, pages.device), token_start, token_end, page_size)
    rows[slots, start:end] = slab[:, token_start:token_end].transpose(0, 1)


def write_slab(
    engine: TransferEngine,
    slab_address: int,
    endpoint: str,
    region_address: int,
    transfers: Sequence[Transfer],
) -> WriteReport:
    """Write a registered slab to a peer's region in the given transfers; blocking.

    Every transfer lands at the same offset of the region as it has in the
    slab. Raises ``TransferError`` naming the endpoint when any write fails
    (the peer is gone, the region is not registered there): a region is
    complete or the handoff failed, never partly reported as done.
    """
    local = [slab_address + t.offset for t in transfers]
    remote = [region_address + t.offset for t in transfers]
    sizes = [t.length for t in transfers]
    started = time.perf_counter()
    done = engine.move(endpoint, local, remote, sizes, write=True)
    seconds = time.perf_counter() - started
    if not all(done):
        raise TransferError(f"handoff write to {endpoint}: {done.count(False)} of {len(sizes)} transfers failed")
    return WriteReport(len(sizes), sum(sizes), seconds)


def write_naive(
    engine: TransferEngine,
    kv_cache: torch.Tensor,
    block_table: BlockTable,
    num_tokens: int,
    endpoint: str,
    destinations: torch.Tensor,
) -> WriteReport:
    """Copy one stage's KV straight from its pages: one write per token per layer.

    ``kv_cache`` must be registered with ``engine``; ``destinations`` holds
    the peer address of every (layer, token) entry, layer-major
    (``token_major_destinations`` for decode's pages). The baseline the
    gathered handoff replaces, for the benchmark only; blocking.
    """
    entry_bytes = kv_cache.shape[-1] * kv_cache.element_size()
    src = entry_addresses(kv_cache, block_table, num_tokens)
    if destinations.numel() != src.numel():
        raise ValueError(f"destinations: {destinations.numel()} addresses for {src.numel()} entries")
    local, remote = src.tolist(), destinations.reshape(-1).tolist()
    started = time.perf_counter()
    for first in range(0, len(local), NAIVE_BATCH):
        last = min(first + NAIVE_BATCH, len(local))
        try:
            engine.write_sync(endpoint, local[first:last], remote[first:last], [entry_bytes] * (last - first))
        except TransferError as exc:
            raise TransferError(f"naive handoff write to {endpoint} failed at entry {first}: {exc}") from exc
    return WriteReport(len(local), len(local) * entry_bytes, time.perf_counter() - started)


def entry_addresses(kv_cache: torch.Tensor, block_table: BlockTable, num_tokens: int) -> torch.Tensor:
    """Address of every (layer, token) entry of tokens ``[0, num_tokens)`` in a stage's pages, layer-major.

    Found through ``pack_kv`` itself (packing each entry's own address in
    place of its bytes), so it follows the page layout, whatever it is.
    """
    *dims, _ = kv_cache.shape
    offsets = torch.zeros(dims, dtype=torch.int64)
    for dim, stride in enumerate(kv_cache.stride()[:-1]):
        shape = [1] * len(dims)
        shape[dim] = dims[dim]
        offsets += torch.arange(dims[dim]).view(shape) * stride
    addresses = (offsets * kv_cache.element_size() + kv_cache.data_ptr()).unsqueeze(-1)
    return pack_kv(addresses, block_table, 0, num_tokens).view(torch.int64)


def token_major_destinations(
    pages_address: int, pages_shape: Sequence[int], page_ids: BlockTable, num_tokens: int, entry_bytes: int
) -> torch.Tensor:
    """Address of every (layer, token) entry in decode's pages at ``pages_address``, layer-major.

    ``pages_shape`` is ``[num_pages, page_size, num_layers, ...]``; token t of
    layer l lives at ``pages[page_ids[t // page_size], t % page_size, l]``.
    """
    _, page_size, num_layers = pages_shape[:3]
    slots = token_slots(as_block_table(page_ids), 0, num_tokens, page_size)
    return (slots.unsqueeze(0) * num_layers + torch.arange(num_layers).unsqueeze(1)).reshape(-1) * entry_bytes + pages_address


def scatter_region(region: torch.Tensor, layout: HandoffLayout, pages: torch.Tensor, page_ids: BlockTable) -> None:
    """Copy a received region into decode's token-major pages.

    ``region``: uint8 tensor over (at least) the region's ``layout.nbytes``
    bytes. ``pages``: ``[num_pages, page_size, num_layers, kv_entry_dim]`` in
    the KV dtype, contiguous; token t of layer l goes to
    ``pages[page_ids[t // page_size], t % page_size, l]``. Per stage one
    indexed copy of whole pages and one of the last partial page (no loop
    over tokens or pages); bytes are copied as they are, so every KV dtype
    (float8 included) round-trips exactly. Raises ValueError naming
    the argument when shapes disagree with the layout.
    """
    if region.dtype != torch.uint8 or region.dim() != 1 or not region.is_contiguous():
        raise ValueError("region: must be a contiguous 1-D uint8 tensor")
    if region.numel() < layout.nbytes:
        raise ValueError(f"region: {region.numel()} bytes, the layout needs {layout.nbytes}")
    if pages.dim() != 4 or not pages.is_contiguous():
        raise ValueError(f"pages: must be contiguous [num_pages, page_size, num_layers, kv_entry_dim], got {tuple(pages.shape)}")
    num_pages, page_size, num_layers, entry_dim = pages.shape
    entry_bytes = entry_dim * pages.element_size()
    if num_layers != layout.num_layers:
        raise ValueError(f"pages: {num_layers} layers, the layout has {layout.num_layers}")
    if entry_bytes != layout.entry_bytes:
        raise ValueError(f"pages: {entry_bytes}-byte entries, the layout has {layout.entry_bytes}")
    ids = as_block_table(page_ids, pages.device)
    needed = -(-layout.num_tokens // page_size)
    if ids.numel() < needed:
        raise ValueError(f"page_ids: {ids.numel()} pages, {layout.num_tokens} tokens need {needed}")
    used = ids[:needed]
    if int(used.min()) < 0 or int(used.max()) >= num_pages:
        raise ValueError(f"page_ids: must be in [0, {num_pages})")
    if used.unique().numel() != needed:
        raise ValueError("page_ids: repeats a page")
    data = region.to(pages.device)
    word = _word_dtype(entry_bytes, data, pages)
    words = entry_bytes // word.itemsize
    # [num_pages, page_size, num_layers, words]: whole words move, not bytes
    rows = pages.view(torch.uint8).view(num_pages, page_size, num_layers, entry_bytes).view(word)
    num_tokens = layout.num_tokens
    full = num_tokens // page_size
    for stage, (start, end) in enumerate(layout.layer_split):
        offset = layout.stage_offset(stage)
        slab = data[offset : offset + layout.stage_nbytes(stage)].view(word).view(end - start, num_tokens, words)
        # region layer-major, pages token-major: whole pages in one indexed copy, then the last partial page
        if full:
            rows[used[:full], :, start:end] = slab[:, : full * page_size].view(
                end - start, full, page_size, words).permute(1, 2, 0, 3)
        if num_tokens > full * page_size:
            rows[int(used[full]), : num_tokens - full * page_size, start:end] = slab[:, full * page_size :].transpose(0, 1)


def _word_dtype(entry_bytes: int, *tensors: torch.Tensor) -> torch.dtype:
    """The widest integer type that tiles an entry and every tensor's start: copies move words, not bytes."""
    for dtype in (torch.int64, torch.int32, torch.int16):
        if entry_bytes % dtype.itemsize == 0 and all(t.data_ptr() % dtype.itemsize == 0 for t in tensors):
            return dtype
    return torch.uint8
