"""The built-in models' sampler emits printable ASCII only; the logits themselves are untouched."""

from __future__ import annotations

import dataclasses

import torch

from kvpool.model import get_config
from kvpool.model.config import PRINTABLE_ASCII
from kvpool.model.sampling import SamplingParams, greedy_token, output_logits, sample

TINY = get_config("tiny")


def test_built_in_configs_sample_printable_ascii_only() -> None:
    assert {get_config(n).output_ids for n in ("tiny", "dsv3-kv", "dsv3-kv-61")} == {PRINTABLE_ASCII}
    logits = torch.zeros(TINY.vocab_size)
    logits[5], logits[300] = 9.0, 8.0  # the model prefers a control byte, then a special
    logits[65] = 1.0
    assert greedy_token(logits, TINY) == 65
    assert greedy_token(logits, dataclasses.replace(TINY, output_ids=None)) == 5  # a loaded checkpoint: no mask
    drawn = {sample(output_logits(logits, TINY), SamplingParams(temperature=2.0, top_k=50, seed=s))
             for s in range(200)}
    assert drawn and all(0x20 <= t < 0x7F and chr(t).isprintable() for t in drawn)
    assert len(drawn) > 1  # still sampling, among the printable ids


def test_the_models_logits_are_left_as_they_were() -> None:
    logits = torch.randn(2, TINY.vocab_size, generator=torch.Generator().manual_seed(3))
    before = logits.clone()
    masked = output_logits(logits, TINY)
    assert torch.equal(logits, before)
    assert torch.equal(masked[:, 0x20:0x7F], logits[:, 0x20:0x7F])
    assert bool(torch.isinf(masked[:, :0x20]).all()) and bool(torch.isinf(masked[:, 0x7F:]).all())
