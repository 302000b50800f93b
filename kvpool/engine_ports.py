"""The transfer engine's ports: a process's engines listen where no engine of this user on this host did lately.

An engine keeps what it learns of a peer (its data port, its memory) under the peer's name, ``host:port`` of
the peer's handshake listener, for as long as it lives, and never asks again: neither a failed transfer nor the
peer's death drops it. When a process that held a name is gone and a new engine takes the same port, every
engine that had met the old one goes on using the old one's data port and cannot reach the new one; each of its
transfers there fails, for good (measured on 0.3.13: a store replaced on its predecessor's port, four writes in
a row failed; ``MC_DISABLE_METACACHE=1`` heals it but asks the peer again for each object: a write of one 4 KB
object took 6-14 times as long, one of 88 objects of 256 KB 4-6 times). Left to itself, the engine picks its
ports at random in 15000-17000, so each restart on a host lands on a name some peer remembers about once in 2000
starts per name remembered (the suite's workers met it: a test's write into a new store failed).

So each process reserves a window of ``WIDTH`` ports in ``[FIRST, LAST)`` before it loads the engine's module,
which reads its range (``MC_MIN_RPC_PORT``/``MC_MAX_RPC_PORT``: the handshake listener's port and the data
port alike) once, as it loads: windows are handed out in turn from a cursor file in this user's runtime folder,
under a lock, skipping any window one of whose ports cannot be bound now. A window comes back only after every
other has been handed out (625 process starts), and a name within it only if an engine there takes it again.

An operator who sets either variable chooses the range: nothing is reserved. ``KVPOOL_ENGINE_PORTS=off`` leaves
the choice to the engine. Where no window can be had (an unsafe folder, every window busy) the engine chooses,
and the process logs why.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import random
import socket
import stat
from collections.abc import Iterator
from pathlib import Path

import structlog

from kvpool.secret_files import UnsafeFolder, private_folder, runtime_folder

log = structlog.get_logger(__name__)

FIRST = 15000  # the engine's own default range starts here; kvpool.ports keeps services' listeners at 20000 up
LAST = 20000
WIDTH = 8  # ports a process's engines share: each takes two (handshake, data), so four engines at once
MIN_ENV, MAX_ENV = "MC_MIN_RPC_PORT", "MC_MAX_RPC_PORT"
SWITCH_ENV = "KVPOOL_ENGINE_PORTS"
CURSOR_NAME = "engine-ports"

_window: tuple[int, int] | None = None  # this process's, once reserved: [first, last]


class NoWindow(Exception):
    """No window could be reserved; the message says why."""


def bindable(port: int) -> bool:
    """Whether a TCP listener could bind ``port`` now, as the engine binds (no SO_REUSEADDR): a port with a
    listener, a connection or a closing one on it is not."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("0.0.0.0", port))
        except OSError as exc:
            if exc.errno in (errno.EADDRINUSE, errno.EACCES):
                return False
            raise
    return True


def _read_cursor(fd: int, windows: int) -> int:
    data = os.pread(fd, 64, 0).split()
    try:
        return int(data[0]) % windows
    except (IndexError, ValueError):  # a new file (or one cut short): start anywhere
        return random.randrange(windows)


def reserve(folder: Path | str | None = None, width: int = WIDTH, first: int = FIRST,
            last: int = LAST) -> tuple[int, int]:
    """The next window of ``width`` ports in ``[first, last)`` whose ports all bind now, as ``(lowest, highest)``;
    the cursor in ``folder`` (this user's runtime folder unless given; made 0700 when missing) moves past it.
    Raises :class:`NoWindow` for an unsafe folder or when no window is free."""
    windows = (last - first) // width
    if windows < 1:
        raise NoWindow(f"[{first}, {last}) holds no window of {width} ports")
    try:
        folder = private_folder(runtime_folder() if folder is None else folder, "runtime folder")
    except (UnsafeFolder, OSError) as exc:
        raise NoWindow(str(exc)) from exc
    path = folder / CURSOR_NAME
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as exc:  # a symlink planted at the name, say
        raise NoWindow(f"cannot open {path}: {exc}") from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            raise NoWindow(f"{path} is not a file of this user's")
        fcntl.flock(fd, fcntl.LOCK_EX)  # released as the file closes
        start = _read_cursor(fd, windows)
        for step in range(windows):
            index = (start + step) % windows
            low = first + index * width
            if all(bindable(port) for port in range(low, low + width)):
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{(index + 1) % windows}\n".encode(), 0)
                return low, low + width - 1
        raise NoWindow(f"every window of {width} ports in [{first}, {last}) has a port in use")
    finally:
        os.close(fd)


def window() -> tuple[int, int] | None:
    """This process's window, once reserved; None before, or where the engine or an operator chose."""
    return _window


@contextlib.contextmanager
def pinned() -> Iterator[None]:
    """Around the first import of the engine's module: its range is this process's window, and the
    variables are as they were afterwards (a child process reserves its own)."""
    global _window
    if os.environ.get(SWITCH_ENV, "on") == "off" or MIN_ENV in os.environ or MAX_ENV in os.environ:
        yield
        return
    try:
        low, high = reserve()
    except NoWindow as exc:
        log.warning("engine_ports_unreserved", reason=str(exc),
                    consequence="the engine picks its ports at random; a peer that met an earlier engine on the "
                                "same port cannot reach this one")
        yield
        return
    os.environ[MIN_ENV], os.environ[MAX_ENV] = str(low), str(high)
    try:
        yield
        _window = (low, high)
    finally:
        del os.environ[MIN_ENV], os.environ[MAX_ENV]


def free_in_window() -> int | None:
    """Ports of this process's window that bind now (None without one): an engine needs two."""
    if _window is None:
        return None
    return sum(bindable(port) for port in range(_window[0], _window[1] + 1))
