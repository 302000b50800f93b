"""Domain errors of the core: plain exceptions, no transport.

Each names what is wrong and, for bad input, the field. The service edge
(``kvpool.status``) maps each class to one gRPC status code; nothing here
knows about gRPC.
"""

from __future__ import annotations

import re

# "token_ids[3]: ..." or "sampling.top_p: ...": the raising site names the field first
_FIELD_PREFIX = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*(?:\[\d+\])?(?:\.[A-Za-z_][A-Za-z0-9_]*(?:\[\d+\])?)*): ")


# the field a decode shard's "no room now" names (``NoRoomNow``)
ROOM_FIELD = "decode_room"


class KvpoolError(Exception):
    """Base of every domain error.

    ``field`` names the request field at fault (None when no one field is):
    given explicitly, or the leading ``name: `` the raising site wrote. It
    travels as its own value across gRPC (``kvpool.status``), so no receiver
    ever reads it back out of the message text. ``retry_after_s`` tells a
    refused caller when trying again is worthwhile.
    """

    def __init__(self, message: str, *, field: str | None = None, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.message = message
        if field is None:
            match = _FIELD_PREFIX.match(message)
            field = match.group(1) if match else None
        self.field = field or None  # "": known to name no field (never read from the text)
        self.retry_after_s = retry_after_s


class InvalidArgument(KvpoolError):
    """A request field is malformed; the message names the field, and ``field`` holds its name."""


class NotFound(KvpoolError):
    """The named thing (segment, request, handle) does not exist."""


class FailedPrecondition(KvpoolError):
    """The request is well-formed but the system is in the wrong state for it."""


class ResourceExhausted(KvpoolError):
    """No room (pool space, device blocks, pages) now; the caller may retry later."""


class NoRoomNow(ResourceExhausted):
    """A decode shard has no pages or receive region for a request now (``field`` "decode_room"): the
    router queues it again and asks once the shard says room was given back. ``room_epoch``: the shard's
    give-backs when it refused (a router that has seen a later count knows room came back since)."""

    def __init__(self, message: str, *, room_epoch: int | None = None, **kwargs: object) -> None:
        kwargs.setdefault("field", ROOM_FIELD)
        super().__init__(message, **kwargs)  # type: ignore[arg-type]
        self.room_epoch = room_epoch  # None: the shard did not say


class PermissionDenied(KvpoolError):
    """The caller's role may not make this call (or not on this object)."""


class Unavailable(KvpoolError):
    """A dependency is down or the service is not ready yet."""


class DeviceCacheLost(FailedPrecondition):
    """A stage was asked to read device KV it never wrote: it restarted since
    stage 0 cached those chunks. No device hit can be trusted on that pipeline."""


class RestoreFellShort(Unavailable):
    """A stage could not restore every pool chunk its forward was planned past (a store gone, an object
    corrupt): it computed nothing, and stage 0 plans the request again without the pool.
    ``corrupt_chunk_indexes`` names the chunks whose objects failed their checksum, so stage 0 reports their
    groups to the master when it ends the lease."""

    def __init__(self, message: str, *, corrupt_chunk_indexes: tuple[int, ...] = (), **kwargs: object) -> None:
        super().__init__(message, **kwargs)  # type: ignore[arg-type]
        self.corrupt_chunk_indexes = tuple(corrupt_chunk_indexes)
