"""sched=session in the simulator on hand-made traces: the work-aware queue's order, session end, prefetch (exact)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvpool.core.sessions.table import SessionId
from kvpool.tools.sim.compare_sched import parse_sched_compare, ratios
from kvpool.tools.sim.engine import Simulation
from kvpool.tools.sim.job import SIM_TENANT
from kvpool.tools.sim.topology import GIB, RunSettings
from kvpool.workload.weka import Session
from tests.unit.test_sim_engine import COST, session, topology

A = list(range(1, 9))  # 2 full chunks and a partial one


def run(traces: list[Session], sched: str, **settings: object) -> Simulation:
    base = RunSettings(num_sessions=len(traces), duration_s=1000.0, warmup_s=0.0, think_scale=1.0,
                       start_spread_s=0.0, restart_sessions=False, sched=sched)
    # decode holds every turn here at once (4,096 one-token pages), so turns wait in stage 0's queue, whose
    # order these tests are about, not in the router's for decode room
    sim = Simulation(replace(topology(1), decode_kv_gib_per_gpu=4096 / GIB),
                     RunSettings(**{**{f: getattr(base, f) for f in base.__slots__}, **settings}), COST, traces)
    sim.run()
    return sim


def test_the_work_aware_queue_serves_the_short_turn_before_the_long_one() -> None:
    # all arrive at 0: s0 starts at once; s1 (a cold 3 chunks) and s2 (a cold half chunk) wait behind it
    traces = [session((522, A, 0.0)), session((778, list(range(21, 33)), 0.0)), session((128, [41, 42], 0.0))]
    fifo = [t[0] for t in run(traces, "fifo").metrics.turn_tokens]
    work = [t[0] for t in run(traces, "session", max_wait_s=30.0).metrics.turn_tokens]
    assert fifo == ["s0.t0", "s1.t0", "s2.t0"]
    assert work == ["s0.t0", "s2.t0", "s1.t0"]


def test_aging_bounds_the_wait_the_long_turn_goes_first_once_overdue() -> None:
    traces = [session((522, A, 0.0)), session((778, list(range(21, 33)), 0.0)), session((128, [41, 42], 0.0))]
    # s0 computes for 2 + 10/256 chunk-times + 3 to fill (~5 s): by then s1 has waited past 1 s
    sim = run(traces, "session", max_wait_s=1.0)
    assert [t[0] for t in sim.metrics.turn_tokens] == ["s0.t0", "s1.t0", "s2.t0"]
    assert sim.pipelines["p0.0"].queue.num_overdue_pops == 2


def test_a_sessions_last_turn_releases_its_device_blocks_fifo_keeps_them() -> None:
    traces = [session((522, A, 0.0))]
    assert run(traces, "fifo").pipelines["p0.0"].blocks.num_cached_blocks == 2
    sim = run(traces, "session")
    blocks = sim.pipelines["p0.0"].blocks
    assert blocks.num_cached_blocks == 0 and blocks.num_uncached_free_blocks == blocks.num_blocks
    assert sim.sessions is not None and len(sim.sessions.policies["p0.0"].sessions) == 0


def test_a_history_the_device_lost_during_think_time_is_prefetched_and_used() -> None:
    # s0's T0 caches A's 2 chunks; s1's only turn (3 chunks + a partial: all 4 blocks) evicts them, then
    # ends its session (its blocks are released, uncached); 1 s before s0's T1 (think 100 s, the hint),
    # the pool's copy of A is staged into those blocks, and T1 finds A on the device
    traces = [session((522, A, 0.0), (778, A + [9, 10, 11, 12], 100.0)), session((778, list(range(21, 33)), 0.0))]
    fifo = run(traces, "fifo")
    sim = run(traces, "session")
    assert [t for t in fifo.metrics.turn_tokens if t[0] == "s0.t1"] == [("s0.t1", 0, 512, 266)]
    assert [t for t in sim.metrics.turn_tokens if t[0] == "s0.t1"] == [("s0.t1", 512, 0, 266)]
    assert sim.sessions is not None
    figures = sim.sessions.figures()
    chunk_bytes = 4 * 1 * 256  # 4 layers x 1 byte x 256 tokens
    assert (figures["prefetches"], figures["prefetched_bytes"], figures["prefetch_used_bytes"],
            figures["prefetch_wasted_bytes"]) == (1, 2 * chunk_bytes, 2 * chunk_bytes, 0)
    # the restore left the critical path: T1 waited on no read
    assert fifo.metrics.restore_s == [pytest.approx(1.0)] and sim.metrics.restore_s == []


def test_without_the_hint_nothing_is_prefetched() -> None:
    traces = [session((522, A, 0.0), (778, A + [9, 10, 11, 12], 100.0)), session((778, list(range(21, 33)), 0.0))]
    sim = run(traces, "session", think=False)
    assert sim.sessions is not None and sim.sessions.figures()["prefetches"] == 0


def test_sessions_are_scoped_by_the_simulators_tenant() -> None:
    traces = [session((522, A, 0.0), (778, A + [9, 10, 11, 12], 100.0))]
    sim = run(traces, "session", duration_s=50.0)  # between the turns
    assert sim.sessions is not None
    assert sim.sessions.policies["p0.0"].sessions.idle_order() == [SessionId(SIM_TENANT, "s0")]


def test_compare_flag_and_ratios() -> None:
    parse_sched_compare("sched=fifo,session")
    for bad in ("sched=session,fifo", "pool=shared,split", "sched=fifo"):
        with pytest.raises(SystemExit, match="--compare"):
            parse_sched_compare(bad)
    fifo = {"ttft_p50_s": 4.0, "ttft_p99_s": 10.0, "ttft_mean_s": 5.0, "throughput_per_gpu": 100.0,
            "prompt_tok_s": 90.0, "restore_critical_s_per_turn": 0.2, "reuse_ratio": 0.9,
            "wasted_prefetch_share": 0.0, "errors": 0, "trace_bound": 0.95}
    session_side = dict(fifo, ttft_p50_s=1.0, ttft_p99_s=9.0, throughput_per_gpu=101.0, restore_critical_s_per_turn=0.1,
                        reuse_ratio=0.91, wasted_prefetch_share=0.25, errors=1, trace_bound=0.92)
    out = ratios(fifo, session_side)
    assert out == {"ttft_p50_session_over_fifo": 0.25, "ttft_p99_session_over_fifo": 0.9,
                   "ttft_mean_session_over_fifo": 1.0, "throughput_session_over_fifo": 1.01,
                   "prompt_throughput_session_over_fifo": 1.0, "restore_critical_session_over_fifo": 0.5,
                   "reuse_session": 0.91, "reuse_fifo": 0.9, "trace_bound_session": 0.92, "trace_bound_fifo": 0.95,
                   "reuse_gap_session": pytest.approx(0.01), "reuse_gap_fifo": pytest.approx(0.05),
                   "wasted_prefetch_share": 0.25, "errors": 1}


def test_pooling_runs_over_seeds_takes_percentiles_over_all_their_turns() -> None:
    from kvpool.tools.sim.compare_sched import per_seed, pool_runs

    def side(samples: list[float], tokens: int, reuse: float, bound: float, **more: object) -> dict[str, object]:
        return {"ttft_samples": samples, "ttft_p50_s": samples[len(samples) // 2], "ttft_p99_s": max(samples),
                "ttft_mean_s": sum(samples) / len(samples), "counted_prompt_tokens": tokens, "reuse_ratio": reuse,
                "trace_bound": bound, "throughput_per_gpu": 100.0 * len(samples), "prompt_tok_s": 90.0 * len(samples),
                "restore_critical_s_per_turn": 0.1, "turns": len(samples),
                "errors": 0, "sched": "fifo", "ttft_breakdown": {"all": {}}, **more}

    a = side([1.0, 2.0, 3.0, 10.0], 300, 0.9, 0.95, prefetched_bytes=100, prefetch_wasted_bytes=10,
             wasted_prefetch_share=0.1, prefetch_outcomes={"used": 2, "wasted": 1})
    b = side([4.0, 5.0, 6.0, 7.0, 8.0, 9.0], 100, 0.5, 0.55, prefetched_bytes=300, prefetch_wasted_bytes=90,
             wasted_prefetch_share=0.3, prefetch_outcomes={"used": 1, "cancelled": 4})
    one = pool_runs([a])
    # the summary's own nearest rank (kvpool.tools.sim.metrics.percentile): the 2nd of 4
    assert one["ttft_p50_s"] == 2.0 and one["ttft_p99_s"] == 10.0 and one["ttft_breakdown"] == {"all": {}}
    assert "ttft_samples" not in one and one["ttft_turns"] == 4
    both = pool_runs([a, b])
    # ten turns, 1..10: the 6th is the p50 (no run's own p50 is 6), the 10th the p90 and p99
    assert (both["ttft_p50_s"], both["ttft_p90_s"], both["ttft_p99_s"], both["ttft_mean_s"]) == (6.0, 10.0, 10.0, 5.5)
    assert both["reuse_ratio"] == pytest.approx((0.9 * 300 + 0.5 * 100) / 400)  # weighted by prompt tokens
    assert both["trace_bound"] == pytest.approx((0.95 * 300 + 0.55 * 100) / 400)
    assert both["throughput_per_gpu"] == 500.0 and both["turns"] == 10 and both["counted_prompt_tokens"] == 400
    assert both["wasted_prefetch_share"] == pytest.approx(100 / 400)  # over all prefetched bytes, not a mean
    assert both["prefetch_outcomes"] == {"cancelled": 4, "used": 3, "wasted": 1}
    assert "ttft_breakdown" not in both and both["sched"] == "fifo"
    rows = per_seed([0, 1], [a, b], [dict(a, ttft_p50_s=1.5), dict(b, ttft_p99_s=18.0, errors=2)])
    assert [(r["seed"], r["ttft_p50_session_over_fifo"], r["ttft_p99_session_over_fifo"], r["errors"]) for r in rows] == [
        (0, 0.5, 1.0, 0), (1, 1.0, 2.0, 2)]


def test_replay_compare_sched_sides_and_hints() -> None:
    from kvpool.tools.replay.compare import parse_compare, sched_ratios, side_settings
    from kvpool.tools.replay.engine import session_hints
    from kvpool.tools.replay.topology import TopologySettings, side_topology
    from kvpool.tools.replay.workload import ReplaySession, ReplayTurn

    assert parse_compare("sched=fifo,session") == ("sched", ("fifo", "session"))
    with pytest.raises(ValueError, match="sched=fifo,session"):
        parse_compare("sched=fifo,lifo")
    side = side_settings(TopologySettings(), "sched", "session")
    args = side_topology(side).servers[0].pipelines[0].args
    assert args[args.index("--sched") + 1] == "session"
    turns = tuple(ReplayTurn(i, 10.0 * i, think, 64, (i,), 64, 4) for i, think in enumerate((0.0, 30.0, 8.0)))
    session = ReplaySession("s", "s", 64, 0.0, 0, turns, ())
    assert [session_hints(session, t, 0.5) for t in turns] == [
        {"expected_next_s": 15.0}, {"expected_next_s": 4.0}, {"session_end": True}]
    fifo = {"ttft_p50_s": 2.0, "ttft_p99_s": 4.0, "prompt_tok_s": 100.0, "restore_wait_total_s": 1.0,
            "reuse_ratio": 0.8, "errors": 0}
    out = sched_ratios(fifo, dict(fifo, ttft_p50_s=1.0, prompt_tok_s=99.0, prefetched_bytes=100,
                                  prefetch_used_bytes=80, prefetch_wasted_bytes=20, errors=0))
    assert (out["ttft_p50_session_over_fifo"], out["throughput_session_over_fifo"], out["wasted_prefetch_share"],
            out["errors"]) == (0.5, 0.99, 0.2, 0)


def test_a_turns_arrival_touches_its_sessions_cached_blocks_in_fifo_too() -> None:
    # as stage 0 does for every turn: while s0's turn waits, its session's cached block is the most recently used
    from kvpool.tools.sim.job import Job
    from kvpool.tools.sim.workload import SessionPlay

    trace = session((257, [1, 2, 3, 4, 5], 0.0))
    settings = RunSettings(num_sessions=1, duration_s=1000.0, warmup_s=0.0, start_spread_s=0.0, sched="fifo")
    pipeline = Simulation(topology(1), settings, COST, [trace]).pipelines["p0.0"]  # not run: driven by hand
    blocks = pipeline.blocks
    for request_id, key in (("a", "s0"), ("b", "s1")):
        blocks.allocate(request_id, [key.encode()], 256, 0, session=SessionId(SIM_TENANT, key))
        blocks.commit_chunks(request_id, 0, [key.encode()])
        blocks.free(request_id)
    a, b = blocks.cached_block_id(b"s0"), blocks.cached_block_id(b"s1")
    assert blocks.free_block_ids()[-2:] == [a, b]
    play = SessionPlay(0, trace)
    turn, _ = play.take_turn(256)
    pipeline.busy = True  # the turn waits
    pipeline.enqueue(Job("s0.t0", play, turn, 0.0))
    assert blocks.free_block_ids()[-2:] == [b, a] and len(pipeline.queue) == 1


def test_ttft_breakdown_by_band() -> None:
    from kvpool.tools.sim.metrics import ttft_breakdown

    # 100 turns: TTFT i+1 s, queue i s, 1 s after the restore (0.75 to the handoff's end, 0.25 to the first decoded
    # token); the slowest also waited 0.5 s on its lookup
    parts = [(i + 1.0, float(i), 0.0, 0.0, 0.75, 0.25) for i in range(99)] + [(100.0, 98.5, 0.5, 0.0, 0.75, 0.25)]
    out = ttft_breakdown(parts)
    assert out["all"]["turns"] == 100 and out["all"]["ttft_s"] == pytest.approx(50.5)
    assert (out["p40_p60"]["turns"], out["p40_p60"]["ttft_s"], out["p40_p60"]["queue_s"]) == (21, 50.0, 49.0)
    assert out["p99_up"] == {"turns": 1, "ttft_s": 100.0, "queue_s": 98.5, "lookup_s": 0.5, "restore_s": 0.0,
                             "after_restore_s": 0.75, "first_token_s": 0.25}
    assert ttft_breakdown([]) == {}
    # the prefetched turn of the hand-made run waits on no restore; FIFO's restores its 2 chunks (1 s)
    traces = [session((522, A, 0.0), (778, A + [9, 10, 11, 12], 100.0)), session((778, list(range(21, 33)), 0.0))]
    assert max(p[3] for p in run(traces, "fifo").metrics.ttft_parts) == pytest.approx(1.0)
    assert max(p[3] for p in run(traces, "session").metrics.ttft_parts) == 0.0


def test_the_line_under_the_table_says_how_far_the_p99_holds() -> None:
    from kvpool.tools.sim.compare_sched import SINGLE_RUN_NOTE, offsets_line

    assert offsets_line({"seeds": 1}) == SINGLE_RUN_NOTE and "--seeds 5" in SINGLE_RUN_NOTE
    rows = [{"ttft_p99_session_over_fifo": p} for p in (1.104, 0.963, 1.401)]
    assert offsets_line({"seeds": 3, "first_seed": 0, "closed_loop": {"per_seed": rows}}) == (
        "3 trace offsets pooled (0-2); the closed loop's p99 ratio by offset: 0.96-1.40")
    assert offsets_line({"seeds": 3, "first_seed": 5, "closed_loop": {"per_seed": rows}}).startswith(
        "3 trace offsets pooled (5-7);")


def test_first_seed_picks_the_offsets_and_is_checked_before_any_run() -> None:
    from kvpool.services import cli_parser
    from kvpool.tools.sim.compare_sched import run_compare

    def args(*argv: str) -> object:
        return cli_parser.build_parser().parse_args(["simulate", "--compare", "sched=fifo,session", *argv])

    assert (args().first_seed, args("--first-seed", "5", "--seeds", "5").first_seed) == (0, 5)
    with pytest.raises(SystemExit, match="--first-seed: must be >= 0, got -1"):
        run_compare(args("--first-seed", "-1"), "unused.toml")
    with pytest.raises(SystemExit, match="--seeds: must be at least 1, got 0"):
        run_compare(args("--first-seed", "5", "--seeds", "0"), "unused.toml")
