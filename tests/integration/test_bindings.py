"""Nothing a cluster starts listens on a wildcard address (issue 19).

The stock transfer engine binds every interface; kvpool/native/bind_shim.c,
preloaded by every engine-owning role, rewrites those binds to the configured
transfer host. The shim itself is checked here; every listening socket of a
running ``kvpool up`` cluster is checked in test_tenants.py (one cluster for both).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvpool import bind_shim


WILDCARDS = {"0.0.0.0", "*", "[::]", "::", "[::ffff:0.0.0.0]"}


def listening(pids: set[int]) -> list[tuple[str, str, int]]:
    """(protocol, local address, pid) of every listening TCP socket and bound UDP socket of ``pids``."""
    found = []
    for proto, flag in (("tcp", "-ltnpH"), ("udp", "-lunpH")):
        out = subprocess.run(["ss", flag], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            fields = line.split()
            for pid in pids:
                if f"pid={pid}," in line:
                    found.append((proto, fields[3], pid))
    return found


def host_of(local: str) -> str:
    host = local.rsplit(":", 1)[0]
    return host.split("%", 1)[0]  # 127.0.0.1%lo: bound to a device as well


SNIPPET = """
import ctypes, socket, sys
out = []
for family, host in ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::"), (socket.AF_INET, "127.0.0.2")):
    with socket.socket(family) as s:
        s.bind((host, 0))
        out.append(s.getsockname()[0])
print(",".join(out))
"""


@pytest.mark.cluster
def test_the_shim_rewrites_wildcard_binds_and_leaves_named_ones(tmp_path: Path) -> None:
    path = bind_shim.build()
    env = {**os.environ, "LD_PRELOAD": str(path), bind_shim.ADDRESS_ENV: "127.0.0.1"}
    out = subprocess.run([sys.executable, "-c", SNIPPET], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "127.0.0.1,::ffff:127.0.0.1,127.0.0.2"
    # without an address it passes every bind through: the control that proves the check can fail
    env.pop(bind_shim.ADDRESS_ENV)
    out = subprocess.run([sys.executable, "-c", SNIPPET], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "0.0.0.0,::,127.0.0.2"


def test_a_wildcard_transfer_host_is_refused() -> None:
    with pytest.raises(ValueError, match="wildcard"):
        bind_shim.bind_address("0.0.0.0")
    assert bind_shim.bind_address("::1") == "::1"
    assert bind_shim.bind_address("localhost") in {"127.0.0.1", "::1"}


@pytest.mark.cluster
def test_a_child_started_with_the_shim_preloaded_does_not_exec_itself_again() -> None:
    """The launcher preloads the shim for engine roles (kvpool/tools/cluster/process.py): one interpreter
    start per process, not two. Without it, the child execs itself under the shim."""
    code = ("from kvpool import bind_shim; bind_shim.exec_with_shim('127.0.0.1', ['-c', 'print(\"again\")']); "
            "print('once', bind_shim.rewrites())")
    plain = subprocess.run([sys.executable, "-c", code], env=dict(os.environ), capture_output=True, text=True)
    preloaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                               env=bind_shim.child_env("127.0.0.1", dict(os.environ)))
    assert plain.stdout.strip() == "again", plain.stderr
    assert preloaded.stdout.strip() == "once 0", preloaded.stderr  # loaded, no bind rewritten yet
    # another host than the child will serve on: it execs itself with its own
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           env=bind_shim.child_env("127.0.0.2", dict(os.environ)))
    assert other.stdout.strip() == "again", other.stderr
