"""``kvpool pool stats``: the master's view of the pool, as a table or JSON."""

from __future__ import annotations

from typing import Any

from kvpool.sizes import format_size


# the order of groups a master keeps (StatsResponse.index_order)
_ORDERS = {"c": "in C", "python": "in Python"}


def format_stats(stats: dict[str, Any]) -> str:
    capacity = int(stats["capacity_bytes"])
    used = int(stats["used_bytes"])
    share = used / capacity if capacity else 0.0
    lines = [
        f"pool (master incarnation {stats['master_incarnation']})",
        f"  capacity   {format_size(capacity)}",
        f"  used       {format_size(used)} ({share:.1%}; evicts at {stats['high_watermark']:.0%} "
        f"down to {stats['low_watermark']:.0%})",
        f"  objects    {stats['num_objects']} ({stats['num_puts_in_flight']} being written)",
        f"  groups     {stats['num_groups']} ({stats['num_complete_groups']} complete; least recently used first, "
        f"kept {_ORDERS.get(stats.get('index_order', ''), 'by a master that does not say how')})",
        f"  leases     {stats['num_leases']}",
        f"  evictions  {stats['evicted_groups']} groups, {format_size(int(stats['evicted_bytes']))}",
        f"  revoked    {stats['revoked_puts']} puts",
        f"  tenants    {len(stats['tenants'])}",
    ]
    for tenant in stats["tenants"]:
        lines.append(
            f"    {tenant['tenant'][:24]:24}  {format_size(int(tenant['bytes']))} of a "
            f"{format_size(int(tenant['share_bytes']))} share  {tenant['num_groups']} groups, "
            f"{tenant['evicted_groups']} evicted"
        )
    lines.append(f"  segments   {len(stats['segments'])}")
    for seg in stats["segments"]:
        cap = int(seg["capacity_bytes"])
        lines.append(
            f"    {seg['segment_id'][:16]:16}  {seg['endpoint']:21} node {seg['numa_node']:>2}  "
            f"{format_size(int(seg['used_bytes']))} / {format_size(cap)}  {seg['num_objects']} objects"
        )
    return "\n".join(lines)
