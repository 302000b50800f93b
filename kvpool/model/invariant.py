"""Products whose every row is computed the same way whatever else is computed with it.

A request's answer must not depend on what shares its decode step or where
its prefill started computing (a device hit, a pool hit, a recompute after a
fault): greedy decoding turns a last-bit difference into another token
wherever two logits nearly tie. Measured on this CPU build: a matmul's rows
of fewer than four are summed another way than the rows of a larger one,
by up to ~3e-6 in a tiny-model logit. Every matrix product the model runs on
a variable number of rows goes through here and runs on at least
``MIN_ROWS`` rows (zero rows pad it; their results are dropped), so a row's
result depends only on its own inputs: products of every row count tried
(4..300, and up to 40,000) give each row bitwise the same result, on one
thread and on two (MKL, this CPU). ``tests/model/test_invariance.py`` holds
the whole model to it, so a BLAS that sums otherwise fails there first. A
GPU build needs batch-invariant kernels instead.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

MIN_ROWS = 4  # measured: the least row count summed as every larger one is (16 would cost a one-row step 4x, not 2x)


def _padded(x: torch.Tensor, dim: int) -> torch.Tensor:
    shape = list(x.shape)
    shape[dim] = MIN_ROWS - shape[dim]
    return torch.cat((x, x.new_zeros(shape)), dim=dim)


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, weight)`` for x [rows, in], each row computed as in a product of at least MIN_ROWS."""
    rows = x.shape[0]
    if rows >= MIN_ROWS:
        return F.linear(x, weight)
    return F.linear(_padded(x, 0), weight)[:rows]


def einsum_rows(equation: str, x: torch.Tensor, weight: torch.Tensor, rows_dim: int = 0) -> torch.Tensor:
    """``torch.einsum(equation, x, weight)``, each row along x's ``rows_dim`` (a batch index of the product, kept
    in the output) computed as in a product of at least MIN_ROWS."""
    rows = x.shape[rows_dim]
    if rows >= MIN_ROWS:
        return torch.einsum(equation, x, weight)
    inputs, output = equation.replace(" ", "").split("->")
    out_dim = output.index(inputs.split(",")[0][rows_dim])
    return torch.einsum(equation, _padded(x, rows_dim), weight).narrow(out_dim, 0, rows)



def weighted_values(probs: torch.Tensor, values: torch.Tensor, lengths: Sequence[int]) -> torch.Tensor:
    """``torch.bmm(probs, values)`` for probs [B, h, T], values [B, T, d] where row i's keys past
    ``lengths[i]`` have probability 0: each row's product over its own keys alone, so its result is the same
    whatever T the batch pads it to (one product over all T keys sums in an order that depends on T,
    measured: rows of 200-300 keys padded by 50 differ)."""
    return torch.stack([torch.mm(probs[i, :, :n], values[i, :n]) for i, n in enumerate(lengths)])
