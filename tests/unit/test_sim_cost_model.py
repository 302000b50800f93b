"""The simulator's cost model: the default file parses, bad values are refused naming the field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvpool.tools.sim.cost_model import (DEFAULT_COST_MODEL, RESULTS_DIR, SEED_TEXT, CostModel, PrefillCost,
                                         bench_turn_check, load_cost_model, parse_cost_model, provenance)


def test_the_default_file_parses_to_its_stated_numbers() -> None:
    cost = load_cost_model()
    assert cost.model.kv_bytes_per_token == 61 * 576  # DeepSeek-V3 fp8: 35,136 B
    assert cost.prefill.chunk_base_s == 0.00124
    assert cost.restore.read_gbps_per_gpu == 4.19
    assert cost.handoff.max_transfer_bytes == 8 << 20
    assert DEFAULT_COST_MODEL.name == "cost_model.toml"


def test_the_master_is_priced_from_its_bench_record() -> None:
    """The TOML names one `kvpool bench master` record; the times are that record's CPU per call."""
    cost = load_cost_model()
    record = json.loads((RESULTS_DIR / cost.master.record).read_text())["output"]
    top = max(record["scales"], key=lambda s: s["objects"])
    floor = top["session_floor_cpu_ms"] / 1e3
    m = cost.master
    assert (m.release_s, m.lookup_base_s, m.put_base_s) == (floor, floor, 2 * floor)
    # a lookup of the bench's history with its release, and a save of its chunks x stages, as measured
    assert m.lookup_base_s + 450 * m.lookup_per_group_s + m.release_s == pytest.approx(top["lookup_cpu_ms"] / 1e3)
    assert m.put_base_s + 22 * 4 * m.put_per_object_s == pytest.approx(top["save_cpu_ms"] / 1e3)
    assert cost.lookup_s(450) + cost.release_s() == pytest.approx(2.374e-3)  # the 22ba568 record's figure
    # its typical turn, which the price was not read from, priced against what the bench measured
    check = bench_turn_check(m, record)
    assert check["measured_ms"] == top["turn_cpu_ms"] and 0.8 < check["priced_over_measured"] < 1.5


def test_the_master_record_is_the_one_source_of_its_times(tmp_path: Path) -> None:
    path = tmp_path / "cost.toml"
    path.write_text('[master]\nrecord = "2026-12-05-bench-master-22ba568-quiet.json"\nlookup_base_s = 0.02\n')
    with pytest.raises(ValueError, match=r"\[master\] lookup_base_s: given beside record"):
        load_cost_model(path)
    path.write_text('[master]\nrecord = "no-such-record.json"\n')
    with pytest.raises(ValueError, match=r"\[master\] record: cannot read"):
        load_cost_model(path)
    (tmp_path / "bad.json").write_text('{"output": {"scales": []}}')
    path.write_text('[master]\nrecord = "bad.json"\n')
    with pytest.raises(ValueError, match="not a kvpool bench master output"):
        load_cost_model(path, results_dir=tmp_path)


def test_every_constant_of_the_default_model_is_sourced_or_fitted() -> None:
    """Outside the four fitted inputs every constant names a bench record that exists, the seed, or a stated
    assumption; the fitted inputs are at most four."""
    from kvpool.tools.sim.calibrate import FITTED

    cost = load_cost_model()
    assert len(FITTED) <= 4
    for key, entry in provenance(cost).items():
        if key.removeprefix("fit.") in FITTED:
            continue
        source = entry["source"]
        assert isinstance(source, str), f"{key} has no source"
        kind, _, text = source.partition(": ")
        assert kind in ("bench", "seed", "assumed"), f"{key}: {source}"
        if kind == "bench":
            name = text.split()[0]
            assert (RESULTS_DIR / name).is_file() or name == "the", f"{key}: {name} is no record"
    assert SEED_TEXT.startswith("../shared/seed/")


