"""bench path cases: the per-pair ratios and the targets, from figures."""

from __future__ import annotations

from kvpool.tools.bench.path_cases import MODE_SETS, _pair_ratios, check


def run(ttft: float, second: float | None) -> dict[str, float | None]:
    return {"ttft_ms": ttft, "second_token_ms": second}


def test_pair_ratios_are_the_median_of_push_over_after_on_the_same_prompt() -> None:
    pairs = [{"push": run(110, 120), "after_prefill": run(100, 100)},
             {"push": run(90, 95), "after_prefill": run(100, 100)},
             {"push": run(200, None), "after_prefill": run(100, 100)}]  # no second token: left out of its ratio
    assert _pair_ratios(pairs) == {"ttft_ms": 1.1, "second_token_ms": 1.075}
    assert _pair_ratios([]) == {"ttft_ms": None, "second_token_ms": None}


def test_the_targets_stay_the_p50s_within_five_percent() -> None:
    case = {"push": {"ttft_ms_p50": 105.0, "second_token_ms_p50": 106.0},
            "after_prefill": {"ttft_ms_p50": 100.0, "second_token_ms_p50": 100.0},
            "handoff_exposed_ms_p50": 4.0, "handoff_total_ms_p50": 10.0}
    targets = check({"errors": 0, "greedy_identical": "3/3", "16k_cold": case})
    assert targets == {"errors_zero": True, "greedy_identical": True, "16k_cold_exposed_le_0.4_total": True,
                       "16k_cold_ttft_ms_p50_push_le_after_x1.05": True,
                       "16k_cold_second_token_ms_p50_push_le_after_x1.05": False}


def test_pieces_are_compared_with_the_stages_one_after_another_on_the_same_prompt() -> None:
    pairs = [{"push": run(60, 70), "after_stage": run(100, 100)},
             {"push": run(80, 90), "after_stage": run(100, 100)}]
    assert _pair_ratios(pairs, "after_stage") == {"ttft_ms": 0.7, "second_token_ms": 0.8}
    assert _pair_ratios(pairs) == {"ttft_ms": None, "second_token_ms": None}  # no after_prefill run
    case = {"push": {"ttft_ms_p50": 70.0, "second_token_ms_p50": 110.0},
            "after_stage": {"ttft_ms_p50": 100.0, "second_token_ms_p50": 100.0}}
    targets = check({"errors": 0, "greedy_identical": "2/2", "4k_cold": case})
    assert targets == {"errors_zero": True, "greedy_identical": True,
                       "4k_cold_ttft_ms_p50_push_le_after_stage_x1.05": True,
                       "4k_cold_second_token_ms_p50_push_le_after_stage_x1.05": False}


def test_every_handoff_choice_names_its_modes() -> None:
    from kvpool.services.cli_parser import build_parser  # noqa: PLC0415

    assert MODE_SETS["pieces"] == ("push", "after_stage") and MODE_SETS["both"] == ("push", "after_prefill")
    parser = build_parser("bench")
    for choice in MODE_SETS:
        assert parser.parse_args(["bench", "path", "--handoff", choice]).handoff == choice
