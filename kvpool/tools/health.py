"""``kvpool health ADDRESS``: is a service serving? For container and unit health checks.

A ``host:port`` address asks the standard gRPC health service (the whole
server, service name ""); an ``http://`` URL asks for a 200, as the router's
``/health`` answers only while every service behind it is healthy. The exit
status is the answer: 0 serving, 1 not serving or unreachable (one line on
stderr says which), so ``healthcheck:`` and ``ExecStartPost=`` can use it as is.
"""

from __future__ import annotations

import sys
import urllib.error
import urllib.request

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvpool import tls


def grpc_serving(address: str, timeout_s: float) -> str:
    """"" when the server at ``address`` reports SERVING, else why not."""
    creds = tls.channel_credentials()  # KVPOOL_TLS_*: a secure cluster's
    with (grpc.secure_channel(address, creds) if creds else grpc.insecure_channel(address)) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
        except grpc.RpcError as exc:
            return f"{exc.code().name}: {exc.details()}"  # type: ignore[attr-defined]
    if reply.status != health_pb2.HealthCheckResponse.SERVING:
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return ""


def http_healthy(url: str, timeout_s: float) -> str:
    """"" when ``url`` answers 200, else why not."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:  # noqa: S310 (the caller's own URL)
            return "" if response.status == 200 else f"HTTP {response.status}"
    except urllib.error.HTTPError as exc:
        return f"HTTP {exc.code}"
    except (urllib.error.URLError, OSError) as exc:
        return str(getattr(exc, "reason", exc))


def check(address: str, timeout_s: float) -> int:
    http = address.startswith(("http://", "https://"))
    problem = http_healthy(address, timeout_s) if http else grpc_serving(address, timeout_s)
    if problem:
        print(f"kvpool health: {address}: {problem}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m kvpool.tools.health ADDRESS``: the same check without the CLI's imports (cheaper per probe)."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m kvpool.tools.health ADDRESS|URL", file=sys.stderr)
        return 2
    return check(args[0], 3.0)


if __name__ == "__main__":
    sys.exit(main())
