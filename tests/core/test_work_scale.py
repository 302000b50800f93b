"""The measured work factor (kvpool.core.prefill.work_scale): exact figures."""

from __future__ import annotations

import math

import pytest

from kvpool.core.errors import InvalidArgument
from kvpool.core.prefill.queue import WorkWeights, prefill_work_s
from kvpool.core.prefill.work_scale import MAX_FACTOR, MIN_FACTOR, WorkScale, host_work_s

W = WorkWeights()


def test_the_factor_is_one_until_enough_work_was_observed_then_the_ratio_of_the_sums() -> None:
    scale = WorkScale(half_life=64, min_estimated_s=0.01)
    assert scale.factor == 1.0
    scale.observe(0.004, 0.4)  # 100x slower, but only 4 ms of reference work seen
    assert scale.factor == 1.0
    scale.observe(0.006, 0.6)
    assert scale.factor == pytest.approx(100.0)
    assert scale.estimated_total_s == pytest.approx(0.01)


def test_each_observation_weighs_half_as_much_after_a_half_life() -> None:
    scale = WorkScale(half_life=1, min_estimated_s=0)
    scale.observe(1.0, 10.0)  # 10x
    scale.observe(1.0, 2.0)  # 2x: the first now weighs 1/2
    assert scale.factor == pytest.approx((10 * 0.5 + 2) / (1 * 0.5 + 1))
    for _ in range(60):
        scale.observe(1.0, 2.0)
    assert scale.factor == pytest.approx(2.0)  # the host's new speed, the old one forgotten


def test_a_piece_is_observed_at_its_context() -> None:
    scale = WorkScale(min_estimated_s=0)
    estimate = prefill_work_s(4096, 2048, 0, W)  # tokens [2048, 4096) at their mean context
    scale.observe_piece(2048, 4096, 3 * estimate, W)
    assert scale.factor == pytest.approx(3.0)
    with pytest.raises(InvalidArgument, match="^piece: "):
        scale.observe_piece(10, 10, 1.0, W)


def test_the_factor_is_bounded_and_bad_observations_are_refused() -> None:
    fast, slow = WorkScale(min_estimated_s=0), WorkScale(min_estimated_s=0)
    fast.observe(1.0, 0.0)
    slow.observe(1e-9, 1e9)
    assert (fast.factor, slow.factor) == (MIN_FACTOR, MAX_FACTOR)
    for estimated, measured in ((0.0, 1.0), (-1.0, 1.0), (math.nan, 1.0), (1.0, -1.0), (1.0, math.inf)):
        with pytest.raises(InvalidArgument):
            fast.observe(estimated, measured)
    assert fast.num_observed == 1
    with pytest.raises(InvalidArgument, match="^half_life: "):
        WorkScale(half_life=0)


def test_host_work_scales_the_compute_and_takes_the_restore_as_measured() -> None:
    compute = prefill_work_s(5000, 4000, 0, W)
    assert host_work_s(5000, 4000, 3, W, factor=50.0, restore_s_per_chunk=0.02) == pytest.approx(50 * compute + 0.06)
    assert host_work_s(5000, 4000, 0, W, factor=1.0, restore_s_per_chunk=0.0) == pytest.approx(compute)
    with pytest.raises(InvalidArgument):
        host_work_s(5000, 4000, 0, W, factor=0.0, restore_s_per_chunk=0.0)
    with pytest.raises(InvalidArgument, match="^num_restore_chunks: "):
        host_work_s(5000, 4000, -1, W, factor=1.0, restore_s_per_chunk=0.0)
