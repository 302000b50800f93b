"""Device block manager: exact block ids, eviction order, refcounts, invariants."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvpool.core.prefill.block_manager import BlockManager, NoFreeBlocks
from kvpool.core.chunk_hash import ChunkHash, chunk_hashes
from kvpool.core.errors import InvalidArgument, NotFound, ResourceExhausted
from kvpool.core.sessions.table import SessionId
from kvpool.core.tenancy.shares import TenantShares, parse_weights

NS = "ns"
CHUNK = 4


def prompt(n: int, seed: int = 0) -> list[int]:
    return [seed * 1000 + i for i in range(n)]


def hashes(ids: list[int]) -> list[ChunkHash]:
    return chunk_hashes(NS, ids, CHUNK)


def run(bm: BlockManager, request_id: str, ids: list[int], commit: bool = True, num_hit: int | None = None) -> list[int]:
    """Allocate with the full device hit (or ``num_hit``), then commit every full chunk."""
    hs = hashes(ids)
    hit = bm.match_prefix(hs) if num_hit is None else num_hit
    table = bm.allocate(request_id, hs, len(ids), hit)
    if commit:
        bm.commit_chunks(request_id, hit, hs[hit:])
    return table


def run_as(bm: BlockManager, tenant: str, request_id: str, ids: list[int]) -> list[int]:
    """``run`` for ``tenant``: its hashes are rooted at it, as the scheduler's are."""
    hs = chunk_hashes(f"{NS}/{tenant}", ids, CHUNK)
    table = bm.allocate(request_id, hs, len(ids), bm.match_prefix(hs), tenant)
    bm.commit_chunks(request_id, 0, hs)
    return table


def cached_of(bm: BlockManager, tenant: str, ids: list[int]) -> int:
    return bm.match_prefix(chunk_hashes(f"{NS}/{tenant}", ids, CHUNK))


def test_a_tenant_over_its_device_share_reuses_its_own_oldest_blocks() -> None:
    bm = BlockManager(8, CHUNK)
    assert run_as(bm, "alice", "a", prompt(8)) == [0, 1]
    bm.free("a")
    for i in range(3):
        run_as(bm, "flood", f"f{i}", prompt(8, seed=i + 1))
        bm.free(f"f{i}")
    assert bm.free_block_ids() == [1, 0, 3, 2, 5, 4, 7, 6]
    assert bm.tenant_blocks == {"alice": 2, "flood": 6}
    # flood (6 of a 4-block share) takes its own least recently used blocks, not alice's older ones
    assert run_as(bm, "flood", "f3", prompt(8, seed=4)) == [3, 2]
    assert cached_of(bm, "alice", prompt(8)) == 2
    bm.free("f3")
    # alice, within her share, takes from flood, the tenant over its share
    assert run_as(bm, "alice", "a2", prompt(8, seed=9)) == [5, 4]
    assert cached_of(bm, "alice", prompt(8)) == 2
    assert bm.tenant_blocks == {"alice": 4, "flood": 4}


def test_a_request_over_its_share_still_gets_blocks_from_the_lru_end() -> None:
    bm = BlockManager(4, CHUNK)
    run_as(bm, "alice", "a", prompt(4))
    bm.free("a")
    # flood holds none cached: its 3 blocks come uncached, then from alice's (the only cached one)
    assert run_as(bm, "flood", "f", prompt(16, seed=1)) == [1, 2, 3, 0]
    assert bm.tenant_blocks == {"flood": 4} and cached_of(bm, "alice", prompt(4)) == 0


def test_one_tenant_evicts_in_plain_lru_order() -> None:
    weighted = BlockManager(8, CHUNK, TenantShares(parse_weights(["alice=3"])))
    plain = BlockManager(8, CHUNK)
    for bm in (weighted, plain):
        for i in range(6):
            run(bm, f"r{i}", prompt(9, seed=i))
            bm.free(f"r{i}")
    assert weighted.free_block_ids() == plain.free_block_ids()
    assert [b.chunk_hash for b in weighted.blocks] == [b.chunk_hash for b in plain.blocks]


def test_forgotten_and_unhashed_blocks_are_no_ones() -> None:
    bm = BlockManager(8, CHUNK)
    run_as(bm, "alice", "a", prompt(10))
    assert bm.tenant_blocks == {"alice": 3}
    bm.free("a")
    assert bm.tenant_blocks == {"alice": 2}  # the partial block caches nothing
    bm.forget_cached()
    assert bm.tenant_blocks == {}


