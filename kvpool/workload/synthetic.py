"""A synthetic coding-agent session shaped like the real traces, for demos and tests without trace files.

Shape (from the agentx-weka traces): a system + tool prompt of ~16K tokens,
then turns whose prompt is the whole conversation so far plus what happened
since the last turn (the model's reply and a tool's output), so about 95% of
each prompt was seen before; replies of a few hundred tokens. Deterministic in
its seed; the result is an ordinary ``Session`` (64-token blocks, hash ids
chained from the start) that ``kvpool.workload.tokens`` turns into token ids.
"""

from __future__ import annotations

import random

from kvpool.workload.weka import Session, Turn

BLOCK_SIZE = 64


def synthetic_session(
    num_turns: int = 12,
    seed: int = 0,
    system_tokens: int = 4_000,
    tool_tokens: int = 12_000,
    first_user_tokens: int = 1_500,
    session_id: str = "synthetic",
) -> Session:
    """A growing-context session: every turn adds the previous reply and a tool output (a few % of the prompt)."""
    if num_turns < 1:
        raise ValueError(f"num_turns: must be >= 1, got {num_turns}")
    rng = random.Random(seed)
    next_id = iter(range(1, 1 << 30))
    prefix_blocks = (system_tokens + tool_tokens + first_user_tokens) // BLOCK_SIZE
    hash_ids = [next(next_id) for _ in range(prefix_blocks)]
    turns = []
    t = 0.0
    for _ in range(num_turns):
        output_tokens = rng.randint(120, 600)
        think_time = rng.uniform(0.5, 4.0)
        turns.append(Turn(t, len(hash_ids) * BLOCK_SIZE, output_tokens, tuple(hash_ids), think_time))
        # the reply and then a tool's output join the conversation: ~3-6% new blocks a turn
        new_tokens = output_tokens + rng.randint(200, 1_200)
        hash_ids.extend(next(next_id) for _ in range(-(-new_tokens // BLOCK_SIZE)))
        t += think_time + output_tokens / 50
    return Session(session_id, BLOCK_SIZE, system_tokens, tool_tokens, tuple(turns))
