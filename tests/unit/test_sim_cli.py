"""``kvpool simulate --quick --json``: the last line is one JSON object with the seed's comparisons."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
TRACES = ROOT.parent / "shared" / "traces" / "agentx-weka"


def write_traces(folder: Path) -> Path:
    """Two small sessions in the weka format: 3 turns each, growing prompts sharing their history."""
    folder.mkdir()
    for k in range(2):
        ids = list(range(1000 * k, 1000 * k + 40))
        requests = [{"t": 10.0 * i, "in": 64 * (20 + 10 * i) + 5, "out": 50, "hash_ids": ids[: 20 + 10 * i],
                     "think_time": 30.0} for i in range(3)]
        (folder / f"trace_{k:04d}.json").write_text(json.dumps(
            {"id": f"t{k}", "block_size": 64, "tool_tokens": 0, "system_tokens": 0, "requests": requests}))
    return folder


@pytest.mark.cluster  # starts the CLI in a process
def test_quick_json_line_has_the_keys(tmp_path: Path) -> None:
    traces = write_traces(tmp_path / "traces")
    runs = tmp_path / "runs.jsonl"
    result = subprocess.run(
        [sys.executable, "-m", "kvpool.services.cli", "simulate", "--quick", "--json", "--traces", str(traces),
         "--runs-to", str(runs), "--jobs", "1", "--think-scale", "1", "--only", "seed-per_server-16-shared-strict,seed-per_server-16-split-strict,"
         "seed-per_server-16-shared-4,seed-per_server-16-split-4"],
        capture_output=True, text=True, cwd=ROOT, timeout=240,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert "tok/s/GPU" in lines[0]  # the table first
    final = json.loads(lines[-1])
    ratios = final["shared_over_split"]["per_server"]["16"]
    assert set(ratios) == {"strict", "4"} and all(v > 0 for v in ratios.values())
    best = final["shared_over_split_best"]["per_server"]["16"]
    assert best["throughput"] > 0 and best["ttft_p99"] > 0
    assert {best["throughput_thresholds"][0], best["throughput_thresholds"][1]} <= {"strict", "4"}
    assert final["sim_speed"] > 0
    # every run was appended as it ended; reporting from them gives the same comparisons
    assert len(runs.read_text().splitlines()) == 4
    again = subprocess.run(
        [sys.executable, "-m", "kvpool.services.cli", "simulate", "--json", "--traces", str(traces), "--from-runs", str(runs)],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
    )
    assert again.returncode == 0, again.stderr
    replayed = json.loads(again.stdout.strip().splitlines()[-1])
    assert replayed["shared_over_split"] == final["shared_over_split"]


@pytest.mark.cluster
def test_only_with_no_match_fails_naming_the_flag() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "kvpool.services.cli", "simulate", "--quick", "--json", "--traces", str(ROOT),
         "--only", "nothing"], capture_output=True, text=True, cwd=ROOT, timeout=60,
    )
    assert result.returncode != 0
    assert "--only matched no run" in result.stderr


def test_validate_uses_this_hosts_cost_model_unless_told() -> None:
    from kvpool.tools.sim.cost_model import CPU_COST_MODEL, DEFAULT_COST_MODEL
    from kvpool.services.cli_parser import build_parser
    from kvpool.tools.sim.cost_model import cost_model_path

    parser = build_parser()
    assert cost_model_path(parser.parse_args(["simulate", "--validate"])) == str(CPU_COST_MODEL)
    assert cost_model_path(parser.parse_args(["simulate", "--quick"])) == str(DEFAULT_COST_MODEL)
    chosen = parser.parse_args(["simulate", "--validate", "--cost-model", str(DEFAULT_COST_MODEL)])
    assert cost_model_path(chosen) == str(DEFAULT_COST_MODEL)


@pytest.mark.skipif(not (TRACES / "trace_0002.json").is_file(), reason="needs ../shared/traces/agentx-weka")
def test_validate_json_line_keys_with_the_cluster_side_replaced(monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    # no cluster in a unit test: the "real" side is the simulator's own replay of the three validation
    # sessions, round robin, 45 turns, 3 output tokens each, timed by the CPU cost model, so the verdict is
    # exact: equal counts, no timing error, and the small pool restores and evicts
    from kvpool.tools.sim.cost_model import CPU_COST_MODEL, load_cost_model
    from kvpool.tools.sim.validate import ValidationSetup, replay_sessions, turn_key
    from kvpool.workload.weka import load_session
    from kvpool.tools.sim import validate_cmd as simulate_validate
    from kvpool.services.cli_parser import build_parser

    sessions = [load_session(TRACES / name) for name in simulate_validate.VALIDATION_TRACES]
    order = [f"s{k}.t{i}" for i in range(33) for k, s in enumerate(sessions) if i < len(s.turns)][:45]
    # one request at a time: admitted, its blocks freed, its save's freed
    events = [(kind, name) for request_id in order
              for kind, name in (("admit", request_id), ("free", request_id), ("free", request_id + "/save"))]
    setup = ValidationSetup(context=32768, device_cache_tokens=simulate_validate.DEVICE_CACHE_TOKENS,
                            store_bytes=simulate_validate.SEGMENT_BYTES)
    keys = [turn_key(r) for r in order]
    turns, span, pool = replay_sessions(sessions, setup, load_cost_model(CPU_COST_MODEL), events,
                                        dict.fromkeys(keys, 3))
    assert pool["events_left"] == 0
    fake = {key: replace(t, output_tokens=3) for key, t in turns.items()}
    real = {"turns": fake, "events": events, "wall_s": span, "pool": {"evicted_groups": pool["evictions"]}, "errors": 0,
            "effects": pool["effects"], "router_effects": pool["router_effects"]}
    monkeypatch.setattr(simulate_validate, "_real_side", lambda *a: real)
    args = build_parser().parse_args(["simulate", "--validate", "--quick", "--json", "--traces", str(TRACES)])
    assert simulate_validate.main(args) == 0
    final = json.loads(capsys.readouterr().out)  # one JSON document on stdout (the runs' lines go to stderr)
    assert list(final)[-6:] == ["pool_tokens", "evictions", "effects_equal", "token_counts_equal", "throughput_error",
                                "ttft_p50_error"]
    assert final["cost_model"] == "cost_model_cpu.toml" and final["runs"] == 1
    assert final["turns_compared"] == 45 and final["mismatched_turns"] == [] and final["num_mismatched_turns"] == 0
    assert final["pool_tokens"] == final["real_pool_tokens"] == sum(t.pool_tokens for t in turns.values()) > 0
    assert final["evictions"] == final["real_evictions"] == pool["evictions"] > 0
    assert final["token_counts_equal"] is True
    # every request's driver effects, one by one (each admitted, looked up, forwarded, its blocks freed)
    assert final["effects_equal"] is True and final["requests_effects_compared"] == 45
    assert final["num_effects_differing"] == 0
    # and the router's: each turn admitted at once (no decode room is short here), its room held, its end
    assert final["router_effects_compared"] == 45 and final["num_router_effects_differing"] == 0
    assert pool["router_effects"]["s0.t0"] == [
        {"event": "admit", "effect": "Serve", "pipeline_reason": "new_session", "locality": "same_server", "tries": 1,
         "shard_tries": 1},
        {"event": "reserved", "effect": "Apply", "tickets": 0, "expired": 0, "unavailable": 0},
        {"event": "end", "effect": "Apply", "tickets": 0, "expired": 0, "unavailable": 0}]
    assert pool["router_effects"]["s0.t1"][0]["pipeline_reason"] == "affinity"
    assert final["throughput_error"] == pytest.approx(0.0) and final["ttft_p50_error"] == 0.0


def stage0(kind: str, request_id: str, session_key: str, **fields: object) -> dict[str, object]:
    return {"source": "stage0", "kind": kind, "request_id": request_id, "session_key": session_key, **fields}


def test_block_events_from_stage_zeros_records() -> None:
    from kvpool.tools.sim.validate import turn_key
    from kvpool.tools.sim.validate_cmd import recorded_orders

    def admitted(request_id: str, session_key: str, attempt: int = 1) -> dict[str, object]:
        return stage0("effect", request_id, session_key, effect="Admitted", attempt=attempt)

    def freed(request_id: str, session_key: str, holder: str) -> dict[str, object]:
        return stage0("effect", request_id, session_key, effect="Freed", holders=[holder])

    records = [
        admitted("r1", "b"), admitted("r2", "a"),
        stage0("effect", "r1", "b", effect="Prefilled"),
        freed("r1", "b", "r1"),
        admitted("r2", "a", attempt=2),  # planned again: the same request
        admitted("r4", "other"), freed("r4", "other", "r4"),
        freed("r1", "b", "r1/save"),
        admitted("r5", "a"), freed("r2", "a", "r2"),
    ]
    # a forward's end (its computed chunks cached) is a block event too: which block caches a chunk depends on it
    assert recorded_orders(records, ["a", "b"])[0] == [
        ("admit", "s1.t0"), ("admit", "s0.t0"), ("commit", "s1.t0"), ("free", "s1.t0"), ("free", "s1.t0/save"),
        ("admit", "s0.t1"), ("free", "s0.t0")]
    assert turn_key("s12.t3") == (12, 3)


def test_recorded_orders_read_arrivals_the_masters_pool_operations_and_each_requests_effects(tmp_path: Path) -> None:
    from kvpool.request_record import RequestRecord, read_records
    from kvpool.tools.sim.validate_cmd import recorded_orders

    path = tmp_path / "requests.jsonl"
    stage, master = RequestRecord("stage0", str(path)), RequestRecord("master", str(path))
    router = RequestRecord("router", str(path))
    router.write("effect", "r2", session_key="a", event="admit", effect="Serve", tries=1)
    stage.write("touch", "r0", session_key="a")  # refused before admission: no turn
    stage.write("touch", "r1", session_key="b")
    stage.write("touch", "r2", session_key="a")
    stage.write("effect", "r2", session_key="a", effect="Admitted", attempt=1)
    stage.write("effect", "r2", session_key="a", effect="Lookup", candidates=3)
    master.write("pool_op", "r2", op="lookup", groups=3, complete=2)
    stage.write("effect", "r1", session_key="b", effect="Admitted", attempt=1)
    master.write("pool_op", "r1", op="put_start", first_key="ns/h1/3", items=2, evicted=1)
    master.write("pool_op", "r9", op="lookup", groups=1, complete=0)  # not a session's
    master.write("pool_op", "r1", op="put_end", first_key="ns/h1/3", items=2)
    stage.write("effect", "r2", session_key="a", effect="Freed", holders=["r2"])
    master.write("pool_op", "r2", op="release", released=True)
    router.write("effect", "r0", session_key="a", event="admit", effect="Serve", tries=1)  # never admitted: no turn
    router.write("effect", "r2", session_key="a", event="end", effect="Apply", tickets=0)
    with path.open("a") as torn:
        torn.write('{"source": "stage0", "kind"')  # a process killed mid-line
    blocks, ops, effects, router_effects = recorded_orders(read_records(path), ["a", "b"])
    # a session's n-th admitted request is its turn n
    assert blocks == [("touch", "s1.t0"), ("touch", "s0.t0"), ("admit", "s0.t0"), ("admit", "s1.t0"),
                      ("free", "s0.t0")]
    assert ops == [(("lookup", "s0.t0"), 2), (("put_start", "s1.t0/3"), 1), (("put_end", "s1.t0/3"), 2),
                   (("release", "s0.t0"), 1)]
    assert effects == {"s0.t0": [{"effect": "Admitted", "attempt": 1}, {"effect": "Lookup", "candidates": 3},
                                 {"effect": "Freed", "holders": ["r2"]}],
                       "s1.t0": [{"effect": "Admitted", "attempt": 1}]}
    assert router_effects == {"s0.t0": [{"event": "admit", "effect": "Serve", "tries": 1},
                                        {"event": "end", "effect": "Apply", "tickets": 0}]}


def replay_recorded(name: str, tmp_path: Path) -> tuple[Any, Any, Any, Any, Any]:
    """A real cluster's records (``tests/data/NAME``) read as ``simulate --validate`` reads them, and the
    simulator's replay of the validation sessions in their recorded order: (events, stage 0's effects, the
    router's effects, the turns, the replay's pool figures)."""
    import gzip

    from kvpool.request_record import read_records
    from kvpool.tools.sim import validate_cmd
    from kvpool.tools.sim.cost_model import CPU_COST_MODEL, load_cost_model
    from kvpool.tools.sim.validate import ValidationSetup, replay_sessions
    from kvpool.workload.weka import load_session

    records = tmp_path / "requests.jsonl"
    records.write_bytes(gzip.decompress((ROOT / "tests" / "data" / name).read_bytes()))
    traces = [TRACES / trace for trace in validate_cmd.VALIDATION_TRACES]
    # the replay names a trace's one session by its file
    events, ops, effects, router = validate_cmd.recorded_orders(read_records(records), [t.stem for t in traces])
    setup = ValidationSetup(context=32768, device_cache_tokens=validate_cmd.DEVICE_CACHE_TOKENS,
                            store_bytes=validate_cmd.SEGMENT_BYTES)
    turns, _, pool = replay_sessions([load_session(t) for t in traces], setup, load_cost_model(CPU_COST_MODEL),
                                     events, None, ops)
    return events, effects, router, turns, pool


def test_a_recorded_cluster_run_replays_with_every_requests_effects_equal(tmp_path: Path) -> None:
    """A real cluster's records (``simulate --validate``, 71 turns of the three sessions, recorded again
    2026-12-05 once stage 0 named its lookups' device-held prefix (49 of them had one: the master leased and
    located fewer groups) and reserved every stage's objects of a save in one put (43 put starts where 176
    were). Where a forward's computed chunk was already cached in another block, whether another request's
    allocation evicted that block before the forward ended decides whether the session's next turn hits 8
    chunks or 7. The simulator commits each forward at its recorded place (``("commit", id)``) and makes each
    save after it, as stage 0 does, so every request's effects come out equal, and the master's operations
    with them."""
    from kvpool.tools.sim.validate import differing_effects

    events, effects, _, turns, pool = replay_recorded("validate-records-commit-order.jsonl.gz", tmp_path)
    assert ("commit", "s0.t7") in events and len(effects) == 71
    assert sum(e.get("held", 0) > 0 for turn in effects.values() for e in turn if e["effect"] == "Lookup") == 49
    assert pool["events_left"] == 0 and pool["pool_ops_left"] == 0 and pool["pool_ops_differing"] == []
    assert differing_effects(pool["effects"], effects) == []
    assert (turns[(0, 7)].device_tokens, turns[(0, 7)].pool_tokens) == (2048, 0)  # as the cluster had it


@pytest.mark.skipif(not (TRACES / "trace_0002.json").is_file(), reason="needs ../shared/traces/agentx-weka")
def test_a_recorded_cluster_run_replays_with_every_requests_router_effects_equal(tmp_path: Path) -> None:
    """A real cluster's records (``simulate --validate``, 71 turns of the three sessions, recorded 2026-12-06
    once the router recorded its request driver's effects; the cluster had 30,720 pool tokens and 86
    evictions). The simulator's router runs the same driver over ``Admission``: every request's router effects
    come out as the cluster's router recorded them, and stage 0's and the master's as before."""
    from kvpool.tools.sim.validate import differing_effects

    _, effects, router, turns, pool = replay_recorded("validate-records-router.jsonl.gz", tmp_path)
    assert len(router) == len(effects) == 71
    assert all(turn[0]["event"] == "admit" and turn[-1]["event"] == "end" for turn in router.values())
    assert pool["events_left"] == 0 and pool["pool_ops_left"] == 0 and pool["pool_ops_differing"] == []
    assert differing_effects(pool["effects"], effects) == []
    assert pool["router_effects"] == router
    assert sum(t.pool_tokens for t in turns.values()) == 30720 and pool["evictions"] == 86


