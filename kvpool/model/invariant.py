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

MIN_ROWS = 4  # measured: the least row count summed as every larger one is (a one-row product costs 2x on four)


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


def attend_each(query: torch.Tensor, keys: torch.Tensor, lengths: Sequence[int], scale: float,
                value_dim: int) -> torch.Tensor:
    """Each sequence's one-query attention over its own keys: query [B, h, d], keys [B, T, d] (sequence i's
    first ``lengths[i]``, the rest padding), values the keys' first ``value_dim`` columns; [B, h, value_dim].

    Sequence by sequence, on exactly its keys, so its result is the same whatever T the batch pads it to:
    a product, or a softmax, over a padded row sums in an order that depends on the padding (measured:
    scores and softmax of rows under 12 keys, the weighted values of rows of 200-300 keys).
    """
    out = []
    for i, n in enumerate(lengths):
        own = keys[i, :n]
        probs = torch.softmax(torch.mm(query[i], own.t()) * scale, dim=-1)
        out.append(torch.mm(probs, own[:, :value_dim]))
    return torch.stack(out)