def snapshot(bm: BlockManager) -> tuple:
    return (
        bm.free_block_ids(),
        [(b.ref_count, b.chunk_hash) for b in bm.blocks],
        {h: bm.cached_block_id(h) for b in bm.blocks if (h := b.chunk_hash)},
        {r: bm.block_table(r) for r in list(bm._requests)},
    )


def test_fresh_pool_allocates_in_id_order() -> None:
    bm = BlockManager(num_blocks=8, chunk_size=CHUNK)
    assert run(bm, "a", prompt(10)) == [0, 1, 2]  # 2 full chunks + a partial one
    assert bm.block_table("a") == [0, 1, 2]
    assert bm.free_block_ids() == [3, 4, 5, 6, 7]
    assert (bm.num_free_blocks, bm.num_cached_blocks, bm.usage) == (5, 2, 3 / 8)
    assert [b.ref_count for b in bm.blocks] == [1, 1, 1, 0, 0, 0, 0, 0]
    assert bm.blocks[2].chunk_hash is None  # the partial chunk is never cached


def test_freed_blocks_stay_cached_and_hit() -> None:
    bm = BlockManager(8, CHUNK)
    run(bm, "a", prompt(10))
    bm.free("a")
    # hashed blocks to the MRU end tail-first; the unhashed partial block to the LRU end
    assert bm.free_block_ids() == [2, 3, 4, 5, 6, 7, 1, 0]
    assert (bm.num_free_blocks, bm.num_cached_blocks, bm.usage) == (8, 2, 0.0)
    assert bm.match_prefix(hashes(prompt(10))) == 2
    assert bm.match_prefix(hashes(prompt(16))) == 2  # a longer prompt with the same head
    assert run(bm, "b", prompt(10)) == [0, 1, 2]
    assert bm.free_block_ids() == [3, 4, 5, 6, 7]


def test_forget_cached_drops_every_hit_and_keeps_live_tables() -> None:
    bm = BlockManager(8, CHUNK)
    run(bm, "a", prompt(10))  # blocks 0, 1 cached, 2 partial; a still holds them
    run(bm, "b", prompt(8, seed=1))  # blocks 3, 4 cached
    bm.free("b")
    assert bm.free_block_ids() == [5, 6, 7, 4, 3]
    assert bm.forget_cached() == 4
    assert bm.num_cached_blocks == 0
    assert bm.match_prefix(hashes(prompt(10))) == 0 and bm.match_prefix(hashes(prompt(8, seed=1))) == 0
    # free blocks that were cached are reused first now (LRU end), in the order they had
    assert bm.free_block_ids() == [4, 3, 5, 6, 7]
    assert bm.block_table("a") == [0, 1, 2] and [b.ref_count for b in bm.blocks[:3]] == [1, 1, 1]
    assert all(b.chunk_hash is None for b in bm.blocks)
    # a's chunks may be committed again by a later request, nothing else changes
    bm.free("a")
    assert bm.free_block_ids() == [0, 1, 2, 4, 3, 5, 6, 7]  # uncached now: each to the LRU end
    assert bm.forget_cached() == 0


def test_lru_eviction_is_tail_first() -> None:
    bm = BlockManager(6, CHUNK)
    a = prompt(12)
    assert run(bm, "a", a) == [0, 1, 2]
    bm.free("a")
    assert bm.free_block_ids() == [3, 4, 5, 2, 1, 0]
    # a 4-block prompt takes the 3 never-used blocks, then evicts a's tail chunk
    assert run(bm, "b", prompt(16, seed=1)) == [3, 4, 5, 2]
    assert bm.match_prefix(hashes(a)) == 2
    assert run(bm, "c", prompt(4, seed=2)) == [1]
    assert bm.match_prefix(hashes(a)) == 1
    assert bm.cached_block_id(hashes(a)[0]) == 0
    assert bm.num_cached_blocks == 1 + 4 + 1


def test_free_returns_blocks_lru_first_across_requests() -> None:
    bm = BlockManager(4, CHUNK)
    run(bm, "a", prompt(8))
    run(bm, "b", prompt(8, seed=1))
    bm.free("b")
    bm.free("a")  # freed last = used most recently
    assert bm.free_block_ids() == [3, 2, 1, 0]