def test_recorded_pool_ops_apply_in_the_recorded_order_and_count_differing_outcomes() -> None:
    from kvpool.tools.sim.events import EventLoop
    from kvpool.tools.sim.validate import RecordedPoolOps

    loop = EventLoop()
    master = RecordedPoolOps([(("lookup", "s0.t0"), 2), (("put_start", "s1.t0/0"), 0), (("put_end", "s1.t0/0"), 3)],
                             loop)
    applied: list[str] = []

    def apply(name: str, figure: int) -> Callable[[], int]:
        return lambda: applied.append(name) or figure

    master.run(("put_start", "s1.t0/0"), apply("put_start", 0))  # waits for the lookup
    master.run(("lookup", "s9.t9"), apply("other lookup", 5))  # not recorded: at once
    loop.run(1.0)
    assert applied == ["other lookup"] and master.num_left == 3
    master.run(("lookup", "s0.t0"), apply("lookup", 1))  # the cluster's lookup found 2 groups
    master.run(("put_end", "s1.t0/0"), apply("put_end", 3))
    loop.run(2.0)
    assert applied == ["other lookup", "lookup", "put_start", "put_end"] and master.num_left == 0
    assert master.differing == [("lookup", "s0.t0")]


def test_recorded_block_events_run_in_the_recorded_order_and_admit_only_the_recorded_turns() -> None:
    from kvpool.tools.sim.events import EventLoop
    from kvpool.tools.sim.validate import RecordedBlockEvents

    loop = EventLoop()
    events = RecordedBlockEvents([("admit", "s1.t0"), ("free", "s1.t0"), ("admit", "s0.t0")], loop)
    ran: list[str] = []
    events.run(("admit", "s0.t0"), lambda: ran.append("admit s0.t0"))  # s1.t0 goes first
    events.run(("admit", "s9.t9"), lambda: ran.append("admit s9.t9"))  # never admitted by the cluster: never
    events.run(("free", "s9.t9/save"), lambda: ran.append("free s9.t9/save"))  # not in the order: at once
    loop.run(1.0)
    assert ran == ["free s9.t9/save"] and events.num_left == 3 and events.head() == ("admit", "s1.t0")
    events.run(("free", "s1.t0"), lambda: ran.append("free s1.t0"))
    events.run(("admit", "s1.t0"), lambda: ran.append("admit s1.t0"))
    loop.run(2.0)
    assert ran == ["free s9.t9/save", "admit s1.t0", "free s1.t0", "admit s0.t0"] and events.num_left == 0


