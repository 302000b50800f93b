"""The Mooncake transfer engine, as every kvpool process uses it.

One engine per process, initialised once with the P2P handshake (no metadata
server); every buffer bytes land in or leave from is registered once at start
and reused. Batch transfers run in a worker thread so the event loop keeps
serving while the engine moves bytes.
"""

from __future__ import annotations

import asyncio
import ctypes
import mmap
import socket
from dataclasses import dataclass, field

import structlog

log = structlog.get_logger(__name__)


class TransferError(RuntimeError):
    """A batch transfer failed (peer gone, bad address, ...)."""


@dataclass(slots=True)
class HostBuffer:
    """Page-aligned anonymous memory with a stable address.

    The memory is not touched here, so a NUMA memory policy set before
    ``touch()`` decides where its pages land.
    """

    size: int
    _map: mmap.mmap = field(init=False, repr=False)
    _array: ctypes.Array = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.size <= 0:
            raise ValueError(f"buffer size must be positive, got {self.size}")
        self._map = mmap.mmap(-1, self.size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self._array = (ctypes.c_char * self.size).from_buffer(self._map)

    @property
    def address(self) -> int:
        return ctypes.addressof(self._array)

    def view(self, offset: int = 0, length: int | None = None) -> memoryview:
        """A zero-copy view of ``[offset, offset+length)``."""
        end = self.size if length is None else offset + length
        if offset < 0 or end > self.size or end < offset:
            raise ValueError(f"view [{offset}, {end}) outside buffer of {self.size} bytes")
        return memoryview(self._map)[offset:end]

    def touch(self) -> None:
        """Fault every page in now, so first transfers do not pay for it."""
        page = mmap.PAGESIZE
        mv = memoryview(self._map)
        for off in range(0, self.size, page):
            mv[off] = 0
        mv.release()

    def close(self) -> None:
        try:
            del self._array
            self._map.close()
        except (BufferError, AttributeError):  # a view is still alive; the OS frees at exit
            pass


def local_host_name() -> str:
    return socket.gethostname()


class TransferEngine:
    """One Mooncake transfer engine (TCP here, RDMA where the host has it)."""

    def __init__(self, host: str = "127.0.0.1", protocol: str = "tcp", device: str = "") -> None:
        from mooncake.engine import TransferEngine as _Engine  # native module, loaded lazily

        self._engine = _Engine()
        rc = self._engine.initialize(host, "P2PHANDSHAKE", protocol, device)
        if rc != 0:
            raise TransferError(f"transfer engine initialize({host!r}, {protocol!r}) failed: {rc}")
        self.host = host
        self.protocol = protocol
        self.rpc_port = int(self._engine.get_rpc_port())
        self._registered: dict[int, int] = {}

    @property
    def endpoint(self) -> str:
        """The session name peers use to reach this engine."""
        return f"{self.host}:{self.rpc_port}"

    def register(self, address: int, size: int) -> None:
        """Register memory once; registering the same region again is a no-op."""
        if self._registered.get(address, -1) >= size:
            return
        rc = self._engine.register_memory(address, size)
        if rc != 0:
            raise TransferError(f"register_memory({address:#x}, {size}) failed: {rc}")
        self._registered[address] = size

    def unregister(self, address: int) -> None:
        if self._registered.pop(address, None) is not None:
            self._engine.unregister_memory(address)

    def write_sync(self, endpoint: str, local: list[int], remote: list[int], sizes: list[int]) -> None:
        """Write local→remote in one batch; raises TransferError on failure."""
        if not sizes:
            return
        rc = self._engine.batch_transfer_sync_write(endpoint, local, remote, sizes)
        if rc != 0:
            raise TransferError(f"batch write of {len(sizes)} objects to {endpoint} failed: {rc}")

    def read_sync(self, endpoint: str, local: list[int], remote: list[int], sizes: list[int]) -> None:
        """Read remote→local in one batch; raises TransferError on failure."""
        if not sizes:
            return
        rc = self._engine.batch_transfer_sync_read(endpoint, local, remote, sizes)
        if rc != 0:
            raise TransferError(f"batch read of {len(sizes)} objects from {endpoint} failed: {rc}")

    async def write(self, endpoint: str, local: list[int], remote: list[int], sizes: list[int]) -> None:
        await asyncio.to_thread(self.write_sync, endpoint, local, remote, sizes)

    async def read(self, endpoint: str, local: list[int], remote: list[int], sizes: list[int]) -> None:
        await asyncio.to_thread(self.read_sync, endpoint, local, remote, sizes)
