"""Same-host shared memory: segments an owner hands to peers of the same user, and the peers' mappings of them.

Owns three things and their invariants:

- ``SharedSegment``: a sealed memfd mapped read/write. Its size is sealed (no shrink, no grow, no new seals), so
  no process holding the fd can truncate it under a reader: a mapping of it never raises SIGBUS. Its ``token``
  (random, made at creation) names this incarnation of the memory; a restarted owner has a new one.
- ``SegmentShare``: the owner's Unix socket, in a private folder (this user's, 0700, not a symlink; never the
  abstract namespace, which any local user can reach). A peer sends ``MAP <segment_name>\\n``; the owner checks the
  peer's credentials (``SO_PEERCRED``) and answers only a peer of its own uid, with one JSON line
  ``{"size": N, "token": "..."}`` and the segment's fd attached. Anything else gets one ``{"error": "..."}`` line
  and the connection closes. After an answer the connection stays open and the owner never writes on it again: the
  peer reads EOF when the owner exits or removes the segment.
- A segment may come with a doorbell (an eventfd the owner reads): a peer sends ``BELL <segment_name>\n`` on a
  connection of its own and gets ``{"token": "..."}`` with the eventfd attached (the connection then closes); a peer
  rings it after writing something the owner should look at. An owner without one refuses, and the peer goes on
  without it.
- ``SegmentMaps``: the peer's cache of mappings, one per (socket path, segment name). The peer checks that the
  socket's owner runs as its own uid too. A mapping is forgotten when its owner's connection ends, when a later
  ``map`` names another token (the owner restarted) or on ``forget``; a forgotten mapping takes no new pins
  (``using()`` raises ``StaleSegment``) and is unmapped as soon as the last pin drops, so a copy in flight never
  reads unmapped memory and a dead owner's memory is not kept alive.

Copies are plain memory moves (``copy``) that callers run on a worker thread, inside ``MappedSegment.using()``.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import fcntl
import json
import errno
import mmap
import os
import secrets
import socket
import stat
import struct
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from kvpool.core.setting import setting
from kvpool.secret_files import private_folder, runtime_folder
from kvpool.transfer import huge_pages

log = structlog.get_logger(__name__)

SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
MAX_LINE_BYTES = 4096  # a request or an answer is one short line
DEAD_SOCKET_AGE_S = 60.0  # a socket nobody listens on is swept once it is this old (module: sweep_dead_sockets)
REQUEST_TIMEOUT_S = 5.0  # a peer that connects and says nothing is dropped after this
ANSWER_TIMEOUT_S = 5.0  # an owner that does not answer a MAP within this is unavailable
_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def default_shared_memory_dir() -> str:
    """The folder of a host's shared-memory sockets when no setting names one: the user's runtime folder
    (``kvpool.secret_files.runtime_folder``)."""
    return runtime_folder()


def shared_memory_dir_setting() -> Any:
    """The ``shared_memory_dir`` setting of every role that offers or maps shared memory (stores, stages,
    decode): one folder per host, named the same by all of them."""
    return setting(help="folder of the shared-memory sockets: this user's alone (0700); every member of the "
                   "cluster on this host names the same", factory=default_shared_memory_dir,
                   default_text="$XDG_RUNTIME_DIR/kvpool, else /tmp/kvpool-UID")


class SharedMemoryUnavailable(Exception):
    """A segment could not be mapped (no such socket, refused, owner gone); the message says why."""


class OutOfReach(SharedMemoryUnavailable):
    """The socket is not there for this process (another container's folder, say): its owner may be alive,
    and the transfer engine may still reach its memory."""


class StaleSegment(SharedMemoryUnavailable):
    """The segment's owner is another incarnation than the one the caller knew (token mismatch), or the mapping
    was forgotten because its owner went away: its bytes are not the ones the caller is after."""


@dataclass(slots=True, frozen=True)
class PeerCredentials:
    """Who is at the other end of a connected Unix socket, as the kernel recorded it at connect time."""

    pid: int
    uid: int
    gid: int


def peer_credentials(sock: socket.socket) -> PeerCredentials:
    """The ``SO_PEERCRED`` credentials of ``sock``'s peer."""
    pid, uid, gid = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
    return PeerCredentials(pid=pid, uid=uid, gid=gid)


def copy(dst_address: int, src_address: int, nbytes: int) -> None:
    """Copy ``nbytes`` from ``src_address`` to ``dst_address`` (a memmove; regions may overlap). Blocks for the
    whole copy, so callers run it on a worker thread, with both regions pinned."""
    ctypes.memmove(dst_address, src_address, nbytes)


def _view(memory: mmap.mmap, size: int, offset: int, length: int | None) -> memoryview:
    end = size if length is None else offset + length
    if offset < 0 or end > size or end < offset:
        raise ValueError(f"view [{offset}, {end}) outside segment of {size} bytes")
    return memoryview(memory)[offset:end]


class SharedSegment:
    """A sealed memfd of ``size`` bytes, mapped read/write, that the owner hands to same-host peers by fd.

    Offers ``HostBuffer``'s interface (``address``, ``size``, ``view``, ``touch``, ``close``), so a store can use
    either. The size is sealed: nobody holding the fd can shrink or grow it. The pages are not touched here, so a
    NUMA memory policy set before ``touch()`` decides where they land.
    """

    def __init__(self, size: int, name: str) -> None:
        if size <= 0:
            raise ValueError(f"shared segment size must be positive, got {size}")
        self.size = size
        self.name = name
        self.token = secrets.token_hex(16)
        self.fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, size)
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, SEALS)
            self._map = mmap.mmap(self.fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(self.fd)
            raise
        if huge_pages():
            # 2 MiB pages where shmem has them (shmem_enabled "advise" or more): fewer faults and TLB misses
            with contextlib.suppress(OSError):
                self._map.madvise(mmap.MADV_HUGEPAGE)
        self._array = (ctypes.c_char * size).from_buffer(self._map)
        self.address = ctypes.addressof(self._array)

    def view(self, offset: int = 0, length: int | None = None) -> memoryview:
        """A zero-copy view of ``[offset, offset+length)``."""
        return _view(self._map, self.size, offset, length)

    def touch(self) -> None:
        """Fault every page in now, so first transfers do not pay for it."""
        mv = memoryview(self._map)
        for off in range(0, self.size, mmap.PAGESIZE):
            mv[off] = 0
        mv.release()

    def close(self) -> None:
        """Unmap and close the fd; peers that mapped the segment keep their mappings until they drop them."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        try:
            del self._array
            self._map.close()
        except (BufferError, AttributeError):  # a view is still alive; the OS frees at exit
            pass


def sweep_dead_sockets(folder: Path, older_than_s: float = DEAD_SOCKET_AGE_S) -> list[Path]:
    """Remove the sockets in ``folder`` that nobody listens on (an owner killed before it could remove its
    own) and that are older than ``older_than_s`` (a newer one may be an owner between its bind and its
    listen); the ones removed."""
    removed = []
    now = time.time()
    for path in folder.glob("*.sock"):
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            continue
        if not stat.S_ISSOCK(st.st_mode) or st.st_uid != os.geteuid() or now - st.st_mtime < older_than_s:
            continue
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(str(path))
        except ConnectionRefusedError:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
                removed.append(path)
        except OSError:
            pass
        finally:
            probe.close()
    if removed:
        log.info("shared_memory_sockets_swept", folder=str(folder), removed=len(removed))
    return removed


class SegmentShare:
    """The owner's side: a Unix socket at ``folder / f"{name}.sock"`` that hands the fds of its segments to peers
    of this process's uid, and to no one else.

    ``folder`` must be private (this user's, 0700, not a symlink): the folder keeps other users from even reaching
    the socket, and the ``SO_PEERCRED`` check refuses them if they do. Each answered connection stays open until the
    peer hangs up, the segment is removed or the share closes, so the peer learns when the memory goes away.
    """

    def __init__(self, folder: Path, name: str) -> None:
        if not name or "/" in name or name.startswith("."):
            raise ValueError(f"share name {name!r} must be a plain file name (no '/', not hidden)")
        self.folder = private_folder(folder, "shared-memory folder")
        self.socket_path = self.folder / f"{name}.sock"
        self._segments: dict[str, SharedSegment] = {}
        self._doorbells: dict[str, int] = {}  # segment name -> the eventfd peers ring
        self._holders: dict[str, set[socket.socket]] = {}  # segment name -> connections that mapped it
        self._connections: set[asyncio.Task] = set()
        self._listener: socket.socket | None = None
        self._accepting: asyncio.Task | None = None

    def add(self, segment_name: str, segment: SharedSegment, doorbell: int | None = None) -> None:
        """Share ``segment``, with ``doorbell`` (an eventfd the caller owns and reads) for peers to ring."""
        if segment_name in self._segments:
            raise ValueError(f"segment {segment_name!r} is already shared at {self.socket_path}")
        self._segments[segment_name] = segment
        if doorbell is not None:
            self._doorbells[segment_name] = doorbell

    def remove(self, segment_name: str) -> None:
        """Stop sharing a segment and hang up on the peers that mapped it, so they unmap it."""
        self._segments.pop(segment_name, None)
        self._doorbells.pop(segment_name, None)
        for conn in self._holders.pop(segment_name, set()):
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)

    async def start(self) -> Path:
        """Listen; a socket file left by a previous owner in this (private) folder is replaced, and the
        folder's dead sockets (``sweep_dead_sockets``) are removed."""
        sweep_dead_sockets(self.folder)
        st = None
        with contextlib.suppress(FileNotFoundError):
            st = os.lstat(self.socket_path)
        if st is not None:
            if not stat.S_ISSOCK(st.st_mode):
                raise SharedMemoryUnavailable(f"{self.socket_path} exists and is not a socket; not replacing it")
            os.unlink(self.socket_path)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(str(self.socket_path))
            os.chmod(self.socket_path, 0o600)
            listener.listen(128)
            listener.setblocking(False)
        except BaseException:
            listener.close()
            raise
        self._listener = listener
        self._accepting = asyncio.create_task(self._accept())
        return self.socket_path

    async def close(self) -> None:
        """Stop listening, hang up on every peer and remove the socket file."""
        tasks = [t for t in (self._accepting, *self._connections) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._accepting = None
        if self._listener is not None:
            self._listener.close()
            self._listener = None
            self.socket_path.unlink(missing_ok=True)

    async def _accept(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            conn, _ = await loop.sock_accept(self._listener)
            task = asyncio.create_task(self._answer(conn))
            self._connections.add(task)
            task.add_done_callback(self._connections.discard)

    async def _answer(self, conn: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        segment_name = None
        try:
            try:
                line = await asyncio.wait_for(_read_request(loop, conn), REQUEST_TIMEOUT_S)
            except (TimeoutError, OSError, ValueError) as exc:
                return self._refuse(conn, peer_credentials(conn), f"bad request: {exc}")
            peer = peer_credentials(conn)
            if peer.uid != os.geteuid():
                return self._refuse(conn, peer, f"peer uid {peer.uid} is not this owner's uid {os.geteuid()}")
            verb, _, segment_name = line.partition(" ")
            segment = self._segments.get(segment_name)
            if verb == "BELL" and segment is not None and segment_name in self._doorbells:
                answer = json.dumps({"token": segment.token}).encode() + b"\n"
                socket.send_fds(conn, [answer], [self._doorbells[segment_name]])
                segment_name = None
                return None
            if verb != "MAP" or segment is None:
                reason = (f"unknown request {line!r}" if verb not in ("MAP", "BELL") else
                          f"no segment {segment_name!r} here" if segment is None else
                          f"no doorbell for {segment_name!r}")
                segment_name = None
                return self._refuse(conn, peer, reason)
            answer = json.dumps({"size": segment.size, "token": segment.token}).encode() + b"\n"
            socket.send_fds(conn, [answer], [segment.fd])
            self._holders.setdefault(segment_name, set()).add(conn)
            # the owner never writes again: this waits for the peer to hang up, and closing it on exit or
            # ``remove`` is how the peer learns the memory is gone
            while await loop.sock_recv(conn, MAX_LINE_BYTES):
                pass
        except OSError:
            pass  # the peer hung up or ``remove`` shut the connection down
        finally:
            if segment_name is not None:
                self._holders.get(segment_name, set()).discard(conn)
            conn.close()

    @staticmethod
    def _refuse(conn: socket.socket, peer: PeerCredentials, reason: str) -> None:
        log.warning("shared_memory_refused", peer_uid=peer.uid, peer_pid=peer.pid, reason=reason)
        with contextlib.suppress(OSError):
            conn.send(json.dumps({"error": reason}).encode() + b"\n")


async def _read_request(loop: asyncio.AbstractEventLoop, conn: socket.socket) -> str:
    data = b""
    while not data.endswith(b"\n"):
        chunk = await loop.sock_recv(conn, MAX_LINE_BYTES)
        if not chunk:
            raise ValueError("the peer hung up before a full line")
        data += chunk
        if len(data) > MAX_LINE_BYTES:
            raise ValueError(f"request longer than {MAX_LINE_BYTES} bytes")
    return data[:-1].decode("utf-8", errors="replace")


class MappedSegment:
    """A peer's read/write mapping of an owner's segment.

    Copies run inside ``using()``, which pins the mapping: once forgotten (owner gone, restarted, or ``forget``)
    it takes no new pins and is unmapped when the last pin drops. ``address`` is valid only under a pin; views
    taken with ``view`` must be released before the pin is, or the unmap waits for them to be collected.
    """

    def __init__(self, memory: mmap.mmap, size: int, token: str, socket_path: str, segment_name: str) -> None:
        self.size = size
        self.token = token
        self.socket_path = socket_path
        self.segment_name = segment_name
        self._map = memory
        self._array = (ctypes.c_char * size).from_buffer(memory)
        self.address = ctypes.addressof(self._array)
        self._lock = threading.Lock()
        self._pins = 0
        self.forgotten = False
        self.unmapped = False
        self.doorbell = -1  # the owner's eventfd, when it offered one (closed with the mapping)
        self.bell_asked = False

    def ring(self) -> bool:
        """Ring the owner's doorbell, if it has one; call it under ``using()`` (the fd lives as long as the
        mapping). False when there is none."""
        if self.doorbell < 0:
            return False
        try:
            os.eventfd_write(self.doorbell, 1)
        except BlockingIOError:  # the counter is full: the owner has plenty to read already
            pass
        return True

    @contextlib.contextmanager
    def using(self) -> Iterator[MappedSegment]:
        """Pin the mapping for a copy; raises ``StaleSegment`` if it has been forgotten."""
        with self._lock:
            if self.forgotten:
                raise StaleSegment(f"segment {self.segment_name!r} at {self.socket_path} was forgotten: "
                                   "its owner went away or restarted")
            self._pins += 1
        try:
            yield self
        finally:
            with self._lock:
                self._pins -= 1
                unmap = self.forgotten and self._pins == 0
            if unmap:
                self._unmap()

    def view(self, offset: int = 0, length: int | None = None) -> memoryview:
        """A zero-copy view of ``[offset, offset+length)``; take it under ``using()``."""
        if self.unmapped:
            raise StaleSegment(f"segment {self.segment_name!r} at {self.socket_path} is unmapped")
        return _view(self._map, self.size, offset, length)

    def forget(self) -> None:
        """Take no new pins; unmap now, or when the last pin drops."""
        with self._lock:
            self.forgotten = True
            unmap = self._pins == 0
        if unmap:
            self._unmap()

    def _unmap(self) -> None:
        with self._lock:
            if self.unmapped:
                return
            self.unmapped = True
            doorbell, self.doorbell = self.doorbell, -1
        if doorbell >= 0:
            os.close(doorbell)
        try:
            del self._array
            self._map.close()
        except BufferError:  # a view is still alive: the mapping goes when the last view is collected
            log.warning("shared_memory_unmap_deferred", socket_path=self.socket_path, segment=self.segment_name)


class SegmentMaps:
    """The peer's side: one mapping per (socket path, segment name), each with the owner's connection watched.

    Invariant: a cached mapping's owner connection is open, and its token is the last one ``map`` was asked for;
    every other mapping made here is forgotten (unmapped once unpinned). ``mapped_bytes`` counts the mappings not
    yet unmapped, forgotten ones still pinned included.
    """

    def __init__(self) -> None:
        self._cached: dict[tuple[str, str], MappedSegment] = {}
        self._watchers: dict[MappedSegment, asyncio.Task] = {}
        self._owners: dict[MappedSegment, socket.socket] = {}  # each mapping's connection to its owner
        self._live: list[MappedSegment] = []
        self._locks: dict[tuple[str, str], asyncio.Lock] = {}

    @property
    def mapped_bytes(self) -> int:
        self._live = [m for m in self._live if not m.unmapped]
        return sum(m.size for m in self._live)

    async def map(self, socket_path: str, segment_name: str, token: str, doorbell: bool = False) -> MappedSegment:
        """The mapping of ``segment_name`` at ``socket_path`` whose owner's token is ``token``; with ``doorbell``,
        its owner's doorbell too where it offers one (asked once per mapping; ``MappedSegment.ring``).

        Raises ``StaleSegment`` when the owner answers another token, ``SharedMemoryUnavailable`` when the socket
        is missing or unreachable, its owner is another user, or the owner refuses."""
        key = (str(socket_path), segment_name)
        async with self._locks.setdefault(key, asyncio.Lock()):  # one caller maps, and asks for the bell, at once
            mapped = await self._map(key, token)
            if doorbell and not mapped.bell_asked:
                mapped.bell_asked = True
                fd = await self._ask_doorbell(key[0], segment_name, token)
                if fd >= 0:
                    with contextlib.suppress(StaleSegment), mapped.using():  # pinned: its unmap closes the fd
                        mapped.doorbell, fd = fd, -1
                if fd >= 0:  # forgotten meanwhile
                    os.close(fd)
        return mapped

    async def _ask_doorbell(self, socket_path: str, segment_name: str, token: str) -> int:
        """The owner's eventfd for ``segment_name``, or -1 when it offers none (an older owner) or fails."""
        loop = asyncio.get_running_loop()
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        conn.setblocking(False)
        fds: list[int] = []
        try:
            await loop.sock_connect(conn, socket_path)
            if peer_credentials(conn).uid != os.geteuid():
                return -1
            await loop.sock_sendall(conn, f"BELL {segment_name}\n".encode())
            answer = _parse_answer(await asyncio.wait_for(_read_answer(loop, conn, fds), ANSWER_TIMEOUT_S),
                                   socket_path)
            if "error" in answer or answer.get("token") != token or len(fds) != 1:
                return -1
            fd = fds.pop()
            return fd
        except (OSError, TimeoutError, SharedMemoryUnavailable) as exc:
            log.info("shared_memory_doorbell_unavailable", socket_path=socket_path, segment=segment_name,
                     reason=str(exc))
            return -1
        finally:
            for fd in fds:
                os.close(fd)
            conn.close()

    async def _map(self, key: tuple[str, str], token: str) -> MappedSegment:
        """``map``'s mapping, under ``key``'s lock."""
        cached = self._cached.get(key)
        if cached is not None and cached.token == token and not cached.forgotten:
            if self._owner_alive(cached):
                return cached
            # the owner died a moment ago and the watcher has not seen it yet: its memory is no store's now
            log.info("shared_memory_owner_gone", socket_path=cached.socket_path, segment=cached.segment_name)
            self._forget(cached)
        mapped, conn = await self._connect_and_map(key[0], key[1], token)
        if cached is not None:  # the owner restarted: its old memory is not what the caller is after
            self._forget(cached)
        self._cached[key] = mapped
        self._live.append(mapped)
        watcher = asyncio.create_task(self._watch(mapped, conn))
        # closed only once the watcher is done: the loop drops its reader for the fd first, so a new socket
        # that reuses the fd number keeps its own reader
        watcher.add_done_callback(lambda _: conn.close())
        self._watchers[mapped] = watcher
        self._owners[mapped] = conn
        return mapped

    def forget(self, socket_path: str) -> None:
        """Forget every mapping from ``socket_path`` (its owner is known to be gone)."""
        for (path, _), mapped in list(self._cached.items()):
            if path == str(socket_path):
                self._forget(mapped)

    async def close(self) -> None:
        tasks = list(self._watchers.values())
        for mapped in list(self._cached.values()):
            self._forget(mapped)
        await asyncio.gather(*tasks, return_exceptions=True)

    def _forget(self, mapped: MappedSegment) -> None:
        key = (mapped.socket_path, mapped.segment_name)
        if self._cached.get(key) is mapped:
            del self._cached[key]
        self._owners.pop(mapped, None)
        task = self._watchers.pop(mapped, None)
        if task is not None and task is not asyncio.current_task():
            task.cancel()  # its done callback closes the connection
        mapped.forget()

    def _owner_alive(self, mapped: MappedSegment) -> bool:
        """Whether the owner's end of the connection is still open, asked now (the owner never writes, so
        anything but "nothing to read yet" means it is gone)."""
        conn = self._owners.get(mapped)
        if conn is None:
            return False
        try:
            conn.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except BlockingIOError:
            return True
        except OSError:
            return False
        return False

    async def _watch(self, mapped: MappedSegment, conn: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        with contextlib.suppress(OSError):
            while await loop.sock_recv(conn, MAX_LINE_BYTES):
                pass  # the owner never writes after its answer; only EOF matters
        log.info("shared_memory_owner_gone", socket_path=mapped.socket_path, segment=mapped.segment_name)
        self._forget(mapped)

    async def _connect_and_map(self, socket_path: str, segment_name: str,
                               token: str) -> tuple[MappedSegment, socket.socket]:
        loop = asyncio.get_running_loop()
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        conn.setblocking(False)
        fds: list[int] = []
        try:
            try:
                await loop.sock_connect(conn, socket_path)
            except OSError as exc:
                # no such socket here (another mount namespace, another folder): out of this process's reach;
                # a socket nobody listens on any more (ECONNREFUSED): its owner is gone
                unreachable = exc.errno in (errno.ENOENT, errno.EACCES, errno.ENOTDIR)
                kind = OutOfReach if unreachable else SharedMemoryUnavailable
                raise kind(f"cannot connect to shared-memory socket {socket_path}: {exc.strerror or exc}") from exc
            owner = peer_credentials(conn)
            if owner.uid != os.geteuid():
                raise SharedMemoryUnavailable(f"shared-memory socket {socket_path} is served by uid {owner.uid} "
                                              f"(pid {owner.pid}), not by this user (uid {os.geteuid()}); "
                                              "not mapping another user's memory")
            await loop.sock_sendall(conn, f"MAP {segment_name}\n".encode())
            try:
                line = await asyncio.wait_for(_read_answer(loop, conn, fds), ANSWER_TIMEOUT_S)
            except TimeoutError as exc:
                raise SharedMemoryUnavailable(f"{socket_path} did not answer MAP {segment_name!r} within "
                                              f"{ANSWER_TIMEOUT_S} s") from exc
            answer = _parse_answer(line, socket_path)
            if "error" in answer:
                raise SharedMemoryUnavailable(f"{socket_path} refused MAP {segment_name!r}: {answer['error']}")
            if len(fds) != 1:
                raise SharedMemoryUnavailable(f"{socket_path} answered MAP {segment_name!r} with {len(fds)} fds, "
                                              "not 1")
            if answer.get("token") != token:
                raise StaleSegment(f"segment {segment_name!r} at {socket_path} has token {answer.get('token')!r}, "
                                   f"not {token!r}: its owner restarted")
            size = answer.get("size")
            if not isinstance(size, int) or size <= 0:
                raise SharedMemoryUnavailable(f"{socket_path} answered a bad size {size!r} for {segment_name!r}")
            memory = _map_sealed(fds[0], size, socket_path, segment_name)
        except BaseException:
            conn.close()
            raise
        finally:
            for fd in fds:
                os.close(fd)
        return MappedSegment(memory, size, token, socket_path, segment_name), conn


def _map_sealed(fd: int, size: int, socket_path: str, segment_name: str) -> mmap.mmap:
    """Map ``fd`` only if it cannot shrink under the mapping (a shrink would turn reads into SIGBUS)."""
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError as exc:
        raise SharedMemoryUnavailable(f"{socket_path} sent for {segment_name!r} an fd that is not a memfd") from exc
    if not seals & fcntl.F_SEAL_SHRINK or os.fstat(fd).st_size < size:
        raise SharedMemoryUnavailable(f"{socket_path} sent for {segment_name!r} memory that is not sealed against "
                                      f"shrinking to at least {size} bytes; a shrink would crash this reader")
    return mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)


async def _read_answer(loop: asyncio.AbstractEventLoop, conn: socket.socket, fds: list[int]) -> bytes:
    """One answer line; the fds that came with it are appended to ``fds`` (the caller closes them)."""
    data = b""
    while not data.endswith(b"\n") and len(data) <= MAX_LINE_BYTES:
        readable = loop.create_future()
        loop.add_reader(conn.fileno(), lambda: readable.done() or readable.set_result(None))
        try:
            await readable
        finally:
            loop.remove_reader(conn.fileno())
        try:
            chunk, received, _, _ = socket.recv_fds(conn, MAX_LINE_BYTES, 4)
        except BlockingIOError:
            continue
        except OSError as exc:
            raise SharedMemoryUnavailable(f"the shared-memory owner hung up: {exc.strerror or exc}") from exc
        fds.extend(received)
        if not chunk:
            break
        data += chunk
    return data


def _parse_answer(line: bytes, socket_path: str) -> dict:
    if not line.endswith(b"\n"):
        raise SharedMemoryUnavailable(f"{socket_path} closed the connection without a full answer")
    try:
        answer = json.loads(line)
    except ValueError as exc:
        raise SharedMemoryUnavailable(f"{socket_path} answered something that is not JSON: {line[:80]!r}") from exc
    if not isinstance(answer, dict):
        raise SharedMemoryUnavailable(f"{socket_path} answered {answer!r}, not an object")
    return answer