def test_sources_name_fields_of_the_model(tmp_path: Path) -> None:
    path = tmp_path / "cost.toml"
    path.write_text('[sources]\n"decode.step_base" = "seed"\n')
    with pytest.raises(ValueError, match=r"\[sources\] decode.step_base: names no field"):
        load_cost_model(path)
    path.write_text('[sources]\n"decode.step_base_s" = ""\n')
    with pytest.raises(ValueError, match="expected a non-empty string"):
        load_cost_model(path)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[restore]\nread_gbps_per_gpu = 0\n", "[restore] read_gbps_per_gpu: must be finite and > 0, got 0"),
        ("[prefill]\nchunk_base_s = -1.0\n", "[prefill] chunk_base_s: must be finite and >= 0, got -1.0"),
        ("[decode]\nstep_base_s = \"fast\"\n", "[decode] step_base_s: expected a number, got 'fast'"),
        ("[model]\nchunk_tokens = 256.5\n", "[model] chunk_tokens: expected an integer, got 256.5"),
        ("[handoff]\nbandwidth = 5\n", "[handoff] bandwidth: unknown field"),
        ("[gpu]\nx = 1\n", "[gpu]: unknown table (expected one of ['decode', 'fit', 'handoff', 'master', 'model', 'prefill', 'restore'])"),
        ("[decode]\nstep_per_seq_s = nan\n", "[decode] step_per_seq_s: must be finite and >= 0, got nan"),
        ("[model]\nnum_layers = true\n", "[model] num_layers: expected an integer, got True"),
    ],
)
def test_bad_values_are_refused_naming_the_field(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "cost.toml"
    path.write_text(text)
    with pytest.raises(ValueError) as excinfo:
        load_cost_model(path)
    assert str(excinfo.value) == f"{path}: {message}"


def test_not_toml_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "cost.toml"
    path.write_text("[prefill\n")
    with pytest.raises(ValueError, match="not valid TOML"):
        load_cost_model(path)


def test_compute_time_is_the_sum_over_chunks_plus_the_pipeline_fill() -> None:
    cost = CostModel(prefill=PrefillCost(chunk_base_s=0.5, chunk_per_context_token_s=0.001))
    # 3 chunks at contexts 256, 512, 768: 3 x 0.5 + (0.256 + 0.512 + 0.768); fill: 3 stages x the last chunk
    per_chunk = [0.5 + 0.001 * c for c in (256, 512, 768)]
    assert cost.compute_s(256, 768, 4) == pytest.approx(sum(per_chunk) + 3 * per_chunk[-1])
    assert cost.compute_s(0, 0, 4) == 0.0


def test_restore_and_handoff_times() -> None:
    cost = load_cost_model()
    # 470 chunks of one stage (8,784 B a token) at the bench's 4.19 GB/s a reader, nothing an object: not chosen
    # to land in the seed's 150-220 ms (the calibration checks where it lands)
    assert cost.restore_s(470, 8784) == pytest.approx(470 * 256 * 8784 / 4.19e9)
    assert cost.restore_s(0, 8784) == 0.0
    # 94,371,840 B in 4 stage slabs of 23.6 MB: 3 writes each at once; bytes at 50 GB/s, 13.8 us a write
    assert cost.handoff_s(94_371_840, 4) == pytest.approx(94_371_840 / 50e9 + 3 * 1.38e-5)
    parsed = parse_cost_model({"decode": {"step_base_s": 0.01, "step_per_seq_s": 0, "step_per_kv_token_s": 0}})
    assert parsed.decode_step_s(64, 1e6) == 0.01


def test_the_cpu_file_parses_and_names_every_field() -> None:
    import tomllib
    from dataclasses import fields

    from kvpool.tools.sim.cost_model import _TABLES, CPU_COST_MODEL

    assert CPU_COST_MODEL.name == "cost_model_cpu.toml"
    document = tomllib.loads(CPU_COST_MODEL.read_text())
    # every number is stated (and commented) in the file, none left to the seed's defaults (its master's times
    # given, not read from a record)
    assert {t: set(v) for t, v in document.items()} == {t: {f.name for f in fields(c)} - {"record"}
                                                        for t, c in _TABLES.items()}
    cost = load_cost_model(CPU_COST_MODEL)
    assert cost.model.kv_bytes_per_token == 8 * 384  # tiny: 8 layers x 96 float32 values
    assert cost.prefill.sequential_stages == 1
    assert cost.prefill.chunk_base_s == 0.0116
    assert cost.handoff.per_request_s == 0.0136
    assert cost.handoff.per_prompt_token_s == 1.88e-5


def test_the_seed_model_keeps_overlapping_stages_and_no_per_request_cost() -> None:
    cost = load_cost_model()
    assert cost.prefill.sequential_stages == 0
    assert cost.handoff.per_request_s == 0.0 and cost.handoff.per_prompt_token_s == 0.0
    import tomllib

    assert "sequential_stages" not in tomllib.loads(DEFAULT_COST_MODEL.read_text())["prefill"]


def test_sequential_stages_take_every_stage_time_and_no_fill() -> None:
    cost = CostModel(prefill=PrefillCost(chunk_base_s=0.5, chunk_per_context_token_s=0.001, sequential_stages=1))
    # 3 chunks at contexts 256, 512, 768, each through 4 stages one after another
    assert cost.compute_s(256, 768, 4) == pytest.approx(4 * sum(0.5 + 0.001 * c for c in (256, 512, 768)))
    # 16 tokens: a sixteenth of a chunk at context 0, four times
    assert cost.compute_s(0, 16, 4) == pytest.approx(4 * 16 / 256 * 0.5)
    assert cost.compute_s(0, 0, 4) == 0.0


def test_the_handoff_charges_the_request_and_its_prompt_tokens() -> None:
    from kvpool.tools.sim.cost_model import HandoffCost, ModelShape

    cost = CostModel(model=ModelShape(num_layers=4, kv_entry_bytes=2, chunk_tokens=256),
                     handoff=HandoffCost(gbps=1.0, per_transfer_s=0.0, per_request_s=0.25, per_prompt_token_s=0.001))
    # 1,000 tokens x 8 B: 8,000 B at 1 GB/s, + 0.25 s, + 1,000 x 1 ms
    assert cost.handoff_s(8000, 4) == pytest.approx(8e-6 + 0.25 + 1.0)
    none = CostModel(model=ModelShape(num_layers=4, kv_entry_bytes=2, chunk_tokens=256),
                     handoff=HandoffCost(gbps=1.0, per_transfer_s=0.0))
    assert none.handoff_s(8000, 4) == pytest.approx(8e-6)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[prefill]\nsequential_stages = 2\n", "[prefill] sequential_stages: must be 0 or 1, got 2"),
        ("[prefill]\nsequential_stages = 1.0\n", "[prefill] sequential_stages: expected an integer, got 1.0"),
        ("[handoff]\nper_request_s = -0.1\n", "[handoff] per_request_s: must be finite and >= 0, got -0.1"),
    ],
)
def test_the_new_fields_refuse_bad_values(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "cost.toml"
    path.write_text(text)
    with pytest.raises(ValueError) as excinfo:
        load_cost_model(path)
    assert str(excinfo.value) == f"{path}: {message}"
