"""A request's numbers never depend on what computes with it or where its computing started.

Bitwise, not within a tolerance: greedy decoding turns a last-bit difference
into another token wherever two logits nearly tie, and the chaos replay holds
every answer to the clean run's. So a prompt's KV and logits are the same
from any chunk-aligned start (a device hit, a pool hit, a recompute after a
fault) and in any pieces, and a decode step gives each sequence the logits it
gets alone, whatever shares the step.
"""

from __future__ import annotations

import random

import pytest
import torch

from kvpool.core.handoff.layout import HandoffLayout
from kvpool.handoff import scatter_region
from kvpool.model import InProcessPipeline, ModelConfig, pack_kv
from kvpool.model import invariant
from kvpool.model.attention import FORM_BLOCK
from kvpool.model.decode import DecodeInput, DecodeModel
from tests.model.inputs import random_token_ids

CHUNK = 256
BLOCK = 16


def test_a_chunk_is_a_whole_number_of_form_blocks() -> None:
    assert CHUNK % FORM_BLOCK == 0


@pytest.mark.parametrize("rows", list(range(1, 21)) + [33, 300])
def test_each_row_of_a_product_is_what_it_is_in_any_larger_one(rows: int) -> None:
    """The BLAS property the rest stands on, checked here so that a build that sums otherwise fails by name."""
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 256, generator=generator)
    x = torch.randn(rows, 256, generator=generator)
    many = torch.cat((x, torch.randn(64, 256, generator=generator)))
    assert torch.equal(invariant.linear(x, weight), invariant.linear(many, weight)[:rows])
    batched = torch.randn(rows, 4, 32, generator=generator)
    w = torch.randn(4, 32, 64, generator=generator)
    wide = torch.cat((batched, torch.randn(64, 4, 32, generator=generator)))
    assert torch.equal(invariant.einsum_rows("bhd,hdr->bhr", batched, w),
                       invariant.einsum_rows("bhd,hdr->bhr", wide, w)[:rows])
    heads_first = batched.transpose(0, 1)
    assert torch.equal(invariant.einsum_rows("hnd,hdr->hnr", heads_first, w, rows_dim=1),
                       invariant.einsum_rows("hnd,hdr->hnr", wide.transpose(0, 1), w, rows_dim=1)[:, :rows])


def prefill(config: ModelConfig, weights, prompt: torch.Tensor, starts: list[int], piece: int = 2048,
            dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Compute ``prompt`` in calls beginning at each of ``starts`` (and 0), each cut in pieces at multiples of
    ``piece`` as a stage cuts them; the last position's logits and every layer's KV."""
    num_blocks = -(-prompt.numel() // BLOCK)
    pipe = InProcessPipeline(config, num_blocks=num_blocks, block_size=BLOCK, kv_dtype=dtype, weights=weights)
    table = list(range(num_blocks))
    bounds = sorted({0, *starts, prompt.numel()})
    logits = None
    for call_start, call_end in zip(bounds, bounds[1:]):
        start = call_start
        while start < call_end:
            end = min(call_end, (start // piece + 1) * piece)
            logits = pipe.forward(prompt[start:end], table, start)
            start = end
    return logits[-1], torch.cat([cache.flatten() for cache in pipe.kv_caches])


@pytest.mark.parametrize("num_tokens,starts,piece", [
    (1100, [256], 2048),  # a pool hit of one chunk
    (1100, [768], 2048),
    (1100, [256, 512, 768, 1024], 2048),  # a turn at a time: each start a hit
    (1100, [], 512),  # smaller pieces
    (1026, [1024], 2048),  # two tokens computed: fewer rows than a product's least
    (1060, [512], 512),  # the last block short: it takes the absorbed form, the others the expanded
    (2600, [256, 2304], 2048),  # past the first segment: the segments before are one unmasked call
    (2600, [2048, 2560], 1024),
])
def test_a_prefill_is_the_same_from_any_chunk_aligned_start(tiny, tiny_weights, num_tokens, starts, piece) -> None:
    prompt = random_token_ids(tiny, num_tokens, seed=num_tokens)
    whole_logits, whole_kv = prefill(tiny, tiny_weights, prompt, [])
    logits, kv = prefill(tiny, tiny_weights, prompt, starts, piece)
    assert torch.equal(kv, whole_kv)
    assert torch.equal(logits, whole_logits)


def test_a_bfloat16_cache_is_the_same_from_any_chunk_aligned_start(tiny, tiny_weights) -> None:
    prompt = random_token_ids(tiny, 700, seed=7)
    whole = prefill(tiny, tiny_weights, prompt, [], dtype=torch.bfloat16)
    hit = prefill(tiny, tiny_weights, prompt, [512], dtype=torch.bfloat16)
    assert torch.equal(hit[1], whole[1]) and torch.equal(hit[0], whole[0])


def test_a_decode_row_is_the_same_whatever_shares_its_step(tiny, tiny_weights) -> None:
    rng = random.Random(0)
    model = DecodeModel(tiny, num_pages=512, page_size=BLOCK, weights=tiny_weights)
    sequences, next_page = [], 0
    # short rows (a softmax or product over under 12 padded keys sums otherwise) and 200-300 keys (so does the
    # weighing of values over a padded length)
    for i, n in enumerate([3, 9, 40, 230, 290, 600]):
        prompt = random_token_ids(tiny, n, seed=100 + i)
        pipe = InProcessPipeline(tiny, num_blocks=-(-n // BLOCK), block_size=BLOCK, weights=tiny_weights)
        table = list(range(-(-n // BLOCK)))
        logits = pipe.forward(prompt, table, 0)
        pages = list(range(next_page, next_page + -(-(n + 1) // BLOCK)))[::-1]
        next_page += len(pages)
        layout = HandoffLayout.of(n, [(0, tiny.num_hidden_layers)], model.entry_bytes)
        scatter_region(pack_kv(pipe.kv_caches[0], table, 0, n), layout, model.pages, pages)
        sequences.append(DecodeInput(int(logits[-1].argmax()), n, pages))
    alone = [model.step([s])[0] for s in sequences]
    for _ in range(12):
        chosen = rng.sample(range(len(sequences)), rng.randint(2, len(sequences)))
        together = model.step([sequences[i] for i in chosen])
        for row, i in enumerate(chosen):
            assert torch.equal(together[row], alone[i]), f"sequence {i} in a step of {len(chosen)}"
