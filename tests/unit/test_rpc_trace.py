"""The critical path from an interceptor trace: sequential and nested calls chain, parallel ones do not."""

from __future__ import annotations

from kvpool.rpc_trace import critical_path, critical_path_depth


def call(method: str, span: str, parent: str, start: float, end: float) -> dict[str, object]:
    return {"request_id": "r", "method": f"/kvpool.rpc.{method}", "span": span, "parent": parent,
            "start": start, "end": end}


TRACE = [
    call("Router/Generate", "g", "", 0.0, 11.0),  # the client's call: the entry, not counted
    call("Decode/Reserve", "a", "g", 0.1, 1.0),
    call("Prefill/Prefill", "b", "g", 1.0, 10.0),
    call("PoolMaster/Lookup", "c", "b", 1.1, 1.2),
    call("PoolMaster/ReleaseLease", "r", "b", 1.25, 1.28),  # stage 0 awaits it before the forward
    call("PrefillStage/Restore", "d", "b", 1.3, 2.1),  # stage 1 and ...
    call("PrefillStage/Restore", "e", "b", 1.31, 2.0),  # ... stage 2 at once: one level
    call("PrefillStage/Forward", "f", "b", 2.2, 8.0),
    call("Decode/Landed", "l0", "b", 2.5, 2.51),  # stage 0's check and announce, beside stage 1's forward
    call("Decode/Landed", "l1", "b", 2.6, 2.62),
    call("PrefillStage/Forward", "h", "f", 3.0, 7.5),  # nested: stage 1 forwards to stage 2
    call("Decode/Landed", "z", "f", 5.0, 5.01),  # stage 1's, beside stage 2's forward
    call("Decode/Landed", "x", "h", 7.0, 7.01),  # stage 2's check, then its announce
    call("Decode/Landed", "y", "h", 7.2, 7.3),
    call("PrefillStage/SaveDone", "i", "b", 8.1, 12.0),  # beside the request, not on its way
    call("PoolMaster/PutStart", "p", "f", 7.6, 7.7),
    call("PrefillStage/HandoffDone", "k", "b", 8.1, 9.0),
    call("Decode/Landed", "w", "k", 8.5, 8.6),  # the last stage's final logits, announced after its forward
    call("Decode/Generate", "l", "g", 10.5, 11.0),  # a stream ends at its first message
    call("Decode/Stats", "m", "", 20.0, 20.1),  # after the first token: not counted
]


def test_the_streamed_path_on_three_stages() -> None:
    # Reserve → Prefill (Lookup → ReleaseLease → Restore → Forward (→ Forward (→ Landed → Landed)) →
    # HandoffDone (→ Landed)) → Generate
    assert critical_path(TRACE, first_token_at=11.0) == [
        "Decode/Reserve", "Prefill/Prefill", "PoolMaster/Lookup", "PoolMaster/ReleaseLease", "PrefillStage/Restore",
        "PrefillStage/Forward", "PrefillStage/Forward", "Decode/Landed", "Decode/Landed", "PrefillStage/HandoffDone",
        "Decode/Landed", "Decode/Generate"]
    assert critical_path_depth(TRACE, first_token_at=11.0) == 12
    assert critical_path_depth(TRACE, first_token_at=1.05) == 2  # Reserve, then Prefill had started
    assert critical_path_depth([], first_token_at=1.0) == 0


def test_parallel_siblings_never_chain() -> None:
    calls = [call("Router/Generate", "g", "", 0.0, 9.0), call("HandoffStage/WriteLayers", "a", "g", 0.0, 2.0),
             call("HandoffStage/WriteLayers", "b", "g", 1.0, 3.0), call("HandoffStage/WriteLayers", "c", "g", 0.5, 1.5)]
    assert critical_path_depth(calls, first_token_at=5.0) == 1


def test_without_the_entry_call_the_roots_chain() -> None:
    # the router names the request afresh: the client's call to it is traced under another id
    calls = [c for c in TRACE if c["span"] != "g"]
    assert critical_path_depth(calls, first_token_at=11.0) == 12
