"""The few etcd v3 calls kvpool needs, over its own grpcio channel.

etcd's gRPC API (``etcdserverpb``) straight, with the generated messages the
``aetcd`` package ships: our channel carries our mutual TLS (``kvpool.tls``)
when the process is configured, which aetcd's own client cannot. Every call
has a deadline; a failure raises ``grpc.aio.AioRpcError`` as it comes and the
caller (the candidate, the leader watch) decides what it means.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc
from aetcd.rpc import rpc_pb2, rpc_pb2_grpc

from kvpool import tls

CALL_TIMEOUT_S = 2.0
# etcd answers in milliseconds; a reconnect must not wait gRPC's default backoff (up to 120 s)
ETCD_CHANNEL_OPTIONS = [("grpc.max_reconnect_backoff_ms", 250), ("grpc.initial_reconnect_backoff_ms", 50),
                        ("grpc.keepalive_time_ms", 10_000)]


def check_endpoint(endpoint: str, field_name: str = "etcd") -> str:
    """``host:port`` (an ``http://`` or ``https://`` prefix, as etcd prints its URLs, is dropped)."""
    bare = endpoint.removeprefix("http://").removeprefix("https://").rstrip("/")
    host, _, port = bare.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) <= 65535:
        raise ValueError(f"{field_name}: {endpoint!r} is not host:port")
    return bare


def prefix_end(prefix: bytes) -> bytes:
    """The end of the key range holding every key that starts with ``prefix``."""
    end = bytearray(prefix)
    while end:
        if end[-1] < 0xFF:
            end[-1] += 1
            return bytes(end)
        end.pop()
    return b"\0"


@dataclass(slots=True, frozen=True)
class KeyValue:
    key: bytes
    value: bytes
    create_revision: int
    mod_revision: int
    lease: int


@dataclass(slots=True, frozen=True)
class Change:
    """One watched event: ``value`` None for a delete (or a lease that expired)."""

    key: bytes
    value: bytes | None
    create_revision: int
    revision: int


def _kv(message: Any) -> KeyValue:
    return KeyValue(message.key, message.value, message.create_revision, message.mod_revision, message.lease)


