"""A put batch's checks decide a save's batch a group at a time, and answer every batch exactly as the item by
item loop does: the same error, naming the same first bad item, or none."""

from __future__ import annotations

from unittest import mock

from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.core.errors import KvpoolError
from kvpool.core.pool import put_checks
from kvpool.core.pool.put_checks import check_put_batch
from kvpool.core.pool.records import PutRequestItem
from tests.core.fixtures import KB, make_index


def outcome(call: object) -> str:
    try:
        call()  # type: ignore[operator]
    except KvpoolError as error:
        return f"{type(error).__name__}: {error}"
    return "ok"


ITEMS = st.lists(st.tuples(st.sampled_from(["a", "b", "c"]), st.integers(0, 4), st.integers(1, 4),
                           st.sampled_from([KB, 50 * KB, 200 * KB])), max_size=12)


@settings(max_examples=300, deadline=None)
@given(items=ITEMS, stored=st.integers(0, 3))
def test_the_batch_checks_answer_as_the_item_by_item_loop(items: list[tuple[str, int, int, int]],
                                                           stored: int) -> None:
    index, _ = make_index(segment_bytes=100 * KB)
    for m in range(stored):  # group "a" holds members already (declared with 3)
        index.put_start("host0", [PutRequestItem(f"a/{m}", "a", 3, KB)])
    batch = [PutRequestItem(f"{group}/{place}", group, size, nbytes) for group, place, size, nbytes in items]

    def check() -> None:
        check_put_batch(batch, index.segments, index.groups, index.holds, index.holds_any)

    fast = outcome(check)
    with mock.patch.object(put_checks, "_all_good", lambda *args: False):
        loop = outcome(check)
    assert fast == loop


def test_a_saves_batch_passes_without_the_loop() -> None:
    index, _ = make_index(segment_bytes=100 * KB)
    batch = [PutRequestItem(f"g{g}/{s}", f"g{g}", 4, KB) for g in range(3) for s in range(4)]
    assert put_checks._all_good(batch, 100 * KB, index.groups, index.holds_any)
    assert not put_checks._all_good(batch + batch[:1], 100 * KB, index.groups, index.holds_any)  # a duplicate key
