"""The simulator on hand-made traces: exact token counts from the core's decisions, exact times from the cost model."""

from __future__ import annotations

import gc
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.tools.sim.cost_model import CostModel, DecodeCost, HandoffCost, ModelShape, PrefillCost, RestoreCost
from kvpool.tools.sim.engine import Simulation, layer_split
from kvpool.tools.sim.events import EventLoop
from kvpool.tools.sim.summary import summarize
from kvpool.tools.sim.topology import GIB, RunSettings, Topology
from kvpool.workload.weka import Session, parse_session

# 4 layers x 1 byte: a stage's object of a 256-token chunk is 256 B, a group 1 KiB
COST = CostModel(
    model=ModelShape(num_layers=4, kv_entry_bytes=1, chunk_tokens=256),
    prefill=PrefillCost(chunk_base_s=1.0, chunk_per_context_token_s=0.0),
    restore=RestoreCost(read_gbps_per_gpu=1e6, per_object_s=0.5),
    decode=DecodeCost(step_base_s=0.01, step_per_seq_s=0.0, step_per_kv_token_s=0.0),
    handoff=HandoffCost(gbps=1e6, per_transfer_s=0.0),
)


def topology(num_servers: int) -> Topology:
    # 4 device blocks per stage GPU; decode: 1,024 one-token pages; a 1 MiB store per NUMA node
    return Topology(num_servers=num_servers, device_kv_gib_per_gpu=1024 / GIB, decode_page_tokens=1,
                    store_gib=(1 << 20) / GIB)


def session(*turns: tuple[int, list[int], float]) -> Session:
    requests = [{"t": 10.0 * i, "in": n, "out": 4, "hash_ids": ids, "think_time": think}
                for i, (n, ids, think) in enumerate(turns)]
    return parse_session({"id": "hand", "block_size": 64, "tool_tokens": 0, "system_tokens": 0,
                          "requests": requests})


def run(trace: Session, pool: str, num_servers: int = 1, setup: Any = None) -> Simulation:
    settings = RunSettings(num_sessions=1, duration_s=1000.0, warmup_s=0.0, pool=pool, think_scale=1.0,
                           start_spread_s=0.0, restart_sessions=False)
    sim = Simulation(topology(num_servers), settings, COST, [trace])
    if setup is not None:
        setup(sim)
    sim.run()
    return sim


A = list(range(1, 9))  # 8 blocks: 2 full chunks (+10 tokens without an id)


def test_event_loop_runs_in_time_then_schedule_order() -> None:
    loop, seen = EventLoop(), []
    loop.at(2.0, seen.append, "c")
    loop.at(1.0, seen.append, "a")
    loop.at(1.0, seen.append, "b")
    loop.at(5.0, seen.append, "late")
    loop.run(3.0)
    assert seen == ["a", "b", "c"] and loop.now == 3.0


def test_housekeeping_runs_every_so_many_events_outside_simulated_time() -> None:
    """The runner keeps the heap from here (``kvpool.heap``): called between events, it changes no event's time."""
    every = EventLoop.HOUSEKEEPING_EVERY
    kept: list[tuple[int, float]] = []
    loop = EventLoop()
    loop.housekeeping = lambda: kept.append((loop.num_events, loop.now))
    times: list[float] = []
    for k in range(2 * every + 5):
        loop.at(k * 0.001, times.append, k * 0.001)
    loop.run(10.0)
    assert kept == [(every, (every - 1) * 0.001), (2 * every, (2 * every - 1) * 0.001)]
    assert times == sorted(times) and len(times) == 2 * every + 5 and loop.now == 10.0


