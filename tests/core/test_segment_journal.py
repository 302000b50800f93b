"""A segment's journal in columns (``SegmentJournal``), against the plainest model of it: a list of every change
as a row. Whatever the entries (additions and removals, keys whole or by prefix), the acknowledgements (forward,
repeated, backward, past the end) and the limits, a heartbeat's changes are the model's next ``limit`` rows after
the acknowledged ones, entries cut at either end where a change of theirs is acknowledged or past the limit (entries
made one at a time or a batch at once alike); and
acknowledged entries are forgotten as the journal goes, so a store that keeps up keeps the master's memory flat."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.core.pool.records import ChangeRow, JournalChanges, ObjectRecord, SegmentJournal

PARTS = st.lists(st.sampled_from(["0", "1", "2", "3", "k/x"]), min_size=0, max_size=4)
OPS = st.lists(st.one_of(
    st.tuples(st.just("add"), PARTS, st.sampled_from(["", "g/"]), st.integers(0, 2**64 - 1)),
    st.tuples(st.just("remove"), PARTS, st.sampled_from(["", "g/"])),
    st.tuples(st.just("add_groups"), st.integers(0, 4), st.integers(0, 3)),
    st.tuples(st.just("remove_groups"), st.lists(PARTS, max_size=4)),
    st.tuples(st.just("ack"), st.integers(-2, 3), st.booleans()),
    st.tuples(st.just("beat"), st.integers(0, 12)),
    st.tuples(st.just("clear"),),
), max_size=60)


def added_rows(first: int, parts: list[str], prefix: str, checksum: int) -> list[ChangeRow]:
    return [(first + i, prefix + part, "g", 4, 64 * i, 10 + i, checksum, "alice") for i, part in enumerate(parts)]


@settings(max_examples=300, deadline=None)
@given(ops=OPS, compact_after=st.sampled_from([1, 2, 3, 4096]))
def test_a_heartbeat_takes_the_next_unacknowledged_changes_wherever_acks_and_limits_cut(
        ops: list[tuple], compact_after: int) -> None:  # type: ignore[type-arg]
    journal = SegmentJournal(compact_after=compact_after)
    model: list[ChangeRow] = []  # every change, in order
    acked = 0
    for op in ops:
        if op[0] == "add":
            _, parts, prefix, checksum = op
            journal.add_members("g", 4, tuple(parts), tuple(64 * i for i in range(len(parts))),
                                tuple(10 + i for i in range(len(parts))), (checksum,) * len(parts), "alice", prefix)
            model += added_rows(len(model) + 1, parts, prefix, checksum)
        elif op[0] == "remove":
            _, parts, prefix = op
            journal.remove_keys(tuple(parts), prefix)
            model += [(len(model) + 1 + i, prefix + part, "", 0, 0, 0, 0, "") for i, part in enumerate(parts)]
        elif op[0] == "add_groups":  # whole groups of a commit, keyed by place, at once
            _, count, members = op
            keys = tuple(map(str, range(members)))
            ids = [f"c{len(model)}-{i}" for i in range(count)]
            journal.add_groups(ids, keys, [tuple(64 * m + i for m in range(members)) for i in range(count)],
                               [(10,) * members] * count, [(i,) * members for i in range(count)],
                               ["t"] * count, [f"{group_id}/" for group_id in ids])
            for i, group_id in enumerate(ids):
                model += [(len(model) + 1 + m, f"{group_id}/{m}", group_id, members, 64 * m + i, 10, i, "t")
                          for m in range(members)]
        elif op[0] == "remove_groups":  # removals of several groups' keys at once (an empty one is no entry)
            removals = op[1]
            journal.remove_groups([tuple(parts) for parts in removals], [f"r{n}/" for n in range(len(removals))])
            for n, parts in enumerate(removals):
                model += [(len(model) + 1 + i, f"r{n}/{part}", "", 0, 0, 0, 0, "") for i, part in enumerate(parts)]
        elif op[0] == "ack":  # a step from the last acknowledgement, or from the end
            _, step, from_end = op
            sequence = max(0, (len(model) if from_end else acked) + step)
            journal.ack(sequence)
            acked = max(acked, min(sequence, len(model)))
        elif op[0] == "beat":
            limit = op[1]
            changes = journal.pending_columns(limit)
            assert changes.rows() == model[acked:acked + limit] if limit > 0 else changes.rows() == []
            assert len(changes) == len(changes.rows())
            assert len(changes.offset) == len(changes.size) == len(changes.checksum) == \
                sum(n for n, size in zip(changes.count, changes.group_size) if size)
            assert sum(changes.count) == len(changes.part) and all(changes.count)
        else:  # a resync: the store's records are taken as they are
            journal.clear()
            acked = len(model)
        assert journal.sequence == len(model) and journal.acked == acked and journal.unacked == len(model) - acked
        assert journal.pending_rows(1 << 30) == model[acked:]
        # the entries kept: those holding an unacknowledged change, and at most as many acknowledged ones
        assert journal.head <= max(compact_after, journal.num_entries + 1)


def test_a_store_that_keeps_up_keeps_the_journal_short() -> None:
    journal = SegmentJournal(compact_after=64)
    for n in range(10_000):
        journal.add_members(f"g{n}", 4, ("0", "1", "2", "3"), (0, 64, 128, 192), (64,) * 4, (n,) * 4, "t", f"g{n}/")
        journal.remove_keys(("0", "1", "2", "3"), f"g{n - 1}/")
        if n % 20 == 19:
            changes = journal.pending_columns(1 << 20)
            assert changes.first[0] == journal.acked + 1 and len(changes) == journal.unacked == 8 * 20
            journal.ack(changes.first[-1] + changes.count[-1] - 1)
    assert journal.unacked == 0 and len(journal.firsts) <= 2 * 64 + 40


def test_a_record_added_alone_is_one_entry_of_one_change() -> None:
    journal = SegmentJournal()
    journal.add(ObjectRecord("g/0", "g", 2, 128, 64, 7, "bob"))
    assert journal.pending_columns(10) == JournalChanges([1], [1], [""], ["g"], [2], ["bob"], ["g/0"], [128], [64],
                                                         [7])
    assert journal.pending(10)[0].added == ObjectRecord("g/0", "g", 2, 128, 64, 7, "bob")
