"""weka trace loader: flattening of subagents, absolute times, defaults, validation errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvpool.workload.weka import Turn, load_session, load_sessions


def request(t: float, tokens: int, ids: list[int], think: float | None = 1.0, out: int = 10) -> dict[str, Any]:
    body: dict[str, Any] = {"t": t, "type": "n", "in": tokens, "out": out, "hash_ids": ids}
    if think is not None:
        body["think_time"] = think
    return body


def trace(requests: list[dict[str, Any]], **top: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "id": "trace_0001", "block_size": 64, "hash_id_scope": "local",
        "tool_tokens": 100, "system_tokens": 20, "requests": requests,
    }
    doc.update(top)
    return doc


def write(tmp_path: Path, doc: Any, name: str = "trace_0001.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(doc))
    return path


def test_subagent_requests_are_flattened_in_absolute_time_order(tmp_path: Path) -> None:
    subagent = {
        "t": 5.0, "type": "subagent", "agent_id": "agent_001",
        "requests": [request(0.0, 64, [10]), request(2.0, 128, [10, 11]), request(7.0, 130, [10, 11])],
    }
    doc = trace([request(0.0, 64, [1]), subagent, request(9.0, 128, [1, 2])])
    session = load_session(write(tmp_path, doc))
    assert [(t.t, t.agent_id) for t in session.turns] == [
        (0.0, None), (5.0, "agent_001"), (7.0, "agent_001"), (9.0, None), (12.0, "agent_001"),
    ]
    assert session.turns[4] == Turn(12.0, 130, 10, (10, 11), 1.0, "agent_001")
    assert (session.id, session.block_size, session.shared_prefix_tokens) == ("trace_0001", 64, 120)


def test_equal_times_keep_file_order(tmp_path: Path) -> None:
    subagent = {"t": 3.0, "type": "subagent", "requests": [request(0.0, 64, [7])]}
    doc = trace([request(3.0, 64, [1]), subagent])
    turns = load_session(write(tmp_path, doc)).turns
    assert [t.hash_ids for t in turns] == [(1,), (7,)]
    assert turns[1].agent_id == "requests[1]"  # an unnamed subagent is named by its position


def test_missing_think_time_is_zero_and_both_id_counts_accepted(tmp_path: Path) -> None:
    # 130 tokens: 2 full blocks (the real files' count) or 3 blocks with a partial last one
    doc = trace([request(0.0, 130, [1, 2], think=None), request(1.0, 130, [1, 2, 3])])
    turns = load_session(write(tmp_path, doc)).turns
    assert turns[0].think_time == 0.0
    assert [t.hash_ids for t in turns] == [(1, 2), (1, 2, 3)]


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda d: d["requests"][0].pop("out"), "requests[0].out: missing"),
        (lambda d: d["requests"][1]["requests"][0].pop("in"), "requests[1].requests[0].in: missing"),
        (lambda d: d["requests"][0].update(hash_ids=[1, 2, 3, 4]), "requests[0].hash_ids: 4 ids for in=130"),
        (lambda d: d["requests"][0].update(hash_ids=[1, "x"]), "requests[0].hash_ids"),
        (lambda d: d["requests"][0].update(t=-1), "requests[0].t"),
        (lambda d: d["requests"][1]["requests"][0].update(out=1.5), "requests[1].requests[0].out"),
        (lambda d: d.update(block_size=0), "block_size"),
        (lambda d: d.update(hash_id_scope="global"), "hash_id_scope"),
        (lambda d: d.pop("system_tokens"), "system_tokens: missing"),
        (lambda d: d.update(requests={}), "requests: expected a list"),
    ],
)
def test_bad_input_names_file_and_field(tmp_path: Path, mutate: Any, field: str) -> None:
    subagent = {"t": 1.0, "type": "subagent", "requests": [request(0.0, 64, [5])]}
    doc = trace([request(0.0, 130, [1, 2]), subagent])
    mutate(doc)
    path = write(tmp_path, doc)
    with pytest.raises(ValueError, match=str(path)) as info:
        load_session(path)
    assert field in str(info.value)


def test_invalid_json_and_non_object(tmp_path: Path) -> None:
    bad = tmp_path / "trace_0002.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="trace_0002.json: not valid JSON"):
        load_session(bad)
    with pytest.raises(ValueError, match="top level"):
        load_session(write(tmp_path, [1, 2]))


def test_load_sessions_selects_by_id_and_limit(tmp_path: Path) -> None:
    for n in (3, 1, 2):
        write(tmp_path, trace([request(0.0, 64, [n])], id=f"trace_000{n}"), f"trace_000{n}.json")
    (tmp_path / "notes.json").write_text("{}")  # not a trace_*.json: ignored
    assert [s.id for s in load_sessions(tmp_path)] == ["trace_0001", "trace_0002", "trace_0003"]
    assert [s.id for s in load_sessions(tmp_path, limit=2)] == ["trace_0001", "trace_0002"]
    assert [s.id for s in load_sessions(tmp_path, ids=["trace_0003", "trace_0001"])] == ["trace_0003", "trace_0001"]
    with pytest.raises(ValueError, match="trace_0009"):
        load_sessions(tmp_path, ids=["trace_0009"])
    with pytest.raises(ValueError, match="not a directory"):
        load_sessions(tmp_path / "absent")
