"""Another local user against the pool's shared memory (issue 36): uid 65534 (``setpriv``), holding no file of
the cluster, tries every Unix socket on the host and every store process's open files, and gets no byte of KV.

A pool with a planted secret runs as root (the tests' user). The attacker script lists /proc/net/unix and asks
each socket for a segment as a peer would (``MAP <name>``), looks for a passed file descriptor, and tries to open
each store's memfd through /proc/PID/fd and /proc/PID/map_files. The transfer engines are out of scope here:
until a one-host cluster opens no engine port, they stay the hole docs/security.md names.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from kvpool.pool.client import PoolClient
from kvpool.pool.objects import PutObject, PutResult
from kvpool.tools.cluster import LocalPool
from kvpool.transfer import HostBuffer

pytestmark = [pytest.mark.cluster,
              pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                                 reason="acting as another local user needs root and setpriv")]

SECRET = b"kvpool-shm-secret-" + os.urandom(8).hex().encode()

ATTACK = r'''
import json, os, socket, stat, sys
secret = sys.argv[1].encode()
pids = [int(p) for p in sys.argv[2].split(",")]
names = sys.argv[3].split(",")  # the attacker is assumed to know every segment's name (the master's Stats tell)
found = {"sockets_tried": 0, "connected": 0, "fds_received": 0, "secret_seen": False, "opened": []}
paths = set()
with open("/proc/net/unix") as table:
    for line in table.read().splitlines()[1:]:
        parts = line.split()
        if len(parts) >= 8:
            paths.add(parts[7])
for path in sorted(paths):
    address = "\0" + path[1:] if path.startswith("@") else path
    found["sockets_tried"] += 1
    try:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.settimeout(1.0)
        conn.connect(address)
    except OSError:
        continue
    found["connected"] += 1
    conn.close()
    for name in names:
        try:
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            conn.settimeout(1.0)
            conn.connect(address)
            conn.sendall(b"MAP " + name.encode() + b"\n")
            data, fds, _, _ = socket.recv_fds(conn, 4096, 4)
            found["fds_received"] += len(fds)
            for fd in fds:
                found["secret_seen"] |= secret in os.pread(fd, 64 << 20, 0)
                os.close(fd)
        except OSError:
            pass
        conn.close()
for pid in pids:
    for folder in (f"/proc/{pid}/fd", f"/proc/{pid}/map_files"):
        try:
            names = os.listdir(folder)
        except OSError:
            continue
        for name in names:
            path = os.path.join(folder, name)
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
            except OSError:
                continue
            found["opened"].append(path)
            try:
                if stat.S_ISREG(os.fstat(fd).st_mode):  # a memfd is a regular file; a pipe would block
                    found["secret_seen"] |= secret in os.read(fd, 64 << 20)
            except OSError:
                pass
            os.close(fd)
print(json.dumps(found))
'''


async def test_another_user_maps_no_segment_and_reads_no_secret(pool: LocalPool, engine, buffer: HostBuffer) -> None:
    client = PoolClient(pool.master_address, engine)
    client.register(buffer.address, buffer.size)
    try:
        buffer.view(0, len(SECRET))[:] = SECRET
        assert await client.put([PutObject("ns/secret/0", "ns/secret", 1, buffer.address, 4096)]) == [PutResult.STORED]
        found = await client.lookup(["ns/secret"])
        assert await client.read([(found.groups[0].members["ns/secret/0"], buffer.address + (8 << 20))]) == [True]
        assert client.maps.mapped_bytes > 0  # read through the shared memory: the path under attack is live
        await client.release(found.lease_id)
    finally:
        await client.close()
    pids = ",".join(str(store.proc.pid) for store in pool.stores)
    names = ",".join(store.ready["segment_id"] for store in pool.stores)
    done = subprocess.run(["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups",
                           sys.executable, "-c", ATTACK, SECRET.decode(), pids, names],
                          capture_output=True, text=True, timeout=120, cwd="/")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["sockets_tried"] > 0
    assert result["fds_received"] == 0
    assert result["opened"] == []
    assert result["secret_seen"] is False
