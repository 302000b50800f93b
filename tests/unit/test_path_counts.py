"""A request's counts from an RPC trace: sequential and nested calls chain, parallel ones do not, saves count
apart, and a stream's awaited exchanges count as round trips."""

from __future__ import annotations

from typing import Any

from kvpool.tools.bench.path_counts import critical_path, request_counts


def call(method: str, span: str, parent: str, start: float, end: float, answers: list[float] | None = None,
         kind: str = "unary_unary") -> dict[str, Any]:
    return {"request_id": "r", "method": f"/kvpool.rpc.{method}", "kind": kind, "span": span, "parent": parent,
            "start": start, "end": end, "answers": [end] if answers is None else answers}


TRACE = [
    call("Router/Generate", "g", "", 0.0, 11.0, kind="unary_stream"),  # the client's call: the entry, not counted
    call("Decode/Reserve", "a", "g", 0.1, 1.0),
    call("Prefill/Prefill", "b", "g", 1.0, 10.0),
    call("PoolMaster/Lookup", "c", "b", 1.1, 1.2),
    call("PoolMaster/ReleaseLease", "r", "b", 1.25, 1.28),  # stage 0 awaits it before the forward
    call("PrefillStage/Restore", "d", "b", 1.3, 2.1),  # stage 1 and ...
    call("PrefillStage/Restore", "e", "b", 1.31, 2.0),  # ... stage 2 at once: one level
    call("PrefillStage/ForwardPieces", "f", "b", 2.2, 8.0, kind="stream_unary"),
    call("Decode/Landed", "l0", "b", 2.5, 2.51),  # stage 0's check and announce, beside stage 1's forward
    call("Decode/Landed", "l1", "b", 2.6, 2.62),
    call("PrefillStage/ForwardPieces", "h", "f", 3.0, 7.5, kind="stream_unary"),  # nested: stage 1 to stage 2
    call("Decode/Landed", "z", "f", 5.0, 5.01),  # stage 1's, beside stage 2's forward
    call("Decode/Landed", "x", "h", 7.0, 7.01),  # stage 2's check, then its announce
    call("Decode/Landed", "y", "h", 7.2, 7.3),
    call("PrefillStage/SaveDone", "i", "b", 8.1, 12.0),  # a save: beside the request, not on its way
    call("PoolMaster/PutStart", "p", "f", 7.6, 7.7),
    call("PrefillStage/HandoffDone", "k", "b", 8.1, 9.0),
    call("Decode/Landed", "w", "k", 8.5, 8.6),  # the last stage's final logits, announced after its forward
    call("Decode/Generate", "l", "g", 10.5, 11.0, kind="unary_stream"),  # a stream ends at its first message
    call("Decode/ReleaseRegion", "q", "g", 11.5, 11.6),  # after the first token: made, not on the path
]
PATH = ["Decode/Reserve", "Prefill/Prefill", "PoolMaster/Lookup", "PoolMaster/ReleaseLease", "PrefillStage/Restore",
        "PrefillStage/ForwardPieces", "PrefillStage/ForwardPieces", "Decode/Landed", "Decode/Landed",
        "PrefillStage/HandoffDone", "Decode/Landed", "Decode/Generate"]


def test_the_streamed_path_on_three_stages() -> None:
    # Reserve → Prefill (Lookup → ReleaseLease → Restore → Forward (→ Forward (→ Landed → Landed)) →
    # HandoffDone (→ Landed)) → Generate
    assert critical_path(TRACE, first_token_at=11.0) == PATH
    assert len(critical_path(TRACE, first_token_at=1.05)) == 2  # Reserve, then Prefill had started
    assert critical_path([], first_token_at=1.0) == []


def test_counts_of_a_request() -> None:
    counts = request_counts(TRACE, first_token_at=11.0, stages=3)
    assert counts["rpcs_per_request"] == 19  # every call but the entry, the save and the late release included
    assert counts["save_rpcs"] == 2
    assert counts["round_trips_per_request"] == 19
    assert counts["critical_path_depth"] == 12
    assert counts["depth_beyond_stage_hops"] == 10  # less the two forward hops of three stages
    assert counts["critical_path"] == PATH
    assert counts["rpcs_by_method"]["Decode/Landed"] == 6
    assert "Router/Generate" not in counts["rpcs_by_method"]


