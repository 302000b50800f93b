"""Stage 0's request driver (``kvpool.core.prefill.driver``): its exact transitions, and over any order of
answers, failures and cancels, no block is held after a request's end."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvpool.core.chunk_hash import ChunkHash
from kvpool.core.errors import DeviceCacheLost, FailedPrecondition, ResourceExhausted, RestoreFellShort, Unavailable
from kvpool.core.prefill.block_manager import BlockManager
from kvpool.core.prefill.driver import (
    Admitted,
    Failed,
    Forward,
    Freed,
    Lookup,
    PlannedAgain,
    PrefillDriver,
    Prefilled,
    ReleaseLease,
    RestoreOnStages,
    SavesThenFree,
    Step,
    WaitForBlocks,
    save_holder,
)

CHUNK = 256


def hashes(prefix: str, num_tokens: int) -> list[ChunkHash]:
    return [ChunkHash(f"{prefix}/{i}") for i in range(num_tokens // CHUNK)]


def driver(blocks: BlockManager, request_id: str = "r", num_tokens: int = 3 * CHUNK + 10, prefix: str = "p",
           **options: object) -> PrefillDriver:
    return PrefillDriver(request_id, num_tokens, CHUNK, hashes(prefix, num_tokens), blocks, 30.0,
                         **options)  # type: ignore[arg-type]


def test_a_cold_request_is_looked_up_forwarded_saved_and_freed() -> None:
    blocks = BlockManager(16, CHUNK)
    d = driver(blocks)
    assert d.start(now=0.0) == [Admitted(1), Lookup(tuple(hashes("p", 3 * CHUNK + 10)))]
    holder = save_holder("r")
    assert d.looked_up(0, "") == [Forward(0, 0, tuple(hashes("p", 3 * CHUNK)), restore=False)]
    assert blocks.has_holder(holder)  # every stage's put reads these blocks: held from before the forward
    assert d.forward_ended(now=1.0) == [SavesThenFree(holder), Prefilled()]
    assert d.release() == [Freed(("r",))]
    assert d.ended and d.holds_blocks  # its saves still read
    assert d.saves_ended(holder, now=2.0) == [Freed((holder,))]
    assert not d.holds_blocks and not blocks.has_holder("r") and not blocks.has_holder(holder)
    # the next turn of the prompt is a device hit: nothing looked up past it but the chunks from the head
    again = driver(blocks, "r2")
    assert again.start(now=3.0)[0] == Admitted(1)
    assert again.request.num_device_chunks == 3


def test_without_a_pool_nothing_is_looked_up_or_saved() -> None:
    blocks = BlockManager(16, CHUNK)
    d = driver(blocks, pool=False)
    assert d.start(now=0.0) == [Admitted(1), Forward(0, 0, (), restore=False)]
    assert d.forward_ended(now=1.0) == [Prefilled()]
    assert d.release() == [Freed(("r",))] and not d.holds_blocks


def test_a_pool_hit_rides_the_chain_and_its_lease_ends_beside_the_request() -> None:
    blocks = BlockManager(16, CHUNK)
    d = driver(blocks)
    d.start(now=0.0)
    # two complete groups from the head: the forward is planned past them before any stage read them
    assert d.looked_up(2, "lease-1") == [Forward(2 * CHUNK, 2, (ChunkHash("p/2"),), restore=True)]
    assert d.forward_ended(1.0, [2, 2, 2, 2], corrupt_chunk_indexes=()) == [
        ReleaseLease("lease-1"), SavesThenFree(save_holder("r")), Prefilled()]
    assert (d.request.num_pool_tokens, d.request.num_computed_tokens) == (2 * CHUNK, CHUNK + 10)


def test_a_planned_pool_hit_without_chunks_releases_its_lease_at_once() -> None:
    blocks = BlockManager(16, CHUNK)
    d = driver(blocks)
    d.start(now=0.0)
    assert d.looked_up(0, "lease-0") == [ReleaseLease("lease-0"), Forward(0, 0, tuple(hashes("p", 3 * CHUNK)),
                                                                          restore=False)]


def test_older_stages_restore_by_their_own_calls_before_the_forward() -> None:
    blocks = BlockManager(16, CHUNK)
    d = driver(blocks, restore_on_chain=False)
    d.start(now=0.0)
    assert d.looked_up(2, "lease-1") == [RestoreOnStages()]
    # stage 2 read only the first chunk: the prefix counts as far as every stage read it
    assert d.restored([2, 2, 1, 2], corrupt_chunk_indexes=[1]) == [
        ReleaseLease("lease-1", (1,)), Forward(CHUNK, 1, (ChunkHash("p/1"), ChunkHash("p/2")), restore=False)]
    assert d.forward_ended(now=1.0) == [SavesThenFree(save_holder("r")), Prefilled()]


def test_a_stage_short_of_its_restore_plans_the_request_again_without_the_pool_after_its_saves() -> None:
    blocks = BlockManager(16, CHUNK)
    d = driver(blocks)
    d.start(now=0.0)
    d.looked_up(2, "lease-1")
    holder = save_holder("r")
    effects = d.forward_ended(1.0, [2, 1, 2, 2])
    assert effects[:3] == [ReleaseLease("lease-1"), SavesThenFree(holder), Freed(("r",))]
    assert isinstance(effects[3], PlannedAgain) and effects[3].how == "without_pool" and len(effects) == 4
    assert d.step is Step.WAITING_SAVES and blocks.has_holder(holder)
    # its saves let go of their blocks: the second attempt, no lookup (without the pool), all computed and saved
    assert d.saves_ended(holder, now=2.0) == [Freed((holder,)), Admitted(2),
                                              Forward(0, 0, tuple(hashes("p", 3 * CHUNK)), restore=False)]
    assert d.forward_ended(now=3.0) == [SavesThenFree(holder), Prefilled()]


def test_a_restarted_stage_drops_the_device_hits_and_a_second_failure_fails() -> None:
    blocks = BlockManager(16, CHUNK)
    first = driver(blocks, "a", pool=False)
    first.start(now=0.0)
    first.forward_ended(now=0.5)
    first.release()
    d = driver(blocks, "b", pool=False)
    d.start(now=1.0)
    assert d.request.num_device_chunks == 3
    effects = d.forward_failed(DeviceCacheLost("stage 2 restarted"), now=1.5)
    assert effects[0] == Freed(("b",)) and effects[1].how == "without_device_hits"  # type: ignore[union-attr]
    assert effects[2:] == [Admitted(2), Forward(0, 0, (), restore=False)]
    assert blocks.num_cached_blocks == 0 and d.request.num_device_chunks == 0
    last = d.forward_failed(DeviceCacheLost("again"), now=2.0)
    assert last[0] == Freed(("b",)) and isinstance(last[1], Failed) and isinstance(last[1].error, Unavailable)
    assert d.ended and not d.holds_blocks


def test_any_other_failure_fails_the_request_as_it_came() -> None:
    blocks = BlockManager(16, CHUNK)
    d = driver(blocks)
    d.start(now=0.0)
    d.looked_up(0, "")
    error = Unavailable("stage 1: UNAVAILABLE", field="pipeline")
    assert d.forward_failed(error, now=1.0) == [SavesThenFree(save_holder("r")), Freed(("r",)), Failed(error)]
    assert d.saves_ended(save_holder("r"), now=2.0) == [Freed((save_holder("r"),))]
    assert not d.holds_blocks and blocks.num_free_blocks == 16


def test_a_request_waits_for_blocks_until_its_deadline() -> None:
    blocks = BlockManager(4, CHUNK)
    holder = driver(blocks, "a", pool=False)
    holder.start(now=0.0)  # 4 blocks
    d = driver(blocks, "b", pool=False)
    assert d.start(now=1.0) == [WaitForBlocks(31.0)]
    assert d.blocks_freed(now=2.0) == [WaitForBlocks(31.0)]  # still held
    holder.forward_ended(now=3.0)
    assert holder.release() == [Freed(("a",))]
    assert d.blocks_freed(now=4.0)[0] == Admitted(1)  # the cached prefix, shared
    late = driver(blocks, "c", prefix="q", pool=False)
    assert late.start(now=5.0) == [WaitForBlocks(35.0)]
    refused = late.blocks_freed(now=35.0)
    assert len(refused) == 1 and isinstance(refused[0], Failed) and isinstance(refused[0].error, ResourceExhausted)
    assert late.ended and not late.holds_blocks


def test_a_cancelled_request_ends_once_what_is_in_flight_ended() -> None:
    blocks = BlockManager(16, CHUNK)
    d = driver(blocks)
    d.start(now=0.0)
    assert d.cancel() == []  # its lookup is in flight
    assert d.looked_up(2, "lease-1") == [ReleaseLease("lease-1"), Freed(("r",)), Failed(None)]
    assert d.ended and not blocks.has_holder("r")
    e = driver(blocks, "e")
    e.start(now=1.0)
    e.looked_up(0, "")
    assert e.cancel() == []  # the stages write its blocks
    assert e.forward_ended(now=2.0) == [SavesThenFree(save_holder("e")), Freed(("e",)), Failed(None)]
    assert e.saves_ended(save_holder("e"), now=3.0) == [Freed((save_holder("e"),))]
    full = BlockManager(4, CHUNK)
    driver(full, "a", pool=False).start(now=0.0)
    queued = driver(full, "b", prefix="q", pool=False)
    assert queued.start(now=0.0) == [WaitForBlocks(30.0)]
    assert queued.cancel() == [Failed(None)] and queued.ended  # nothing held: at once
    assert queued.blocks_freed(now=1.0) == [] and queued.cancel() == []
    with pytest.raises(FailedPrecondition):
        queued.looked_up(0, "")


ERRORS = {"lost": DeviceCacheLost("stage restarted"), "short": RestoreFellShort("short"),
          "down": Unavailable("stage down")}


class DriverMachine(RuleBasedStateMachine):
    """Several requests on one device cache, every answer, failure and cancel in any order: the block
    manager holds exactly the blocks of requests still going (and of saves still running), and nothing
    once every request ended and every save ended."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = BlockManager(12, CHUNK)
        self.drivers: dict[str, PrefillDriver] = {}
        self.saves: set[tuple[str, str]] = set()  # (request id, holder) of SavesThenFree not answered
        self.waiting: set[str] = set()  # WaitForBlocks not followed by blocks_freed
        self.next_id = 0
        self.now = 0.0

    def _apply(self, request_id: str, effects: list[object]) -> None:
        for effect in effects:
            if isinstance(effect, SavesThenFree):
                self.saves.add((request_id, effect.holder))
            elif isinstance(effect, WaitForBlocks):
                self.waiting.add(request_id)
            elif isinstance(effect, Freed):  # whoever waits may go on
                for waiter in sorted(self.waiting):
                    self.waiting.discard(waiter)
                    self._apply(waiter, self.drivers[waiter].blocks_freed(self.now))

    def _in(self, step: Step) -> list[str]:
        return sorted(r for r, d in self.drivers.items() if d.step is step)

    @rule(num_tokens=st.integers(1, 5 * CHUNK), prefix=st.sampled_from("abc"), pool=st.booleans(),
          chain=st.booleans())
    def arrive(self, num_tokens: int, prefix: str, pool: bool, chain: bool) -> None:
        request_id = f"r{self.next_id}"
        self.next_id += 1
        d = self.drivers[request_id] = PrefillDriver(request_id, num_tokens, CHUNK, hashes(prefix, num_tokens),
                                                     self.blocks, 5.0, pool=pool, restore_on_chain=chain)
        self._apply(request_id, d.start(self.now))

    @precondition(lambda self: self._in(Step.LOOKING_UP))
    @rule(i=st.integers(0, 50), found=st.integers(0, 5), lease=st.booleans())
    def look_up(self, i: int, found: int, lease: bool) -> None:
        ids = self._in(Step.LOOKING_UP)
        d = self.drivers[ids[i % len(ids)]]
        found = min(found, len(d.request.lookup_candidates))
        self._apply(d.request_id, d.looked_up(found, f"lease-{d.request_id}" if lease and found else ""))

    @precondition(lambda self: self._in(Step.RESTORING))
    @rule(i=st.integers(0, 50), counts=st.lists(st.integers(0, 5), min_size=4, max_size=4))
    def restore(self, i: int, counts: list[int]) -> None:
        ids = self._in(Step.RESTORING)
        d = self.drivers[ids[i % len(ids)]]
        self._apply(d.request_id, d.restored(counts))

    @precondition(lambda self: self._in(Step.FORWARDING))
    @rule(i=st.integers(0, 50), counts=st.lists(st.integers(0, 5), min_size=4, max_size=4),
          failure=st.sampled_from([None, "lost", "short", "down"]))
    def forward(self, i: int, counts: list[int], failure: str | None) -> None:
        ids = self._in(Step.FORWARDING)
        d = self.drivers[ids[i % len(ids)]]
        effects = (d.forward_ended(self.now, counts) if failure is None
                   else d.forward_failed(ERRORS[failure], self.now))
        self._apply(d.request_id, effects)

    @precondition(lambda self: self._in(Step.PREFILLED))
    @rule(i=st.integers(0, 50))
    def answer_out(self, i: int) -> None:
        ids = self._in(Step.PREFILLED)
        d = self.drivers[ids[i % len(ids)]]
        self._apply(d.request_id, d.release())

    @precondition(lambda self: self.saves)
    @rule(i=st.integers(0, 50))
    def saves_end(self, i: int) -> None:
        request_id, holder = sorted(self.saves)[i % len(self.saves)]
        self.saves.discard((request_id, holder))
        self._apply(request_id, self.drivers[request_id].saves_ended(holder, self.now))

    @precondition(lambda self: self.drivers)
    @rule(i=st.integers(0, 50))
    def cancel(self, i: int) -> None:
        ids = sorted(self.drivers)
        d = self.drivers[ids[i % len(ids)]]
        self._apply(d.request_id, d.cancel())

    @rule(dt=st.floats(0, 3))
    def tick(self, dt: float) -> None:
        self.now += dt
        for waiter in sorted(self.waiting):  # a wait's deadline came
            self.waiting.discard(waiter)
            self._apply(waiter, self.drivers[waiter].blocks_freed(self.now))

    @invariant()
    def blocks_are_held_by_live_requests_and_running_saves_only(self) -> None:
        for request_id, d in self.drivers.items():
            assert self.blocks.has_holder(request_id) == (d.step in (
                Step.LOOKING_UP, Step.RESTORING, Step.FORWARDING, Step.PREFILLED))
            told = (request_id, save_holder(request_id)) in self.saves  # a SavesThenFree not answered yet
            assert self.blocks.has_holder(save_holder(request_id)) == d.save_held
            assert d.save_held == (told or d.step is Step.FORWARDING and d.save_held)
            if d.ended:
                assert not d.holds_blocks or (request_id, save_holder(request_id)) in self.saves

    def teardown(self) -> None:
        """Every request is driven to its end and every save ends: no block is held."""
        for _ in range(20):
            for request_id, d in sorted(self.drivers.items()):
                if d.step is Step.LOOKING_UP:
                    self._apply(request_id, d.looked_up(0, ""))
                elif d.step is Step.RESTORING:
                    self._apply(request_id, d.restored([0, 0, 0, 0]))
                elif d.step is Step.FORWARDING:
                    self._apply(request_id, d.forward_ended(self.now, [5, 5, 5, 5]))
                elif d.step is Step.PREFILLED:
                    self._apply(request_id, d.release())
                elif d.step is Step.WAITING_BLOCKS:
                    self._apply(request_id, d.cancel())
            for request_id, holder in sorted(self.saves):
                self.saves.discard((request_id, holder))
                self._apply(request_id, self.drivers[request_id].saves_ended(holder, self.now))
        assert all(d.ended for d in self.drivers.values())
        assert self.blocks.num_free_blocks == self.blocks.num_blocks
        assert not any(self.blocks.has_holder(r) or self.blocks.has_holder(save_holder(r)) for r in self.drivers)


TestDriverMachine = DriverMachine.TestCase
TestDriverMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
