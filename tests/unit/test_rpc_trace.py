"""The critical path from an interceptor trace: sequential and nested calls chain, parallel ones do not."""

from __future__ import annotations

from kvpool.rpc_trace import critical_path_depth


def call(method: str, span: str, parent: str, start: float, end: float) -> dict[str, object]:
    return {"request_id": "r", "method": f"/kvpool.rpc.{method}", "span": span, "parent": parent,
            "start": start, "end": end}


TRACE = [
    call("Router/Generate", "g", "", 0.0, 11.0),  # the client's call: the entry, not counted
    call("Decode/Reserve", "a", "g", 0.1, 1.0),
    call("Prefill/Prefill", "b", "g", 1.0, 10.0),
    call("PoolMaster/Lookup", "c", "b", 1.1, 1.2),
    call("PrefillStage/Restore", "d", "b", 1.3, 2.1),  # stage 1 and ...
    call("PrefillStage/Restore", "e", "b", 1.31, 2.0),  # ... stage 2 at once: one level
    call("PrefillStage/Forward", "f", "b", 2.2, 8.0),
    call("PrefillStage/Forward", "h", "f", 3.0, 7.5),  # nested: stage 1 forwards to stage 2
    call("PrefillStage/SaveDone", "i", "b", 8.1, 12.0),  # beside the request, not on its way
    call("HandoffStage/WriteLayers", "j", "b", 8.2, 9.0),
    call("HandoffStage/WriteLayers", "k", "b", 8.21, 8.9),
    call("Decode/Generate", "l", "g", 10.5, 11.0),  # a stream ends at its first message
    call("Decode/Stats", "m", "", 20.0, 20.1),  # after the first token: not counted
]


def test_the_admission_first_path_on_two_stages() -> None:
    # Reserve → Prefill (Lookup → Restore → Forward (→ Forward) → WriteLayers) → Generate
    assert critical_path_depth(TRACE, first_token_at=11.0) == 8
    assert critical_path_depth(TRACE, first_token_at=1.05) == 2  # Reserve, then Prefill had started
    assert critical_path_depth([], first_token_at=1.0) == 0


def test_parallel_siblings_never_chain() -> None:
    calls = [call("Router/Generate", "g", "", 0.0, 9.0), call("HandoffStage/WriteLayers", "a", "g", 0.0, 2.0),
             call("HandoffStage/WriteLayers", "b", "g", 1.0, 3.0), call("HandoffStage/WriteLayers", "c", "g", 0.5, 1.5)]
    assert critical_path_depth(calls, first_token_at=5.0) == 1


def test_without_the_entry_call_the_roots_chain() -> None:
    # the router names the request afresh: the client's call to it is traced under another id
    calls = [c for c in TRACE if c["span"] != "g"]
    assert critical_path_depth(calls, first_token_at=11.0) == 8
