"""What a chaos run cost, turn by turn against the clean run of the same sessions.

The replay's prompts come from the trace, never from earlier answers, so the
clean run (temperature 0, float32 KV) gives every turn's one right answer and
its figures. Each fault owns the turns issued from its moment to the next
fault's (the last: to the end). Per fault:

- ``failed``: turns that ended with an HTTP status, an error event or a
  transport error (``statuses`` counts them by status; 0 is no HTTP status);
- ``lost_silently``: turns whose stream ended without ``[DONE]`` or usage and
  without saying it failed, or that the chaos run skipped (a later turn of
  its session went out);
- ``wrong_outputs``: answered turns whose text differs from the clean run's
  (each named in the report's ``wrong``: the turn, where the texts part,
  both texts and where each run took its prompt from);
- ``reuse_lost_tokens``: prompt tokens the clean run served from device or
  pool and the chaos run computed; the reuse and pool shares and median TTFT
  of both runs over the fault's answered turns;
- ``recovered_s``: from the fault to the first run of ``WINDOW`` consecutive
  answered turns whose median TTFT is within 10% of the clean run's on the
  same turns and whose reuse is within 10% of it (None: not within the run).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from kvpool.tools.replay.records import TurnRecord

WINDOW = 8  # turns compared at once when deciding recovery
TOLERANCE = 0.10
BEFORE_S = 30.0  # "before a fault": the answered turns issued this long before it
WRONG_NAMED = 20  # wrong turns the report names, the first in issue order


def _key(record: TurnRecord) -> tuple[str, int]:
    return record.session_id, record.turn


def _reused(record: TurnRecord) -> int:
    return record.device_tokens + record.pool_tokens


def _recovered_s(after: Sequence[TurnRecord], clean: dict[tuple[str, int], TurnRecord], at_s: float) -> float | None:
    answered = [r for r in after if r.error is None and clean.get(_key(r)) is not None
                and clean[_key(r)].error is None]
    for start in range(0, max(0, len(answered) - WINDOW + 1)):
        window = answered[start:start + WINDOW]
        twins = [clean[_key(r)] for r in window]
        ttft_ok = statistics.median(r.ttft_s for r in window) <= (1 + TOLERANCE) * statistics.median(
            r.ttft_s for r in twins)
        reuse_ok = sum(map(_reused, window)) >= (1 - TOLERANCE) * sum(map(_reused, twins))
        if ttft_ok and reuse_ok:
            return max(0.0, window[0].issued_at - at_s)
    return None


def _wrong(records: Sequence[TurnRecord], clean: dict[tuple[str, int], TurnRecord]) -> list[TurnRecord]:
    """The answered turns whose text differs from the clean run's answer to the same turn."""
    return [r for r in records if r.error is None and clean.get(_key(r)) is not None
            and clean[_key(r)].error is None and r.text != clean[_key(r)].text]


def _wrong_turn(fault: str, chaos: TurnRecord, clean: TurnRecord) -> dict[str, Any]:
    """One wrong answer, named: the turn, where the texts part, and each run's source of the prompt's KV."""
    parts_at = next((i for i, (a, b) in enumerate(zip(chaos.text, clean.text)) if a != b),
                    min(len(chaos.text), len(clean.text)))

    def run(record: TurnRecord) -> dict[str, Any]:
        return {"text": record.text, "device_tokens": record.device_tokens, "pool_tokens": record.pool_tokens,
                "computed_tokens": record.computed_tokens, "pipeline": record.pipeline, "shard": record.shard}

    return {"fault": fault, "session_id": chaos.session_id, "turn": chaos.turn,
            "issued_at_s": round(chaos.issued_at, 2), "prompt_tokens": chaos.prompt_tokens,
            "parts_at_char": parts_at, "chaos": run(chaos), "clean": run(clean)}


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 4) if values else None


def _outage(owned: Sequence[TurnRecord], until_s: float, no_pool: Sequence[TurnRecord]) -> dict[str, Any]:
    """A killed process's downtime: its turns' median TTFT, and the same turns' run without a pool."""
    down = [r for r in owned if r.issued_at < until_s and r.error is None]
    twins = {_key(r): r for r in no_pool if r.error is None}
    paired = [r for r in down if _key(r) in twins]
    chaos_p50 = _median([r.ttft_s for r in paired])
    no_pool_p50 = _median([twins[_key(r)].ttft_s for r in paired])
    return {"down_turns": len(down), "down_ttft_p50_s": _median([r.ttft_s for r in down]),
            "down_ttft_p50_paired_s": chaos_p50, "no_pool_ttft_p50_s": no_pool_p50,
            "down_ttft_vs_no_pool": None if not chaos_p50 or not no_pool_p50 else round(chaos_p50 / no_pool_p50, 3)}


