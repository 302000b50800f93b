"""The handoff's messages as the core's types, and back: the one place they convert, for every
service that passes them on (the router from decode's ``Reserve`` to stage 0's ``Prefill``,
stage 0 to the later stages, the stages' figures back to stage 0 and on to the router). Also the
``SharedMemory`` message, which a handoff target, a store's segment and a stage's hidden states
all carry.

``target_from_message`` is where a ``HandoffTarget`` message is checked on its own (its layout
tiles, its sizes are positive) and becomes a :class:`~kvpool.core.handoff.target.HandoffTarget`;
whether it fits a pipeline is ``check_target``'s (the core's).
"""

from __future__ import annotations

from kvpool.core.errors import InvalidArgument
from kvpool.core.handoff.layout import HandoffLayout
from kvpool.core.handoff.target import HandoffFigures, HandoffTarget, StageHandoffFigures
from kvpool.core.pool.paths import SharedMemoryRef
from kvpool.rpc import handoff_pb2, pool_pb2


def target_layout(target: handoff_pb2.HandoffTarget) -> HandoffLayout:
    """The target's layout, checked on its own (tiling, positive sizes)."""
    if not target.HasField("layout"):
        raise InvalidArgument("target.layout: missing")
    layout = target.layout
    try:
        return HandoffLayout.of(layout.num_tokens, [(r.start, r.end) for r in layout.layer_split], layout.entry_bytes,
                                layout.trailer_bytes)
    except InvalidArgument as exc:
        raise InvalidArgument(f"target.layout.{exc}") from None


def target_from_message(target: handoff_pb2.HandoffTarget) -> HandoffTarget:
    shared = shared_memory_from_message(target.shared_memory) if target.HasField("shared_memory") else None
    if shared is not None:
        shared.check("target.shared_memory")
    return HandoffTarget(region_id=target.region_id, endpoint=target.endpoint, address=target.address,
                         size=target.size, deadline_unix_ms=target.deadline_unix_ms, layout=target_layout(target),
                         notify_address=target.notify_address, host=target.host, shared=shared,
                         shared_base_address=target.shared_base_address, control_offset=target.control_offset)


def target_message(target: HandoffTarget) -> handoff_pb2.HandoffTarget:
    layout = target.layout
    return handoff_pb2.HandoffTarget(
        region_id=target.region_id, endpoint=target.endpoint, address=target.address, size=target.size,
        deadline_unix_ms=target.deadline_unix_ms, notify_address=target.notify_address, host=target.host,
        shared_base_address=target.shared_base_address, shared_memory=shared_memory_message(target.shared),
        control_offset=target.control_offset,
        layout=handoff_pb2.HandoffLayout(
            num_tokens=layout.num_tokens, entry_bytes=layout.entry_bytes, trailer_bytes=layout.trailer_bytes,
            layer_split=[handoff_pb2.LayerRange(start=s, end=e) for s, e in layout.layer_split]),
    )


def shared_memory_message(shared: SharedMemoryRef | None) -> pool_pb2.SharedMemory | None:
    if shared is None:
        return None
    return pool_pb2.SharedMemory(socket_path=shared.socket_path, name=shared.name, token=shared.token)


def shared_memory_from_message(message: pool_pb2.SharedMemory) -> SharedMemoryRef:
    """The reference as sent; the receiver checks it (``SharedMemoryRef.check``) naming its own field."""
    return SharedMemoryRef(message.socket_path, message.name, message.token)


def stage_figures_from_message(figures: handoff_pb2.StageHandoffFigures) -> StageHandoffFigures:
    return StageHandoffFigures(
        stage=figures.stage, transfers=figures.transfers, bytes=figures.bytes, gather_seconds=figures.gather_seconds,
        write_seconds=figures.write_seconds, scatter_seconds=figures.scatter_seconds, ranges=figures.ranges,
        forward_end_unix_ms=figures.forward_end_unix_ms, last_write_end_unix_ms=figures.last_write_end_unix_ms)


def stage_figures_message(figures: StageHandoffFigures) -> handoff_pb2.StageHandoffFigures:
    return handoff_pb2.StageHandoffFigures(
        stage=figures.stage, transfers=figures.transfers, bytes=figures.bytes, gather_seconds=figures.gather_seconds,
        write_seconds=figures.write_seconds, scatter_seconds=figures.scatter_seconds, ranges=figures.ranges,
        forward_end_unix_ms=figures.forward_end_unix_ms, last_write_end_unix_ms=figures.last_write_end_unix_ms)


def handoff_message(figures: HandoffFigures) -> handoff_pb2.HandoffResponse:
    return handoff_pb2.HandoffResponse(
        region_id=figures.region_id, stages=[stage_figures_message(s) for s in figures.stages],
        transfers=figures.transfers, bytes=figures.bytes, seconds=figures.seconds)


def handoff_from_message(figures: handoff_pb2.HandoffResponse) -> HandoffFigures:
    return HandoffFigures(
        region_id=figures.region_id, stages=tuple(stage_figures_from_message(s) for s in figures.stages),
        transfers=figures.transfers, bytes=figures.bytes, seconds=figures.seconds)
