"""Transfer-engine processes listen on the cluster's own address only.

The stock Mooncake transfer engine binds its TCP acceptor and its handshake
listener to the wildcard address (``MC_TCP_BIND_ADDRESS`` changes only the
address it advertises), and any peer that reaches those ports can read and
write the process's memory. So every process that owns an engine runs with
``kvpool/native/bind_shim.c`` preloaded: it rewrites the process's wildcard
binds to ``KVPOOL_BIND_ADDRESS``. ``exec_with_shim`` is called by each
engine-owning role first thing; it re-executes the process (same pid) with
the shim preloaded when it is not yet, building it with the C compiler when no
build exists (``scripts/setup.sh`` builds it ahead).

``KVPOOL_BIND_SHIM=off`` runs without it, wildcard binds and all; the process
logs that it does.
"""

from __future__ import annotations

import ctypes
import ipaddress
import os
import socket
import sys
from pathlib import Path

from kvpool import native_build
from kvpool.native_build import NativeUnavailable

ADDRESS_ENV = "KVPOOL_BIND_ADDRESS"
SWITCH_ENV = "KVPOOL_BIND_SHIM"
SOURCE = native_build.NATIVE / "bind_shim.c"


class ShimUnavailable(NativeUnavailable):
    """The shim can be neither found nor built (no C compiler)."""


def find() -> Path | None:
    """The built shim for the current source, if there is one."""
    return native_build.find(SOURCE)


def build() -> Path:
    """Build the shim (once per source version); returns its path."""
    try:
        return native_build.build(SOURCE, ("-ldl", "-lpthread"))
    except NativeUnavailable as exc:
        raise ShimUnavailable(f"{exc}\n(or set {SWITCH_ENV}=off to let the transfer engine bind every "
                              "interface)") from None


def bind_address(host: str) -> str:
    """The IP address ``host`` names; a wildcard address is refused."""
    try:
        address = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        try:
            infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
        except socket.gaierror as exc:
            raise ValueError(f"transfer_host: cannot resolve {host!r}: {exc}") from None
        address = ipaddress.ip_address(infos[0][4][0])
    if address.is_unspecified:
        raise ValueError(f"transfer_host: {host!r} is the wildcard address; name the address peers reach "
                         "this engine at (the transfer engine must not listen on every interface)")
    return str(address)


def rewrites() -> int | None:
    """Wildcard binds the loaded shim rewrote so far; None when it is not loaded."""
    try:
        return int(ctypes.c_ulong.in_dll(ctypes.CDLL(None), "kvpool_bind_shim_rewrites").value)
    except ValueError:
        return None


def child_env(host: str, env: dict[str, str]) -> dict[str, str]:
    """``env`` for a child engine process that will serve its transfer engine on ``host``, with the
    shim already preloaded, so the child's ``exec_with_shim`` finds itself set up and does not exec
    itself again (one interpreter start less per process).

    Unchanged when the shim is switched off or not built, or ``host`` does not resolve: the child
    then does it all itself, and says why if it cannot. A child whose settings name another host
    still execs itself with its own.
    """
    if env.get(SWITCH_ENV, "on") == "off" or (path := find()) is None:
        return env
    try:
        address = bind_address(host)
    except ValueError:
        return env
    preload = [p for p in env.get("LD_PRELOAD", "").split(":") if p and p != str(path)]
    return {**env, ADDRESS_ENV: address, "LD_PRELOAD": ":".join([str(path), *preload])}


def exec_with_shim(host: str, argv: list[str]) -> None:
    """Return once this process runs with the shim bound to ``host``; else re-exec it so.

    ``argv`` follows the interpreter in the new process (``["-m", "pkg", *args]``).

    Call it before anything starts threads or opens sockets: ``execv`` keeps
    the pid (ready files, parents' signals) and replaces everything else.
    """
    if os.environ.get(SWITCH_ENV, "on") == "off":
        return
    address = bind_address(host)
    if os.environ.get(ADDRESS_ENV) == address and rewrites() is not None:
        return
    path = build()
    preload = os.environ.get("LD_PRELOAD", "")
    if str(path) in preload.split(":") and os.environ.get(ADDRESS_ENV) == address:
        # we exec'd ourselves with it already, and it did not load
        raise ShimUnavailable(f"LD_PRELOAD={preload} did not load {path}")
    env = dict(os.environ)
    env[ADDRESS_ENV] = address
    env["LD_PRELOAD"] = ":".join([str(path), *[p for p in preload.split(":") if p]])
    os.execve(sys.executable, [sys.executable, *argv], env)
