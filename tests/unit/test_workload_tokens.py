"""Token ids of trace prompts: lengths under a scale factor, determinism, the prefix property, speed."""

from __future__ import annotations


import pytest

from kvpool.workload.tokens import (
    scaled_block_tokens,
    scaled_prompt_tokens,
    shared_prefix_tokens,
    turn_token_ids,
)

VOCAB = 32000


@pytest.mark.parametrize(("scale", "expected"), [(1, 64), (16, 4), (3, 21), (64, 1), (128, 1)])
def test_scaled_block_tokens(scale: int, expected: int) -> None:
    assert scaled_block_tokens(64, scale) == expected


@pytest.mark.parametrize(
    ("tokens", "ids", "scale", "expected"),
    [
        (128, [1, 2], 16, 8),
        (130, [1, 2], 16, 9),  # 2 full blocks of 4 + ceil(2 * 4 / 64) = 1 for the id-less tail
        (130, [1, 2, 3], 16, 9),  # same length when the partial block has an id
        (191, [1, 2], 16, 12),  # tail of 63 tokens -> ceil(63 * 4 / 64) = 4
        (130, [1, 2], 1, 130),
        (0, [], 16, 0),
    ],
)
def test_scaled_lengths(tokens: int, ids: list[int], scale: int, expected: int) -> None:
    assert len(turn_token_ids("s", ids, tokens, 64, scale, VOCAB)) == expected
    assert scaled_prompt_tokens(tokens, 64, scale) == expected


def test_tokens_are_pinned() -> None:
    # pinned: a change here changes every replay's prompts (and cached results keyed on them)
    assert turn_token_ids("s", [1, 2], 128, 64, 16, 1000) == [394, 771, 129, 634, 701, 236, 891, 272]
    assert shared_prefix_tokens(64, 16, 1000) == [569, 448, 185, 510]


def test_token_range_and_session_namespace() -> None:
    a = turn_token_ids("a", list(range(50)), 50 * 64, 64, 16, 7)
    assert all(1 <= t < 7 for t in a)  # token 0 never used
    assert turn_token_ids("a", [1], 64, 64, 1, VOCAB) != turn_token_ids("b", [1], 64, 64, 1, VOCAB)


def test_shared_leading_ids_give_exactly_that_token_prefix() -> None:
    x = turn_token_ids("s", [1, 2, 3], 192, 64, 16, VOCAB)
    y = turn_token_ids("s", [1, 2, 4], 192, 64, 16, VOCAB)
    assert x[:8] == y[:8]
    assert all(p != q for p, q in zip(x[8:], y[8:]))
    longer = turn_token_ids("s", [1, 2, 3, 5], 300, 64, 16, VOCAB)
    assert longer[:12] == x
    # a partial block with an id is the start of that id's full block
    partial = turn_token_ids("s", [1, 2, 3], 150, 64, 16, VOCAB)
    assert partial == x[:8] + x[8:10]  # ceil(22 * 4 / 64) = 2
    # an id-less tail depends on the prompt length, so it is not shared with a longer prompt
    tail_a = turn_token_ids("s", [1, 2], 150, 64, 16, VOCAB)
    tail_b = turn_token_ids("s", [1, 2], 160, 64, 16, VOCAB)
    assert tail_a[:8] == tail_b[:8] and tail_a[8:] != tail_b[8:]


def test_shared_prefix_is_prepended_and_nested() -> None:
    prefix = shared_prefix_tokens(17000, 16, VOCAB)
    assert len(prefix) == 1063  # ceil(17000 / 16)
    assert shared_prefix_tokens(16000, 16, VOCAB) == prefix[:1000]
    tokens = turn_token_ids("s", [1], 64, 64, 16, VOCAB, shared_prefix=prefix)
    assert tokens == prefix + turn_token_ids("s", [1], 64, 64, 16, VOCAB)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="4 hash ids for 130 tokens"):
        turn_token_ids("s", [1, 2, 3, 4], 130, 64, 16, VOCAB)
    with pytest.raises(ValueError, match="scale"):
        turn_token_ids("s", [], 0, 64, 0, VOCAB)
    with pytest.raises(ValueError, match="vocab_size"):
        shared_prefix_tokens(10, 1, 1)


def test_130k_prompt_at_scale_16_has_the_scaled_length_and_is_deterministic() -> None:
    # how fast this is belongs in a benchmark; here: the length and the determinism
    ids = list(range(130_000 // 64))
    tokens = turn_token_ids("s130k", ids, 130_000, 64, 16, VOCAB)
    assert len(tokens) == 8125
    assert tokens == turn_token_ids("s130k", ids, 130_000, 64, 16, VOCAB)
    assert tokens != turn_token_ids("other", ids, 130_000, 64, 16, VOCAB)
