"""The synthetic session has the real traces' shape: a growing context, ~95% of each prompt seen before."""

from __future__ import annotations

from kvpool.workload.bounds import trace_block_bound
from kvpool.workload.synthetic import synthetic_session


def test_shape_and_determinism() -> None:
    session = synthetic_session(num_turns=12, seed=3)
    assert session == synthetic_session(num_turns=12, seed=3)
    assert session != synthetic_session(num_turns=12, seed=4)
    turns = session.turns
    assert len(turns) == 12 and turns[0].input_tokens == (4_000 + 12_000 + 1_500) // 64 * 64
    for before, after in zip(turns, turns[1:]):
        # each prompt is the previous one plus new blocks
        assert after.hash_ids[: len(before.hash_ids)] == before.hash_ids
        assert after.input_tokens > before.input_tokens and after.t > before.t
    bound = trace_block_bound([session])
    assert 0.85 < bound < 0.97  # the first turn is all new; later turns ~95% seen