def chaos_report(clean: Sequence[TurnRecord], chaos: Sequence[TurnRecord], faults: Sequence[tuple[str, float]],
                 back: dict[str, float] | None = None, no_pool: Sequence[TurnRecord] | None = None) -> dict[str, Any]:
    """The JSON report; ``faults`` are (label, seconds after the chaos run started) in time order;
    ``back``: when each killed process was ready again (its downtime's turns are reported apart, and
    held against ``no_pool``, the same sessions on a cluster without a pool, when given)."""
    back = back or {}
    twins = {_key(r): r for r in clean}
    issued = {_key(r) for r in chaos}
    last_issued: dict[str, int] = {}
    for r in chaos:
        last_issued[r.session_id] = max(r.turn, last_issued.get(r.session_id, -1))
    # a turn skipped while later turns of its session went out (past the last: --duration ended the run)
    never_issued = [k for k in twins if k not in issued and k[1] < last_issued.get(k[0], -1)]
    ordered = sorted(chaos, key=lambda r: r.issued_at)
    rows: list[dict[str, Any]] = []
    named: list[dict[str, Any]] = []
    for i, (label, at_s) in enumerate(faults):
        until = faults[i + 1][1] if i + 1 < len(faults) else float("inf")
        owned = [r for r in ordered if at_s <= r.issued_at < until]
        failed = [r for r in owned if r.error is not None and not r.lost]
        statuses: dict[str, int] = {}
        for r in failed:
            statuses[str(r.status)] = statuses.get(str(r.status), 0) + 1
        wrong = _wrong(owned, twins)
        compared = [r for r in owned if r.error is None and twins.get(_key(r)) is not None
                    and twins[_key(r)].error is None]
        named += [_wrong_turn(label, r, twins[_key(r)]) for r in wrong[:WRONG_NAMED - len(named)]]
        clean_reuse = sum(_reused(twins[_key(r)]) for r in compared)
        chaos_reuse = sum(_reused(r) for r in compared)
        recovered = _recovered_s([r for r in ordered if r.issued_at >= at_s], twins, at_s)
        prompt = max(1, sum(r.prompt_tokens for r in compared))
        rows.append({
            "fault": label, "at_s": round(at_s, 2), "turns": len(owned), "failed": len(failed),
            "statuses": statuses, "failed_errors": sorted({(r.error or "")[:160] for r in failed})[:3],
            "lost_silently": sum(r.lost for r in owned), "wrong_outputs": len(wrong),
            "reuse_lost_tokens": clean_reuse - chaos_reuse,
            "reuse_clean": round(clean_reuse / prompt, 4), "reuse_chaos": round(chaos_reuse / prompt, 4),
            "pool_share_clean": round(sum(twins[_key(r)].pool_tokens for r in compared) / prompt, 4),
            "ttft_p50_clean_s": _median([twins[_key(r)].ttft_s for r in compared]),
            "ttft_p50_chaos_s": _median([r.ttft_s for r in compared]),
            "recovered_s": None if recovered is None else round(recovered, 2),
        })
        earlier = [r for r in ordered if at_s - BEFORE_S <= r.issued_at < at_s and r.error is None]
        rows[-1]["pool_share_before"] = round(
            sum(r.pool_tokens for r in earlier) / max(1, sum(r.prompt_tokens for r in earlier)), 4)
        if label in back:
            rows[-1]["down_s"] = round(back[label] - at_s, 2)
            rows[-1].update(_outage(owned, back[label], no_pool or []))
    before = [r for r in ordered if not faults or r.issued_at < faults[0][1]]
    wrong_before = _wrong(before, twins)
    named = [_wrong_turn("before the faults", r, twins[_key(r)]) for r in wrong_before] + named
    return {
        "turns": len(chaos), "clean_turns": len(clean), "clean_errors": sum(r.error is not None for r in clean),
        "wrong_outputs": sum(row["wrong_outputs"] for row in rows) + len(wrong_before),
        "lost_silently": sum(row["lost_silently"] for row in rows) + len(never_issued)
        + sum(r.lost for r in before),
        "failed": sum(row["failed"] for row in rows) + sum(r.error is not None and not r.lost for r in before),
        "faults": rows,
        "recovered_all": all(row["recovered_s"] is not None for row in rows),
        "wrong": named[:WRONG_NAMED],
    }


def format_chaos_table(report: dict[str, Any]) -> str:
    """The per-fault table (markdown), then the totals."""
    lines = ["| fault | at s | turns | failed (by status) | lost silently | wrong | reuse clean → chaos "
             "| TTFT p50 clean → chaos s | back within 10% after s |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in report["faults"]:
        statuses = ", ".join(f"{k}: {v}" for k, v in sorted(row["statuses"].items())) or "-"
        recovered = "not within the run" if row["recovered_s"] is None else f"{row['recovered_s']:g}"
        lines.append(f"| {row['fault']} | {row['at_s']:g} | {row['turns']} | {row['failed']} ({statuses}) "
                     f"| {row['lost_silently']} | {row['wrong_outputs']} | {row['reuse_clean']:.1%} → "
                     f"{row['reuse_chaos']:.1%} | {row['ttft_p50_clean_s']} → {row['ttft_p50_chaos_s']} "
                     f"| {recovered} |")
    for row in report["faults"]:
        if "down_s" in row:
            lines.append(f"\n{row['fault']}: down {row['down_s']:g} s, {row['down_turns']} turns answered meanwhile, "
                         f"TTFT p50 {row['down_ttft_p50_paired_s']} s vs {row['no_pool_ttft_p50_s']} s for the same "
                         f"turns without a pool (x{row['down_ttft_vs_no_pool']}); pool share in the "
                         f"{BEFORE_S:g} s before {row['pool_share_before']:.1%}")
    for wrong in report.get("wrong", []):
        chaos, clean = wrong["chaos"], wrong["clean"]
        lines.append(f"\nwrong: session {wrong['session_id']} turn {wrong['turn']} ({wrong['fault']}, issued at "
                     f"{wrong['issued_at_s']:g} s, {wrong['prompt_tokens']} prompt tokens) parts at char "
                     f"{wrong['parts_at_char']}: chaos {chaos['text']!r} (device {chaos['device_tokens']}, pool "
                     f"{chaos['pool_tokens']}, computed {chaos['computed_tokens']}) vs clean {clean['text']!r} "
                     f"(device {clean['device_tokens']}, pool {clean['pool_tokens']}, computed "
                     f"{clean['computed_tokens']})")
    lines.append(f"\nturns {report['turns']}, failed {report['failed']}, lost silently {report['lost_silently']}, "
                 f"wrong outputs {report['wrong_outputs']}, recovered_all {report['recovered_all']}")
    return "\n".join(lines)
