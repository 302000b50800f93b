"""When each request of a session is due: agent timelines and the schedule, in virtual time, exact."""

from __future__ import annotations

from typing import Any

import pytest

from kvpool.tools.replay.schedule import PlannedTurn, SessionSchedule, TurnRef, simulate
from kvpool.workload.timelines import AgentTimeline, agent_timelines
from kvpool.workload.weka import Session, parse_session


def request(t: float, think: float, ids: list[int]) -> dict[str, Any]:
    return {"t": t, "in": 64 * len(ids), "out": 8, "hash_ids": ids, "think_time": think}


def session_with_subagent() -> Session:
    """Main agent at t 0, 9, 20; a subagent entered at t 5 whose requests are at its own t 1 and 3."""
    subagent = {"t": 5.0, "type": "subagent", "agent_id": "explore",
                "requests": [request(1.0, 0.0, [10]), request(3.0, 1.5, [10, 11])]}
    doc = {"id": "s", "block_size": 64, "hash_id_scope": "local", "tool_tokens": 0, "system_tokens": 0,
           "requests": [request(0.0, 0.0, [1]), subagent, request(9.0, 4.0, [1, 2]), request(20.0, 2.0, [1, 2, 3])]}
    return parse_session(doc)


def schedule_of(session: Session, time_scale: float, start: float = 0.0) -> SessionSchedule:
    turns = [PlannedTurn(t.t, t.think_time) for t in session.turns]
    return SessionSchedule(turns, agent_timelines(session), start, time_scale)


def issued(schedule: SessionSchedule, service_time: Any) -> list[tuple[float, str | None, int]]:
    """(issue time, agent, turn index in the session) in issue order."""
    timelines = schedule.timelines
    return [(t, timelines[ref.timeline].agent_id, ref.turn) for t, ref in simulate(schedule, service_time)]


def test_timelines_keep_each_agent_and_where_it_was_spawned() -> None:
    session = session_with_subagent()
    # flattened by absolute time: main 0, explore 6, explore 8, main 9, main 20
    assert [(t.t, t.agent_id) for t in session.turns] == [
        (0.0, None), (6.0, "explore"), (8.0, "explore"), (9.0, None), (20.0, None)]
    assert agent_timelines(session) == [
        AgentTimeline(None, None, 0.0, 0, (0, 3, 4)),
        AgentTimeline("explore", 0, 5.0, 1, (1, 2)),  # spawned after the main agent's turn at t 0
    ]


def test_subagent_first_request_at_parent_t_plus_own_t_beside_the_parent() -> None:
    # every request takes 2 s; think times as recorded (scale 1)
    got = issued(schedule_of(session_with_subagent(), 1.0, start=100.0), lambda ref: 2.0)
    assert got == [
        (100.0, None, 0),      # main: its t 0
        (106.0, None, 3),      # main: answered at 102, then its think time 4.0
        (106.0, "explore", 1),  # subagent: entry t 5 + its own t 1, while the main agent's turn is in flight
        (109.5, "explore", 2),  # subagent: answered at 108, then its think time 1.5
        (110.0, None, 4),      # main: answered at 108, then 2.0
    ]


def test_think_scale_zero_starts_the_subagent_when_its_spawning_turn_answers() -> None:
    got = issued(schedule_of(session_with_subagent(), 0.0), lambda ref: 2.0)
    assert got == [(0.0, None, 0), (2.0, None, 3), (2.0, "explore", 1), (4.0, None, 4), (4.0, "explore", 2)]


def test_a_subagent_never_starts_before_its_spawning_turn_is_answered() -> None:
    # the main agent's first turn takes 10 s: the subagent (due at 6) waits for it
    got = issued(schedule_of(session_with_subagent(), 1.0), lambda ref: 10.0 if ref.turn == 0 else 1.0)
    assert got == [(0.0, None, 0), (10.0, "explore", 1), (12.5, "explore", 2), (14.0, None, 3), (17.0, None, 4)]


def test_one_request_per_timeline_in_flight_and_completion_must_match() -> None:
    schedule = schedule_of(session_with_subagent(), 0.0)
    first = schedule.pop_due(0.0)
    assert first == [TurnRef(0, 0, 0)]
    assert schedule.pop_due(50.0) == []  # the main agent's next turn waits for the answer
    assert schedule.next_due() is None
    with pytest.raises(ValueError):
        schedule.complete(TurnRef(1, 0, 1), 1.0)  # never issued
    schedule.complete(first[0], 1.0)
    assert schedule.next_due() == 1.0
    assert schedule.pop_due(1.0) == [TurnRef(0, 1, 3), TurnRef(1, 0, 1)]
    assert not schedule.done


def test_negative_time_scale_is_refused() -> None:
    with pytest.raises(ValueError, match="time_scale"):
        schedule_of(session_with_subagent(), -1.0)


def test_a_nested_subagent_hangs_on_its_own_parent_and_waits_for_it() -> None:
    inner = {"t": 2.0, "type": "subagent", "agent_id": "inner", "requests": [request(0.5, 0.0, [30])]}
    outer = {"t": 4.0, "type": "subagent", "agent_id": "outer",
             "requests": [request(0.0, 0.0, [20]), inner, request(5.0, 0.0, [20, 21])]}
    doc = {"id": "n", "block_size": 64, "hash_id_scope": "local", "tool_tokens": 0, "system_tokens": 0,
           "requests": [request(0.0, 0.0, [1]), outer]}
    session = parse_session(doc)
    # absolute: main 0; outer 4 and 9; inner 4 + 2 + 0.5
    assert [(t.t, t.agent_id) for t in session.turns] == [(0.0, None), (4.0, "outer"), (6.5, "inner"), (9.0, "outer")]
    assert agent_timelines(session) == [
        AgentTimeline(None, None, 0.0, 0, (0,)),
        AgentTimeline("outer", 0, 4.0, 1, (1, 3)),
        AgentTimeline("inner", 1, 6.0, 1, (2,)),  # spawned by outer's first turn (t 4 <= 6)
    ]
    # outer's first turn takes 5 s: inner (due at 6.5) waits for it to answer at 9
    got = issued(schedule_of(session, 1.0), lambda ref: 5.0 if ref.turn == 1 else 1.0)
    assert got == [(0.0, None, 0), (4.0, "outer", 1), (9.0, "outer", 3), (9.0, "inner", 2)]
