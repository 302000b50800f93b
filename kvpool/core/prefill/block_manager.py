"""The device KV cache's block manager: refcounted, prefix-cached blocks.

One block holds one chunk of ``chunk_size`` tokens for every layer of every
stage (stage 0 owns this table; all stages mirror it). Pure: no torch, no I/O.
Shaped like nano-vllm's ``BlockManager`` and vLLM v1's ``BlockPool``.

Invariants:
- a block is on the free list iff its ref count is 0;
- a block's ref count equals the number of live block tables that hold it;
- ``_hash_to_block_id[h] == b`` iff ``blocks[b].chunk_hash == h`` (a bijection
  between cached hashes and hashed blocks; a hash is set once, on a full chunk);
- the partial last chunk of a prompt gets a block but never a hash.

- a block some I/O reads from (a save writing it to the pool straight from
  the pages) holds a reference through ``hold`` until that I/O ends, so it is
  never reused, and never a restore's target, while the bytes are in flight.
  A hold is no session's turn: blocks it releases last stay the cached blocks
  of the session whose request last took them.

Eviction order: the free list runs LRU → MRU, every uncached block before
every cached one; allocation takes the LRU end and only then forgets that
block's hash (lazy eviction). Blocks start in id order (block 0 first).
``free`` returns a request's hashed blocks to the MRU end in reverse table
order, so a prompt's tail is evicted before its head, and its unhashed blocks
to the LRU end, since they cache nothing.

Tenants: a block in use or cached belongs to the tenant whose request took
it (``tenant_blocks`` counts them); a free uncached block is no one's. An
allocation takes uncached free blocks first (they cost no one anything); a
cached one is chosen by ``tenancy.shares``'s rule with shares of
``num_blocks``: a tenant over its share (with the allocation) reuses its own
least recently used cached blocks first, then those of the tenants furthest
over their share, and only then the free list's LRU end. That last step is
taken even by a tenant over its share: a request always gets its blocks when
enough are free. With one tenant the order is the plain LRU order above.

Sessions (retention by session, not chunk recency alone): a request may name
its session (``allocate(session=...)``); its hashed blocks that reach ref
count 0 are that session's cached blocks. ``touch_session`` (a turn of the
session starts, or a prefetch stages it) moves all of them to the MRU end,
including chunks the current prompt does not reach (a sub-agent's branch, a
history cut to the context), so the free list runs sessions idle longest
first. ``touch_sessions`` (before an admission from a queue) orders the waiting
sessions so that the next served is evicted last. ``end_session`` (the client said the session is over) uncaches them:
they move to the LRU end and are reused first; ``end_session(max_blocks=n)``
uncaches only the n least recently used of them (a prefetch taking room from
a session expected later than its own).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass

from kvpool.core.chunk_hash import DEFAULT_TENANT, ChunkHash
from kvpool.core.errors import InvalidArgument, NotFound, ResourceExhausted
from kvpool.core.sessions.table import SessionId
from kvpool.core.tenancy.shares import TenantShares, VictimOrder


class NoFreeBlocks(ResourceExhausted):
    """``allocate`` needs more free blocks than exist; no state was changed."""

    def __init__(self, num_needed: int, num_free: int) -> None:
        super().__init__(f"need {num_needed} free blocks, have {num_free}")
        self.num_needed = num_needed
        self.num_free = num_free


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    chunk_hash: ChunkHash | None = None
    tenant: str | None = None  # whose KV it holds: in use or cached; None when free and uncached
    session: SessionId | None = None  # free and cached: the session that last used it
    user: SessionId | None = None  # in use: the session of the request that last took it (a hold's blocks keep it)


@dataclass(slots=True)
class _Request:
    block_table: list[int]
    num_full_chunks: int
    session: SessionId | None = None
    held: bool = False  # a ``hold``: no request of its own; its blocks stay their user's session's


class BlockManager:
    """Request-level API over a pool of ``num_blocks`` blocks (see module doc)."""

    def __init__(self, num_blocks: int, chunk_size: int, shares: TenantShares | None = None) -> None:
        if num_blocks <= 0 or chunk_size <= 0:
            raise InvalidArgument(f"num_blocks and chunk_size must be positive, got {num_blocks}, {chunk_size}")
        self.num_blocks = num_blocks
        self.chunk_size = chunk_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        # free list: first = LRU (next to allocate), last = MRU; O(1) both ends and middle
        self._free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._hash_to_block_id: dict[ChunkHash, int] = {}
        self._requests: dict[str, _Request] = {}
        self.shares = shares if shares is not None else TenantShares()
        # blocks each tenant holds (in use or cached), and its cached free blocks LRU first
        self.tenant_blocks: dict[str, int] = {}
        self._cached_free: dict[str, OrderedDict[int, None]] = {}
        self._session_free: dict[SessionId, OrderedDict[int, None]] = {}  # each session's cached free blocks
        self.num_evicted = 0  # cached blocks an allocation took (their chunk uncached): the device cache's evictions

    # queries
    @property
    def num_free_blocks(self) -> int:
        """Blocks with ref count 0, cached or not: all are allocatable."""
        return len(self._free_block_ids)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks holding a hashed chunk, referenced or not."""
        return len(self._hash_to_block_id)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by a live request."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def free_block_ids(self) -> list[int]:
        """The free list, LRU first: the order in which blocks will be reused."""
        return list(self._free_block_ids)

    def cached_block_id(self, chunk_hash: ChunkHash) -> int | None:
        return self._hash_to_block_id.get(chunk_hash)

    def block_table(self, request_id: str) -> list[int]:
        return list(self._request(request_id).block_table)

    def num_blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.chunk_size)

    def match_prefix(self, chunk_hashes: Sequence[ChunkHash]) -> int:
        """Number of leading chunks cached on device. Read-only: no LRU touch."""
        num_hit = 0
        for chunk_hash in chunk_hashes:
            if chunk_hash not in self._hash_to_block_id:
                break
            num_hit += 1
        return num_hit

    # request lifecycle
    def allocate(
        self,
        request_id: str,
        chunk_hashes: Sequence[ChunkHash],
        num_tokens: int,
        num_device_hit_chunks: int,
        tenant: str = DEFAULT_TENANT,
        session: SessionId | None = None,
    ) -> list[int]:
        """Block table for the whole prompt of ``tenant``: the first ``num_device_hit_chunks``
        blocks are the cached ones (ref'd, taken off the free list), the rest
        fresh (chosen by the tenants' rule, module doc). ``chunk_hashes`` are the
        prompt's full-chunk hashes. Raises ``NoFreeBlocks`` (state untouched) if
        the fresh blocks do not fit."""
        if request_id in self._requests:
            raise InvalidArgument(f"request_id {request_id!r} already has a block table")
        if num_tokens <= 0:
            raise InvalidArgument(f"num_tokens must be positive, got {num_tokens}")
        num_full_chunks = num_tokens // self.chunk_size
        if len(chunk_hashes) != num_full_chunks:
            raise InvalidArgument(
                f"chunk_hashes has {len(chunk_hashes)} hashes, {num_tokens} tokens make {num_full_chunks} full chunks"
            )
        if not 0 <= num_device_hit_chunks <= num_full_chunks:
            raise InvalidArgument(f"num_device_hit_chunks {num_device_hit_chunks} not in [0, {num_full_chunks}]")
        if self.match_prefix(chunk_hashes[:num_device_hit_chunks]) != num_device_hit_chunks:
            raise InvalidArgument("num_device_hit_chunks exceeds the cached prefix (stale match?)")

        hit_block_ids = [self._hash_to_block_id[h] for h in chunk_hashes[:num_device_hit_chunks]]
        num_new = self.num_blocks_needed(num_tokens) - len(hit_block_ids)
        # hit blocks sitting on the free list stop being allocatable once touched
        num_hit_free = sum(1 for b in set(hit_block_ids) if self.blocks[b].ref_count == 0)
        num_available = self.num_free_blocks - num_hit_free
        if num_new > num_available:
            raise NoFreeBlocks(num_new, num_available)

        # touch hits before allocating, so a fresh allocation cannot evict them
        for block_id in hit_block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                self._take_free(block)
            block.ref_count += 1
        victims = self.shares.victim_order(self.tenant_blocks, tenant, num_new, self.num_blocks, any_allowed=True)
        block_table = hit_block_ids + [self._allocate_block(victims) for _ in range(num_new)]
        for block_id in block_table:
            self.blocks[block_id].user = session
        self._requests[request_id] = _Request(block_table, num_full_chunks, session)
        return list(block_table)

    def commit_chunks(self, request_id: str, chunk_index_start: int, chunk_hashes: Sequence[ChunkHash]) -> None:
        """Mark chunks ``chunk_index_start..`` (computed or restored from the
        pool) as cached, so later requests hit them. First writer wins: a hash
        already held by another block keeps that block, and this one stays
        unhashed (it returns to the free list uncached)."""
        request = self._request(request_id)
        chunk_index_end = chunk_index_start + len(chunk_hashes)
        if not 0 <= chunk_index_start <= chunk_index_end <= request.num_full_chunks:
            raise InvalidArgument(
                f"chunks [{chunk_index_start}, {chunk_index_end}) not within the {request.num_full_chunks} full chunks"
            )
        for chunk_index, chunk_hash in enumerate(chunk_hashes, chunk_index_start):
            block = self.blocks[request.block_table[chunk_index]]
            if block.chunk_hash == chunk_hash:
                continue  # device hit or repeated commit
            if block.chunk_hash is not None:
                raise InvalidArgument(
                    f"block {block.block_id} (chunk {chunk_index}) already holds {block.chunk_hash}, not {chunk_hash}"
                )
            if chunk_hash in self._hash_to_block_id:
                continue  # first writer wins
            block.chunk_hash = chunk_hash
            self._hash_to_block_id[chunk_hash] = block.block_id

    def hold(self, holder_id: str, block_ids: Sequence[int]) -> None:
        """One more reference on blocks already in use, under ``holder_id``, until
        ``free(holder_id)``: the blocks stay off the free list even after their
        request is freed (e.g. while a save still reads them). All or nothing."""
        if holder_id in self._requests:
            raise InvalidArgument(f"holder_id {holder_id!r} already holds blocks")
        for block_id in block_ids:
            if not 0 <= block_id < self.num_blocks or self.blocks[block_id].ref_count == 0:
                raise InvalidArgument(f"block {block_id} is not in use: only blocks in use can be held")
        if len(set(block_ids)) != len(block_ids):
            raise InvalidArgument("block_ids repeats a block id")
        for block_id in block_ids:
            self.blocks[block_id].ref_count += 1
        self._requests[holder_id] = _Request(list(block_ids), 0, held=True)

    def has_holder(self, holder_id: str) -> bool:
        """Whether a request or ``hold`` holds blocks under this id now."""
        return holder_id in self._requests

    def is_private(self, request_id: str, block_id: int) -> bool:
        """Whether only this request references the block and it caches nothing:
        the only blocks a restore may write."""
        block = self.blocks[block_id]
        return block_id in self._request(request_id).block_table and block.ref_count == 1 and block.chunk_hash is None

    def free(self, request_id: str) -> None:
        """Drop a request's references; blocks reaching 0 go on the free list
        (hashed: MRU end, tail first; unhashed: LRU end) and stay cached."""
        request = self._requests.pop(request_id, None)
        if request is None:
            raise NotFound(f"request_id {request_id!r} has no block table")
        blocks, free_ids = self.blocks, self._free_block_ids
        # the last tenant's and session's lists, looked up again only when they change (nothing here drops one)
        tenant, tenant_free, session, session_free = None, None, None, None
        for block_id in reversed(request.block_table):
            block = blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                free_ids[block_id] = None
                if block.chunk_hash is None:
                    free_ids.move_to_end(block_id, last=False)
                    self._set_tenant(block, None)
                elif block.tenant is not None:  # always: a block in use has its tenant
                    if block.tenant != tenant or tenant_free is None:
                        tenant = block.tenant
                        tenant_free = self._cached_free.setdefault(tenant, OrderedDict())
                    tenant_free[block_id] = None
                    # a hold released last (a save ending after the handoff) leaves the blocks to the
                    # session that used them: else its next turn's touch would miss them
                    owner = block.user if request.held else request.session
                    block.session = owner
                    if owner is not None:
                        if owner is not session or session_free is None:
                            session = owner
                            session_free = self._session_free.setdefault(owner, OrderedDict())
                        session_free[block_id] = None

    def touch_session(self, session: SessionId) -> int:
        """The session is active: its cached free blocks become the most recently used, keeping
        their order. Returns how many moved."""
        owned = self._session_free.get(session)
        if not owned:
            return 0
        # each list gets its moves in the blocks' order; with one tenant every cached free block is its
        # (``free`` puts each in its tenant's), so both run as C loops (stage 0 touches every waiting session
        # at each admission: the simulator's hottest loop)
        deque(map(self._free_block_ids.move_to_end, owned), 0)
        if len(self._cached_free) == 1:
            (cached,) = self._cached_free.values()
            deque(map(cached.move_to_end, owned), 0)
        else:
            for block_id in owned:
                self._cached_free[self.blocks[block_id].tenant or ""].move_to_end(block_id)
        return len(owned)

    def touch_sessions(self, sessions: Sequence[SessionId]) -> int:
        """Sessions whose turns wait, in the order they will be served: each one's cached free blocks become
        more recently used than those of every session after it, so the next served is the last evicted.
        (Arrival order alone makes the oldest waiter, the next served, the least recently used: once the
        waiters' histories exceed the free blocks, each admission evicted the next one's.) Returns how many
        blocks moved."""
        return sum(self.touch_session(session) for session in reversed(sessions))

    def end_session(self, session: SessionId, max_blocks: int | None = None) -> int:
        """The session is over: its cached free blocks are uncached and reused first (LRU end).
        Blocks a request still holds are left to it. With ``max_blocks``, only that many of them, its
        least recently used first (the tail of its history: the prefix stays). Returns how many were
        released."""
        owned = self._session_free.get(session)
        if not owned:
            return 0
        released = list(owned)[:max_blocks]
        for block_id in reversed(released):
            block = self.blocks[block_id]
            self._take_free(block)
            assert block.chunk_hash is not None  # a session's free blocks are cached
            del self._hash_to_block_id[block.chunk_hash]
            block.chunk_hash = None
            self._set_tenant(block, None)
            self._free_block_ids[block_id] = None
            self._free_block_ids.move_to_end(block_id, last=False)
        return len(released)

    def session_blocks(self, session: SessionId) -> list[int]:
        """The session's cached free blocks, least recently used first."""
        return list(self._session_free.get(session, ()))

    @property
    def num_uncached_free_blocks(self) -> int:
        """Free blocks that cache nothing (they lead the free list): what costs no one anything."""
        return self.num_free_blocks - sum(len(c) for c in self._cached_free.values())

    def forget_cached(self) -> int:
        """Forget every cached chunk: no block matches a prefix any more.

        For when some stage lost its device KV (it restarted): a device hit must
        hold on every stage, so none may be claimed. Referenced blocks stay with
        their requests; free blocks become uncached and move to the LRU end (they
        are reused first). Returns the number of chunks forgotten.
        """
        forgotten = len(self._hash_to_block_id)
        # free cached blocks go to the LRU end keeping their relative order
        cached_free = [b for b in self._free_block_ids if self.blocks[b].chunk_hash is not None]
        for block_id in reversed(cached_free):
            self._free_block_ids.move_to_end(block_id, last=False)
            self._set_tenant(self.blocks[block_id], None)  # free and uncached: no one's
            self.blocks[block_id].session = None
        self._cached_free.clear()
        self._session_free.clear()
        for block_id in self._hash_to_block_id.values():
            self.blocks[block_id].chunk_hash = None
        self._hash_to_block_id.clear()
        return forgotten

    # internals
    def _request(self, request_id: str) -> _Request:
        request = self._requests.get(request_id)
        if request is None:
            raise NotFound(f"request_id {request_id!r} has no block table")
        return request

    def _allocate_block(self, victims: VictimOrder) -> int:
        block = self._pick_free(victims)
        self._take_free(block)
        if block.chunk_hash is not None:  # lazy eviction
            self.num_evicted += 1
            del self._hash_to_block_id[block.chunk_hash]
            block.chunk_hash = None
        self._set_tenant(block, victims.tenant)
        block.ref_count = 1
        return block.block_id

    def _pick_free(self, victims: VictimOrder) -> Block:
        """The free block to reuse: an uncached one, else by the tenants' rule (module doc)."""
        head = self.blocks[next(iter(self._free_block_ids))]
        if head.chunk_hash is None:
            return head  # uncached blocks lead the free list
        if victims.own and (own := self._cached_free.get(victims.tenant)):
            return self.blocks[next(iter(own))]
        over = self.shares.most_over(victims, self.tenant_blocks)
        for tenant in over:  # every tenant over its share with a cached free block has one
            if tenant in self._cached_free:
                return self.blocks[next(iter(self._cached_free[tenant]))]
        return head  # a request always gets its blocks: the global LRU

    def _take_free(self, block: Block) -> None:
        """Take a free block off the free list (and off its tenant's cached free blocks)."""
        del self._free_block_ids[block.block_id]
        if block.chunk_hash is not None and block.tenant is not None:
            cached = self._cached_free[block.tenant]
            del cached[block.block_id]
            if not cached:
                del self._cached_free[block.tenant]
        if block.session is not None:
            owned = self._session_free[block.session]
            del owned[block.block_id]
            if not owned:
                del self._session_free[block.session]
            block.session = None

    def _set_tenant(self, block: Block, tenant: str | None) -> None:
        if block.tenant == tenant:
            return
        counts = self.tenant_blocks
        if block.tenant is not None:
            counts[block.tenant] -= 1
            if not counts[block.tenant]:
                del counts[block.tenant]
        if tenant is not None:
            counts[tenant] = counts.get(tenant, 0) + 1
        block.tenant = tenant
