"""``kvpool pool stats`` shows each tenant's part of the pool beside its share, and the order the master keeps
its groups in, as the master says (``Stats.index_order``)."""

from __future__ import annotations

from google.protobuf.json_format import MessageToDict

from kvpool.core.pool import lru
from kvpool.services.master.servicer import stats_message
from tests.core.fixtures import make_index

from kvpool.pool.stats import format_stats
from kvpool.rpc import pool_pb2


def test_each_tenant_is_listed_with_its_share() -> None:
    stats = pool_pb2.StatsResponse(capacity_bytes=32 << 20, used_bytes=28 << 20, high_watermark=0.9,
                                   low_watermark=0.85, master_incarnation="abc")
    stats.tenants.add(tenant="alice", bytes=17 << 20, num_groups=22, evicted_groups=30, share_bytes=15099494)
    stats.tenants.add(tenant="bob", bytes=11 << 20, num_groups=14, share_bytes=15099494)
    text = format_stats(MessageToDict(stats, preserving_proto_field_name=True,
                                      always_print_fields_with_no_presence=True))
    lines = text.splitlines()
    start = lines.index("  tenants    2")
    assert lines[start + 1:start + 4] == [
        "    alice                     17.0 MiB of a 14.4 MiB share  22 groups, 30 evicted",
        "    bob                       11.0 MiB of a 14.4 MiB share  14 groups, 0 evicted",
        "  segments   0",
    ]


def test_stats_say_which_order_the_master_keeps_its_groups_in() -> None:
    index, _ = make_index()
    stats = stats_message(index, "abc")
    assert stats.index_order == ("c" if lru.native() else "python") == ("c" if index.group_table.native else "python")
    as_dict = MessageToDict(stats, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
    for order, said in (("c", "in C"), ("python", "in Python"), ("", "by a master that does not say how")):
        text = format_stats(as_dict | {"index_order": order})
        assert f"  groups     0 (0 complete; least recently used first, kept {said})" in text.splitlines()