def test_replay_follows_a_lookup_the_master_served_before_an_earlier_admissions() -> None:
    # the cluster's stage 0 admits s0.t0, then s1.t0, and its master serves s1.t0's lookup first: the
    # simulated stage 0 must not hold s0.t0 (waiting for its lookup) before it admits s1.t0
    from kvpool.tools.sim.cost_model import CPU_COST_MODEL, load_cost_model
    from kvpool.tools.sim.validate import ValidationSetup, replay_sessions
    from tests.unit.test_sim_engine import session

    sessions = [session((8192, list(range(1000 * k, 1000 * k + 128)), 0.0)) for k in range(2)]  # 2 chunks at scale 16
    events = [("touch", "s0.t0"), ("touch", "s1.t0"), ("admit", "s0.t0"), ("admit", "s1.t0"), ("free", "s0.t0"),
              ("free", "s1.t0")]
    ops = [(("lookup", "s1.t0"), 0), (("lookup", "s0.t0"), 0)]
    setup = ValidationSetup(context=32768, device_cache_tokens=4608, store_bytes=8 << 20)
    turns, _, pool = replay_sessions(sessions, setup, load_cost_model(CPU_COST_MODEL), events, pool_ops=ops)
    assert pool["events_left"] == 0 and pool["pool_ops_left"] == 0 and pool["stopped_at"] == (None, None)
    assert pool["pool_ops_differing"] == []
    assert {key: (t.device_tokens, t.pool_tokens, t.computed_tokens) for key, t in turns.items()} == {
        (0, 0): (0, 0, 512), (1, 0): (0, 0, 512)}


