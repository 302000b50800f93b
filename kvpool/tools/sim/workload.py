"""Trace sessions as the simulator plays them: chunk hashes from block ids, at full token scale.

A weka trace gives one id per 64-token block, equal ids meaning equal content
with equal prefix. At full scale a 256-token chunk is exactly 4 blocks, and
since ``in // 256 == (in // 64) // 4`` for the real files (only full blocks
carry ids), the chunks of a prompt are its consecutive groups of 4 block ids.
The core's ``chunk_hashes`` is run over the block-id sequence with a chunk
of 4 "tokens": it chains ``h_i = H(h_{i-1}, ids of chunk i)`` rooted at the
namespace, so two prompts share leading chunk hashes exactly when they share
those leading block ids, which is what equal leading token ids would give
(the token ids themselves are never made: no per-token work).

Sessions are played as instances: instance k plays trace ``k % num_traces``
under its own namespace, so two instances of one trace share nothing (as two
real sessions share nothing in these per-session-id traces). With
``agent_prefix`` every instance is a session of one agent: all share one
namespace, and each keeps the trace's own block ids only over its system and
tool prefix (``system_tokens + tool_tokens``; the traces' prefixes are equal
over their first 10-20K tokens), its later blocks made its own
(``own_block_ids``), so sessions share chunks exactly where their prefixes are
equal and nothing after.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from kvpool.core.chunk_hash import ChunkHash, chunk_hashes
from kvpool.workload.weka import Session, Turn

BLOCK_TOKENS = 64


AGENT_NAMESPACE = "sim/agent"


def own_block_ids(ids: list[int], shared_blocks: int, instance: int) -> list[int]:
    """``ids`` with every block past the first ``shared_blocks`` made the instance's own: XOR with a salt
    distinct for every instance (k x an odd constant + 1, a bijection of uint32), so two instances' chains part at
    their first own chunk even when they play one trace."""
    salt = (instance * 2654435761 + 1) & 0xFFFFFFFF
    return ids[:shared_blocks] + [(i ^ salt) & 0xFFFFFFFF for i in ids[shared_blocks:]]


def turn_chunk_hashes(namespace: str, turn: Turn, block_size: int, chunk_tokens: int,
                      own: tuple[int, int] | None = None,
                      last: tuple[list[int], list[ChunkHash]] | None = None) -> tuple[list[int], list[ChunkHash]]:
    """The block ids hashed and the chunk hashes of one prompt: ``turn.input_tokens // chunk_tokens`` of them
    (``own``: the instance and its shared prefix's blocks, for ``own_block_ids``). ``last``: the session's last
    prompt's (ids, hashes): the chunks the two share are not hashed again (the chain gives the same hashes)."""
    if chunk_tokens % block_size:
        raise ValueError(f"chunk_tokens {chunk_tokens} is not a multiple of the trace's block size {block_size}")
    blocks_per_chunk = chunk_tokens // block_size
    num_chunks = turn.input_tokens // chunk_tokens
    ids = turn.hash_ids[: num_chunks * blocks_per_chunk]
    ids = own_block_ids(list(ids), own[1], own[0]) if own is not None else list(ids)
    if not last:
        return ids, chunk_hashes(namespace, ids, blocks_per_chunk)
    last_ids, last_hashes = last
    n = min(len(ids), len(last_ids)) // blocks_per_chunk
    if ids[: n * blocks_per_chunk] != last_ids[: n * blocks_per_chunk]:
        n = next(i for i, (a, b) in enumerate(zip(ids, last_ids)) if a != b) // blocks_per_chunk
    rest = chunk_hashes(namespace, ids[n * blocks_per_chunk:], blocks_per_chunk, last_hashes[n - 1] if n else None)
    return ids, last_hashes[:n] + rest


@dataclass(slots=True)
class SessionPlay:
    """One session instance: a trace replayed turn by turn under its own namespace."""

    instance: int
    trace: Session
    next_turn: int = 0
    hashes: list[ChunkHash] = field(default_factory=list)
    servers: list[int] = field(default_factory=list)  # the server of each turn placed so far
    agent_prefix: bool = False  # a session of one agent: its system and tool prefix shared (see the module doc)
    _hashed: tuple[list[int], list[ChunkHash]] | None = None  # the last prompt's block ids and chunk hashes

    @property
    def key(self) -> str:
        return f"s{self.instance}"

    @property
    def namespace(self) -> str:
        return AGENT_NAMESPACE if self.agent_prefix else f"sim/{self.instance}/{self.trace.id}"

    @property
    def shared_blocks(self) -> int:
        return (self.trace.system_tokens + self.trace.tool_tokens) // self.trace.block_size

    @property
    def done(self) -> bool:
        return self.next_turn >= len(self.trace.turns)

    def take_turn(self, chunk_tokens: int, max_context: int | None = None) -> tuple[Turn, bool]:
        """The next turn as played (cut to ``max_context`` by ``fit_to_context``) and whether it was cut."""
        recorded = self.trace.turns[self.next_turn]
        self.next_turn += 1
        turn = recorded if max_context is None else fit_to_context(recorded, self.trace.block_size, max_context)
        own = (self.instance, self.shared_blocks) if self.agent_prefix else None
        self._hashed = turn_chunk_hashes(self.namespace, turn, self.trace.block_size, chunk_tokens, own, self._hashed)
        self.hashes = self._hashed[1]
        return turn, turn is not recorded


PLACEMENTS = ("first", "stayed", "returned", "new_server")


def placed_on(play: SessionPlay, server: int) -> str:
    """Record that the session's next turn runs on ``server`` and say where that is for its history: its
    ``first`` turn; ``stayed`` on its last turn's server; ``returned`` to a server an earlier turn ran on;
    or a ``new_server`` that holds none of it (split pools: nothing of the session to reuse there)."""
    kind = ("first" if not play.servers else "stayed" if play.servers[-1] == server
            else "returned" if server in play.servers else "new_server")
    play.servers.append(server)
    return kind


def fit_to_context(turn: Turn, block_size: int, max_context: int) -> Turn:
    """The trace-handling rule for a prompt the model cannot take whole.

    A turn whose prompt plus output passes ``max_context`` keeps the prompt's leading
    ``max_context - output`` tokens (and their block ids): the history a client that cuts its
    conversation to the context would resend, so the turn still reuses its session's prefix.
    The cut is counted by the caller (``trace_policy`` in a run's summary); nothing is refused silently.
    """
    output = max(1, turn.output_tokens)
    if turn.input_tokens + output <= max_context:
        return turn
    keep = max(1, max_context - output)
    return replace(turn, input_tokens=keep, hash_ids=turn.hash_ids[: keep // block_size])
