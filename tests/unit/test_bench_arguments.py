"""Bench commands refuse bad arguments by name before they start any process (no cluster needed)."""

from __future__ import annotations

import pytest

from kvpool.tools.bench import handoff_bench
from kvpool.services import cli_parser


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--entry-bytes", "64"], "--entry-bytes: must exceed the 64-value roped key"),
        (["--tokens", "0"], "--tokens, --layers, --entry-bytes and --repeats must be positive"),
    ],
)
def test_bench_handoff_refuses_bad_arguments_by_name(argv: list[str], flag: str) -> None:
    args = cli_parser.build_parser().parse_args(["bench", "handoff", *argv])
    with pytest.raises(SystemExit, match=f"kvpool bench handoff: {flag}"):
        handoff_bench.main(args)


@pytest.mark.cluster  # it asks git
def test_bench_ab_names_a_baseline_that_is_not_a_commit_before_starting_anything(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from kvpool.tools.bench import ab_bench

    args = cli_parser.build_parser().parse_args(
        ["bench", "ab", "--baseline", "no-such-commit", "--workdir", str(tmp_path)])
    with pytest.raises(SystemExit, match="--baseline 'no-such-commit' is not a commit of"):
        ab_bench.main(args)
    assert list(tmp_path.iterdir()) == []  # nothing cloned, no cluster started


@pytest.mark.cluster  # it asks git and clones
def test_bench_ab_runs_the_baselines_own_code_and_this_checkouts(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Run from this checkout's root (as CI and the docs do), ``python -c`` would put the root first on the import
    path: the baseline side must import its own tree, the current side this checkout."""
    from kvpool.tools.bench import ab_bench

    tree = ab_bench.baseline_tree("HEAD", tmp_path)
    assert ab_bench.side_source(tree).is_relative_to(tree.resolve())
    ab_bench.check_side_source(tree)  # does not refuse
    assert ab_bench.side_source(None).is_relative_to(ab_bench.ROOT.resolve())
    assert not ab_bench.side_source(None).is_relative_to(tree.resolve())