def test_parallel_siblings_never_chain() -> None:
    calls = [call("Router/Generate", "g", "", 0.0, 9.0), call("HandoffStage/WriteLayers", "a", "g", 0.0, 2.0),
             call("HandoffStage/WriteLayers", "b", "g", 1.0, 3.0), call("HandoffStage/WriteLayers", "c", "g", 0.5, 1.5)]
    assert len(critical_path(calls, first_token_at=5.0)) == 1


def test_without_the_entry_call_the_roots_chain() -> None:
    # the router names the request afresh: the client's call to it is traced under another id
    calls = [c for c in TRACE if c["span"] != "g"]
    assert critical_path(calls, first_token_at=11.0) == PATH
    assert request_counts(calls, first_token_at=11.0, stages=3)["rpcs_per_request"] == 19


def test_a_streams_awaited_exchanges_are_round_trips() -> None:
    # a bidirectional stream that replaces Reserve and Generate: its first exchange returns the target, the
    # next (after the prefill) the first token; a third after the first token is made but not on the path
    calls = [call("Decode/Session", "s", "", 0.0, 0.1, answers=[0.1, 5.0, 6.0], kind="stream_stream"),
             call("Prefill/Prefill", "p", "", 0.2, 4.0)]
    assert critical_path(calls, first_token_at=5.0) == ["Decode/Session", "Decode/Session", "Prefill/Prefill"]
    counts = request_counts(calls, first_token_at=5.0, stages=1)
    assert counts["rpcs_per_request"] == 2
    assert counts["round_trips_per_request"] == 4
    assert counts["critical_path_depth"] == 3


def test_a_call_without_an_answer_still_counts_once() -> None:
    failed = call("Decode/Reserve", "a", "", 0.0, 0.5, answers=[])  # it failed: no answer, one round trip
    assert critical_path([failed], first_token_at=1.0) == ["Decode/Reserve"]
    assert request_counts([failed], first_token_at=1.0, stages=1)["round_trips_per_request"] == 1


def test_a_fan_out_sent_at_once_is_one_level_though_its_servers_ran_in_turn() -> None:
    # stage 0 sends HandoffDone to three stages at once; a busy host starts each only after the one before ended
    calls = [call("PrefillStage/HandoffDone", n, "", start, start + 0.1) | {"sent": 1.0}
             for n, start in (("a", 1.0), ("b", 1.2), ("c", 1.4))]
    assert critical_path(calls, first_token_at=5.0) == ["PrefillStage/HandoffDone"]
    assert len(critical_path([{k: v for k, v in c.items() if k != "sent"} for c in calls], 5.0)) == 3  # by start


def test_a_sibling_sent_while_a_nested_call_ran_does_not_follow_it() -> None:
    # the forward answered at 2.0, but a task it started was still announcing (Landed, to 3.0) when the
    # HandoffDone went out at 2.5: both are one level below the forward's start, not one after another
    calls = [call("PrefillStage/ForwardPieces", "f", "", 1.0, 2.0), call("Decode/Landed", "l", "f", 1.5, 3.0),
             call("PrefillStage/HandoffDone", "h", "", 2.5, 2.6)]
    assert critical_path(calls, first_token_at=5.0) == ["PrefillStage/ForwardPieces", "Decode/Landed"]


def test_a_detached_call_counts_as_made_and_is_on_no_path() -> None:
    # the lease's release after the forward: nobody waits for it, though it starts before the first token
    release = call("PoolMaster/ReleaseLease", "r2", "b", 8.05, 8.4) | {"detached": True}
    trace = [c for c in TRACE if c["span"] not in {"r", "k", "w"}] + [release]
    counts = request_counts(trace, first_token_at=11.0, stages=3)
    assert "PoolMaster/ReleaseLease" not in counts["critical_path"]
    assert counts["rpcs_by_method"]["PoolMaster/ReleaseLease"] == 1
    awaited = request_counts([c for c in trace if c is not release] + [release | {"detached": False}],
                             first_token_at=11.0, stages=3)
    assert awaited["critical_path_depth"] == counts["critical_path_depth"] + 1  # the same call, awaited
