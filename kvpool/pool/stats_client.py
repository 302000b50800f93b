"""``kvpool pool stats``' one call: the master's ``Stats`` answer, as the plain dict ``format_stats`` reads."""

from __future__ import annotations

from typing import Any

import grpc
from google.protobuf.json_format import MessageToDict

from kvpool import service
from kvpool.ha.master_link import MasterLink, etcd_of
from kvpool.rpc import pool_pb2, pool_pb2_grpc


async def fetch_stats(master: str, timeout_s: float = 5.0) -> dict[str, Any]:
    """``master``: an address, or etcd://HOST:PORT for the leader announced there."""
    if etcd_of(master) is not None:
        link = MasterLink(master, service.channel)
        try:
            if not await link.connect(timeout_s):
                raise SystemExit(f"kvpool pool stats: no master leader announced in etcd at {link.etcd}")
            master = link.address
        finally:
            await link.close()
    async with service.channel(master) as channel:
        try:
            response = await pool_pb2_grpc.PoolMasterStub(channel).Stats(pool_pb2.StatsRequest(), timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise SystemExit(f"kvpool pool stats: master {master}: {exc.code().name}: {exc.details()}") from None
    return MessageToDict(response, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
