"""Mutual TLS for the control plane: one process identity, used by every server and channel.

A process is configured once (``configure``, from the ``[security]`` table,
its flags, or ``KVPOOL_TLS_CA``/``KVPOOL_TLS_CERT``/``KVPOOL_TLS_KEY``). Then
``add_port`` serves TLS that requires a client certificate of the same CA,
``channel_credentials`` dials with this process's certificate (``kvpool.service.channel``), and ``RoleCheck`` holds
every call to ``kvpool.core.tenancy.access``: the caller's certificate names its role.
Unconfigured, servers and channels are plaintext, as before.
"""

from __future__ import annotations

import inspect
import ipaddress
import os
import socket
import ssl
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import structlog

from kvpool.core.tenancy.access import Peer, authorize, is_open
from kvpool.core.errors import PermissionDenied
from kvpool.core.setting import setting

log = structlog.get_logger(__name__)

ENV = {"ca": "KVPOOL_TLS_CA", "cert": "KVPOOL_TLS_CERT", "key": "KVPOOL_TLS_KEY"}


@dataclass(slots=True)
class SecuritySettings:
    """The ``[security]`` table: this process's certificate and the cluster's CA."""

    ca: str = setting("", help="the cluster CA's certificate (PEM); with cert and key: mutual TLS everywhere",
                      metavar="FILE", default_text="$KVPOOL_TLS_CA, else none", flag=False)
    cert: str = setting("", help="this process's certificate (PEM), its common name its role", metavar="FILE",
                        default_text="$KVPOOL_TLS_CERT, else none", flag=False)
    key: str = setting("", help="this process's private key (PEM)", metavar="FILE",
                       default_text="$KVPOOL_TLS_KEY, else none", flag=False)
    insecure: bool = setting(False, help="allow plaintext gRPC on a non-loopback address", flag=False)

    def __post_init__(self) -> None:
        for name, env in ENV.items():
            if not getattr(self, name):
                setattr(self, name, os.environ.get(env, ""))
        given = [n for n in ENV if getattr(self, n)]
        if given and len(given) != 3:
            missing = sorted(set(ENV) - set(given))
            raise ValueError(f"security: {', '.join(missing)} missing (mutual TLS needs ca, cert and key)")

    @property
    def enabled(self) -> bool:
        return bool(self.ca)


@dataclass(frozen=True, slots=True)
class Credentials:
    ca: bytes
    cert: bytes
    key: bytes
    cert_path: str = ""  # where cert and key were read (an ssl.SSLContext loads its chain from files)
    key_path: str = ""


_configured: Credentials | None = None


def configure(settings: SecuritySettings) -> None:
    """This process's identity for every later server and channel."""
    global _configured
    if not settings.enabled:
        _configured = None
        return
    for name in ENV:
        if not Path(getattr(settings, name)).is_file():
            raise ValueError(f"security.{name}: {getattr(settings, name)} is not a file")
    _configured = Credentials(Path(settings.ca).read_bytes(), Path(settings.cert).read_bytes(),
                              Path(settings.key).read_bytes(), settings.cert, settings.key)


def credentials() -> Credentials | None:
    """The configured identity, else the one the environment names, else None (plaintext)."""
    if _configured is None and os.environ.get(ENV["ca"]):
        configure(SecuritySettings())
    return _configured


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        try:
            return all(ipaddress.ip_address(info[4][0]).is_loopback for info in socket.getaddrinfo(host, None))
        except socket.gaierror:
            return False


def refuse_plaintext_off_loopback(settings: SecuritySettings, hosts: Sequence[str], what: str) -> None:
    """A process listening beyond loopback without credentials refuses to start, unless told ``insecure``."""
    exposed = [h for h in hosts if h and not is_loopback(h)]
    if exposed and not settings.enabled and not settings.insecure:
        raise ValueError(f"{what} listens on {', '.join(exposed)} without TLS credentials: give the [security] "
                         "table (or --tls-ca/--tls-cert/--tls-key), or --insecure to run in plaintext anyway")


