"""``kvpool bench master-core``: the master's index and servicer in one process. A quick run measures what it says
it does (saves in both commit forms, evicting as they go, and lookups that find whole histories by handle), and bad
arguments are refused by name before anything runs."""

from __future__ import annotations

import json

import pytest

from kvpool.services import cli_parser
from kvpool.services.master import core_bench as master_core_bench


def test_a_quick_run_saves_in_both_forms_while_evicting_and_finds_whole_histories(
        capsys: pytest.CaptureFixture[str]) -> None:
    args = cli_parser.build_parser().parse_args(["bench", "master-core", "--quick", "--json", "--saves", "60",
                                                 "--lookups", "10"])
    assert master_core_bench.main(args) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    (scale,) = report["scales"]
    assert scale["objects"] >= 10**4 and scale["saves_measured"] >= 60 and scale["evicted_groups_while_saving"] > 0
    whole = master_core_bench.HISTORY_CHUNKS // master_core_bench.SAVE_CHUNKS * master_core_bench.SAVE_CHUNKS
    assert scale["lookup_groups_found"] == whole and scale["lookups_measured"] >= 10
    for key in ("save_cpu_ms", "save_cpu_ms_flat_commits", "save_ms_p50", "save_ms_flat_commits_p50",
                "lookup_cpu_ms", "lookup_ms_p50"):
        assert scale[key] > 0, key
    assert report["allocator"] in ("c", "python") and report["index_order"] in ("c", "python")


@pytest.mark.parametrize(("argv", "message"), [
    (["--objects", "100"], "--objects must be at least 5000, got 100"),
    (["--saves", "0"], "--saves must be positive, got 0"),
    (["--lookups", "-1"], "--lookups must be positive, got -1"),
])
def test_bad_arguments_are_refused_by_name(argv: list[str], message: str) -> None:
    args = cli_parser.build_parser().parse_args(["bench", "master-core", *argv])
    with pytest.raises(SystemExit, match=f"kvpool bench master-core: {message}"):
        master_core_bench.main(args)


def test_its_shapes_are_bench_masters() -> None:
    from kvpool.tools.bench import master_bench

    for name in ("STAGES", "HISTORY_CHUNKS", "SAVE_CHUNKS", "OBJECT_BYTES", "NAMESPACE"):
        assert getattr(master_core_bench, name) == getattr(master_bench, name), name
