"""SIGTERM drains: a stopping decode shard turns not-ready, finishes the stream it is serving, then exits."""

from __future__ import annotations

import signal
from pathlib import Path

import grpc
import pytest

from kvpool import service
from kvpool.rpc import router_pb2, router_pb2_grpc
from kvpool.tools.up import UpSettings, up_cluster

pytestmark = pytest.mark.cluster


async def test_a_stopping_decode_shard_finishes_its_stream_before_it_exits(tmp_path: Path) -> None:
    config = tmp_path / "cluster.toml"
    config.write_text("[router]\nhealth_interval_s = 0.2\n")
    settings = UpSettings(pipelines=1, stages=1, decode_shards=1, stores=0, http_port=0, grpc_port=0,
                          device_cache_tokens=4096, workdir=str(tmp_path / "logs"))
    with up_cluster(settings, str(config), log_level="info") as cluster:
        shard = cluster.find("decode0")
        router = f"127.0.0.1:{cluster.find('router').ready['port']}"
        async with grpc.aio.insecure_channel(router, options=service.GRPC_OPTIONS) as channel:
            request = router_pb2.GenerateRequest(text="a long answer please",
                                                 sampling=router_pb2.SamplingParams(max_tokens=300))
            tokens, usage = [], router_pb2.GenerateUsage()
            async for response in router_pb2_grpc.RouterStub(channel).Generate(request, timeout=120):
                if response.HasField("usage"):
                    usage = response.usage
                    continue
                tokens.append(response.token_id)
                if len(tokens) == 1:
                    assert shard.proc is not None
                    shard.proc.send_signal(signal.SIGTERM)  # mid-stream
            assert len(tokens) == usage.completion_tokens > 1
            assert usage.finish_reason in ("length", "stop")
        assert shard.proc is not None
        assert shard.proc.wait(timeout=30) == 0  # it exits by itself once drained
        text = shard.log_file.read_text()
        assert '"event": "drained"' in text and '"calls_left": 0' in text
