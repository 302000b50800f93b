"""Logical servers as hosts: one network namespace per server on a shaped veth link to a bridge.

Layout (every name starts with ``kvr-``, every address is in ``10.77.0.0/24``,
both made here and removed here)::

    root namespace: bridge kvr-br (10.77.0.1) — the router, a shared master
      └─ veth kvr-s{i}h ══ tc tbf at --link-gbit, both ways ══ kvr-s{i}n (10.77.0.{10+i}) in netns kvr-s{i}

A server's own traffic (its stages, its stores, its decode shard, a split
master) stays inside its namespace; whatever crosses servers, or reaches the
router or a shared master, crosses its link, where the root side's counters
count it: ``tx`` is what went into the server, ``rx`` what came out.

Invariants: one run holds the network at a time (an ``flock`` on
``LOCK_PATH``; the kernel lets go of it when its holder dies, however), and
the holder first removes every ``kvr-`` namespace and link it finds — they
can only be a crashed run's leftovers. ``remove`` removes everything ``create``
made, and is safe to call twice or after a half-made ``create``.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import re
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

PREFIX = "kvr-"
BRIDGE = "kvr-br"
SUBNET = "10.77.0"
BRIDGE_ADDRESS = f"{SUBNET}.1"
LOCK_PATH = Path("/run/kvpool-replay-netns.lock")
# <sched.h>
_CLONE_NEWNET = 0x40000000
_CLONE_NEWUTS = 0x04000000


class NetnsUnavailable(RuntimeError):
    """Namespaces cannot be made here (not root, no ``ip``/``tc``/``unshare``, or a kernel refusal); says why."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if check and result.returncode != 0:
        raise NetnsUnavailable(f"ip {' '.join(args)}: {result.stderr.strip() or result.returncode}")
    return result


def netns_names() -> list[str]:
    """Every ``kvr-`` network namespace now (``ip netns list``)."""
    out = _ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(PREFIX)]


def link_names() -> list[str]:
    """Every ``kvr-`` link in the root namespace (``ip -o link``)."""
    out = _ip("-o", "link", "show", check=False).stdout
    names = (re.match(r"\d+: ([^:@]+)", line) for line in out.splitlines())
    return [m.group(1) for m in names if m is not None and m.group(1).startswith(PREFIX)]


def remove_leftovers() -> list[str]:
    """Delete every ``kvr-`` namespace and link (a crashed run's); returns what was removed. Hold the lock."""
    removed = []
    for name in netns_names():
        _ip("netns", "delete", name, check=False)
        removed.append(f"netns {name}")
    for name in link_names():  # deleting the root side of a veth deletes its peer
        _ip("link", "delete", name, check=False)
        removed.append(f"link {name}")
    return removed


def why_unavailable() -> str | None:
    """None when this host can make namespaces, else the reason."""
    if os.geteuid() != 0:
        return "not running as root"
    for tool in ("ip", "tc", "unshare"):
        if shutil.which(tool) is None:
            return f"no {tool!r} command"
    return None


@dataclass(slots=True)
class ServerLink:
    """One server's namespace and link; byte counters read from the root side of its veth."""

    index: int
    netns: str
    host_link: str  # root side, on the bridge
    ns_link: str  # inside the namespace
    address: str

    def counters(self) -> tuple[int, int]:
        """(bytes into the server, bytes out of it) so far."""
        base = Path("/sys/class/net") / self.host_link / "statistics"
        return int((base / "tx_bytes").read_text()), int((base / "rx_bytes").read_text())


