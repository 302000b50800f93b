"""Placement: which segments a batch of new pool objects is offered, in order.

Pure: no I/O. The pool index asks for an order per batch and allocates from
the first segment in it that has room.

Rules:
- the writer's own host first (its bytes need not cross the network), then
  the segment with the most free bytes, then segment id (deterministic);
- a batch of at least ``stripe_min_bytes`` is striped round robin over the
  first host's segments (one rotation per object, so its transfers run in
  parallel), a smaller one stays on one segment while it fits (one
  transfer); what does not fit spills to the other segments in order.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

from kvpool.core.pool.records import Segment


def placement_order(segments: Iterable[Segment], client_host: str) -> list[Segment]:
    """The writer's own host first, then the most free space, then segment id."""
    return sorted(segments, key=lambda s: (s.host != client_host, -s.allocator.free_bytes, s.segment_id))


def stripe_rotations(order: list[Segment]) -> list[list[Segment]]:
    """Every segment, once per rotation of the first one's host's segments, then the rest in order."""
    if not order:
        return [[]]
    stripe = [s for s in order if s.host == order[0].host]
    spill = [s for s in order if s.host != order[0].host]
    return [stripe[k:] + stripe[:k] + spill for k in range(len(stripe))]


def batch_orders(
    segments: Iterable[Segment], client_host: str, batch_bytes: int, stripe_min_bytes: int
) -> list[list[Segment]]:
    """The orders the batch's objects take in turn (object i uses ``orders[i % len(orders)]``)."""
    order = placement_order(segments, client_host)
    if batch_bytes >= stripe_min_bytes:
        return stripe_rotations(order)
    return [order]


def group_first(order: list[Segment], group_segment_ids: Collection[str], client_host: str) -> list[Segment]:
    """``order`` with the segments already holding the group's members first, within the writer's host tier.

    Stable: segments otherwise keep their order (rotation, most free first).
    """
    if not group_segment_ids:
        return order
    return sorted(order, key=lambda s: (s.host != client_host, s.segment_id not in group_segment_ids))
