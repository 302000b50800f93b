"""Port 0, for a service that listens: a free port below the kernel's ephemeral range.

Asked to bind port 0, the kernel picks from the range it also gives every outgoing connection its local port
(``net.ipv4.ip_local_port_range``, 32768-60999 by default). A service restarted on the port it had (its peers keep
its address: the supervisor of ``kvpool up``, kvpool/tools/cluster/process.py) can then find that port held by some
client's connection made while it was down, and fail to bind it on every retry. A port below that range is never
given to an outgoing connection; only another listener can take it, and a listener picks it only on purpose or
through this module, at random among thousands.

``listen(host, port, bind)`` calls ``bind(port)`` for a port given; for port 0 it tries free ports of
``[FLOOR, the range's start)`` in random order, and falls back to the kernel's choice where that span is too small
(a host whose ephemeral range was moved down) or every try found its port taken.
"""

from __future__ import annotations

import errno
import random
import socket
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
# below it, the ports other software on a host of ours listens on by default: the transfer engine's
# (Mooncake picks its listeners between 15000 and 17000), etcd's (2379-2380)
FLOOR = 20000
MIN_SPAN = 1024  # fewer free candidates than this: let the kernel choose
TRIES = 32


def ephemeral_start(path: str = RANGE_FILE) -> int:
    """The first port of the kernel's ephemeral range (this network namespace's)."""
    try:
        with open(path) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # the kernel's default


def candidates(start: int | None = None, tries: int = TRIES, rng: random.Random | None = None) -> list[int]:
    """Ports to try for a bind to port 0, in order: ``tries`` distinct ones of ``[FLOOR, start)``; none when
    that span is under ``MIN_SPAN`` ports."""
    start = ephemeral_start() if start is None else start
    if start - FLOOR < MIN_SPAN:
        return []
    return (rng or random.SystemRandom()).sample(range(FLOOR, start), tries)


def is_taken(host: str, port: int) -> bool:
    """Whether something holds ``host:port`` now, tried as servers bind (with SO_REUSEADDR, so a closed
    connection's TIME_WAIT does not count). Any other failure (an address this host lacks) is not "taken": the
    real bind says what it is."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            return exc.errno == errno.EADDRINUSE
    return False


def listen(host: str, port: int, bind: Callable[[int], T]) -> T:
    """``bind(port)``; for port 0, ``bind(p)`` for the first candidate ``p`` that is free and binds (module doc),
    else ``bind(0)``. ``bind`` raises ``OSError`` or ``RuntimeError`` (gRPC's) when it fails; a failure whose port
    is not taken is raised as it is."""
    if port != 0:
        return bind(port)
    for p in candidates():
        if is_taken(host, p):
            continue
        try:
            return bind(p)
        except (OSError, RuntimeError):
            if not is_taken(host, p):
                raise  # not the port: the address, a certificate, ... (said as the caller says it)
            # another listener took it between the probe and the bind: the next one
    return bind(0)
