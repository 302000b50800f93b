"""The Mooncake transfer engine, as every kvpool process uses it.

One engine per process, initialised once with the P2P handshake (no metadata
server); every buffer bytes land in or leave from is registered once at start
and reused. Batch transfers run in a worker thread so the event loop keeps
serving while the engine moves bytes. The engine listens in the port window
its process reserved (``kvpool.engine_ports``): a process that replaces
another never comes back under its name.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import mmap
import os
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import structlog

from kvpool import engine_ports

log = structlog.get_logger(__name__)

# Transparent huge pages for every HostBuffer (KVPOOL_HUGE_PAGES=0 turns them off).
HUGE_PAGES_ENV = "KVPOOL_HUGE_PAGES"


def huge_pages() -> bool:
    """Read when a buffer is made, not at import: a process forked from a zygote that imported this
    module gets its own environment only afterwards."""
    return hasattr(mmap, "MADV_HUGEPAGE") and os.environ.get(HUGE_PAGES_ENV, "1") != "0"

# The engine's sync batch calls spin a core on the batch status until the last
# byte lands. From this many bytes up, ``move`` submits each object as its own
# transfer and polls them with short sleeps instead, leaving that core to the
# copies (and to a reader verifying what already landed).
POLL_MIN_BYTES = 4 << 20
POLL_INTERVAL_S = 0.0002
MAX_IN_FLIGHT = 512  # objects queued per call at most (see ``TransferEngine.move``)
# as the engine's own sync calls: 30 s plus a nanosecond per byte
TRANSFER_TIMEOUT_S = 30.0
# what an async submit returns when it failed (0, or -1 as an unsigned batch id)
_NO_BATCH = (0, -1, (1 << 64) - 1)


class TransferError(RuntimeError):
    """A batch transfer failed (peer gone, bad address, ...)."""


@dataclass(slots=True, frozen=True)
class Move:
    """One object to move between local registered memory and a peer's."""

    endpoint: str  # the peer engine's session name
    local: int  # address here
    remote: int  # address at the peer
    size: int


