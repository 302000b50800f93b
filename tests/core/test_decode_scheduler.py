"""Decode policy: exact page ids, FIFO admission, stop rules, and invariants after random steps."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvpool.core.decode.pages import PageAllocator, pages_for
from kvpool.core.decode.scheduler import FINISH_CONTEXT, FINISH_LENGTH, FINISH_STOP, DecodeScheduler
from kvpool.core.errors import InvalidArgument, ResourceExhausted
from tests.core.fixtures import Clock


def scheduler(num_pages: int = 8, page_size: int = 4, max_batch_size: int = 4, max_context: int = 64):
    return DecodeScheduler(num_pages, page_size, max_batch_size, max_context, Clock(0.0))


def test_pages_lowest_first_and_all_or_nothing_free() -> None:
    pages = PageAllocator(6)
    assert pages.allocate(2) == [0, 1]
    assert pages.allocate(3) == [2, 3, 4]
    assert pages.allocate(2) is None and pages.num_free == 1
    pages.free([1, 3])
    assert pages.allocate(2) == [1, 3]
    with pytest.raises(InvalidArgument, match="page_ids"):
        pages.free([0, 5])  # 5 is free: nothing freed
    assert pages.free_page_ids() == [5]
    assert pages_for(9, 4) == 3 and pages_for(8, 4) == 2


def test_admission_reserves_prompt_plus_max_tokens_minus_one() -> None:
    s = scheduler()
    a = s.submit("a", num_prompt_tokens=5, max_tokens=4)  # 8 KV entries: 2 pages
    b = s.submit("b", num_prompt_tokens=6, max_tokens=4)  # 9 KV entries: 3 pages
    assert [q.seq_id for q in s.admit()] == ["a", "b"]
    assert (a.page_ids, b.page_ids, s.num_pages_used) == ([0, 1], [2, 3, 4], 5)
    assert (a.num_cached_tokens, a.position) == (5, 5)


def test_full_shard_queues_fifo_without_overtaking_and_release_frees_at_once() -> None:
    s = scheduler(num_pages=4)
    s.submit("a", 8, 5)  # 12 entries: 3 pages
    s.submit("b", 8, 1)  # 8 entries: 2 pages, does not fit after a
    s.submit("c", 1, 1)  # 1 page would fit, but must not overtake b
    assert [q.seq_id for q in s.admit()] == ["a"]
    assert (s.num_waiting, s.num_pages_used) == (2, 3)
    assert s.admit() == []
    s.release("a")
    assert s.num_pages_used == 0
    assert [q.seq_id for q in s.admit()] == ["b", "c"]
    assert [q.page_ids for q in s.running()] == [[0, 1], [2]]


def test_batch_size_caps_running() -> None:
    s = scheduler(num_pages=64, max_batch_size=2)
    for name in "abc":
        s.submit(name, 2, 2)
    assert [q.seq_id for q in s.admit()] == ["a", "b"]
    assert s.num_waiting == 1
    s.release("b")
    assert [q.seq_id for q in s.admit()] == ["c"]


def test_refused_up_front_naming_the_field() -> None:
    s = scheduler(num_pages=4, page_size=4, max_context=64)
    with pytest.raises(InvalidArgument, match="max_tokens: must be positive"):
        s.submit("a", 4, 0)
    with pytest.raises(InvalidArgument, match="max_tokens: .*context of 64"):
        s.submit("a", 60, 5)
    with pytest.raises(InvalidArgument, match="max_tokens: .*needs 5 pages, the shard has 4"):
        s.submit("a", 10, 8)  # 17 entries
    with pytest.raises(InvalidArgument, match="prompt_token_ids"):
        s.submit("a", 0, 1)
    s.submit("a", 10, 7)  # 16 entries: exactly the shard
    with pytest.raises(InvalidArgument, match="seq_id"):
        s.submit("a", 1, 1)
    assert s.num_waiting == 1


def test_stop_rules_and_step_accounting() -> None:
    s = scheduler(max_context=12)
    s.submit("a", 4, 3, stop_token_ids=[7])
    s.submit("b", 9, 3)
    s.submit("c", 2, 5, stop_token_ids=[7])
    s.admit()
    assert s.on_token("a", 1) is None  # first token (from prefill)
    s.on_step("a")
    assert s.on_token("a", 2) is None
    s.on_step("a")
    assert s.on_token("a", 3) == FINISH_LENGTH
    # every output but the last is cached; the reservation is exactly used
    a = s.get("a")
    assert a is not None and a.num_cached_tokens == a.kv_capacity == 6
    with pytest.raises(InvalidArgument, match="no reserved page"):
        s.on_step("a")
    assert s.on_token("c", 7) == FINISH_STOP
    assert [s.on_token("b", t) for t in (1, 2, 3)] == [None, None, FINISH_LENGTH]


def test_context_is_a_stop_rule() -> None:
    s = scheduler(max_context=8)
    s.submit("a", 5, 3)
    s.admit()
    assert [s.on_token("a", 1), s.on_token("a", 1), s.on_token("a", 1)] == [None, None, FINISH_LENGTH]
    # with a context stop reachable only through the rule itself
    s2 = DecodeScheduler(8, 4, 4, 8, Clock(0.0))
    s2.submit("b", 5, 3)
    s2.admit()
    s2.max_context = 7  # a shard whose context shrank under a queued request still stops in time
    assert [s2.on_token("b", 1), s2.on_token("b", 1)] == [None, FINISH_CONTEXT]


def test_release_is_idempotent_and_works_while_waiting() -> None:
    s = scheduler(num_pages=2)
    s.submit("a", 8, 1)
    s.submit("b", 1, 1)
    s.admit()
    assert s.release("b") is not None and s.num_waiting == 0
    assert s.release("b") is None
    assert s.release("a") is not None and s.num_pages_used == 0
    assert s.release("a") is None


def test_reserved_before_prefill_holds_pages_then_needs_only_a_slot() -> None:
    s = scheduler(num_pages=8, max_batch_size=1)
    a = s.reserve("a", 10, 3)  # 12 entries: 3 pages, taken now
    assert a.page_ids == [0, 1, 2] and s.num_reserved == 1 and s.num_pages_used == 3
    with pytest.raises(ResourceExhausted, match="6 needed, 5 free"):
        s.reserve("b", 20, 4)  # 23 entries: 6 pages
    assert s.get("b") is None and s.num_pages_used == 3
    s.submit("c", 4, 1)  # not reserved: waits for pages at admit
    with pytest.raises(InvalidArgument, match="max_tokens: 10 prompt tokens and max_tokens 4 differ"):
        s.submit("a", 10, 4)
    s.submit("a", 10, 3, stop_token_ids=[9])  # queued behind c, its pages kept
    assert [q.seq_id for q in s.waiting()] == ["c", "a"] and s.num_reserved == 0
    assert [q.seq_id for q in s.admit()] == ["c"]  # one batch slot
    assert s.running()[0].page_ids == [3]
    s.release("c")
    assert [(q.seq_id, q.page_ids, q.stop_token_ids) for q in s.admit()] == [("a", [0, 1, 2], frozenset({9}))]
    s.reserve("d", 4, 1)
    assert s.release("d").seq_id == "d" and s.num_pages_used == 3  # an unused reservation frees at once


class DecodeMachine(RuleBasedStateMachine):
    """Random submits, admits, steps and releases; the invariants hold after each."""

    def __init__(self) -> None:
        super().__init__()
        self.s = DecodeScheduler(num_pages=12, page_size=4, max_batch_size=3, max_context=40, clock=Clock(0.0))
        self.next_id = 0

    @rule(prompt=st.integers(1, 30), max_tokens=st.integers(1, 20))
    def submit(self, prompt: int, max_tokens: int) -> None:
        seq_id = f"s{self.next_id}"
        self.next_id += 1
        try:
            self.s.submit(seq_id, prompt, max_tokens, stop_token_ids=[0])
        except InvalidArgument:
            assert prompt + max_tokens > 40 or pages_for(prompt + max_tokens - 1, 4) > 12
            assert self.s.get(seq_id) is None

    @rule(prompt=st.integers(1, 30), max_tokens=st.integers(1, 20))
    def reserve(self, prompt: int, max_tokens: int) -> None:
        seq_id = f"s{self.next_id}"
        self.next_id += 1
        free = self.s.pages.num_free
        try:
            self.s.reserve(seq_id, prompt, max_tokens)
        except InvalidArgument:
            assert prompt + max_tokens > 40 or pages_for(prompt + max_tokens - 1, 4) > 12
            assert self.s.get(seq_id) is None
        except ResourceExhausted:
            assert pages_for(prompt + max_tokens - 1, 4) > free and self.s.get(seq_id) is None
        else:
            assert self.s.pages.num_free == free - pages_for(prompt + max_tokens - 1, 4)

    @rule(index=st.integers(0, 20))
    def start(self, index: int) -> None:
        reserved = self.s.reserved()
        if reserved:
            seq = reserved[index % len(reserved)]
            self.s.submit(seq.seq_id, seq.num_prompt_tokens, seq.max_tokens, stop_token_ids=[0])

    @rule()
    def admit(self) -> None:
        before = self.s.waiting()
        admitted = self.s.admit()
        assert [q.seq_id for q in admitted] == [q.seq_id for q in before[: len(admitted)]]  # FIFO
        if self.s.num_waiting and self.s.num_running < 3:
            head = self.s.waiting()[0]
            assert not head.page_ids and pages_for(head.kv_capacity, 4) > self.s.pages.num_free

    @rule(token=st.integers(0, 3))
    def step(self, token: int) -> None:
        # feed every running sequence's newest token, then make the next
        for seq in self.s.running():
            if seq.num_output_tokens == 0:
                if self.s.on_token(seq.seq_id, token):
                    self.s.release(seq.seq_id)
                continue
            self.s.on_step(seq.seq_id)
            if self.s.on_token(seq.seq_id, token):
                self.s.release(seq.seq_id)

    @rule(index=st.integers(0, 20))
    def release(self, index: int) -> None:
        seqs = self.s.running() + self.s.waiting() + self.s.reserved()
        if seqs:
            used = self.s.num_pages_used
            seq = seqs[index % len(seqs)]
            held = len(seq.page_ids)
            self.s.release(seq.seq_id)
            assert self.s.num_pages_used == used - held  # freed at once

    @invariant()
    def pages_are_accounted(self) -> None:
        running = self.s.running()
        holders = running + self.s.reserved() + self.s.waiting()
        held = [p for seq in holders for p in seq.page_ids]
        assert len(held) == len(set(held)) == self.s.num_pages_used
        assert sorted(held + self.s.pages.free_page_ids()) == list(range(12))
        for seq in self.s.reserved() + self.s.waiting():  # all or nothing: reserved before prefill, or none
            assert len(seq.page_ids) in (0, pages_for(seq.kv_capacity, 4))
        assert all(seq.page_ids for seq in self.s.reserved())
        assert len(running) <= 3

    @invariant()
    def reservations_cover_the_kv(self) -> None:
        for seq in self.s.running():
            assert len(seq.page_ids) == pages_for(seq.kv_capacity, 4)
            assert seq.num_cached_tokens <= seq.kv_capacity
            if seq.num_output_tokens:
                assert seq.num_cached_tokens == seq.num_prompt_tokens + seq.num_output_tokens - 1
            assert seq.num_output_tokens <= seq.max_tokens


TestDecodeMachine = DecodeMachine.TestCase
TestDecodeMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_pages_in_runs_give_what_a_heap_of_single_ids_gives() -> None:
    """The allocator keeps free runs, not single ids: any sequence of allocations and frees (some refused) gives
    the same ids, the same refusals and the same free list as a heap of ids (its former, per-page form)."""
    import heapq

    from hypothesis import given, settings
    from hypothesis import strategies as st

    @settings(max_examples=300, deadline=None)
    @given(st.integers(1, 40), st.lists(st.tuples(st.booleans(), st.integers(0, 9), st.integers(0, 1 << 30)),
                                        max_size=80))
    def check(num_pages: int, steps: list[tuple[bool, int, int]]) -> None:
        pages, heap, held = PageAllocator(num_pages), list(range(num_pages)), []
        for take, num, pick in steps:
            if take:
                want = None if num > len(heap) else [heapq.heappop(heap) for _ in range(num)]
                assert pages.allocate(num) == want
                if want:
                    held.append(want)
            elif held:
                ids = held.pop(pick % len(held))
                if pick % 3 == 0 and heap:  # a free page among them: refused, nothing freed
                    with pytest.raises(InvalidArgument, match="page_ids"):
                        pages.free([*ids, heap[0]])
                if pick % 5 == 0 and ids:
                    with pytest.raises(InvalidArgument, match="repeats"):
                        pages.free([*ids, ids[0]])
                pages.free(ids[::-1] if pick % 2 else ids)
                for i in ids:
                    heapq.heappush(heap, i)
            assert pages.free_page_ids() == sorted(heap)
            assert pages.num_free == len(heap) and pages.num_used == num_pages - len(heap)

    check()
