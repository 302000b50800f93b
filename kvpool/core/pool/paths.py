"""Which path a pool move takes: shared memory on the segment's own host, the transfer engine elsewhere.

A store may offer its segment as shared memory (``SharedMemoryRef``: a Unix socket in a folder only the
cluster's user can enter, the segment's name there, the token of this incarnation of the memory). A
client on the same host maps it and copies; any other client uses the transfer engine.

The host a segment declares decides, never whether a socket happens to connect: emulated hosts in
network namespaces share one kernel (and one filesystem), and must still move their bytes as separate
hosts do. ``engine_only`` (a setting) forces the engine everywhere, for comparison.

Pure: no I/O.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kvpool.core.errors import InvalidArgument

MAX_SOCKET_PATH_BYTES = 107  # sun_path holds 108 bytes with its terminating NUL
MAX_NAME_BYTES = 128


class BytePath(enum.Enum):
    MEMORY = "memory"  # a copy between mappings on one host
    ENGINE = "engine"  # the transfer engine


@dataclass(frozen=True, slots=True)
class SharedMemoryRef:
    """Where a segment's memory is mapped on its host."""

    socket_path: str
    name: str
    token: str

    def check(self, field: str) -> None:
        """Raise ``InvalidArgument`` naming ``field`` unless every part is usable."""
        if not self.socket_path.startswith("/") or len(self.socket_path.encode()) > MAX_SOCKET_PATH_BYTES:
            raise InvalidArgument(f"{field}.socket_path: must be an absolute path of at most "
                                  f"{MAX_SOCKET_PATH_BYTES} bytes")
        for part in ("name", "token"):
            value = getattr(self, part)
            if not value or len(value.encode()) > MAX_NAME_BYTES or not value.isprintable() or " " in value:
                raise InvalidArgument(f"{field}.{part}: must be 1..{MAX_NAME_BYTES} bytes, printable, no spaces")


@dataclass(frozen=True, slots=True)
class SegmentAccess:
    """How a client reaches one segment: its host, where its bytes start, and its shared memory if any."""

    segment_id: str
    host: str
    base_address: int
    shared: SharedMemoryRef | None = None

    def offset(self, address: int) -> int:
        """Where ``address`` (the store's own, as locations carry it) lies in the shared memory."""
        return address - self.base_address


def byte_path(access: SegmentAccess | None, client_host: str, engine_only: bool = False) -> BytePath:
    """The path of a move between a client on ``client_host`` and a segment (module doc)."""
    if engine_only or access is None or access.shared is None or not client_host:
        return BytePath.ENGINE
    return BytePath.MEMORY if access.host == client_host else BytePath.ENGINE
