"""The simulator's cost model: the default file parses, bad values are refused naming the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvpool.sim.cost_model import DEFAULT_COST_MODEL, CostModel, PrefillCost, load_cost_model, parse_cost_model


def test_the_default_file_parses_to_its_stated_numbers() -> None:
    cost = load_cost_model()
    assert cost.model.kv_bytes_per_token == 61 * 576  # DeepSeek-V3 fp8: 35,136 B
    assert cost.prefill.chunk_base_s == 0.00124
    assert cost.restore.read_gbps_per_gpu == 6.5
    assert cost.handoff.max_transfer_bytes == 8 << 20
    assert DEFAULT_COST_MODEL.name == "cost_model.toml"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[restore]\nread_gbps_per_gpu = 0\n", "[restore] read_gbps_per_gpu: must be finite and > 0, got 0"),
        ("[prefill]\nchunk_base_s = -1.0\n", "[prefill] chunk_base_s: must be finite and >= 0, got -1.0"),
        ("[decode]\nstep_base_s = \"fast\"\n", "[decode] step_base_s: expected a number, got 'fast'"),
        ("[model]\nchunk_tokens = 256.5\n", "[model] chunk_tokens: expected an integer, got 256.5"),
        ("[handoff]\nbandwidth = 5\n", "[handoff] bandwidth: unknown field"),
        ("[gpu]\nx = 1\n", "[gpu]: unknown table (expected one of ['decode', 'handoff', 'model', 'prefill', 'restore'])"),
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
    # 470 chunks of one stage (8,784 B a token) at 6.5 GB/s plus 50 us an object: the seed's 150-220 ms
    assert 0.150 <= cost.restore_s(470, 8784) <= 0.220
    assert cost.restore_s(0, 8784) == 0.0
    # 94,371,840 B in 4 stage slabs of 23.6 MB: 3 writes each at once; bytes at 50 GB/s
    assert cost.handoff_s(94_371_840, 4) == pytest.approx(94_371_840 / 50e9 + 3 * 2e-5)
    parsed = parse_cost_model({"decode": {"step_base_s": 0.01, "step_per_seq_s": 0, "step_per_kv_token_s": 0}})
    assert parsed.decode_step_s(64, 1e6) == 0.01
