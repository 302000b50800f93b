"""The served context: the smallest of the model's context and every cache, page pool and arena."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvpool.core.decode.pages import kv_capacity, pages_for_request
from kvpool.core.decode.regions import REGION_ALIGNMENT
from kvpool.core.api.served_context import ShardLimits, served_context

# tiny's shard under kvpool up's old defaults: 8 layers x 96 float32 values = 3,072 bytes per token
OLD_DEFAULT = ShardLimits(max_context=32768, num_pages=256 * 2**20 // (16 * 3072), page_size=16,
                          arena_bytes=64 * 2**20, region_bytes_per_token=3072)


def test_the_issue_figures() -> None:
    # prefill's 64 blocks of 256 held 16,384 prompt tokens; the arena held about 21.8K
    assert OLD_DEFAULT.max_prompt_in_arena() == 21845
    assert served_context(32768, [16384], [OLD_DEFAULT]) == 16385
    assert served_context(32768, [], [OLD_DEFAULT]) == 21846
    assert served_context(32768, [], []) == 32768


def test_the_tightest_limit_wins() -> None:
    pages = ShardLimits(max_context=32768, num_pages=100, page_size=16, arena_bytes=2**30, region_bytes_per_token=8)
    assert served_context(32768, [40000, 5000], [pages]) == 1601
    assert served_context(1000, [40000], [pages]) == 1000
    trailer = ShardLimits(32768, 10**6, 16, 3 * REGION_ALIGNMENT + 100, 1000, region_trailer_bytes=4096)
    assert trailer.max_prompt_in_arena() == 8  # (12,288 - 4,096) // 1,000


@given(prompt_limit=st.integers(1, 5000), num_pages=st.integers(1, 500), page_size=st.sampled_from([1, 16, 64]),
       arena=st.integers(REGION_ALIGNMENT, 10**7), per_token=st.integers(1, 5000), trailer=st.integers(0, 5000),
       model_context=st.integers(2, 40000))
def test_every_request_within_the_served_context_fits_and_one_past_it_does_not(
    prompt_limit: int, num_pages: int, page_size: int, arena: int, per_token: int, trailer: int, model_context: int,
) -> None:
    shard = ShardLimits(model_context, num_pages, page_size, arena, per_token, trailer)
    context = served_context(model_context, [prompt_limit], [shard])

    def fits(prompt: int, max_tokens: int) -> bool:
        region = -(-(prompt * per_token + trailer) // REGION_ALIGNMENT) * REGION_ALIGNMENT
        return (prompt + max_tokens <= model_context and prompt <= prompt_limit
                and pages_for_request(prompt, max_tokens, page_size) <= num_pages and region <= arena
                and kv_capacity(prompt, max_tokens) >= prompt)

    if context >= 2:
        # the two extremes of a request that fills the context: the longest prompt, the most output
        assert fits(context - 1, 1) and fits(1, context - 1)
    # one past it: some split does not fit
    assert not (fits(context, 1) and fits(1, context))
