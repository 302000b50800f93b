"""Port 0 for a service (kvpool/ports.py): a free port below the ephemeral range, so a restart can have it again.

The defect it answers: ``kvpool up`` restarts a service on the ports it had; a port the kernel chose from the
ephemeral range could meanwhile be the local port of some outgoing connection, and the restarted service failed to
bind it on every retry (a CI run's ``test_operations``: ``Address already in use``, the supervisor timed out).
"""

from __future__ import annotations

import errno
import os
import random
import socket

import pytest
from prometheus_client import CollectorRegistry

from kvpool import ports, service
from kvpool.admin_http import start_admin
from kvpool.services.router.server import listen_http

HOST = "127.0.0.1"


def _holder() -> socket.socket:
    """A listener the kernel placed; it holds its port until closed."""
    sock = socket.socket()
    sock.bind((HOST, 0))
    sock.listen()
    return sock


def test_candidates_lie_below_the_ephemeral_range_and_are_distinct() -> None:
    got = ports.candidates(start=32768, tries=32, rng=random.Random(1))
    assert len(got) == len(set(got)) == 32
    assert all(ports.FLOOR <= p < 32768 for p in got)


def test_no_candidates_where_the_range_was_moved_down_to_the_floor() -> None:
    assert ports.candidates(start=ports.FLOOR + ports.MIN_SPAN - 1) == []
    assert len(ports.candidates(start=ports.FLOOR + ports.MIN_SPAN, tries=3)) == 3


def test_the_ephemeral_start_is_read_from_the_kernel_and_defaults_when_unreadable(tmp_path) -> None:
    f = tmp_path / "range"
    f.write_text("40000\t60999\n")
    assert ports.ephemeral_start(str(f)) == 40000
    assert ports.ephemeral_start(str(tmp_path / "missing")) == 32768
    assert ports.ephemeral_start() == int(open(ports.RANGE_FILE).read().split()[0])


def _free_port() -> int:
    """A port nothing holds now (the kernel's pick, released)."""
    with _holder() as sock:
        return int(sock.getsockname()[1])


def test_a_given_port_is_bound_as_given() -> None:
    assert ports.listen(HOST, 4321, lambda p: p) == 4321


def test_port_0_skips_taken_candidates(monkeypatch: pytest.MonkeyPatch) -> None:
    held = _holder()
    free_port = _free_port()
    try:
        monkeypatch.setattr(ports, "candidates", lambda start=None: [held.getsockname()[1], free_port])
        tried: list[int] = []
        assert ports.listen(HOST, 0, lambda p: tried.append(p) or p) == free_port
        assert tried == [free_port]  # the taken one was never handed to the bind
    finally:
        held.close()


def test_a_candidate_taken_between_probe_and_bind_moves_on_to_the_next(monkeypatch: pytest.MonkeyPatch) -> None:
    sock = socket.socket()
    p1, p2 = _free_port(), _free_port()
    monkeypatch.setattr(ports, "candidates", lambda start=None: [p1, p2])
    racer = socket.socket()

    def bind(p: int) -> int:
        if p == p1:  # another listener gets there first
            racer.bind((HOST, p1))
            racer.listen()
        sock.bind((HOST, p))
        return p

    try:
        assert ports.listen(HOST, 0, bind) == p2
        assert sock.getsockname()[1] == p2
    finally:
        racer.close()
        sock.close()


def test_a_failure_that_is_not_the_port_is_raised_not_retried(monkeypatch: pytest.MonkeyPatch) -> None:
    p1, p2 = _free_port(), _free_port()
    monkeypatch.setattr(ports, "candidates", lambda start=None: [p1, p2])
    tried: list[int] = []

    def bind(p: int) -> int:
        tried.append(p)
        raise RuntimeError("bad certificate")

    with pytest.raises(RuntimeError, match="bad certificate"):
        ports.listen(HOST, 0, bind)
    assert tried == [p1]


def test_no_candidate_falls_back_to_the_kernels_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    held = _holder()
    try:
        monkeypatch.setattr(ports, "candidates", lambda start=None: [held.getsockname()[1]])
        assert ports.listen(HOST, 0, lambda p: p) == 0
    finally:
        held.close()


def test_an_address_this_host_lacks_is_not_taken() -> None:
    with socket.socket() as s:
        with pytest.raises(OSError) as exc:
            s.bind(("192.0.2.1", 0))  # TEST-NET-1: not this host's
    assert exc.value.errno == errno.EADDRNOTAVAIL
    assert not ports.is_taken("192.0.2.1", _free_port())


def _below_ephemeral(port: int) -> bool:
    return ports.FLOOR <= port < ports.ephemeral_start()


async def test_a_grpc_server_on_port_0_listens_below_the_ephemeral_range() -> None:
    handle = await service.create_server(HOST, 0, lambda s: None)
    try:
        assert _below_ephemeral(handle.port)
    finally:
        await handle.server.stop(None)


def test_the_admin_port_and_the_routers_http_port_on_0_listen_below_the_ephemeral_range() -> None:
    admin = start_admin(HOST, 0, CollectorRegistry())
    try:
        assert _below_ephemeral(admin.server_address[1])
    finally:
        admin.shutdown()
        admin.server_close()
    http = listen_http(HOST, 0)
    try:
        assert _below_ephemeral(http.getsockname()[1])
    finally:
        http.close()


def test_a_taken_admin_port_given_explicitly_fails_and_leaks_nothing() -> None:
    before = len(os.listdir("/proc/self/fd"))
    held = _holder()
    try:
        with pytest.raises(OSError) as exc:
            start_admin(HOST, held.getsockname()[1], CollectorRegistry())
        assert exc.value.errno == errno.EADDRINUSE
    finally:
        held.close()
    assert len(os.listdir("/proc/self/fd")) == before  # the socket and the wake pipe were closed
