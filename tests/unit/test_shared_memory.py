"""Shared memory between processes of one user: real memfds, real Unix sockets, real other processes.

The owner runs in a child process (``OWNER``) where a test needs it to die or restart; a peer of another uid runs
under ``setpriv`` as uid 65534 with a client written on the standard library alone (``RAW_CLIENT``), so what is
tested is the owner's own check, not our client's manners. Those tests start processes, so they are marked
``cluster``.
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import fcntl
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from kvpool.secret_files import UnsafeFolder
from kvpool.shared_memory import (
    MappedSegment,
    SegmentMaps,
    SegmentShare,
    SharedMemoryUnavailable,
    SharedSegment,
    StaleSegment,
    copy,
)

ROOT = Path(__file__).resolve().parents[2]
SIZE = 1 << 20
NOBODY = 65534
SETPRIV = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]

# owns segment "kv" filled with ``fill``, shared at <folder>/<name>.sock; prints its token, then answers
# "read <offset> <length>" on stdin with the bytes' hex
OWNER = """
import asyncio, sys
from pathlib import Path
import structlog
structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
from kvpool.shared_memory import SegmentShare, SharedSegment

async def main(folder, name, size, fill):
    segment = SharedSegment(size, "kv")
    segment.view()[:] = bytes([fill]) * size
    share = SegmentShare(Path(folder), name)
    share.add("kv", segment)
    await share.start()
    print(segment.token, flush=True)
    loop = asyncio.get_running_loop()
    while line := await loop.run_in_executor(None, sys.stdin.readline):
        _, offset, length = line.split()
        print(bytes(segment.view(int(offset), int(length))).hex(), flush=True)

asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])))
"""

# asks <socket> for <segment> with the protocol itself and prints what came back: an error, or the answer and
# how many fds it carried
RAW_CLIENT = """
import socket, sys
conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
try:
    conn.connect(sys.argv[1])
except OSError as exc:
    print("connect", exc.errno, flush=True)
    sys.exit(0)
conn.sendall(f"{sys.argv[3] if len(sys.argv) > 3 else 'MAP'} {sys.argv[2]}\\n".encode())
data, fds, _, _ = socket.recv_fds(conn, 4096, 4)
print("answer", len(fds), data.decode().strip(), flush=True)
"""

# listens at <socket> as whatever uid it runs as and hands out a sealed memfd with token "t" to anyone
FAKE_OWNER = """
import fcntl, json, os, socket, sys
listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
listener.bind(sys.argv[1])
listener.listen(4)
print("ready", flush=True)
fd = os.memfd_create("fake", os.MFD_ALLOW_SEALING)
os.ftruncate(fd, 4096)
fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
while True:
    conn, _ = listener.accept()
    socket.send_fds(conn, [json.dumps({"size": 4096, "token": "t"}).encode() + b"\\n"], [fd])
