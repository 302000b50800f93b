"""``simulate --validate --validate-mode gated|long``: stage 0's gate (one prefill at a time, FIFO, the serving-order
touch) on a real cluster's records and in the simulator, compared request by request."""

from __future__ import annotations

import gzip
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
TRACES = ROOT.parent / "shared" / "traces" / "agentx-weka"
needs_traces = pytest.mark.skipif(not (TRACES / "trace_0002.json").is_file(),
                                  reason="needs ../shared/traces/agentx-weka")


def stage0(kind: str, request_id: str, session_key: str, **fields: object) -> dict[str, object]:
    return {"source": "stage0", "kind": kind, "request_id": request_id, "session_key": session_key, **fields}


def test_gated_a_requests_hand_is_its_first_effect_even_a_wait_for_blocks() -> None:
    from kvpool.tools.sim.validate_cmd import device_evictions, recorded_orders

    records = [
        stage0("touch", "r1", "a"), stage0("effect", "r1", "a", effect="Admitted", attempt=1),
        stage0("blocks", "r1", "a", evicted=0),
        stage0("touch", "r2", "b"),
        stage0("effect", "r1", "a", effect="Prefilled"), stage0("effect", "r1", "a", effect="Freed", holders=["r1"]),
        stage0("effect", "r2", "b", effect="WaitForBlocks", deadline=9.0),  # the gate handed it: it waits
        stage0("effect", "r1", "a", effect="Freed", holders=["r1/save"]),
        stage0("effect", "r2", "b", effect="Admitted", attempt=1), stage0("blocks", "r2", "b", evicted=3),
    ]
    gated = recorded_orders(records, ["a", "b"], gated=True)[0]
    # (no commit: one prefill at a time, no two forwards race to cache a chunk)
    assert gated == [("touch", "s0.t0"), ("admit", "s0.t0"), ("touch", "s1.t0"), ("free", "s0.t0"),
                     ("admit", "s1.t0"), ("free", "s0.t0/save")]
    # ungated, a turn's admission is its Admitted (it tries again on each free until then)
    ungated = recorded_orders(records, ["a", "b"])[0]
    assert ("commit", "s0.t0") in ungated and ungated[-2:] == [("free", "s0.t0/save"), ("admit", "s1.t0")]
    assert device_evictions(records) == 3 and device_evictions([]) == -1


def replay_gated(name: str, mode: str, left_out: str = "") -> tuple[Any, Any, Any, Any, Any]:
    """A gated cluster's records (``tests/data/NAME``, ``--validate-records``) replayed as ``simulate --validate
    --validate-mode MODE`` replays them (``left_out``: "free", the releases' order; "pool_ops", the master's):
    (records, stage 0's effects, the router's, the turns, the pool's figures)."""
    from kvpool.request_record import read_records
    from kvpool.tools.sim import validate_cmd
    from kvpool.tools.sim.cost_model import CPU_COST_MODEL, load_cost_model
    from kvpool.tools.sim.validate import ValidationSetup, replay_sessions
    from kvpool.workload.weka import load_session

    records = [r for r in read_records_gz(ROOT / "tests" / "data" / name, read_records)]
    traces = [TRACES / trace for trace in validate_cmd.VALIDATION_TRACES]
    events, ops, effects, router = validate_cmd.recorded_orders(records, [t.stem for t in traces], gated=True)
    events = [event for event in events if event[0] != left_out]
    ops = [] if left_out == "pool_ops" else ops
    m = validate_cmd.MODES[mode]
    setup = ValidationSetup(scale=m.scale, context=32768, device_cache_tokens=m.device_cache_tokens,
                            store_bytes=m.segment_bytes)
    turns, _, pool = replay_sessions([load_session(t) for t in traces], setup, load_cost_model(CPU_COST_MODEL),
                                     events, None, ops, gated=True)
    return records, effects, router, turns, pool


def read_records_gz(path: Path, read: Any) -> list[dict[str, Any]]:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        plain = Path(tmp) / "requests.jsonl"
        plain.write_bytes(gzip.decompress(path.read_bytes()))
        return read(plain)


