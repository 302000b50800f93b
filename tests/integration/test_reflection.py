"""Every service answers gRPC server reflection, so grpcurl and similar tools
work without the proto files: real processes, asked with the reflection API."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from google.protobuf import descriptor_pb2
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from kvpool import service
from kvpool.tools.cluster import LocalDecode, LocalPipeline, LocalPool, ServiceProcess
from kvpool.rpc import decode_pb2, pool_pb2, prefill_pb2, router_pb2

HEALTH = "grpc.health.v1.Health"
REFLECTION = "grpc.reflection.v1alpha.ServerReflection"
POOL_MASTER = pool_pb2.DESCRIPTOR.services_by_name["PoolMaster"]
PREFILL = prefill_pb2.DESCRIPTOR.services_by_name["Prefill"].full_name
PREFILL_STAGE = prefill_pb2.DESCRIPTOR.services_by_name["PrefillStage"].full_name
DECODE = decode_pb2.DESCRIPTOR.services_by_name["Decode"].full_name
ROUTER = router_pb2.DESCRIPTOR.services_by_name["Router"].full_name


def reflect(address: str, *requests: reflection_pb2.ServerReflectionRequest) -> list[
        reflection_pb2.ServerReflectionResponse]:
    with grpc.insecure_channel(address) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        return list(stub.ServerReflectionInfo(iter(requests), timeout=10))


def list_services(address: str) -> set[str]:
    [response] = reflect(address, reflection_pb2.ServerReflectionRequest(list_services=""))
    assert response.WhichOneof("message_response") == "list_services_response", response
    return {s.name for s in response.list_services_response.service}


@pytest.mark.cluster
def test_master_and_store_list_their_services_and_serve_descriptors(tmp_path: Path) -> None:
    with LocalPool(num_stores=1, segment_size="8MiB", workdir=tmp_path) as pool:
        assert list_services(pool.master_address) == {POOL_MASTER.full_name, HEALTH, REFLECTION}
        store = pool.stores[0].ready["port"]
        assert list_services(f"127.0.0.1:{store}") == {HEALTH, REFLECTION}

        [response] = reflect(pool.master_address,
                             reflection_pb2.ServerReflectionRequest(file_containing_symbol=POOL_MASTER.full_name))
        assert response.WhichOneof("message_response") == "file_descriptor_response", response
        files = [descriptor_pb2.FileDescriptorProto.FromString(raw)
                 for raw in response.file_descriptor_response.file_descriptor_proto]
        [served] = [s for f in files for s in f.service if f"{f.package}.{s.name}" == POOL_MASTER.full_name]
        # what a client without the protos learns is the service as compiled here
        assert {m.name: (m.input_type, m.output_type) for m in served.method} == {
            m.name: (f".{m.input_type.full_name}", f".{m.output_type.full_name}") for m in POOL_MASTER.methods}

        [missing] = reflect(pool.master_address,
                            reflection_pb2.ServerReflectionRequest(file_containing_symbol="kvpool.rpc.NoSuchService"))
        assert missing.WhichOneof("message_response") == "error_response"
        assert missing.error_response.error_code == grpc.StatusCode.NOT_FOUND.value[0]


@pytest.mark.cluster
def test_prefill_stages_list_the_services_they_serve(tmp_path: Path) -> None:
    with LocalPipeline(num_stages=2, master="", workdir=tmp_path) as pipeline:
        first, last = (f"127.0.0.1:{stage.ready['port']}" for stage in pipeline.stages)
        # stage 0 also serves the Prefill API; the later stages do not
        assert list_services(first) == {PREFILL, PREFILL_STAGE, HEALTH, REFLECTION}
        assert list_services(last) == {PREFILL_STAGE, HEALTH, REFLECTION}


@pytest.mark.cluster
def test_decode_shards_and_the_router_list_the_services_they_serve(tmp_path: Path) -> None:
    with LocalPipeline(num_stages=1, master="", workdir=tmp_path / "stages") as pipeline, \
            LocalDecode(["--num-pages", "64"], workdir=tmp_path / "decode") as shard:
        assert list_services(shard.address) == {DECODE, HEALTH, REFLECTION}
        router = ServiceProcess("router", ["router", "--port", "0", "--http-port", "0", "--admin-port", "0",
                                           "--pipelines", pipeline.address, "--shards", shard.address], tmp_path)
        router.start()
        try:
            router.wait_ready()
            assert list_services(f"127.0.0.1:{router.ready['port']}") == {ROUTER, HEALTH, REFLECTION}
        finally:
            router.stop()


async def test_an_unknown_service_name_is_refused_before_serving() -> None:
    with pytest.raises(ValueError, match="kvpool.rpc.PoolMastr"):
        await service.create_server("127.0.0.1", 0, lambda s: None, service_names=["kvpool.rpc.PoolMastr"])
