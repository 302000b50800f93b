"""A session as a tree of agent timelines: the main agent and each subagent, each its own stream of turns.

``weka.Session.turns`` flattens every agent into one time-ordered list (the
order the bounds and the token ids use). A replay that honors the real
concurrency needs the streams back: a subagent runs beside its parent, at its
own times. Invariants of ``agent_timelines``:
- timeline 0 is the main agent (``agent_id`` None, ``parent`` None,
  ``start_t`` 0.0); every other timeline's ``parent`` is a smaller index;
- every turn of the session is in exactly one timeline, and a timeline's
  ``turns`` are indices into ``Session.turns`` in increasing order (so in
  nondecreasing ``t``);
- ``spawn_after`` is how many of the parent's turns have ``t <= start_t``:
  the subagent was spawned by the parent's answer to its last such turn.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpool.workload.weka import Session


@dataclass(slots=True, frozen=True)
class AgentTimeline:
    """One agent's turns: indices into ``Session.turns``; ``start_t`` is its subagent entry's absolute ``t``."""

    agent_id: str | None
    parent: int | None
    start_t: float
    spawn_after: int
    turns: tuple[int, ...]


def agent_timelines(session: Session) -> list[AgentTimeline]:
    """The session's timelines, main agent first, then subagents by first appearance in ``Session.turns``."""
    order: list[str | None] = [None]
    members: dict[str | None, list[int]] = {None: []}
    for index, turn in enumerate(session.turns):
        if turn.agent_id not in members:
            order.append(turn.agent_id)
            members[turn.agent_id] = []
        members[turn.agent_id].append(index)
    position = {agent_id: i for i, agent_id in enumerate(order)}
    timelines: list[AgentTimeline] = []
    for agent_id in order:
        turns = members[agent_id]
        if agent_id is None:
            timelines.append(AgentTimeline(None, None, 0.0, 0, tuple(turns)))
            continue
        first = session.turns[turns[0]]
        parent_id = first.parent_agent_id
        # an unknown parent (a subagent whose parent has no turns of its own) hangs on the main agent
        parent = position.get(parent_id, 0)
        if parent >= position[agent_id]:
            parent = 0
        parent_turns = timelines[parent].turns if parent < len(timelines) else ()
        spawn_after = sum(1 for i in parent_turns if session.turns[i].t <= first.agent_start)
        timelines.append(AgentTimeline(agent_id, parent, first.agent_start, spawn_after, tuple(turns)))
    return timelines