@dataclass(slots=True)
class Network:
    """The bridge, one namespace + shaped veth per server; ``remove()`` undoes all of it."""

    num_servers: int
    link_gbit: float
    links: list[ServerLink] = field(default_factory=list)
    removed_leftovers: list[str] = field(default_factory=list)
    _lock: int | None = None

    def create(self, lock_wait_s: float = 30.0) -> Network:
        reason = why_unavailable()
        if reason is not None:
            raise NetnsUnavailable(reason)
        self._acquire(lock_wait_s)
        try:
            self.removed_leftovers = remove_leftovers()
            _ip("link", "add", BRIDGE, "type", "bridge")
            _ip("addr", "add", f"{BRIDGE_ADDRESS}/24", "dev", BRIDGE)
            _ip("link", "set", BRIDGE, "up")
            for i in range(self.num_servers):
                self.links.append(self._add_server(i))
        except BaseException:
            self.remove()
            raise
        return self

    def _add_server(self, i: int) -> ServerLink:
        link = ServerLink(i, f"{PREFIX}s{i}", f"{PREFIX}s{i}h", f"{PREFIX}s{i}n", f"{SUBNET}.{10 + i}")
        _ip("netns", "add", link.netns)
        _ip("link", "add", link.host_link, "type", "veth", "peer", "name", link.ns_link)
        _ip("link", "set", link.ns_link, "netns", link.netns)
        _ip("link", "set", link.host_link, "master", BRIDGE, "up")
        ns = ("-n", link.netns)
        _ip(*ns, "addr", "add", f"{link.address}/24", "dev", link.ns_link)
        _ip(*ns, "link", "set", link.ns_link, "up")
        _ip(*ns, "link", "set", "lo", "up")
        _ip(*ns, "route", "add", "default", "via", BRIDGE_ADDRESS)
        self._shape(link.host_link, netns=None)  # into the server
        self._shape(link.ns_link, netns=link.netns)  # out of it
        return link

    def _shape(self, dev: str, netns: str | None) -> None:
        rate_bytes = self.link_gbit * 1e9 / 8
        # a burst of ~10 ms of the rate, at least a few 64 KiB GSO segments
        burst = max(int(rate_bytes * 0.01), 256 << 10)
        cmd = ["tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{self.link_gbit}gbit",
               "burst", str(burst), "latency", "50ms"]
        if netns is not None:
            cmd = ["ip", "netns", "exec", netns, *cmd]
        result = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise NetnsUnavailable(f"{' '.join(cmd)}: {result.stderr.strip()}")

    def remove(self) -> None:
        """Delete the namespaces, veths and bridge this made (and any ``kvr-`` leftover), then let the lock go."""
        if self._lock is None:
            return
        try:
            for link in self.links:
                _ip("netns", "delete", link.netns, check=False)
                _ip("link", "delete", link.host_link, check=False)
            _ip("link", "delete", BRIDGE, check=False)
            remove_leftovers()
            self.links.clear()
        finally:
            os.close(self._lock)
            self._lock = None

    def _acquire(self, wait_s: float) -> None:
        fd = os.open(LOCK_PATH, os.O_CREAT | os.O_RDWR, 0o600)
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                self._lock = fd
                return
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    os.close(fd)
                    raise NetnsUnavailable(f"another run holds {LOCK_PATH} (its namespaces are in use)") from None
                time.sleep(0.2)  # waiting for another run to let go of the network


@dataclass(frozen=True, slots=True)
class Place:
    """Where a process runs: a network namespace (None: this one) and a host name of its own (None: ours)."""

    netns: str | None = None
    host_name: str | None = None

    @property
    def here(self) -> bool:
        return self.netns is None and self.host_name is None

    def prefix(self) -> list[str]:
        """The command prefix that runs a process here (see :func:`netns_prefix`)."""
        return netns_prefix(self.netns, self.host_name)

    def forkable(self) -> bool:
        """Whether a forked child can move itself here: joining a namespace needs root (the prefix's
        ``unshare`` maps a user namespace otherwise)."""
        return self.here or os.geteuid() == 0


def enter(netns: str | None, host_name: str | None) -> None:
    """Move this single-threaded process into ``netns`` and a UTS namespace of its own named ``host_name``,
    as the :func:`netns_prefix` commands do for an exec'd one (a zygote's fork does this instead)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if netns is not None:
        fd = os.open(f"/run/netns/{netns}", os.O_RDONLY | os.O_CLOEXEC)
        try:
            if libc.setns(fd, _CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), f"setns into netns {netns}")
        finally:
            os.close(fd)
    if host_name is not None:
        if libc.unshare(_CLONE_NEWUTS) != 0:
            raise OSError(ctypes.get_errno(), "unshare of the UTS namespace")
        socket.sethostname(host_name)


def netns_prefix(netns: str | None, host_name: str | None) -> list[str]:
    """The command prefix that runs a process in ``netns`` (None: this one) under ``host_name`` (None: ours).

    ``unshare --uts`` gives the process a host name of its own (placement's
    "the writer's host"); every step ``exec``s, so the process keeps the pid
    its parent started (signals and the die-with-parent check still work).
    """
    prefix = ["ip", "netns", "exec", netns] if netns else []
    if host_name:
        uts = ["unshare", "--uts"] if os.geteuid() == 0 else ["unshare", "--user", "--map-root-user", "--uts"]
        prefix += [*uts, "sh", "-c", f'hostname {host_name} && exec "$@"', "kvpool-host"]
    return prefix


def uts_works() -> str | None:
    """None when processes can get a host name of their own here, else why not."""
    try:
        result = subprocess.run([*netns_prefix(None, "kvr-probe"), "hostname"], capture_output=True, text=True,
                                timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unshare --uts: {exc}"
    if result.returncode != 0 or result.stdout.strip() != "kvr-probe":
        return f"unshare --uts: {result.stderr.strip() or result.returncode}"
    return None
