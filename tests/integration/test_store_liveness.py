"""A store keeps heart-beating and re-mounting whatever the master answers, and always shuts down cleanly.

The master here is the real servicer over a real index, served in this test's
event loop, with one fault injected: some calls answer a status the store
does not expect. The store is a real ``kvpool store`` process.
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest

from kvpool import service
from kvpool.core.pool.index import PoolIndex
from kvpool.core.pool.settings import IndexSettings
from kvpool.tools.cluster import ServiceProcess
from kvpool.rpc import pool_pb2_grpc
from kvpool.services.master.metrics import MasterMetrics
from kvpool.services.master.servicer import PoolMasterServicer

pytestmark = pytest.mark.cluster

FAULTY_HEARTBEATS = (grpc.StatusCode.INTERNAL, grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNKNOWN)


class FaultyMaster(PoolMasterServicer):
    """The real master, but the first heartbeats and the first re-mount answer unexpected statuses."""

    def __init__(self, index: PoolIndex) -> None:
        super().__init__(index, "incarnation-1", heartbeat_interval_s=0.1, metrics=MasterMetrics())
        self.heartbeats = 0
        self.good_heartbeats = 0
        self.mounts = 0
        self.unmounts = 0
        self.remount_refusals = 0
        self.refuse_next_mount = False
        self.events: dict[str, asyncio.Event] = {k: asyncio.Event() for k in ("beating", "remounted", "unmounted")}

    async def Heartbeat(self, request: Any, context: Any) -> Any:
        self.heartbeats += 1
        if self.heartbeats <= len(FAULTY_HEARTBEATS):
            await context.abort(FAULTY_HEARTBEATS[self.heartbeats - 1], "injected fault")
        response = await super().Heartbeat(request, context)  # NOT_FOUND when the index forgot the segment
        self.good_heartbeats += 1
        if self.good_heartbeats >= 3:
            self.events["beating"].set()
        return response

    async def MountSegment(self, request: Any, context: Any) -> Any:
        if self.refuse_next_mount:
            self.refuse_next_mount = False
            self.remount_refusals += 1
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "injected fault")
        response = await super().MountSegment(request, context)
        self.mounts += 1
        if self.mounts >= 2:
            self.events["remounted"].set()
        return response

    async def UnmountSegment(self, request: Any, context: Any) -> Any:
        response = await super().UnmountSegment(request, context)
        self.unmounts += 1
        self.events["unmounted"].set()
        return response


async def test_store_survives_unexpected_statuses_and_unmounts_on_stop(tmp_path) -> None:  # type: ignore[no-untyped-def]
    index = PoolIndex(IndexSettings(segment_ttl_s=60))
    master = FaultyMaster(index)
    handle = await service.create_server(
        "127.0.0.1", 0, lambda s: pool_pb2_grpc.add_PoolMasterServicer_to_server(master, s)
    )
    store = ServiceProcess(
        "store", ["store", "--master", f"127.0.0.1:{handle.port}", "--port", "0", "--admin-port", "0",
                  "--segment-size", "8MiB", "--heartbeat-interval-s", "0.1", "--segment-id", "seg-a"],
        tmp_path,
    )
    try:
        store.start()
        await asyncio.to_thread(store.wait_ready)
        # three unexpected statuses in a row, then the store is still beating
        await asyncio.wait_for(master.events["beating"].wait(), 30)
        assert master.heartbeats >= len(FAULTY_HEARTBEATS) + 3
        assert store.alive
        # the master forgets the segment (as after a restart) and refuses the first re-mount
        master.refuse_next_mount = True
        index.unmount_segment("seg-a")
        await asyncio.wait_for(master.events["remounted"].wait(), 30)
        assert master.remount_refusals == 1 and master.mounts == 2
        assert "seg-a" in index.segments and store.alive
        # a clean stop unmounts the segment and exits 0
        returncode = await asyncio.to_thread(store.stop)
        assert returncode == 0, store.log_tail()
        assert master.unmounts == 1 and "seg-a" not in index.segments
    finally:
        store.kill()
        await handle.server.stop(grace=None)
