"""The attacker of test_attack_netns.py, run inside a network namespace: ``python -m tests.integration.netns_attacker JSON``.

Each action prints one JSON line of what happened; the test decides what
should have. Actions: ``connect`` (TCP to each address), ``grpc_plain`` (every
gRPC port, no certificate; and UnmountSegment on the master), ``http`` (a
completion with the given key, or none), ``read`` (pool memory through a
transfer engine of our own).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import socket
import sys
import urllib.error
import urllib.request
from typing import Any


def connect(targets: list[list[Any]]) -> dict[str, Any]:
    opened = []
    for host, port in targets:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.settimeout(1.0)
            try:
                sock.connect((host, int(port)))
                opened.append(f"{host}:{port}")
            except OSError:
                pass
    return {"tried": len(targets), "opened": opened}


async def grpc_plain(ports: list[int], host: str, master_port: int, ca: str) -> dict[str, Any]:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from kvpool.rpc import pool_pb2, pool_pb2_grpc

    answered = []
    for port in ports:
        async with grpc.aio.insecure_channel(f"{host}:{port}") as channel:
            try:
                await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2)
                answered.append(port)
            except grpc.aio.AioRpcError:
                pass
    codes = []
    with open(ca, "rb") as fh:
        no_client_cert = grpc.ssl_channel_credentials(root_certificates=fh.read())
    for channel in (grpc.aio.insecure_channel(f"{host}:{master_port}"),
                    grpc.aio.secure_channel(f"{host}:{master_port}", no_client_cert)):
        async with channel:
            try:
                await pool_pb2_grpc.PoolMasterStub(channel).UnmountSegment(
                    pool_pb2.UnmountSegmentRequest(segment_id="up-store0"), timeout=3)
                codes.append("OK")
            except grpc.aio.AioRpcError as exc:
                codes.append(exc.code().name)
    return {"tried": len(ports), "answered": answered, "unmount": codes}


def http(url: str, key: str, body: dict[str, Any]) -> dict[str, Any]:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            answer = json.loads(response.read())
            return {"status": response.status, "cached_tokens":
                    answer["usage"]["prompt_tokens_details"]["cached_tokens"]}
    except urllib.error.HTTPError as exc:
        return {"status": exc.code}


def read(local_host: str, endpoint: str, address: int, size: int) -> dict[str, Any]:
    from kvpool.transfer import HostBuffer, TransferEngine, TransferError

    engine = TransferEngine(local_host)
    buffer = HostBuffer(size)
    engine.register(buffer.address, size)
    try:
        engine.read_sync(endpoint, [buffer.address], [address], [size])
    except TransferError as exc:
        return {"read": False, "error": str(exc)}
    data = bytes(buffer.view())
    return {"read": True, "sha256": hashlib.sha256(data).hexdigest(), "nonzero": sum(1 for b in data if b)}


def main() -> None:
    action = json.loads(sys.argv[1])
    kind = action.pop("action")
    if kind == "connect":
        result = connect(action["targets"])
    elif kind == "grpc_plain":
        result = asyncio.run(grpc_plain(action["ports"], action["host"], action["master_port"], action["ca"]))
    elif kind == "http":
        result = http(action["url"], action["key"], action["body"])
    else:
        result = read(action["local_host"], action["endpoint"], action["address"], action["size"])
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
