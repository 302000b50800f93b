"""Bytes that parse as no request message, sent to every method of a server: each call must end INVALID_ARGUMENT
naming the method's request message and the field ``request`` (never UNKNOWN or INTERNAL)."""

from __future__ import annotations

import grpc
from google.protobuf import descriptor_pool
from google.protobuf.descriptor import FieldDescriptor, MethodDescriptor

from grpc_health.v1 import health_pb2  # noqa: F401  (loads the descriptors the pool is asked for)

from kvpool.rpc import decode_pb2, handoff_pb2, pool_pb2, prefill_pb2, router_pb2  # noqa: F401
from kvpool.status import FIELD_KEY

HEALTH = "grpc.health.v1.Health"
TRUNCATED = b"\xff"  # a tag whose varint never ends


def unparsable(method: MethodDescriptor) -> list[bytes]:
    """A truncated tag, and where the request has a string field, that field holding invalid UTF-8."""
    strings = [f for f in method.input_type.fields if f.type == FieldDescriptor.TYPE_STRING]
    bad_utf8 = [bytes([strings[0].number << 3 | 2, 2]) + b"\xed\xa0"] if strings and strings[0].number < 16 else []
    return [TRUNCATED, *bad_utf8]


def assert_unparsable_bytes_refused(address: str, service_names: list[str]) -> int:
    """Every method of every named service at ``address`` gets each of ``unparsable``; returns the methods tried."""
    methods = 0
    with grpc.insecure_channel(address) as channel:
        for service_name in service_names:
            for method in descriptor_pool.Default().FindServiceByName(service_name).methods:
                path = f"/{service_name}/{method.name}"
                for raw in unparsable(method):
                    try:
                        if method.client_streaming:
                            channel.stream_unary(path)(iter([raw]), timeout=30)
                        elif method.server_streaming:
                            list(channel.unary_stream(path)(raw, timeout=30))
                        else:
                            channel.unary_unary(path)(raw, timeout=30)
                    except grpc.RpcError as exc:
                        assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT, (path, raw, exc.code(), exc.details())
                        assert exc.details().startswith(f"request: not a {method.input_type.full_name} ("), (
                            path, exc.details())
                        assert dict(exc.trailing_metadata() or ()).get(FIELD_KEY) == "request", path
                    else:
                        raise AssertionError(f"{path} answered {raw!r} without an error")
                methods += 1
    return methods