"""


def start_owner(folder: Path, name: str, fill: int) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-c", OWNER, str(folder), name, str(SIZE), str(fill)], cwd=ROOT,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    token = proc.stdout.readline().strip()
    assert len(token) == 32, f"owner did not start (exit {proc.poll()})"
    return proc, token


def owner_bytes(proc: subprocess.Popen, offset: int, length: int) -> bytes:
    proc.stdin.write(f"read {offset} {length}\n")
    proc.stdin.flush()
    return bytes.fromhex(proc.stdout.readline().strip())


def stop(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.wait()


async def eventually(condition, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


async def run_as_nobody(script: str, *args: str) -> str:
    proc = await asyncio.create_subprocess_exec(*SETPRIV, sys.executable, "-c", script, *args,
                                                stdout=subprocess.PIPE)
    out, _ = await asyncio.wait_for(proc.communicate(), 10)
    return out.decode().strip()


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    return tmp_path / "shm"


@pytest.mark.cluster
async def test_peer_in_another_process_reads_and_writes_the_owners_bytes(folder):
    proc, token = start_owner(folder, "store", fill=7)
    maps = SegmentMaps()
    try:
        mapped = await maps.map(str(folder / "store.sock"), "kv", token)
        assert (mapped.size, mapped.token, maps.mapped_bytes) == (SIZE, token, SIZE)
        assert await maps.map(str(folder / "store.sock"), "kv", token) is mapped  # cached
        with mapped.using():
            assert bytes(mapped.view()) == bytes([7]) * SIZE
            mapped.view(100, 5)[:] = b"hello"
            source = ctypes.create_string_buffer(b"by copy", 7)
            copy(mapped.address + 4000, ctypes.addressof(source), 7)
        assert owner_bytes(proc, 100, 5) == b"hello"
        assert owner_bytes(proc, 4000, 7) == b"by copy"
        assert owner_bytes(proc, 4007, 2) == bytes([7, 7])
    finally:
        await maps.close()
        stop(proc)
    assert maps.mapped_bytes == 0


@pytest.mark.cluster
async def test_received_fd_is_sealed_against_resizing(folder):
    proc, _ = start_owner(folder, "store", fill=0)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.connect(str(folder / "store.sock"))
            conn.sendall(b"MAP kv\n")
            data, fds, _, _ = socket.recv_fds(conn, 4096, 1)
        assert json.loads(data)["size"] == SIZE and len(fds) == 1
        for bad in (lambda: os.ftruncate(fds[0], 0), lambda: os.ftruncate(fds[0], 2 * SIZE),
                    lambda: fcntl.fcntl(fds[0], fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE)):
            with pytest.raises(PermissionError) as raised:
                bad()
            assert raised.value.errno == errno.EPERM
        assert os.fstat(fds[0]).st_size == SIZE
        os.close(fds[0])
    finally:
        stop(proc)


@pytest.mark.cluster
async def test_other_uid_cannot_reach_the_socket_in_a_private_folder(folder):
    share = SegmentShare(folder, "store")
    share.add("kv", SharedSegment(SIZE, "kv"))
    path = await share.start()
    try:
        assert await run_as_nobody(RAW_CLIENT, str(path), "kv") == f"connect {errno.EACCES}"
    finally:
        await share.close()
    assert not path.exists()


@pytest.fixture
def reachable_base() -> Iterator[Path]:
    """A folder under /tmp that uid 65534 can reach (pytest's own tmp folders are root's, 0700)."""
    base = Path(tempfile.mkdtemp(prefix="kvpool-shm-"))
    try:
        yield base
    finally:
        shutil.rmtree(base)


@pytest.mark.cluster
@pytest.mark.parametrize("verb", ["MAP", "BELL"])
async def test_owner_refuses_a_peer_of_another_uid_by_its_credentials(reachable_base, verb):
    folder = reachable_base / "shm"
    segment = SharedSegment(SIZE, "kv")
    share = SegmentShare(folder, "store")
    bell = os.eventfd(0, os.EFD_CLOEXEC)
    share.add("kv", segment, bell)  # a doorbell too: another user gets neither the memory nor the bell
    path = await share.start()
    # open the file-system guard for this test only, so the credential check is the one left to refuse
    for opened, mode in ((reachable_base, 0o711), (folder, 0o711), (path, 0o666)):
        os.chmod(opened, mode)
    try:
        with capture_logs() as logs:
            out = await run_as_nobody(RAW_CLIENT, str(path), "kv", verb)
        count, answer = out.removeprefix("answer ").split(" ", 1)
        assert count == "0" and f"peer uid {NOBODY}" in json.loads(answer)["error"]
        assert [(e["event"], e["peer_uid"]) for e in logs] == [("shared_memory_refused", NOBODY)]
        # the same request from this uid is answered with the fd
        maps = SegmentMaps()
        mapped = await maps.map(str(path), "kv", segment.token, doorbell=True)
        assert mapped.size == SIZE and mapped.doorbell >= 0
        await maps.close()
    finally:
        os.chmod(folder, 0o700)
        await share.close()
        segment.close()
        os.close(bell)


@pytest.mark.cluster
async def test_peer_refuses_an_owner_of_another_uid(reachable_base):
    os.chown(reachable_base, NOBODY, NOBODY)
    path = reachable_base / "fake.sock"
    proc = await asyncio.create_subprocess_exec(*SETPRIV, sys.executable, "-c", FAKE_OWNER, str(path),
                                                stdout=subprocess.PIPE)
    maps = SegmentMaps()
    try:
        assert await asyncio.wait_for(proc.stdout.readline(), 10) == b"ready\n"
        with pytest.raises(SharedMemoryUnavailable, match=f"served by uid {NOBODY}"):
            await maps.map(str(path), "kv", "t")
        assert maps.mapped_bytes == 0
    finally:
        proc.kill()
        await proc.wait()


def test_folder_that_is_not_private_is_refused(tmp_path):
    open_folder = tmp_path / "open"
    open_folder.mkdir(mode=0o755)
    os.chmod(open_folder, 0o755)
    with pytest.raises(UnsafeFolder, match="mode 0755"):
        SegmentShare(open_folder, "store")
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, NOBODY, NOBODY)
    with pytest.raises(UnsafeFolder, match=f"owned by uid {NOBODY}"):
        SegmentShare(theirs, "store")
    (tmp_path / "link").symlink_to(theirs)
    with pytest.raises(UnsafeFolder, match="symlink"):
        SegmentShare(tmp_path / "link", "store")


async def test_unavailable_says_why(folder):
    maps = SegmentMaps()
    with pytest.raises(SharedMemoryUnavailable, match="cannot connect"):
        await maps.map(str(folder / "none.sock"), "kv", "t")
    segment = SharedSegment(SIZE, "kv")
    share = SegmentShare(folder, "store")
    share.add("kv", segment)
    path = await share.start()
    try:
        with pytest.raises(SharedMemoryUnavailable, match="no segment 'other' here"):
            await maps.map(str(path), "other", segment.token)
        with pytest.raises(StaleSegment, match="restarted"):
            await maps.map(str(path), "kv", "0" * 32)
        mapped = await maps.map(str(path), "kv", segment.token)
        share.remove("kv")  # the owner drops the segment: the peer forgets it
        await eventually(lambda: mapped.unmapped)
        assert maps.mapped_bytes == 0
    finally:
        await maps.close()
        await share.close()
        segment.close()


@pytest.mark.cluster
async def test_owner_killed_while_mapped_gives_no_crash_and_the_mapping_goes_once_unpinned(folder):
    proc, token = start_owner(folder, "store", fill=9)
    maps = SegmentMaps()
    try:
        mapped = await maps.map(str(folder / "store.sock"), "kv", token)
        with mapped.using():
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            await eventually(lambda: mapped.forgotten)  # EOF on the owner's connection
            assert bytes(mapped.view(0, SIZE)) == bytes([9]) * SIZE  # still mapped under the pin
            assert maps.mapped_bytes == SIZE and not mapped.unmapped
            with pytest.raises(StaleSegment):  # no new copy starts on a dead owner's memory
                with mapped.using():
                    pass
        assert mapped.unmapped and maps.mapped_bytes == 0
        with pytest.raises(SharedMemoryUnavailable):  # the socket file is left, but no one listens
            await maps.map(str(folder / "store.sock"), "kv", token)
    finally:
        await maps.close()
        stop(proc)


@pytest.mark.cluster
async def test_owner_restarted_new_token_maps_new_memory_and_releases_the_old(folder):
    old, old_token = start_owner(folder, "store", fill=1)
    maps = SegmentMaps()
    try:
        first = await maps.map(str(folder / "store.sock"), "kv", old_token)
        old.send_signal(signal.SIGSTOP)  # alive but frozen: its connection gives no EOF, only the token tells
        new, new_token = start_owner(folder, "store", fill=2)
        try:
            assert new_token != old_token
            second = await maps.map(str(folder / "store.sock"), "kv", new_token)
            assert second is not first and first.forgotten and first.unmapped
            assert maps.mapped_bytes == SIZE
            with second.using():
                assert bytes(second.view(0, 16)) == bytes([2]) * 16
            with pytest.raises(StaleSegment):  # the old incarnation is gone; the new mapping stays
                await maps.map(str(folder / "store.sock"), "kv", old_token)
            assert await maps.map(str(folder / "store.sock"), "kv", new_token) is second
        finally:
            stop(new)
    finally:
        await maps.close()
        stop(old)
    assert maps.mapped_bytes == 0


def test_dead_sockets_of_killed_owners_are_swept_and_live_or_young_ones_kept(tmp_path: Path) -> None:
    from kvpool.shared_memory import sweep_dead_sockets

    folder = tmp_path / "run"
    folder.mkdir(mode=0o700)

    def bound(name: str, listening: bool) -> socket.socket:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(str(folder / name))
        if listening:
            s.listen(1)
        return s

    dead, young, live = bound("dead.sock", False), bound("young.sock", False), bound("live.sock", True)
    dead.close()  # its owner is gone; the file stays, as after a SIGKILL
    young.close()
    old = time.time() - 3600
    for name in ("dead.sock", "live.sock"):
        os.utime(folder / name, (old, old))
    (folder / "notes.txt").write_text("not a socket")
    try:
        assert sweep_dead_sockets(folder, older_than_s=60) == [folder / "dead.sock"]
        assert sorted(p.name for p in folder.iterdir()) == ["live.sock", "notes.txt", "young.sock"]
    finally:
        live.close()


async def test_a_peer_rings_the_owners_doorbell_and_an_owner_without_one_says_so(folder):
    bell = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
    share = SegmentShare(folder, "decode")
    arena, plain = SharedSegment(SIZE, "arena"), SharedSegment(SIZE, "plain")
    share.add("arena", arena, bell)
    share.add("plain", plain)
    path = await share.start()
    maps = SegmentMaps()
    try:
        # two writers at once on first use (a stage's ranges): each can ring as soon as it has the mapping
        async def writer() -> tuple[MappedSegment, bool]:
            got = await maps.map(str(path), "arena", arena.token, doorbell=True)
            with got.using():
                return got, got.ring()

        (mapped, rang), (twin, twin_rang) = await asyncio.gather(writer(), writer())
        assert twin is mapped and rang and twin_rang
        assert os.eventfd_read(bell) == 2
        assert await maps.map(str(path), "arena", arena.token, doorbell=True) is mapped  # asked once
        with mapped.using():
            assert mapped.ring() and mapped.ring()
        assert os.eventfd_read(bell) == 2  # the owner reads both rings at once
        unrung = await maps.map(str(path), "plain", plain.token, doorbell=True)  # refused: none offered
        with unrung.using():
            assert unrung.doorbell == -1 and not unrung.ring()

        def ask_for_nothing() -> dict:  # on a thread: this loop is the owner's too
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
                conn.settimeout(5)
                conn.connect(str(path))
                conn.sendall(b"BELL nothing\n")
                return json.loads(conn.recv(4096))

        assert "no segment 'nothing'" in (await asyncio.to_thread(ask_for_nothing))["error"]
    finally:
        await maps.close()
        await share.close()
        os.close(bell)
    assert mapped.doorbell == -1  # its fd closed with the mapping
