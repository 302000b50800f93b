"""``kvpool replay --compare``'s load finder: when it is on, what it steps, what it calls queueing, what it refuses.

The steps themselves run real clusters (docs/benchmarks.md records a run); these are the rules around them.
"""

from __future__ import annotations

import argparse
import math

import pytest

from kvpool.services import cli_parser
from kvpool.tools.replay import compare_cmd
from kvpool.tools.replay.compare import baseline_side, prefill_queueing, run_compare
from kvpool.tools.replay.records import ReplayOptions
from kvpool.tools.replay.topology import TopologySettings


def replay_args(*argv: str) -> argparse.Namespace:
    return cli_parser.build_parser().parse_args(["replay", *argv])


def test_on_by_default_for_sched_unless_the_concurrency_is_given() -> None:
    def on(*argv: str) -> bool:
        args = replay_args(*argv)
        what, _ = compare_cmd._check(args)
        return compare_cmd.find_load_on(args, what)

    assert on("--compare", "sched=fifo,session")
    assert on("--compare", "sched=fifo,session", "--sessions", "16")  # the first step
    assert not on("--compare", "sched=fifo,session", "--concurrency", "16")  # a load of your own
    assert not on("--compare", "sched=fifo,session", "--no-find-load")
    assert not on("--compare", "sched=fifo,session", "--kill-server", "0", "--at", "3")
    assert not on("--compare", "pool=shared,split")
    assert on("--compare", "pool=shared,split", "--find-load")


@pytest.mark.parametrize(("argv", "message"), [
    (("--find-load", "--concurrency", "4"), "--find-load sets the concurrency"),
    (("--find-load", "--kill-server", "0", "--at", "3"), "--find-load: not with --kill-server"),
    (("--find-load-max-sessions", "0"), "--find-load-max-sessions: must be >= 1"),
    (("--sessions", "32", "--find-load-max-sessions", "16"), "--find-load-max-sessions: 16 is below --sessions 32"),
])
def test_bad_load_finder_flags_are_refused_by_name(argv: tuple[str, ...], message: str) -> None:
    with pytest.raises(SystemExit, match=message):
        compare_cmd._check(replay_args("--compare", "sched=fifo,session", *argv))


def test_the_steps_double_up_to_the_last() -> None:
    assert compare_cmd.load_steps(8, 64) == [8, 16, 32, 64]
    assert compare_cmd.load_steps(12, 40) == [12, 24, 40]
    assert compare_cmd.load_steps(16, 16) == [16]


def test_the_baseline_is_the_side_measured_against() -> None:
    assert baseline_side("sched", ("fifo", "session")) == "fifo"
    assert baseline_side("sched", ("session", "fifo")) == "fifo"
    assert baseline_side("pool", ("shared", "split-moving", "split-strict")) == "split-moving"
    assert baseline_side("pool", ("shared", "split-strict")) == "split-strict"
    assert baseline_side("groups", ("on", "off")) == "off"


def test_queueing_is_the_median_wait_in_front_of_prefill_against_the_median_service() -> None:
    summary = {"router_queue_wait_p50_s": 0.5, "prefill_gate_wait_p50_s": 0.25, "prefill_queue_wait_p50_s": 0.0,
               "prefill_compute_p50_s": 0.8}
    assert prefill_queueing(summary) == {"prefill_wait_p50_s": 0.75, "prefill_service_p50_s": 0.8, "queues": False}
    assert prefill_queueing({**summary, "prefill_gate_wait_p50_s": 0.3})["queues"]
    # no gate on a side (nan): the other waits count; no service measured: never queueing
    assert prefill_queueing({**summary, "prefill_gate_wait_p50_s": math.nan})["prefill_wait_p50_s"] == 0.5
    assert not prefill_queueing({**summary, "prefill_compute_p50_s": math.nan, "router_queue_wait_p50_s": 9.0})[
        "queues"]


def test_a_side_already_run_is_reused_only_at_one_level_one_after_the_other() -> None:
    for levels, at_once in (([2, 4], False), ([4], True)):
        with pytest.raises(ValueError, match="ran: only for one level"):
            run_compare("sched", ("fifo", "session"), TopologySettings(), None, levels,  # type: ignore[arg-type]
                        ReplayOptions(), at_once=at_once, ran={"fifo": {}})
