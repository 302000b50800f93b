"""The master keeps one int per distinct object size (``put_items``): a parsed size is an int of its own, and
the index would keep it for the object's life, 32 bytes an object at 10^6 objects; groups of equal sizes share
one tuple of them (``records.shared``). The table of sizes seen is bounded, whatever sizes callers send."""

from __future__ import annotations

from kvpool.rpc import pool_pb2
from kvpool.services.master import servicer as master_servicer
from tests.unit.test_put_packed import request, servicer

KB = 1024


def test_objects_of_one_size_share_one_int() -> None:
    side = servicer()
    for save in range(3):  # separate messages: each parses its sizes afresh
        items = [(f"g{save}/{m}", f"g{save}", 2, 3 * KB) for m in range(2)]
        side.put_start(pool_pb2.PutStartRequest.FromString(request(items, packed=True).SerializeToString()))
    groups = list(side.index.groups.values())
    assert len(groups) == 3 and groups[0].sizes == (3 * KB, 3 * KB)
    assert len({id(group.sizes) for group in groups}) == 1  # one tuple for the three groups' six sizes


def test_the_sizes_seen_stay_bounded() -> None:
    bound = master_servicer.MAX_SIZES
    for first in range(0, bound + 300, 100):
        batch = [pool_pb2.PutItem(key=f"k/{n}", group_id=f"k{n}", group_size=1, size=10_000 + n)
                 for n in range(first, first + 100)]
        master_servicer.put_items(batch, "")
        assert len(master_servicer._SIZES) <= bound + 100