class EtcdClient:
    """One channel to one etcd endpoint (``host:port``)."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = check_endpoint(endpoint)
        creds = tls.channel_credentials()
        self.channel = (grpc.aio.insecure_channel(self.endpoint, options=ETCD_CHANNEL_OPTIONS) if creds is None
                        else grpc.aio.secure_channel(self.endpoint, creds, options=ETCD_CHANNEL_OPTIONS))
        self.kv = rpc_pb2_grpc.KVStub(self.channel)
        self.leases = rpc_pb2_grpc.LeaseStub(self.channel)
        self.watches = rpc_pb2_grpc.WatchStub(self.channel)

    async def close(self) -> None:
        await self.channel.close()

    async def grant(self, ttl_s: int) -> tuple[int, int]:
        """A new lease: (its id, the TTL etcd granted)."""
        response = await self.leases.LeaseGrant(rpc_pb2.LeaseGrantRequest(TTL=ttl_s), timeout=CALL_TIMEOUT_S)
        if response.error:
            raise RuntimeError(f"etcd refused a lease: {response.error}")
        return response.ID, response.TTL

    async def revoke(self, lease_id: int) -> None:
        await self.leases.LeaseRevoke(rpc_pb2.LeaseRevokeRequest(ID=lease_id), timeout=CALL_TIMEOUT_S)

    async def create(self, key: bytes, value: bytes, lease_id: int) -> tuple[bool, KeyValue | None]:
        """Put ``key`` under the lease only if it does not exist: (created, the key as it now stands)."""
        compare = rpc_pb2.Compare(key=key, target=rpc_pb2.Compare.CREATE, result=rpc_pb2.Compare.EQUAL,
                                  create_revision=0)
        request = rpc_pb2.TxnRequest(
            compare=[compare],
            success=[rpc_pb2.RequestOp(request_put=rpc_pb2.PutRequest(key=key, value=value, lease=lease_id)),
                     rpc_pb2.RequestOp(request_range=rpc_pb2.RangeRequest(key=key))],
            failure=[rpc_pb2.RequestOp(request_range=rpc_pb2.RangeRequest(key=key))],
        )
        response = await self.kv.Txn(request, timeout=CALL_TIMEOUT_S)
        kvs = response.responses[-1].response_range.kvs
        return response.succeeded, (_kv(kvs[0]) if kvs else None)

    async def put(self, key: bytes, value: bytes, lease_id: int = 0) -> int:
        response = await self.kv.Put(rpc_pb2.PutRequest(key=key, value=value, lease=lease_id),
                                     timeout=CALL_TIMEOUT_S)
        return response.header.revision

    async def delete(self, key: bytes, only_lease: int = 0) -> bool:
        """Delete ``key`` (only if it is still held by ``only_lease``, when given)."""
        if not only_lease:
            response = await self.kv.DeleteRange(rpc_pb2.DeleteRangeRequest(key=key), timeout=CALL_TIMEOUT_S)
            return response.deleted > 0
        compare = rpc_pb2.Compare(key=key, target=rpc_pb2.Compare.LEASE, result=rpc_pb2.Compare.EQUAL,
                                  lease=only_lease)
        txn = rpc_pb2.TxnRequest(compare=[compare],
                                 success=[rpc_pb2.RequestOp(request_delete_range=rpc_pb2.DeleteRangeRequest(key=key))])
        return (await self.kv.Txn(txn, timeout=CALL_TIMEOUT_S)).succeeded

    async def get(self, key: bytes) -> tuple[KeyValue | None, int]:
        """The key (None: absent) and the store's revision when read."""
        response = await self.kv.Range(rpc_pb2.RangeRequest(key=key), timeout=CALL_TIMEOUT_S)
        return (_kv(response.kvs[0]) if response.kvs else None), response.header.revision

    async def get_prefix(self, prefix: bytes) -> tuple[list[KeyValue], int]:
        response = await self.kv.Range(rpc_pb2.RangeRequest(key=prefix, range_end=prefix_end(prefix)),
                                       timeout=CALL_TIMEOUT_S)
        return [_kv(kv) for kv in response.kvs], response.header.revision

    async def watch(self, key: bytes, start_revision: int, prefix: bool = False) -> AsyncIterator[Change]:
        """Every change of ``key`` (or of every key under it: ``prefix``) from ``start_revision`` on, until the
        stream breaks (the error raises) or the caller stops iterating."""
        create = rpc_pb2.WatchCreateRequest(key=key, start_revision=start_revision,
                                            range_end=prefix_end(key) if prefix else b"")
        call = self.watches.Watch()  # written to, not fed by a generator: cancelling it leaves nothing behind
        try:
            await call.write(rpc_pb2.WatchRequest(create_request=create))
            while True:
                response = await call.read()
                if response is grpc.aio.EOF:
                    raise RuntimeError(f"etcd ended the watch of {key!r}")
                if response.canceled:
                    raise RuntimeError(f"etcd cancelled the watch of {key!r}: {response.cancel_reason or 'compacted'}")
                for event in response.events:
                    deleted = event.type == event.DELETE
                    yield Change(event.kv.key, None if deleted else event.kv.value,
                                 event.kv.create_revision, event.kv.mod_revision)
        finally:
            call.cancel()


class KeepAlive:
    """A lease's keep-alive stream: ``send`` one request now; ``answers`` yields (the send time of the request
    answered, the TTL left) in order. etcd answers a stream's requests in order, so the send times match FIFO."""

    def __init__(self, client: EtcdClient, lease_id: int) -> None:
        self.lease_id = lease_id
        self._sent: deque[float] = deque()
        self._call = client.leases.LeaseKeepAlive()
        self.last_sent = self.last_answered = 0.0  # when (time.monotonic()), for the logs: 0 never

    @property
    def unanswered(self) -> int:
        return len(self._sent)

    async def send(self) -> None:
        """One keep-alive, written now (one writer at a time: the caller's loop)."""
        self.last_sent = time.monotonic()
        self._sent.append(self.last_sent)
        await self._call.write(rpc_pb2.LeaseKeepAliveRequest(ID=self.lease_id))

    async def answers(self) -> AsyncIterator[tuple[float, int]]:
        while True:
            response = await self._call.read()
            if response is grpc.aio.EOF:
                return
            self.last_answered = time.monotonic()
            sent = self._sent.popleft() if self._sent else self.last_answered
            yield sent, response.TTL

    def cancel(self) -> None:
        self._call.cancel()