def test_shared_prefix_refcounts() -> None:
    bm = BlockManager(8, CHUNK)
    a = prompt(12)
    b = a[:8] + prompt(6, seed=1)  # same first 2 chunks, then its own
    assert run(bm, "a", a) == [0, 1, 2]
    assert bm.match_prefix(hashes(b)) == 2
    assert run(bm, "b", b) == [0, 1, 3, 4]
    assert [b.ref_count for b in bm.blocks] == [2, 2, 1, 1, 1, 0, 0, 0]
    bm.free("a")
    assert [b.ref_count for b in bm.blocks] == [1, 1, 0, 1, 1, 0, 0, 0]
    assert bm.free_block_ids() == [5, 6, 7, 2]
    bm.free("b")
    assert bm.free_block_ids() == [4, 5, 6, 7, 2, 3, 1, 0]
    assert bm.num_cached_blocks == 4


def test_hit_on_a_free_cached_block_takes_it_off_the_free_list() -> None:
    bm = BlockManager(4, CHUNK)
    run(bm, "a", prompt(8))
    bm.free("a")
    assert bm.free_block_ids() == [2, 3, 1, 0]
    assert run(bm, "b", prompt(8) + prompt(8, seed=1)) == [0, 1, 2, 3]
    assert bm.num_free_blocks == 0


def test_no_free_blocks_leaves_state_unchanged() -> None:
    bm = BlockManager(4, CHUNK)
    run(bm, "a", prompt(8))
    bm.free("a")
    run(bm, "x", prompt(4, seed=9))  # takes block 2, leaves cached 0, 1 free
    before = snapshot(bm)
    # 2 hits on free cached blocks + 3 fresh: only 1 block is allocatable besides the hits
    with pytest.raises(NoFreeBlocks) as info:
        run(bm, "b", prompt(8) + prompt(10, seed=1))
    assert (info.value.num_needed, info.value.num_free) == (3, 1)
    assert isinstance(info.value, ResourceExhausted)
    assert snapshot(bm) == before
    with pytest.raises(NotFound):
        bm.block_table("b")
    # an exact fit succeeds without evicting its own hits
    assert run(bm, "b", prompt(8) + prompt(2, seed=1)) == [0, 1, 3]


def test_commit_of_a_hash_cached_elsewhere_keeps_the_first_writer() -> None:
    bm = BlockManager(8, CHUNK)
    ids = prompt(8)
    hs = hashes(ids)
    assert run(bm, "a", ids) == [0, 1]
    # the planner caps b's hit at 1 chunk (one token must be computed), so chunk 1 is recomputed
    assert bm.allocate("b", hs, 8, 1) == [0, 2]
    bm.commit_chunks("b", 1, hs[1:])
    assert bm.cached_block_id(hs[1]) == 1
    assert bm.blocks[2].chunk_hash is None
    assert bm.num_cached_blocks == 2
    bm.free("b")
    assert bm.free_block_ids()[0] == 2  # the duplicate caches nothing: reused first
    bm.commit_chunks("a", 0, hs)  # repeated commit is a no-op
    assert bm.cached_block_id(hs[0]) == 0
    with pytest.raises(InvalidArgument):
        bm.commit_chunks("a", 0, hs[1:])  # block 0 already holds another hash


def test_restored_chunks_become_device_cached() -> None:
    bm = BlockManager(8, CHUNK)
    ids = prompt(14)
    hs = hashes(ids)
    assert bm.allocate("a", hs, 14, 0) == [0, 1, 2, 3]
    bm.commit_chunks("a", 0, hs[:2])  # restored from the pool before compute
    assert bm.match_prefix(hs) == 2
    bm.commit_chunks("a", 2, hs[2:])  # computed
    assert bm.match_prefix(hs) == 3


def test_rejects_bad_calls() -> None:
    bm = BlockManager(8, CHUNK)
    hs = hashes(prompt(8))
    with pytest.raises(InvalidArgument):
        bm.allocate("a", hs, 8, 1)  # nothing cached yet
    with pytest.raises(InvalidArgument):
        bm.allocate("a", hs[:1], 8, 0)  # 8 tokens make 2 full chunks
    with pytest.raises(InvalidArgument):
        bm.allocate("a", [], 0, 0)
    bm.allocate("a", hs, 8, 0)
    with pytest.raises(InvalidArgument):
        bm.allocate("a", hs, 8, 0)
    with pytest.raises(InvalidArgument):
        bm.commit_chunks("a", 1, hs)  # past the full chunks
    with pytest.raises(NotFound):
        bm.commit_chunks("zz", 0, hs)
    bm.free("a")
    with pytest.raises(NotFound):
        bm.free("a")
    with pytest.raises(InvalidArgument):
        BlockManager(0, CHUNK)