def test_a_simulation_freezes_its_heap_as_it_goes_and_gives_it_back_at_its_end(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``kvpool.heap``: mid-run what survived is frozen (full collections do not walk the index again and again);
    after the run nothing is, so the next run in the same worker is collected as before."""
    monkeypatch.setattr(EventLoop, "HOUSEKEEPING_EVERY", 2)
    gc.unfreeze()
    frozen: list[int] = []
    sim = run(session((522, A, 0.0), (778, A + [9, 10, 11, 12], 100.0)), "shared",
              setup=lambda sim: sim.loop.at(15.0, lambda: frozen.append(gc.get_freeze_count())))
    assert frozen and frozen[0] > 0
    assert gc.get_freeze_count() == 0 and sim.loop.housekeeping is None


def test_a_session_on_one_server_exact_counts_and_times() -> None:
    # T0 computes 2 chunks + 10 tokens and saves both chunks; T1 (other content, 3 chunks) takes all 4
    # device blocks, evicting T0's; T2 shares T0's 2 chunks: the device lost them, the pool serves them.
    trace = session((522, A, 0.0), (778, list(range(21, 33)), 100.0), (778, A + [33, 34, 35, 36], 100.0))
    sim = run(trace, "shared")
    m = sim.metrics
    assert m.turn_tokens == [
        ("s0.t0", 0, 0, 522),
        ("s0.t1", 0, 0, 778),
        ("s0.t2", 0, 512, 266),
    ]
    assert m.put_objects == 4 * (2 + 3 + 1)  # every stage's object of every chunk computed
    assert m.master_lookups == 3
    # T0: 522/256 chunk-times of 1 s, plus 3 to fill the pipeline; handoff ~0; TTFT ends at the first decoded
    # token, the end of its first 10 ms step (decode: 4 steps of 10 ms)
    assert m.ttft_s[0] == pytest.approx(522 / 256 + 3.0 + 0.01)
    # T2 restores 2 chunks at 0.5 s an object (each stage reads its own at once)
    assert m.restore_s == [pytest.approx(1.0)]
    assert m.ttft_s[2] == pytest.approx(1.0 + 266 / 256 + 3.0 + 0.01)
    assert m.first_token_wait_s == [pytest.approx(0.01)] * 3  # each waited for no batch: its first step
    assert sim.trace_bound() == pytest.approx(512 / (522 + 778 + 778))


def test_shared_pool_serves_a_session_that_moved_server_split_does_not() -> None:
    # T0 runs on server 0; its pipeline fails its health check before T1, which goes to server 1
    trace = session((522, A, 0.0), (778, A + [9, 10, 11, 12], 100.0))

    def fail_p0(sim: Simulation) -> None:
        sim.loop.at(50.0, sim.router.admission.set_health, "p0.0", False)

    shared = run(trace, "shared", num_servers=2, setup=fail_p0)
    split = run(trace, "split", num_servers=2, setup=fail_p0)
    assert shared.metrics.turn_tokens == [("s0.t0", 0, 0, 522), ("s0.t1", 0, 512, 266)]
    assert split.metrics.turn_tokens == [("s0.t0", 0, 0, 522), ("s0.t1", 0, 0, 778)]
    # T1 ran where none of the session had run: [turns, prompt, device, pool] tokens by placement
    assert shared.metrics.by_placement == {"first": [1, 522, 0, 0], "new_server": [1, 778, 0, 512]}
    assert split.metrics.by_placement == {"first": [1, 522, 0, 0], "new_server": [1, 778, 0, 0]}
    assert shared.metrics.placements()["new_server"] == {
        "turn_share": 0.5, "prompt_share": 778 / 1300, "device_share": 0.0, "pool_share": 512 / 778}
    # shared: server 1 read 2 groups (4 objects of 256 B each) from server 0's store; each turn was handed
    # to the decode shard on its pipeline's own server (admission's locality), so no handoff crossed a NIC;
    # split: nothing crossed
    assert shared.network.nic_bytes == {"server0": 2 * 4 * 256, "server1": 2 * 4 * 256}
    assert not any(split.network.nic_bytes.values())
    # split pools: one master per server, over its prefill-side store only
    assert [sorted(i.segments) for i in split.indexes] == [["server0/numa0"], ["server1/numa0"]]
    assert [sorted(i.segments) for i in shared.indexes] == [
        ["server0/numa0", "server0/numa1", "server1/numa0", "server1/numa1"]]


def test_a_turns_placement_is_named_by_where_the_sessions_earlier_turns_ran() -> None:
    from kvpool.tools.sim.workload import SessionPlay, placed_on

    play = SessionPlay(0, session((522, A, 0.0)))
    assert [placed_on(play, server) for server in (3, 3, 1, 3, 2, 1, 1)] == [
        "first", "stayed", "new_server", "returned", "new_server", "returned", "stayed"]
    assert play.servers == [3, 3, 1, 3, 2, 1, 1]


def test_a_dead_servers_stores_are_dropped_after_the_ttl() -> None:
    trace = session((522, A, 0.0), (778, A + [9, 10, 11, 12], 100.0))

    def kill(sim: Simulation) -> None:
        sim.loop.at(20.0, sim._fail_server, 0)

    sim = run(trace, "shared", setup=kill)
    # the chunks T0 saved lived on server 0's own store (placement: the writer's host first)
    assert sorted(sim.indexes[0].segments) == []
    assert sim.dropped_objects == 8
    # T1's device hit needs no pool; the lookup found nothing (the pool lost its copy): written back
    assert sim.metrics.turn_tokens[1] == ("s0.t1", 512, 0, 266)
    assert sim.metrics.write_back_chunks == 2


def test_layer_split_is_even_with_the_extra_layers_first() -> None:
    assert layer_split(61, 4) == [16, 15, 15, 15]
    assert layer_split(8, 4) == [2, 2, 2, 2]


def test_the_simulator_gives_the_counts_the_real_cluster_gave() -> None:
    # tests/integration/test_replay_e2e.py's trace and cluster (2 stages, 8 device chunks), whose counts
    # the real cluster produced through the HTTP API; here from the core alone
    # one session, concurrency 1, no think time, on one pipeline sized as that cluster
    from kvpool.tools.sim.validate import ValidationSetup, scaled_session, setup_topology

    def request(t: float, ids: list[int]) -> dict[str, Any]:
        return {"t": t, "in": 256 * len(ids) + 10, "out": 4, "hash_ids": ids, "think_time": 0.5}

    trace = parse_session({"id": "e2e", "block_size": 256, "tool_tokens": 0, "system_tokens": 0, "requests": [
        request(0, [1, 2]), request(1, [1, 2, 3]), request(2, list(range(10, 17))), request(3, [1, 2, 3, 4]),
        request(4, [1, 2, 3, 4, 5])]})
    setup = ValidationSetup(scale=1, num_stages=2, device_cache_tokens=2048)
    cost, shaped = setup_topology(setup, COST)
    settings = RunSettings(num_sessions=1, duration_s=1e12, warmup_s=0.0, think=False, start_spread_s=0.0,
                           max_instances=1)
    sim = Simulation(shaped, settings, cost, [scaled_session(trace, setup.scale, setup.max_tokens)])
    sim.run()
    # back to back: every turn computes its new tokens (1 s a chunk, + 1 s to fill the 2-stage pipeline) and
    # decodes 4 steps of 10 ms; turn 3 first restores 3 chunks at 0.5 s an object
    assert sim.loop.now == pytest.approx(sum(n / 256 + 1.0 + 0.04 for n in (522, 266, 1802, 266, 266)) + 3 * 0.5)
    assert [(d, p, c) for _, d, p, c in sim.metrics.turn_tokens] == [
        (0, 0, 522), (512, 0, 266), (0, 0, 1802), (0, 768, 266), (1024, 0, 266)]


def test_failure_figures_against_the_twin_run_by_hand() -> None:
    from kvpool.tools.sim.report import failure_figures

    def series(*reuse: float) -> list[dict[str, float]]:
        return [{"t": 60.0 * i, "reuse": r, "pool_share": 0.0} for i, r in enumerate(reuse)]

    base = series(0.50, 0.90, 0.90, 0.92, 0.92, 0.92)
    failed = series(0.50, 0.90, 0.80, 0.85, 0.915, 0.92)  # the stores die at 120 s
    figures = failure_figures(failed, base, 120.0, 60.0)
    assert figures["fail_hit_loss"] == pytest.approx(0.10)  # the window at 120 s
    assert figures["fail_lost_share"] == pytest.approx((0.10 + 0.07 + 0.005 + 0.0) / 4)
    assert figures["fail_recovery_s"] == 180.0  # the window at 240 s is within a point; it ends at 300 s


def test_a_read_from_a_store_that_died_is_a_miss_before_the_master_knows() -> None:
    # as in the shared/split test, T1 goes to server 1 and its history is in server 0's stores; they die at
    # 100 s, T1 looks up at ~105 s (the master drops them only at ~110 s): found, unreadable, computed
    trace = session((522, A, 0.0), (778, A + [9, 10, 11, 12], 100.0))

    def fail_p0_then_its_stores(sim: Simulation) -> None:
        sim.loop.at(50.0, sim.router.admission.set_health, "p0.0", False)
        sim.loop.at(100.0, sim._fail_server, 0)

    sim = run(trace, "shared", num_servers=2, setup=fail_p0_then_its_stores)
    assert sim.metrics.turn_tokens == [("s0.t0", 0, 0, 522), ("s0.t1", 0, 0, 778)]
    # the lookup still leased the 2 groups: the plan had them, the restore could not read them
    assert sim.metrics.restore_s == [pytest.approx(1.0)]
    assert sim.dropped_objects == 8


def test_a_prompt_past_the_context_is_cut_to_its_leading_tokens_and_counted() -> None:
    # context 1,000 tokens: the 1,500-token turn keeps its leading 996 (room for its 4 output tokens):
    # 15 block ids, 3 full chunks, of which T0's 2 chunks are device hits
    trace = session((522, A, 0.0), (1500, list(range(1, 24)), 10.0))
    settings = RunSettings(num_sessions=1, duration_s=1000.0, warmup_s=0.0, think_scale=1.0, start_spread_s=0.0,
                           restart_sessions=False)
    topo = Topology(num_servers=1, device_kv_gib_per_gpu=1024 / GIB, decode_page_tokens=1,
                    store_gib=(1 << 20) / GIB, max_context=1000)
    sim = Simulation(topo, settings, COST, [trace])
    sim.run()
    assert sim.metrics.turn_tokens == [("s0.t0", 0, 0, 522), ("s0.t1", 512, 0, 484)]
    assert sim.trace_policy == {"arrivals": 2, "cut_to_context": 1, "tokens_cut": 504, "refused_device_cache": 0,
                                "refused_decode": 0, "expired_in_queue": 0}
    # the bound over the played turns: T1's first 8 of 15 blocks were seen in T0
    assert sim.trace_bound() == pytest.approx(8 * 64 / (522 + 996))


def test_think_time_is_the_traces_times_the_stated_scale() -> None:
    trace = session((522, A, 0.0), (778, A + [9, 10, 11, 12], 100.0), (778, A + [9, 10, 11, 12], 40.0))
    settings = RunSettings(num_sessions=1, duration_s=1000.0, warmup_s=0.0, think_scale=0.25, start_spread_s=0.0,
                           restart_sessions=False)
    sim = Simulation(topology(1), settings, COST, [trace])
    sim.run()
    assert sim.metrics.think_s == [25.0, 10.0]


def test_a_lookup_waits_for_the_masters_service_and_puts_queue_behind_it() -> None:
    from dataclasses import replace

    from kvpool.tools.sim.cost_model import MasterCost

    cost = replace(COST, master=MasterCost(lookup_base_s=0.25, put_base_s=0.5, put_per_object_s=0.125))
    trace = session((522, A, 0.0))
    settings = RunSettings(num_sessions=1, duration_s=1000.0, warmup_s=0.0, start_spread_s=0.0,
                           restart_sessions=False)
    sim = Simulation(topology(1), settings, cost, [trace])
    sim.run()
    # the lookup's 0.25 s precede compute (522/256 chunk-times + 3 to fill); the put (0.5 + 8 objects x
    # 0.125 s) runs after compute, off the request's path; then the first decode step (10 ms)
    assert sim.metrics.ttft_s == [pytest.approx(0.25 + 522 / 256 + 3.0 + 0.01)]
    assert sim.masters[0].busy_s == pytest.approx(0.25 + 0.5 + 8 * 0.125)
    assert sim.metrics.lookup_wait_s == [pytest.approx(0.25)]
    # after warm-up (from 0 here): the one turn's master time, a lookup and a put
    summary = summarize(sim, wall_s=1.0)
    assert summary["master_s_per_turn"] == pytest.approx(0.25 + 0.5 + 8 * 0.125)
    assert summary["master_ops_per_turn"] == 2.0


def test_decode_kv_counts_filled_pages_not_reserved_ones() -> None:
    from dataclasses import replace

    from kvpool.core.decode.scheduler import DecodeScheduler
    from kvpool.core.decode.shard_room import ShardRoom
    from kvpool.tools.sim.decode_sim import ShardSim
    from kvpool.tools.sim.job import Job
    from kvpool.tools.sim.workload import SessionPlay

    loop = EventLoop()
    # one-token pages; 10 ms a step (COST)
    shard = ShardSim("d0", 0, loop, COST, ShardRoom(DecodeScheduler(1000, 1, 8, 10_000, loop.clock)), lambda j: None)
    trace = session((100, [1], 0.0))
    assert shard.room.reserve("j", 100, 10) is None  # the router's ticket: the room, before prefill
    shard.submit(Job("j", SessionPlay(0, trace), replace(trace.turns[0], output_tokens=10), 0.0))
    seen = []
    loop.at(0.035, lambda: seen.append((shard.filled_pages(), shard.scheduler.num_pages_used)))
    loop.run(1.0)
    # at 35 ms, 3 of 10 steps done: the prompt's 100 pages + 3 decoded tokens are filled, while admission
    # reserved the sequence's whole life: 100 + 10 - 1 = 109 pages
    assert seen == [(103, 109)]


def test_a_turn_short_of_decode_room_waits_at_the_router_and_prefills_once_room_comes_back() -> None:
    # decode: 1,024 one-token pages. s0 holds 522 + 4 - 1 = 525 of them from its ticket; s1 needs 781: its
    # shard refuses it at once, it queues at the router holding nothing, and s2 (131 pages, which would fit)
    # queues behind it (nobody overtakes the head). s0's end gives its pages back and rings: s1, then s2.
    traces = [session((522, A, 0.0)), session((778, list(range(21, 33)), 0.0)), session((128, [41, 42], 0.0))]
    settings = RunSettings(num_sessions=3, duration_s=1000.0, warmup_s=0.0, think_scale=1.0, start_spread_s=0.0,
                           restart_sessions=False)
    sim = Simulation(topology(1), settings, COST, traces)
    sim.router.effects = {}
    sim.run()
    assert [t[0] for t in sim.metrics.turn_tokens] == ["s0.t0", "s1.t0", "s2.t0"]
    events = {job: [(e["event"], e["effect"]) for e in effects] for job, effects in sim.router.effects.items()}
    assert events["s0.t0"] == [("admit", "Serve"), ("reserved", "Apply"), ("end", "Apply")]
    assert events["s1.t0"] == [("admit", "Serve"), ("refused", "Apply"), ("refused", "WaitForTicket"),
                               ("ticketed", "Serve"), ("reserved", "Apply"), ("end", "Apply")]
    assert events["s2.t0"] == [("admit", "WaitForTicket"), ("ticketed", "Serve"), ("reserved", "Apply"),
                               ("end", "Apply")]
    # s1 and s2 were prefilled only after s0's decode ended (COST: 4 steps of 10 ms, the first its first token)
    s0_done = sim.metrics.ttft_s[0] + 3 * 0.01
    assert min(sim.metrics.ttft_s[1:]) > s0_done
    assert sim.trace_policy["expired_in_queue"] == 0 and not sim.router.jobs
    assert all(shard.room.num_held == 0 for shard in sim.shards.values())


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 12), st.integers(1, 40)), min_size=1, max_size=6),
       st.integers(300, 1200), st.floats(5.0, 60.0))
def test_whatever_the_turns_and_the_decode_room_every_turn_ends_and_nothing_is_held(
        turns: list[tuple[int, int]], num_pages: int, queue_timeout_s: float) -> None:
    # sessions of one turn each, all at once: (blocks of 64 tokens, output tokens); decode holds num_pages
    # one-token pages (a turn needing more than that is refused at the door), the router's queue waits
    # queue_timeout_s. Each turn is served, refused or expired, and at the end no page, ticket or queued turn is
    # left, and no prefill block is held
    traces = [session((64 * n - 5, list(range(100 * k, 100 * k + n)), 0.0)) for k, (n, _) in enumerate(turns)]
    traces = [replace(t, turns=(replace(t.turns[0], output_tokens=out),)) for t, (_, out) in zip(traces, turns)]
    topo = replace(topology(1), decode_kv_gib_per_gpu=num_pages / 4 / GIB)  # 4 GPUs x 1 B a token
    settings_ = RunSettings(num_sessions=len(traces), duration_s=10_000.0, warmup_s=0.0, think_scale=1.0,
                            start_spread_s=0.0, restart_sessions=False, queue_timeout_s=queue_timeout_s)
    sim = Simulation(topo, settings_, COST, traces)
    sim.router.effects = {}
    sim.run()
    policy = sim.trace_policy
    served = len(sim.metrics.turn_tokens)
    assert served + policy["refused_device_cache"] + policy["refused_decode"] + policy["expired_in_queue"] == len(turns)
    assert not sim.router.jobs and sim.router.admission.num_admitted == 0 and sim.router.admission.num_queued == 0
    assert all(shard.room.num_held == 0 and shard.scheduler.num_pages_used == 0 for shard in sim.shards.values())
    assert all(p.blocks.num_free_blocks == p.blocks.num_blocks for p in sim.pipelines.values())
    # every turn's router effects end with its release
    assert all(e[-1]["event"] == "end" for e in sim.router.effects.values())


def test_sessions_of_one_agent_share_their_system_and_tool_prefix_and_nothing_after() -> None:
    from kvpool.tools.sim.workload import SessionPlay

    # two traces whose first 8 blocks (2 chunks) are the agent's prefix; they share 12 leading blocks in all
    def trace(name: str, tail: int) -> Session:
        ids = list(range(1, 13)) + list(range(tail, tail + 8))
        return parse_session({"id": name, "block_size": 64, "system_tokens": 128, "tool_tokens": 384,
                              "requests": [{"t": 0.0, "in": 64 * 20, "out": 4, "hash_ids": ids}]})

    a, b = trace("a", 100), trace("b", 200)
    plays = [SessionPlay(0, a, agent_prefix=True), SessionPlay(1, a, agent_prefix=True),
             SessionPlay(2, b, agent_prefix=True), SessionPlay(3, a)]
    hashes = []
    for play in plays:
        play.take_turn(256)
        hashes.append(play.hashes)
    assert plays[0].shared_blocks == 8 and len(hashes[0]) == 5
    # two sessions of one trace: the prefix's 2 chunks alike, the rest their own (no history shared)
    assert hashes[0][:2] == hashes[1][:2] and not set(hashes[0][2:]) & set(hashes[1][2:])
    # another trace with the same prefix: its 2 chunks too (its third, past the agent's prefix, is its own)
    assert hashes[2][:2] == hashes[0][:2] and hashes[2][2] != hashes[0][2]
    # without the agent's prefix a session shares nothing
    assert not set(hashes[3]) & set(hashes[0])


def test_a_turn_hashes_only_what_it_does_not_share_with_the_last_to_the_same_hashes() -> None:
    from kvpool.core.chunk_hash import chunk_hashes
    from kvpool.tools.sim.workload import turn_chunk_hashes
    from kvpool.workload.weka import Turn

    def turn(ids: list[int]) -> Turn:
        return Turn(0.0, 64 * len(ids) + 10, 1, tuple(ids), 0.0)

    grown, branched, shorter = list(range(1, 22)), [*range(1, 7), 99, *range(8, 30)], list(range(1, 10))
    last = None
    for ids in (list(range(1, 13)), grown, branched, shorter, shorter, []):
        for own in (None, (3, 2)):
            got = turn_chunk_hashes("ns", turn(ids), 64, 256, own, last)
            fresh = turn_chunk_hashes("ns", turn(ids), 64, 256, own)
            assert got == fresh and got[1] == chunk_hashes("ns", fresh[0][: len(ids) // 4 * 4], 4)
        last = got


def test_a_runs_memory_follows_its_live_sessions_not_its_simulated_time() -> None:
    # 2 session slots, each trace 3 turns of 2-3 chunks: over 6,000 s the slots play ~300 instances, each
    # ending (its state forgotten) before the next starts. What the run keeps stays within bounds the whole
    # time: per-instance state for the live instances only, no lookup history handle (the simulated driver
    # never sends one, and a kept one would keep the groups it names after the index forgets them), and the
    # pool's groups within its 2 MiB (1 KiB a group: it evicts)
    traces = [session((522, [k * 100 + i for i in range(8)], 1.0), (778, [k * 100 + i for i in range(12)], 1.0),
                      (778, [k * 100 + 50 + i for i in range(12)], 1.0)) for k in range(4)]
    settings_ = RunSettings(num_sessions=2, duration_s=6000.0, warmup_s=0.0, think_scale=1.0, start_spread_s=0.0)
    sim = Simulation(topology(1), settings_, COST, traces)
    seen: list[tuple[int, int, int, int, int]] = []

    def sample() -> None:
        seen.append((len(sim.plays), len(sim._seen), len(sim._seen_blocks),
                     sum(len(i.histories) for i in sim.indexes), sum(len(i.groups) for i in sim.indexes)))
        sim.loop.after(50.0, sample)

    sim.loop.at(1.0, sample)
    sim.run()
    assert sim._next_instance > 200  # many instances started and ended
    assert sim.metrics.master_lookups > 600 and sim.metrics.evicted_groups > 0  # lookups ran, the pool evicted
    assert len(seen) == 120
    assert all(plays <= 2 and seen_ <= 2 and blocks <= 2 and handles == 0 and groups <= 2048
               for plays, seen_, blocks, handles, groups in seen), seen