def test_the_queue_flags_reach_the_compared_runs_settings() -> None:
    from kvpool.tools.sim.compare_sched import run_compare
    from kvpool.tools.sim.topology import RunSettings
    from kvpool.services import cli_parser

    def args(*flags: str) -> object:
        return cli_parser.build_parser("simulate").parse_args(["simulate", "--compare", "sched=fifo,session", *flags])

    parsed = args("--sched-max-wait-s", "inf", "--sched-max-bypass-s", "5", "--session-order", "ratio")
    assert (parsed.sched_max_wait_s, parsed.sched_max_bypass_s, parsed.session_order) == (math.inf, 5.0, "ratio")
    defaults = args()
    assert (defaults.sched_max_wait_s, defaults.sched_max_bypass_s, defaults.session_order) == (4.0, math.inf, "work")
    settings = RunSettings()  # the flags' defaults are RunSettings' own
    assert (settings.max_wait_s, settings.max_bypass_s, settings.session_order) == (4.0, math.inf, "work")
    with pytest.raises(SystemExit, match="max_bypass_s: must be >= 0"):
        run_compare(args("--sched-max-bypass-s", "-1"), "unused.toml")  # type: ignore[arg-type]
    with pytest.raises(SystemExit, match="max_wait_s: must be positive"):  # checked before any run starts
        run_compare(args("--sched-max-wait-s", "0"), "unused.toml")  # type: ignore[arg-type]
    assert args().sched_reorder_below_s == settings.reorder_below_s == math.inf  # no backlog gate by default
    assert args("--sched-reorder-below-s", "12").sched_reorder_below_s == 12.0
    with pytest.raises(SystemExit, match="reorder_below_s: must be positive"):
        run_compare(args("--sched-reorder-below-s", "0"), "unused.toml")  # type: ignore[arg-type]
    with pytest.raises(SystemExit):
        args("--session-order", "lifo")
    assert args().seeds == 1 and args("--seeds", "5").seeds == 5
    with pytest.raises(SystemExit, match="--seeds: must be at least 1"):
        run_compare(args("--seeds", "0"), "unused.toml")  # type: ignore[arg-type]