def test_a_held_block_is_not_reused_until_its_save_ends() -> None:
    """A save writes straight from the pages: its blocks stay referenced after the request is freed."""
    bm = BlockManager(4, CHUNK)
    table = run(bm, "a", prompt(12))  # blocks 0-2, all hashed
    bm.hold("a/save", table[1:])  # the save reads chunks 1-2
    assert (bm.has_holder("a"), bm.has_holder("a/save"), bm.has_holder("b")) == (True, True, False)
    bm.free("a")
    assert (bm.has_holder("a"), bm.has_holder("a/save")) == (False, True)
    assert bm.free_block_ids() == [3, 0]  # 1 and 2 are still referenced by the save
    assert [b.ref_count for b in bm.blocks] == [0, 1, 1, 0]
    with pytest.raises(NoFreeBlocks):
        run(bm, "b", prompt(9, seed=1))  # needs 3 blocks, 2 are allocatable
    bm.free("a/save")
    assert not bm.has_holder("a/save")
    assert bm.free_block_ids() == [3, 0, 2, 1]  # back on the MRU end, tail first
    assert run(bm, "b", prompt(9, seed=1)) == [3, 0, 2]


def test_hold_takes_only_blocks_in_use_and_is_all_or_nothing() -> None:
    bm = BlockManager(4, CHUNK)
    table = run(bm, "a", prompt(8))
    with pytest.raises(InvalidArgument, match="not in use"):
        bm.hold("h", [table[0], 3])
    with pytest.raises(InvalidArgument, match="repeats"):
        bm.hold("h", [table[0], table[0]])
    assert [b.ref_count for b in bm.blocks] == [1, 1, 0, 0]
    bm.hold("h", table)
    with pytest.raises(InvalidArgument, match="already holds"):
        bm.hold("h", table)


def test_only_private_unhashed_blocks_are_restore_targets() -> None:
    bm = BlockManager(6, CHUNK)
    run(bm, "a", prompt(8))  # blocks 0-1 hashed, held by a
    table = bm.allocate("b", hashes(prompt(13)), 13, 2)  # device hit on 0-1, fresh 2-3
    assert table == [0, 1, 2, 3]
    assert [bm.is_private("b", b) for b in table] == [False, False, True, True]
    bm.hold("b/save", [2])
    assert not bm.is_private("b", 2)


ALICE, BOB = SessionId("t", "alice"), SessionId("t", "bob")


def run_session(bm: BlockManager, request_id: str, ids: list[int], session: SessionId) -> list[int]:
    hs = hashes(ids)
    table = bm.allocate(request_id, hs, len(ids), bm.match_prefix(hs), session=session)
    bm.commit_chunks(request_id, 0, hs)
    return table


def test_a_session_turn_keeps_its_whole_history_over_chunk_recency() -> None:
    bm = BlockManager(8, CHUNK)
    run_session(bm, "a1", prompt(8), ALICE)  # alice's main history: blocks 0, 1
    bm.free("a1")
    run_session(bm, "b1", prompt(8, seed=1), BOB)  # blocks 2, 3
    bm.free("b1")
    run_session(bm, "a2", prompt(4, seed=2), ALICE)  # alice's sub-agent: block 4 (no prefix in common)
    assert bm.free_block_ids() == [5, 6, 7, 1, 0, 3, 2]  # chunk recency: alice's main history is the oldest
    assert bm.touch_session(ALICE) == 2  # alice is active: her cached free blocks move to the MRU end
    assert bm.free_block_ids() == [5, 6, 7, 3, 2, 1, 0]
    bm.free("a2")
    assert bm.session_blocks(ALICE) == [1, 0, 4]
    assert bm.session_blocks(BOB) == [3, 2]
    # bob, idle longest, loses his blocks first: tail first
    assert run(bm, "c", prompt(20, seed=3)) == [5, 6, 7, 3, 2]
    assert bm.session_blocks(BOB) == []
    assert bm.match_prefix(hashes(prompt(8))) == 2


