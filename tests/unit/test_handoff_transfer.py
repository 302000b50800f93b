"""The handoff's writes through a real transfer engine (TCP, loopback to its own endpoint).

The gathered path issues exactly the layout's transfers and the region holds
the pages' bytes; the naive path issues one write per (layer, token) and fills
decode's token-major pages; a peer that is gone fails with its name.
"""

from __future__ import annotations

import mmap
from collections.abc import Iterator

import pytest
import torch

from kvpool.core.handoff.layout import (
    MAX_TRANSFER_BYTES,
    HandoffLayout,
    num_naive_writes,
    transfer_plan,
)
from kvpool.handoff import (
    gather_stage,
    scatter_region,
    token_major_destinations,
    write_naive,
    write_slab,
)
from kvpool.model import allocate_kv_cache, get_config, unpack_kv
from kvpool.transfer import HostBuffer, TransferEngine, TransferError

CONFIG = get_config("dsv3-kv")  # 576-value entries, in fp8: 576 bytes, as in DeepSeek-V3
LAYERS, BLOCKS, BLOCK_SIZE = 3, 24, 16
ENTRY = CONFIG.kv_entry_dim
TOKENS = 300
PAGE_SIZE = 8
BLOCK_TABLE = [int(b) for b in torch.randperm(BLOCKS, generator=torch.Generator().manual_seed(1))[:19]]
PAGE_IDS = [int(p) for p in torch.randperm(40, generator=torch.Generator().manual_seed(2))[:38]]
# the request's KV as the region lays it out: [layers, tokens, entry bytes]
PAYLOAD = torch.randint(0, 256, (LAYERS, TOKENS, ENTRY), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def engine() -> TransferEngine:
    return TransferEngine()


# registered buffers live as long as the engine: a freed one's address may come back
# in a later mmap, and the engine refuses to register overlapping memory
_BUFFERS: list[HostBuffer] = []


def registered(engine: TransferEngine, nbytes: int) -> tuple[HostBuffer, torch.Tensor]:
    buffer = HostBuffer(nbytes)
    engine.register(buffer.address, nbytes)
    _BUFFERS.append(buffer)
    return buffer, torch.frombuffer(buffer.view(), dtype=torch.uint8)


@pytest.fixture(scope="module")
def cache(engine: TransferEngine) -> Iterator[torch.Tensor]:
    """A prefill stage's pages (the model's layout) in registered memory: noise, the payload in the request's slots."""
    pages = allocate_kv_cache(CONFIG, LAYERS, BLOCKS, BLOCK_SIZE, torch.float8_e4m3fn)
    raw = pages.view(torch.uint8).view(-1)
    raw.copy_(torch.randint(0, 256, (raw.numel(),), dtype=torch.uint8, generator=torch.Generator().manual_seed(3)))
    unpack_kv(pages, BLOCK_TABLE, 0, PAYLOAD.view(-1))
    engine.register(pages.data_ptr(), raw.numel())
    yield pages
    engine.unregister(pages.data_ptr())


def expected_token_major() -> torch.Tensor:
    """[tokens, layers, entry bytes]: what decode's pages must hold, in token order."""
    return PAYLOAD.transpose(0, 1)


def received_token_major(pages: torch.Tensor) -> torch.Tensor:
    rows = pages.view(torch.uint8)
    return torch.stack([rows[PAGE_IDS[t // PAGE_SIZE], t % PAGE_SIZE] for t in range(TOKENS)])


def test_gathered_write_issues_the_layouts_transfers_and_lands_every_byte(engine, cache) -> None:  # type: ignore[no-untyped-def]
    layout = HandoffLayout.of(TOKENS, [(0, LAYERS)], ENTRY)
    slab_buffer, slab = registered(engine, layout.nbytes)
    region_buffer, region = registered(engine, layout.nbytes)
    gather_stage(cache, BLOCK_TABLE, TOKENS, slab)
    small = transfer_plan(layout.nbytes, 64 << 10)  # force several pieces on a ~0.5 MB slab
    report = write_slab(engine, slab_buffer.address, engine.endpoint, region_buffer.address, small)
    assert (report.transfers, report.nbytes) == (-(-layout.nbytes // (64 << 10)), layout.nbytes)
    assert report.transfers == 8
    assert torch.equal(region, slab)
    assert torch.equal(region, PAYLOAD.view(-1))

    pages = torch.zeros(40, PAGE_SIZE, LAYERS, ENTRY, dtype=torch.uint8).view(torch.float8_e4m3fn)
    scatter_region(region, layout, pages, PAGE_IDS)
    assert torch.equal(received_token_major(pages), expected_token_major())


def test_transfer_counts_follow_from_the_sizes() -> None:
    layout = HandoffLayout.of(8192, [(0, 20), (20, 40)], 576)
    assert layout.stage_nbytes(0) == 94_371_840
    assert len(layout.transfers(0)) == 12 == -(-94_371_840 // MAX_TRANSFER_BYTES)
    assert [t.length for t in layout.transfers(0)][-1] == 94_371_840 - 11 * MAX_TRANSFER_BYTES
    assert num_naive_writes(8192, 20) == 163_840


def test_naive_write_puts_one_entry_per_write_into_token_major_pages(engine, cache) -> None:  # type: ignore[no-untyped-def]
    pages_buffer, pages_bytes = registered(engine, 40 * PAGE_SIZE * LAYERS * ENTRY)
    pages_bytes.zero_()
    shape = (40, PAGE_SIZE, LAYERS, ENTRY)
    destinations = token_major_destinations(pages_buffer.address, shape, PAGE_IDS, TOKENS, ENTRY)
    report = write_naive(engine, cache, BLOCK_TABLE, TOKENS, engine.endpoint, destinations)
    assert (report.transfers, report.nbytes) == (num_naive_writes(TOKENS, LAYERS), TOKENS * LAYERS * ENTRY)
    pages = pages_bytes.view(shape)
    assert torch.equal(received_token_major(pages), expected_token_major())
    # only the request's slots were written
    touched = torch.zeros(40 * PAGE_SIZE, dtype=torch.bool)
    touched[[PAGE_IDS[t // PAGE_SIZE] * PAGE_SIZE + t % PAGE_SIZE for t in range(TOKENS)]] = True
    assert not pages.reshape(40 * PAGE_SIZE, -1)[~touched].any()


def test_a_peer_that_is_gone_fails_naming_it(engine, cache) -> None:  # type: ignore[no-untyped-def]
    layout = HandoffLayout.of(TOKENS, [(0, LAYERS)], ENTRY)
    slab_buffer, _ = registered(engine, layout.nbytes)
    with pytest.raises(TransferError, match="127.0.0.1:1"):
        write_slab(engine, slab_buffer.address, "127.0.0.1:1", 1 << 30, layout.transfers(0))
    destinations = torch.arange(TOKENS * LAYERS, dtype=torch.int64) * ENTRY + (1 << 30)
    with pytest.raises(TransferError, match="127.0.0.1:1"):
        write_naive(engine, cache, BLOCK_TABLE, TOKENS, "127.0.0.1:1", destinations)


def test_the_huge_page_switch_is_read_when_a_buffer_is_made(monkeypatch: pytest.MonkeyPatch) -> None:
    """Not at import: a store forked from a zygote that imported kvpool.transfer gets its environment after."""
    from kvpool import transfer

    monkeypatch.setenv(transfer.HUGE_PAGES_ENV, "0")
    assert transfer.huge_pages() is False
    monkeypatch.setenv(transfer.HUGE_PAGES_ENV, "1")
    assert transfer.huge_pages() is hasattr(mmap, "MADV_HUGEPAGE")


@pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE"), reason="no transparent huge pages here")
def test_a_buffer_asks_for_huge_pages_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvpool import transfer

    monkeypatch.delenv(transfer.HUGE_PAGES_ENV, raising=False)  # the suite turns them off for its processes
    flags = {}
    for asked in (True, False):
        if not asked:
            monkeypatch.setenv(transfer.HUGE_PAGES_ENV, "0")
        buffer = transfer.HostBuffer(4 << 20)
        start = f"{buffer.address:x}-"
        smaps = open("/proc/self/smaps").read().split("\n")
        at = next(i for i, line in enumerate(smaps) if line.startswith(start))
        flags[asked] = next(line for line in smaps[at:] if line.startswith("VmFlags:")).split()[1:]
        buffer.close()
    assert "hg" in flags[True] and "hg" not in flags[False]
