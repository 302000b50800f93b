"""The chaos report: every turn of the chaos run held against the clean run's same turn."""

from __future__ import annotations

from kvpool.tools.replay.chaos_report import WINDOW, chaos_report, format_chaos_table
from kvpool.tools.replay.records import TurnRecord


def turn(i: int, at: float, text: str = "ok", ttft: float = 1.0, reused: int = 90, **kw: object) -> TurnRecord:
    record = TurnRecord("s", i, None, i, 100, 8, issued_at=at, ttft_s=ttft, device_tokens=reused, text=text)
    for name, value in kw.items():
        setattr(record, name, value)
    return record


def test_failed_lost_wrong_and_recovery_per_fault() -> None:
    clean = [turn(i, float(i)) for i in range(30)]
    chaos = [turn(i, float(i)) for i in range(30)]
    # fault A at 5 s: one refused (503), one error event, one cut stream, one wrong answer, slow and cold after
    chaos[5] = turn(5, 5.0, error="HTTP 503: no shard", status=503)
    chaos[6] = turn(6, 6.0, error="error event: decode gone")
    chaos[7] = turn(7, 7.0, error="the stream ended without [DONE]", lost=True)
    chaos[8] = turn(8, 8.0, text="ko")
    for i in range(9, 12):
        chaos[i] = turn(i, float(i), ttft=3.0, reused=0)
    # fault B at 20 s: nothing goes wrong; turn 27 was never sent though 28 was; 29 not reached (the run ended)
    del chaos[29]
    del chaos[27]
    report = chaos_report(clean, chaos, [("kill:decode1@5s", 5.0), ("corrupt:store0@20s", 20.0)])
    a, b = report["faults"]
    assert (a["turns"], a["failed"], a["statuses"], a["lost_silently"], a["wrong_outputs"]) == (
        15, 2, {"0": 1, "503": 1}, 1, 1)
    assert a["reuse_lost_tokens"] == 3 * 90  # turns 9-11 computed what the clean run reused
    assert a["recovered_s"] == 12.0 - 5.0  # turns 12.. match again: the first full window starts there
    assert (b["turns"], b["failed"], b["lost_silently"], b["wrong_outputs"], b["recovered_s"]) == (8, 0, 0, 0, 0.0)
    assert (report["failed"], report["lost_silently"], report["wrong_outputs"]) == (2, 2, 1)  # + the unsent turn
    assert report["recovered_all"] is True
    assert "| kill:decode1@5s | 5 | 15 | 2 (0: 1, 503: 1) | 1 | 1 |" in format_chaos_table(report)
    # the wrong answer is named: which turn, where the texts part, what each run reused
    [wrong] = report["wrong"]
    assert (wrong["fault"], wrong["session_id"], wrong["turn"], wrong["parts_at_char"]) == ("kill:decode1@5s", "s", 8, 0)
    assert (wrong["chaos"]["text"], wrong["clean"]["text"], wrong["clean"]["device_tokens"]) == ("ko", "ok", 90)
    assert "wrong: session s turn 8 (kill:decode1@5s" in format_chaos_table(report)


def test_a_wrong_answer_before_the_first_fault_counts() -> None:
    clean = [turn(i, float(i), text="abcd") for i in range(6)]
    chaos = [turn(i, float(i), text="abcd" if i != 1 else "abXY", pool_tokens=40) for i in range(6)]
    report = chaos_report(clean, chaos, [("kill:master@3s", 3.0)])
    assert report["wrong_outputs"] == 1 and report["faults"][0]["wrong_outputs"] == 0
    [wrong] = report["wrong"]
    assert (wrong["fault"], wrong["turn"], wrong["parts_at_char"], wrong["chaos"]["pool_tokens"]) == (
        "before the faults", 1, 2, 40)


def test_no_window_back_within_ten_percent_is_not_recovered() -> None:
    clean = [turn(i, float(i)) for i in range(WINDOW + 4)]
    chaos = [turn(i, float(i), ttft=1.2 if i >= 2 else 1.0) for i in range(WINDOW + 4)]  # 20% slower after 2 s
    report = chaos_report(clean, chaos, [("slow:store1=200ms@2s", 2.0)])
    assert report["faults"][0]["recovered_s"] is None and report["recovered_all"] is False
    assert report["faults"][0]["ttft_p50_chaos_s"] == 1.2 and report["faults"][0]["ttft_p50_clean_s"] == 1.0


def test_a_killed_process_downtime_against_the_run_without_a_pool() -> None:
    clean = [turn(i, float(i)) for i in range(12)]
    chaos = [turn(i, float(i), ttft=2.0 if 3 <= i < 6 else 1.0) for i in range(12)]
    no_pool = [turn(i, float(i), ttft=1.6, reused=0) for i in range(12)]
    report = chaos_report(clean, chaos, [("kill:master@3s", 3.0)], back={"kill:master@3s": 6.0}, no_pool=no_pool)
    row = report["faults"][0]
    assert (row["down_s"], row["down_turns"], row["down_ttft_p50_s"], row["no_pool_ttft_p50_s"]) == (3.0, 3, 2.0, 1.6)
    assert row["down_ttft_vs_no_pool"] == 1.25
    assert "down_s" not in chaos_report(clean, chaos, [("kill:master@3s", 3.0)])["faults"][0]  # never back


def test_pool_share_before_a_fault() -> None:
    records = [turn(i, float(i), pool_tokens=40 if i < 5 else 0) for i in range(10)]
    row = chaos_report(records, records, [("kill:master@5s", 5.0)])["faults"][0]
    assert row["pool_share_before"] == 0.4  # 5 turns of 100 prompt tokens, 40 from the pool each