def test_blocks_a_save_releases_after_the_handoff_stay_the_sessions() -> None:
    """A save that ends after its request was freed must not orphan the blocks: the session's next turn
    touches them like the rest of its history (before, they were no session's and aged out first)."""
    bm = BlockManager(8, CHUNK)
    table = bm.allocate("a1", hashes(prompt(12)), 12, 0, session=ALICE)  # blocks 0-2
    bm.commit_chunks("a1", 0, hashes(prompt(12)))
    bm.hold("a1/save", table[1:])  # the save reads chunks 1-2 and ends last
    bm.free("a1")
    assert bm.session_blocks(ALICE) == [0]
    run_session(bm, "b1", prompt(8, seed=1), BOB)  # blocks 3-4
    bm.free("b1")
    bm.free("a1/save")
    assert bm.session_blocks(ALICE) == [0, 2, 1]
    assert bm.free_block_ids() == [5, 6, 7, 0, 4, 3, 2, 1]
    assert bm.touch_session(ALICE) == 3  # her whole history goes behind bob's
    assert bm.free_block_ids() == [5, 6, 7, 4, 3, 0, 2, 1]


def test_touch_sessions_makes_the_next_served_the_last_evicted() -> None:
    """Turns of alice, bob and carol wait, bob's to be served first: arrival order alone left bob's history
    the least recently used, the first an admission would take."""
    carol = SessionId("t", "carol")
    bm = BlockManager(8, CHUNK)
    for request_id, seed, session in (("b1", 1, BOB), ("a1", 0, ALICE), ("c1", 2, carol)):
        run_session(bm, request_id, prompt(8, seed=seed), session)
        bm.free(request_id)
    assert bm.free_block_ids() == [6, 7, 1, 0, 3, 2, 5, 4]  # bob's 0-1, alice's 2-3, carol's 4-5
    assert bm.touch_sessions([BOB, carol, ALICE]) == 6
    assert bm.free_block_ids() == [6, 7, 3, 2, 5, 4, 1, 0]  # alice's go first, bob's last
    assert bm.touch_sessions([]) == 0 and bm.touch_sessions([SessionId("t", "dave")]) == 0
    table = bm.allocate("d1", hashes(prompt(16, seed=3)), 16, 0)  # 4 fresh: the 2 uncached, then alice's
    assert table == [6, 7, 3, 2] and bm.match_prefix(hashes(prompt(8, seed=1))) == 2


def test_end_session_uncaches_its_free_blocks_and_they_go_first() -> None:
    bm = BlockManager(6, CHUNK)
    run_session(bm, "a1", prompt(8), ALICE)
    run_session(bm, "b1", prompt(8, seed=1), BOB)
    bm.free("b1")
    bm.free("a1")  # alice is the most recent
    assert (bm.num_uncached_free_blocks, bm.free_block_ids()) == (2, [4, 5, 3, 2, 1, 0])
    assert bm.end_session(ALICE) == 2
    assert bm.free_block_ids() == [1, 0, 4, 5, 3, 2]  # in their order: the tail is reused first
    assert bm.match_prefix(hashes(prompt(8))) == 0 and bm.match_prefix(hashes(prompt(8, seed=1))) == 2
    assert (bm.num_uncached_free_blocks, bm.tenant_blocks) == (4, {"default": 2})
    assert bm.end_session(ALICE) == 0  # nothing left
    # a block the session's live request holds is left to it
    run_session(bm, "b2", prompt(8, seed=1), BOB)
    assert bm.end_session(BOB) == 0 and bm.match_prefix(hashes(prompt(8, seed=1))) == 2


def test_end_session_with_a_limit_uncaches_the_tail_of_its_history_first() -> None:
    bm = BlockManager(8, CHUNK)
    run_session(bm, "a1", prompt(16), ALICE)  # chunks 0-3 in blocks 0-3
    bm.free("a1")
    assert bm.session_blocks(ALICE) == [3, 2, 1, 0]
    assert bm.end_session(ALICE, max_blocks=2) == 2
    assert bm.session_blocks(ALICE) == [1, 0] and bm.match_prefix(hashes(prompt(16))) == 2
    assert bm.free_block_ids()[:2] == [3, 2]  # uncached: reused first
    assert bm.end_session(ALICE, max_blocks=0) == 0 and bm.end_session(ALICE, max_blocks=5) == 2
    assert bm.match_prefix(hashes(prompt(16))) == 0 and bm.num_uncached_free_blocks == 8


