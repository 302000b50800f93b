"""The prefill stages as a flow shop: exact times of overlapping requests (kvpool.tools.sim.stages)."""

from __future__ import annotations

import pytest

from kvpool.tools.sim.cost_model import CostModel, ModelShape, PrefillCost, StageTimes
from kvpool.tools.sim.stages import StageFlow


def test_an_idle_pipeline_ends_one_span_plus_the_fill_after_the_restore() -> None:
    flow = StageFlow(4)
    # the restore landed on every stage at t=2; 3 s a stage, pieces of 1 s
    assert flow.schedule(2.0, StageTimes(3.0, 1.0)) == [5.0, 6.0, 7.0, 8.0]
    assert flow.free_at == [5.0, 6.0, 7.0, 8.0]


def test_a_second_request_waits_for_each_stage_and_its_spread_grows() -> None:
    flow = StageFlow(4)
    flow.schedule(1.0, StageTimes(3.0, 1.0))  # stages end at 4, 5, 6, 7
    # the next, admitted at 4, restored on every stage by 5 (the later stages read while they still compute the
    # first, as the services' stages restore beside their compute): stage s starts once free and the stage
    # before handed it the first piece: 5, 6, 7, 8
    assert flow.schedule(5.0, StageTimes(3.0, 1.0)) == [8.0, 9.0, 10.0, 11.0]
    # stages that forward a request whole (one piece): the second request's stage 1 starts when stage 0 has
    # computed it and stage 1 is free of the first, its restore already landed
    flow2 = StageFlow(2)
    flow2.schedule(0.5, StageTimes(2.0, 2.0))  # sequential: stage 0 ends 2.5, stage 1 4.5
    assert flow2.schedule(3.0, StageTimes(2.0, 2.0)) == [5.0, 7.0]
    # a long restore on a busy pipeline: stage 1 is free at 4.5 but waits for the bytes (6.0) and for stage 0
    assert StageFlow(2, [4.0, 4.5]).schedule(6.0, StageTimes(1.0, 0.5)) == [7.0, 7.5]


def test_a_request_shorter_than_a_piece_goes_through_the_stages_one_after_another() -> None:
    cost = CostModel(model=ModelShape(num_layers=4, kv_entry_bytes=1, chunk_tokens=256),
                     prefill=PrefillCost(chunk_base_s=1.0, chunk_per_context_token_s=0.0, forward_tokens=1024))
    # 768 tokens, one piece of 768: 3 chunk-times a stage, each stage after the previous
    assert cost.stage_times(0, 768) == StageTimes(3.0, 3.0)
    assert cost.compute_s(0, 768, 4) == pytest.approx(12.0)
    # 2,048 tokens: 8 chunk-times a stage, pieces of 4: one span plus 3 pieces to fill
    assert cost.stage_times(0, 2048) == StageTimes(8.0, 4.0)
    assert cost.compute_s(0, 2048, 4) == pytest.approx(8.0 + 3 * 4.0)
    # one chunk per piece (the default): the old pipeline over chunks
    chunked = CostModel(prefill=PrefillCost(chunk_base_s=1.0, chunk_per_context_token_s=0.0))
    assert chunked.compute_s(0, 2048, 4) == pytest.approx(8.0 + 3 * 1.0)


def test_pieces_end_at_multiples_of_the_piece_size_as_the_services_cut_them() -> None:
    cost = CostModel(model=ModelShape(num_layers=4, kv_entry_bytes=1, chunk_tokens=256),
                     prefill=PrefillCost(chunk_base_s=1.0, chunk_per_context_token_s=0.0, forward_tokens=1024))
    # 768 tokens from 512 cross 1,024: pieces [512, 1024) and [1024, 1280), 2 and 1 chunk-times, so the stages
    # overlap on them (3 + 3 x 2 = 9, against 12 for the same 768 tokens inside one piece)
    assert cost.stage_times(512, 768) == StageTimes(3.0, 2.0)
    assert cost.compute_s(512, 768, 4) == pytest.approx(9.0)
    # 2,560 tokens from 768: [768, 1024), [1024, 2048), [2048, 3072), [3072, 3328): the whole middle piece longest
    assert cost.stage_times(768, 2560) == StageTimes(10.0, 4.0)
    # a piece's time grows with its context: the last partial piece can be the longest
    grows = CostModel(model=ModelShape(num_layers=4, kv_entry_bytes=1, chunk_tokens=256),
                      prefill=PrefillCost(chunk_base_s=0.0, chunk_per_context_token_s=1.0, forward_tokens=1024))
    times = grows.stage_times(768, 1280)  # [768, 1024), [1024, 2048): the second, at contexts 1024..1792
    assert times.max_piece_s == pytest.approx(grows._piece_s(1024, 1024))


def test_the_closed_form_flow_equals_a_piece_by_piece_flow_shop() -> None:
    import random

    rng = random.Random(7)
    cost = CostModel(model=ModelShape(num_layers=4, kv_entry_bytes=1, chunk_tokens=256),
                     prefill=PrefillCost(chunk_base_s=0.3, chunk_per_context_token_s=1e-4, forward_tokens=2048))
    flow, free_at = StageFlow(4), [0.0] * 4
    now = 0.0
    for _ in range(300):
        now += rng.uniform(0.0, 2.0)
        first, n = rng.randrange(0, 200_000, 256), rng.randrange(256, 20_000, 256)
        read_end = now + rng.uniform(0.0, 0.5)
        ends = flow.schedule(read_end, cost.stage_times(first, n))
        # piece by piece: each stage's pieces in order, each after the stage before finished it
        cuts, start = [], first
        while start < first + n:
            stop = min(first + n, (start // 2048 + 1) * 2048)
            cuts.append(cost._piece_s(start, stop - start))
            start = stop
        above = [float("-inf")] * len(cuts)
        expected = []
        for s in range(4):
            t = max(read_end, free_at[s])
            for k, p in enumerate(cuts):
                t = max(t, above[k]) + p
                above[k] = t
            free_at[s] = t
            expected.append(t)
        assert ends == pytest.approx(expected, rel=1e-12)


def test_a_flow_needs_a_stage() -> None:
    with pytest.raises(ValueError, match="num_stages"):
        StageFlow(0)