@pytest.mark.cluster  # starts the CLI in a process
def test_compare_sched_reports_the_issue_keys_for_the_offsets_asked(tmp_path: Path) -> None:
    """``simulate --compare sched=fifo,session`` end to end on two small sessions: both loops report every
    key the comparison promises, per offset too, and the open loop's capacity sweep plays the first offset
    --first-seed asks for."""
    from kvpool.tools.sim.compare_sched import GRID

    traces = write_traces(tmp_path / "traces")
    result = subprocess.run(
        [sys.executable, "-m", "kvpool.services.cli", "simulate", "--compare", "sched=fifo,session", "--quick", "--json",
         "--traces", str(traces), "--sessions", "2", "--jobs", "1", "--first-seed", "1", "--seeds", "2"],
        capture_output=True, text=True, cwd=ROOT, timeout=240,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert lines[-2].startswith("2 trace offsets pooled (1-2);")
    out = json.loads(lines[-1])
    keys = {"ttft_p50_session_over_fifo", "ttft_p99_session_over_fifo", "throughput_session_over_fifo",
            "reuse_session", "reuse_fifo", "wasted_prefetch_share", "errors"}
    assert keys <= set(out) and keys <= set(out["open_loop"])
    assert out["errors"] == 0 and 0 < out["ttft_p50_session_over_fifo"] and 0 < out["reuse_fifo"] <= 1
    assert (out["seeds"], out["first_seed"]) == (2, 1)
    assert [r["seed"] for r in out["closed_loop"]["per_seed"]] == [r["seed"] for r in out["open_loop"]["per_seed"]] == [1, 2]
    sweep = out["open_loop"]["capacity_sweep"]
    assert len(sweep) == GRID and {p["seed_offset"] for p in sweep} == {1}