@needs_traces
def test_a_gated_cluster_run_replays_with_every_requests_effects_equal(monkeypatch: pytest.MonkeyPatch) -> None:
    """A real cluster's records (``simulate --validate --validate-mode gated --quick --validate-records``, recorded
    with this mode as 6c76669 has it but the master's default 5 s lease, none of which expired at these sizes:
    stage 0 with ``--sched fifo --sched-slots 1``, 65 turns; the gate handed 28 of them stage 0 with another
    turn waiting, so the serving-order touch ordered two sessions). The simulator's own FIFO queue picks each head
    and touches the serving order at the recorded places: every request's effects, every pool operation's
    outcome and every turn's counts come out as the cluster's, and so do both caches' evictions. Without the
    serving-order touch, or without it for a lone head (the simulator's rule before), they do not."""
    from kvpool.tools.sim import prefill_sim
    from kvpool.tools.sim.validate import differing_effects
    from kvpool.tools.sim.validate_cmd import device_evictions

    records, effects, router, turns, pool = replay_gated("validate-records-gated.jsonl.gz", "gated")
    assert len(effects) == len(router) == 65
    assert pool["events_left"] == 0 and pool["pool_ops_left"] == 0 and pool["pool_ops_differing"] == []
    assert differing_effects(pool["effects"], effects) == [] and pool["router_effects"] == router
    assert sum(t.pool_tokens for t in turns.values()) == 27136 and pool["evictions"] == 144
    assert pool["device_evictions"] == device_evictions(records) == 199

    try_admission = prefill_sim.PipelineSim._try
    monkeypatch.setattr(prefill_sim.PipelineSim, "_try", lambda self, job, serving: try_admission(self, job, None))
    _, effects, _, _, untouched = replay_gated("validate-records-gated.jsonl.gz", "gated")
    assert len(differing_effects(untouched["effects"], effects)) == 14
    monkeypatch.setattr(prefill_sim.PipelineSim, "_try", lambda self, job, serving: try_admission(
        self, job, serving if serving and len(serving) > 1 else None))
    _, effects, _, _, lone = replay_gated("validate-records-gated.jsonl.gz", "gated")
    assert len(differing_effects(lone["effects"], effects)) == 6
    monkeypatch.setattr(prefill_sim.PipelineSim, "_try", try_admission)
    # the orders still taken from the record are needed: the releases', the pool operations'
    for left_out, differing in (("free", 46), ("pool_ops", 31)):
        _, effects, _, _, unordered = replay_gated("validate-records-gated.jsonl.gz", "gated", left_out)
        assert len(differing_effects(unordered["effects"], effects)) == differing


def test_the_modes_reach_the_cluster_as_its_settings(tmp_path: Path) -> None:
    """``--validate-mode`` picks the mode; gated, the cluster's stage 0 runs one prefill at a time in arrival order
    (so its gate queues and touches the serving order); in every mode its master leases for the run's length."""
    from kvpool.services.cli_parser import build_parser
    from kvpool.services.master.settings import MasterSettings
    from kvpool.services.prefill.settings import PrefillSettings
    from kvpool.settings import load_settings
    from kvpool.tools.sim.validate_cmd import LEASE_S, MODES, cluster_config

    parser = build_parser()
    assert parser.parse_args(["simulate", "--validate"]).validate_mode == "ungated"
    assert parser.parse_args(["simulate", "--validate", "--validate-mode", "long"]).validate_mode == "long"
    assert not MODES["ungated"].gated and MODES["gated"].gated and MODES["long"].gated
    for gated, slots in ((False, 0), (True, 1)):
        path = tmp_path / f"{gated}.toml"
        path.write_text(cluster_config(256, gated))
        prefill = load_settings(PrefillSettings, "prefill", str(path), {"num_stages": 1})  # (no later stages)
        assert (prefill.sched, prefill.sched_slots, prefill.chunk_size) == ("fifo", slots, 256)
        assert load_settings(MasterSettings, "master", str(path), {}).lease_s == LEASE_S == 600.0


@needs_traces
def test_a_long_gated_cluster_run_evicts_from_both_caches_alike_and_replays_equal(monkeypatch: pytest.MonkeyPatch
                                                                                  ) -> None:
    """A real cluster's records (``simulate --validate --validate-mode long --validate-records``, at 441d211:
    gated, prompts of 3.9-17.4K tokens (up to 13,833 in the 62 turns it reached in 300 s), 24 handed with another
    turn waiting). Its device cache and its pool each hold one history, not three: both evict, and the
    simulator's caches evict exactly as much."""
    from kvpool.tools.sim import prefill_sim
    from kvpool.tools.sim.validate import differing_effects
    from kvpool.tools.sim.validate_cmd import device_evictions

    records, effects, router, turns, pool = replay_gated("validate-records-long.jsonl.gz", "long")
    assert len(effects) == len(router) == 62 and max(t.prompt_tokens for t in turns.values()) == 13833
    assert pool["events_left"] == 0 and pool["pool_ops_left"] == 0 and pool["pool_ops_differing"] == []
    assert differing_effects(pool["effects"], effects) == [] and pool["router_effects"] == router
    assert sum(t.pool_tokens for t in turns.values()) == 146688 and pool["evictions"] == 650
    assert pool["device_evictions"] == device_evictions(records) == 953

    try_admission = prefill_sim.PipelineSim._try
    monkeypatch.setattr(prefill_sim.PipelineSim, "_try", lambda self, job, serving: try_admission(
        self, job, list(reversed(serving)) if serving else None))  # the serving order backwards
    _, effects, _, _, backwards = replay_gated("validate-records-long.jsonl.gz", "long")
    assert len(differing_effects(backwards["effects"], effects)) == 8