def spins(nbytes: int) -> bool:
    """Whether ``TransferEngine.move`` moves ``nbytes`` to one peer with the spinning sync call.

    The one place this choice is made: callers that run several peers' moves
    ask it too, to run spinning moves one after another rather than have
    spinners fight over cores.
    """
    return nbytes < POLL_MIN_BYTES


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
        if huge_pages():
            # 2 MiB pages where the kernel has them: far fewer faults on touch and
            # TLB misses in every copy in and out (batch transfers ~5-15% faster)
            with contextlib.suppress(OSError):
                self._map.madvise(mmap.MADV_HUGEPAGE)
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
        if "mooncake.engine" not in sys.modules:
            with engine_ports.pinned():  # the module reads its ports' range as it loads: this process's window
                import mooncake.engine  # native module, loaded lazily
        window = engine_ports.window()
        if window is not None and (engine_ports.free_in_window() or 0) < 2:
            # the engine would fail to bind (and 0.3.13 at times crashes doing so): say why instead
            raise TransferError(f"this process's transfer-engine ports {window[0]}-{window[1]} are all in use: "
                                f"at most {engine_ports.WIDTH // 2} engines at once in a process")
        self._engine = sys.modules["mooncake.engine"].TransferEngine()
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
        """Register memory once; registering the same region again is a no-op.

        The engine refuses a range that overlaps one still registered: memory
        freed without ``unregister`` leaves its range behind, and the next
        mapping at those addresses cannot be registered. Say so plainly.
        """
        if self._registered.get(address, -1) >= size:
            return
        if address in self._registered:  # the same start, now longer: register it anew
            self.unregister(address)
        for start, length in self._registered.items():
            if start != address and start < address + size and address < start + length:
                raise TransferError(
                    f"register_memory({address:#x}, {size}) overlaps [{start:#x}, +{length}) registered earlier "
                    "and never unregistered (memory freed without TransferEngine.unregister)"
                )
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

    def move(
        self,
        endpoint: str,
        local: list[int],
        remote: list[int],
        sizes: list[int],
        write: bool,
        landed: Callable[[int], None] | None = None,
        poll: bool = False,
    ) -> list[bool]:
        """Write local→remote (or read remote→local) each object; per-object success.

        ``poll``: never the spinning sync call, whatever the size (a move that
        overlaps compute on the same host must leave the cores to it).

        Blocking: run it in a worker thread. ``landed(i)`` runs in this thread
        as soon as object ``i`` has completed, so a reader can verify it while
        later objects are still in flight. At most ``MAX_IN_FLIGHT`` objects
        are queued at a time: past ~2k queued transfers per peer the TCP
        transport rejects some and resets its lane, stranding the rest.
        """
        n = len(sizes)
        done = [False] * n
        if not poll and spins(sum(sizes)):
            sync = self.write_sync if write else self.read_sync
            for first in range(0, n, MAX_IN_FLIGHT):
                last = min(first + MAX_IN_FLIGHT, n)
                try:
                    try:
                        sync(endpoint, local[first:last], remote[first:last], sizes[first:last])
                    except TransferError as exc:
                        # once more: the engine redials a connection that failed (one the peer closed under
                        # it, say) for the next transfer, and the move is idempotent. (A peer replaced on its
                        # predecessor's port is another matter, which no retry mends: kvpool.engine_ports)
                        log.info("transfer_retried", endpoint=endpoint, objects=last - first, error=str(exc))
                        sync(endpoint, local[first:last], remote[first:last], sizes[first:last])
                except TransferError as exc:
                    log.warning("transfer_failed", endpoint=endpoint, objects=last - first, error=str(exc))
                    continue
                for i in range(first, last):
                    done[i] = True
                    if landed is not None:
                        landed(i)
            return done
        submit = self._engine.batch_transfer_async_write if write else self._engine.batch_transfer_async_read
        check = self._engine.transfer_check_status
        batch_ids: list[int] = []
        to_submit = n
        deadline = time.monotonic() + TRANSFER_TIMEOUT_S + sum(sizes) * 1e-9
        i = 0  # the oldest object in flight: they complete about in submission order
        while True:
            while len(batch_ids) < to_submit and len(batch_ids) - i < MAX_IN_FLIGHT:
                j = len(batch_ids)
                batch_id = submit(endpoint, [local[j]], [remote[j]], [sizes[j]])
                if batch_id in _NO_BATCH:
                    # the peer is unreachable: the rest would fail the same way, one timeout each
                    log.warning("transfer_submit_failed", endpoint=endpoint, objects=n - j)
                    to_submit = j
                    break
                batch_ids.append(batch_id)
            if i >= len(batch_ids):
                break
            status = check(batch_ids[i])  # frees the batch once it completed or failed
            if status == 0:
                if time.monotonic() > deadline:
                    # like the engine's own timeout, the stuck batches are never freed
                    log.warning("transfer_timeout", endpoint=endpoint, objects=len(batch_ids) - i)
                    break
                time.sleep(POLL_INTERVAL_S)
                continue
            if status == 1:
                done[i] = True
                if landed is not None:
                    landed(i)
            # else failed (freed), or the engine's own timeout (-2, never freed, as in its sync calls)
            i += 1
        if not all(done):
            log.warning("transfer_failed", endpoint=endpoint, objects=done.count(False))
        return done

    async def write(self, endpoint: str, local: list[int], remote: list[int], sizes: list[int]) -> None:
        await asyncio.to_thread(self.write_sync, endpoint, local, remote, sizes)

    async def read(self, endpoint: str, local: list[int], remote: list[int], sizes: list[int]) -> None:
        await asyncio.to_thread(self.read_sync, endpoint, local, remote, sizes)