def test_sessions_of_two_tenants_with_one_key_are_two_sessions() -> None:
    bm = BlockManager(6, CHUNK)
    mine, theirs = SessionId("t1", "s"), SessionId("t2", "s")
    run_session(bm, "a", prompt(8), mine)
    run_session(bm, "b", prompt(8, seed=1), theirs)
    bm.free("a")
    bm.free("b")
    assert bm.end_session(theirs) == 2
    assert bm.session_blocks(mine) == [1, 0]
    assert bm.match_prefix(hashes(prompt(8))) == 2


BASES = [prompt(40, seed=s) for s in range(3)]
# bases 0 and 1 are the flooder's (they share no prefix: its hashes), base 2 alice's
TENANT_OF_BASE = ("flood", "flood", "alice")
SESSIONS = (SessionId("flood", "s0"), SessionId("flood", "s1"), SessionId("alice", "s0"))


class BlockManagerMachine(RuleBasedStateMachine):
    """Random allocate / commit / free over prompts that share prefixes."""

    def __init__(self) -> None:
        super().__init__()
        self.bm = BlockManager(12, CHUNK)
        self.prompts: dict[str, list[ChunkHash]] = {}
        self.holds: dict[str, list[int]] = {}
        self.next_id = 0

    @rule(base=st.integers(0, 2), num_tokens=st.integers(1, 40), cap=st.booleans())
    def allocate(self, base: int, num_tokens: int, cap: bool) -> None:
        hs = hashes(BASES[base][:num_tokens])
        hit = self.bm.match_prefix(hs)
        if cap:
            hit = min(hit, (num_tokens - 1) // CHUNK)
        request_id = f"r{self.next_id}"
        self.next_id += 1
        before = snapshot(self.bm)
        tenant = TENANT_OF_BASE[base]
        usage = dict(self.bm.tenant_blocks)
        shares = self.bm.shares.shares(usage, tenant, self.bm.num_blocks)
        cached = {b.block_id: b.tenant for b in self.bm.blocks if b.chunk_hash is not None}
        try:
            table = self.bm.allocate(request_id, hs, num_tokens, hit, tenant, session=SESSIONS[base])
        except NoFreeBlocks:
            assert snapshot(self.bm) == before
            return
        assert len(table) == -(-num_tokens // CHUNK)
        self.prompts[request_id] = hs
        num_new = len(table) - hit
        over = usage.get(tenant, 0) + num_new > shares[tenant]
        lost = {owner for b, owner in cached.items() if self.bm.blocks[b].chunk_hash is None and owner != tenant}
        for owner in lost:
            if over and usage[owner] <= shares[owner]:
                # a tenant over its share takes from one within only when none of its own cached blocks is free
                assert all(b.ref_count or b.chunk_hash is None for b in self.bm.blocks if b.tenant == tenant)

    @precondition(lambda self: self.prompts)
    @rule(data=st.data())
    def commit(self, data: st.DataObject) -> None:
        request_id = data.draw(st.sampled_from(sorted(self.prompts)))
        hs = self.prompts[request_id]
        start = data.draw(st.integers(0, len(hs)))
        end = data.draw(st.integers(start, len(hs)))
        self.bm.commit_chunks(request_id, start, hs[start:end])

    @precondition(lambda self: self.prompts)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        request_id = data.draw(st.sampled_from(sorted(self.prompts)))
        del self.prompts[request_id]
        self.bm.free(request_id)

    @precondition(lambda self: self.prompts)
    @rule(data=st.data())
    def hold(self, data: st.DataObject) -> None:
        request_id = data.draw(st.sampled_from(sorted(self.prompts)))
        table = self.bm.block_table(request_id)
        block_ids = data.draw(st.lists(st.sampled_from(table), unique=True))
        holder_id = f"h{self.next_id}"
        self.next_id += 1
        self.bm.hold(holder_id, block_ids)
        self.holds[holder_id] = block_ids

    @precondition(lambda self: self.holds)
    @rule(data=st.data())
    def end_hold(self, data: st.DataObject) -> None:
        holder_id = data.draw(st.sampled_from(sorted(self.holds)))
        del self.holds[holder_id]
        self.bm.free(holder_id)

    @rule(base=st.integers(0, 2))
    def touch_session(self, base: int) -> None:
        owned = self.bm.session_blocks(SESSIONS[base])
        moved = self.bm.touch_session(SESSIONS[base])
        assert moved == len(owned)
        assert self.bm.free_block_ids()[len(self.bm.free_block_ids()) - moved:] == owned

    @rule(order=st.permutations(range(3)))
    def touch_sessions(self, order: list[int]) -> None:
        served = [SESSIONS[i] for i in order]
        owned = [b for s in reversed(served) for b in self.bm.session_blocks(s)]
        assert self.bm.touch_sessions(served) == len(owned)
        free = self.bm.free_block_ids()
        assert free[len(free) - len(owned):] == owned  # the first served at the MRU end

    @rule(base=st.integers(0, 2))
    def end_session(self, base: int) -> None:
        owned = self.bm.session_blocks(SESSIONS[base])
        assert self.bm.end_session(SESSIONS[base]) == len(owned)
        assert self.bm.free_block_ids()[: len(owned)] == owned
        assert all(self.bm.blocks[b].chunk_hash is None for b in owned)

    @rule()
    def forget_cached(self) -> None:
        # a stage restarted: no chunk may be claimed as a device hit any more
        tables = {r: self.bm.block_table(r) for r in self.prompts}
        self.bm.forget_cached()
        assert self.bm.num_cached_blocks == 0
        assert {r: self.bm.block_table(r) for r in self.prompts} == tables

    @invariant()
    def refcounts_match_tables(self) -> None:
        counts = [0] * self.bm.num_blocks
        for request_id in self.prompts:
            for block_id in self.bm.block_table(request_id):
                counts[block_id] += 1
        for block_ids in self.holds.values():
            for block_id in block_ids:
                counts[block_id] += 1
        assert [b.ref_count for b in self.bm.blocks] == counts

    @invariant()
    def free_list_is_exactly_the_unreferenced(self) -> None:
        free = self.bm.free_block_ids()
        assert len(free) == len(set(free)) == self.bm.num_free_blocks
        assert set(free) == {b.block_id for b in self.bm.blocks if b.ref_count == 0}

    @invariant()
    def tenants_own_exactly_the_used_and_cached_blocks(self) -> None:
        counts: dict[str, int] = {}
        for b in self.bm.blocks:
            assert (b.tenant is None) == (b.ref_count == 0 and b.chunk_hash is None)
            if b.tenant is not None:
                counts[b.tenant] = counts.get(b.tenant, 0) + 1
        assert self.bm.tenant_blocks == counts

    @invariant()
    def uncached_free_blocks_lead_the_free_list(self) -> None:
        cached = [self.bm.blocks[b].chunk_hash is not None for b in self.bm.free_block_ids()]
        assert cached == sorted(cached)

    @invariant()
    def session_blocks_are_exactly_the_cached_free_ones_of_a_session(self) -> None:
        owned = [b for s in SESSIONS for b in self.bm.session_blocks(s)]
        assert len(owned) == len(set(owned))
        assert set(owned) == {b.block_id for b in self.bm.blocks if b.session is not None}
        for b in self.bm.blocks:
            if b.session is not None:
                assert b.ref_count == 0 and b.chunk_hash is not None
        cached_free = sum(1 for b in self.bm.free_block_ids() if self.bm.blocks[b].chunk_hash is not None)
        assert self.bm.num_uncached_free_blocks == self.bm.num_free_blocks - cached_free

    @invariant()
    def hash_map_is_a_bijection(self) -> None:
        hashed = {b.chunk_hash: b.block_id for b in self.bm.blocks if b.chunk_hash is not None}
        assert len(hashed) == self.bm.num_cached_blocks
        assert all(self.bm.cached_block_id(h) == block_id for h, block_id in hashed.items())

    @invariant()
    def live_blocks_hold_their_own_chunk(self) -> None:
        for request_id, hs in self.prompts.items():
            for chunk_index, block_id in enumerate(self.bm.block_table(request_id)):
                chunk_hash = self.bm.blocks[block_id].chunk_hash
                assert chunk_hash is None or chunk_hash == hs[chunk_index]


TestBlockManagerMachine = BlockManagerMachine.TestCase
TestBlockManagerMachine.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
