"""A lookup's found run and a release's usable groups read one field a group (``Group.ready``): exact answers
for every way a group stops being ready, against the three fields it stands for."""

from __future__ import annotations

import itertools

from kvpool.core.pool.index import leading_usable, still_usable
from kvpool.core.pool.records import Group


def group(name: str, state: str) -> Group | None:
    """A group of two members in ``state``: ready, incomplete, corrupt, dropped, or missing (None)."""
    if state == "missing":
        return None
    g = Group(name, 2)
    for m in range(2 if state != "incomplete" else 1):
        g.add_member(f"{name}/{m}", "seg0", 64 * m, 64, 64, checksum=1, committed=True)
    if state == "corrupt":
        g.corrupt = True
    if state == "dropped":
        g.dropped = True
    g.update_ready()
    return g


STATES = ("ready", "incomplete", "corrupt", "dropped", "missing")


def by_fields(groups: list[Group | None]) -> list[Group]:
    """The found run as the three fields say it: there, complete, not corrupt (the table's: never dropped)."""
    run = []
    for g in groups:
        if g is None or not g.complete or g.corrupt or g.dropped:
            break
        run.append(g)
    return run


def test_the_found_run_and_the_usable_groups_are_what_the_fields_say() -> None:
    for states in itertools.product(STATES, repeat=3):  # every state in every place of three
        groups = [group(f"g{i}", state) for i, state in enumerate(states)]
        assert leading_usable(groups) == by_fields(groups), states
        held = [g for g in groups if g is not None]
        assert still_usable(held) == [g for g in held if not g.dropped and not g.corrupt], states
        if all(state == "ready" for state in states):
            assert leading_usable(groups) is groups and still_usable(held) is held


def test_ready_follows_every_change_of_what_it_stands_for() -> None:
    g = group("g", "incomplete")
    assert g is not None and not g.ready
    g.add_member("g/1", "seg0", 64, 64, 64, checksum=1, committed=True)
    assert g.ready
    g.remove_member(0, 64)
    assert not g.ready