def add_port(server: grpc.aio.Server, address: str) -> int:
    creds = credentials()
    if creds is None:
        return server.add_insecure_port(address)
    server_creds = grpc.ssl_server_credentials([(creds.key, creds.cert)], root_certificates=creds.ca,
                                               require_client_auth=True)
    return server.add_secure_port(address, server_creds)


def channel_credentials() -> grpc.ChannelCredentials | None:
    """This process's client side of mutual TLS; None: plaintext."""
    creds = credentials()
    if creds is None:
        return None
    return grpc.ssl_channel_credentials(root_certificates=creds.ca, private_key=creds.key,
                                        certificate_chain=creds.cert)


def server_ssl_context() -> ssl.SSLContext | None:
    """The admin ports' side of mutual TLS (``kvpool.admin_http``): this process's certificate, a client
    certificate of the cluster's CA required; None: plaintext."""
    creds = credentials()
    if creds is None:
        return None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(creds.cert_path, creds.key_path)
    context.load_verify_locations(cadata=creds.ca.decode())
    context.verify_mode = ssl.CERT_REQUIRED
    return context


def client_ssl_context() -> ssl.SSLContext | None:
    """This process's client side of an admin port's mutual TLS (a scrape); None: plaintext."""
    creds = credentials()
    if creds is None:
        return None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.load_verify_locations(cadata=creds.ca.decode())
    context.load_cert_chain(creds.cert_path, creds.key_path)
    return context


def interceptors() -> list[grpc.aio.ServerInterceptor]:
    return [RoleCheck()] if credentials() is not None else []


def peer_of(context: grpc.aio.ServicerContext) -> Peer:
    names = context.auth_context().get("x509_common_name") or []
    if not names:
        raise PermissionDenied("the caller presented no certificate")
    return Peer.from_common_name(names[0].decode())


class RoleCheck(grpc.aio.ServerInterceptor):
    """Every call is held to ``kvpool.core.tenancy.access.authorize`` with the caller's certificate role."""

    async def intercept_service(self, continuation: Callable[[Any], Awaitable[Any]], details: Any) -> Any:
        handler = await continuation(details)
        method = details.method
        if handler is None or is_open(method):
            return handler

        async def check(request: Any, context: grpc.aio.ServicerContext) -> None:
            try:
                authorize(method, peer_of(context), getattr(request, "segment_id", None))
            except PermissionDenied as exc:
                log.warning("call_refused", method=method, peer=context.peer(), reason=str(exc))
                await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(exc))

        single = handler.unary_unary or handler.stream_unary  # one answer (ForwardPieces: a stream of pieces)
        if single is not None:
            streamed = handler.stream_unary is not None

            async def answered(request: Any, context: grpc.aio.ServicerContext) -> Any:
                await check(None if streamed else request, context)  # a stream: before any piece is read
                return await single(request, context)

            make = grpc.stream_unary_rpc_method_handler if streamed else grpc.unary_unary_rpc_method_handler
            return make(answered, handler.request_deserializer, handler.response_serializer)
        if handler.unary_stream is not None:
            stream = handler.unary_stream
            if inspect.isasyncgenfunction(stream):
                async def unary_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
                    await check(request, context)
                    async for item in stream(request, context):
                        yield item
            else:  # a coroutine that writes with context.write
                async def unary_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:  # type: ignore[misc]
                    await check(request, context)
                    return await stream(request, context)

            return grpc.unary_stream_rpc_method_handler(unary_stream, handler.request_deserializer,
                                                        handler.response_serializer)
        if handler.stream_stream is not None:  # the master's Session: checked once, before any message is read
            both = handler.stream_stream

            async def stream_stream(requests: Any, context: grpc.aio.ServicerContext) -> Any:
                await check(None, context)
                async for item in both(requests, context):
                    yield item

            return grpc.stream_stream_rpc_method_handler(stream_stream, handler.request_deserializer,
                                                         handler.response_serializer)
        raise TypeError(f"{method}: RoleCheck has no wrapper for this kind of method")
