"""One real agentx-weka session end to end: load, id counts, token ids, bounds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvpool.workload import (
    chunk_prefix_bound,
    load_session,
    scaled_prompt_tokens,
    session_token_ids,
    trace_block_bound,
)

TRACES = Path(__file__).resolve().parents[2].parent / "shared" / "traces" / "agentx-weka"
SESSION_WITH_SUBAGENTS = TRACES / "trace_0003.json"

pytestmark = pytest.mark.skipif(
    not SESSION_WITH_SUBAGENTS.is_file(), reason=f"real traces not present at {TRACES}"
)


def test_real_session_with_subagents() -> None:
    raw = json.loads(SESSION_WITH_SUBAGENTS.read_text())
    expected_turns = sum(len(r["requests"]) if r.get("type") == "subagent" else 1 for r in raw["requests"])
    session = load_session(SESSION_WITH_SUBAGENTS)
    assert len(session.turns) == expected_turns == 409
    times = [t.t for t in session.turns]
    assert times == sorted(times)
    assert {t.agent_id for t in session.turns} == {None, "agent_001", "agent_002"}
    # the real files give ids for full blocks only
    assert all(len(t.hash_ids) == t.input_tokens // session.block_size for t in session.turns)

    block_bound = trace_block_bound([session])
    assert block_bound == pytest.approx(0.9501, abs=1e-4)

    prompts = list(session_token_ids(session, scale=16, vocab_size=32000))
    assert [len(p) for p in prompts] == [scaled_prompt_tokens(t.input_tokens, 64, 16) for t in session.turns]
    chunk_bound = chunk_prefix_bound(prompts, 256).ratio
    assert 0.85 < chunk_bound < block_bound  # coarser chunks and prefix-only lose a little
