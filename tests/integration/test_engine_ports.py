"""A process's transfer engine listens in the port window it reserved, and a replaced peer comes back under a new
name, which an engine that met its predecessor reaches (kvpool.engine_ports)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvpool.transfer import HostBuffer, TransferEngine

pytestmark = pytest.mark.cluster

ROOT = Path(__file__).resolve().parents[2]

# a peer: an engine and a registered buffer; says where, then, told a byte, checks the buffer holds only it
PEER = """
import json, sys
from kvpool import engine_ports
from kvpool.transfer import HostBuffer, TransferEngine
engine, buffer = TransferEngine(), HostBuffer(1 << 16)
engine.register(buffer.address, buffer.size)
print(json.dumps({"endpoint": engine.endpoint, "window": engine_ports.window(), "address": buffer.address}), flush=True)
byte = int(sys.stdin.readline())
print(json.dumps({"landed": bytes(buffer.view()) == bytes([byte]) * buffer.size}), flush=True)
"""

RESERVER = """
import json, sys
from kvpool.engine_ports import reserve
print(json.dumps([reserve(sys.argv[1]) for _ in range(40)]))
"""


def start_peer() -> tuple[subprocess.Popen[str], dict]:
    peer = subprocess.Popen([sys.executable, "-c", PEER], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    assert peer.stdout is not None
    return peer, json.loads(peer.stdout.readline())


def end_peer(peer: subprocess.Popen[str], byte: int) -> bool:
    out, _ = peer.communicate(f"{byte}\n", timeout=60)
    return bool(json.loads(out)["landed"])


def test_a_replaced_peer_listens_in_a_new_window_and_is_reached_there() -> None:
    client, source = TransferEngine(), HostBuffer(1 << 16)
    client.register(source.address, source.size)
    try:
        seen = []
        for byte in (0x11, 0x22, 0x33):  # each peer replaces the one before
            peer, where = start_peer()
            low, high = where["window"]
            host, port = where["endpoint"].rsplit(":", 1)
            assert low <= int(port) <= high  # the engine took its window's port, not one of its own choosing
            assert all(not (w_low <= int(port) <= w_high) for w_low, w_high in (s["window"] for s in seen))
            source.view()[:] = bytes([byte]) * source.size
            client.write_sync(where["endpoint"], [source.address], [where["address"]], [source.size])
            assert end_peer(peer, byte)
            seen.append(where)
        assert len({s["endpoint"] for s in seen}) == 3
    finally:
        client.unregister(source.address)


def test_processes_reserving_at_once_get_distinct_windows(tmp_path: Path) -> None:
    folder = tmp_path / "run"
    reservers = [subprocess.Popen([sys.executable, "-c", RESERVER, str(folder)], cwd=ROOT, stdout=subprocess.PIPE,
                                  text=True) for _ in range(3)]
    windows = [tuple(w) for r in reservers for w in json.loads(r.communicate(timeout=60)[0])]
    assert len(windows) == 120 and len(set(windows)) == 120  # 625 windows: none handed out twice
