"""One request's trace, as an OpenTelemetry collector receives it: a span for every hop under one trace id.

The test is the collector: an OTLP/gRPC trace receiver (the collector's own ``TraceService`` from
``opentelemetry-proto``) in this process. ``kvpool up --otlp-endpoint`` points every service of a small
cluster at it (a master, one store, a two-stage pipeline, a decode shard, the router); one chat completion
whose prompt fills two chunks (so stage 0 looks the pool up and saves) is sent over HTTP.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
import httpx
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from kvpool.tools.cluster.launcher import Cluster
from kvpool.tools.up import UpSettings, up_cluster
from kvpool.tracing import OTLP_ENV
from tests.integration.conftest import eventually

pytestmark = pytest.mark.cluster

MODEL = "tiny"
PROMPT = "".join(chr(ord("a") + (i * 7) % 26) for i in range(700))  # two full 256-token chunks


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """Keeps every span exported to it, with its service's name."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, Any]] = []
        self.lock = threading.Lock()

    def Export(self, request: Any, context: Any) -> Any:
        with self.lock:
            for resource_spans in request.resource_spans:
                service = next((a.value.string_value for a in resource_spans.resource.attributes
                                if a.key == "service.name"), "")
                for scope in resource_spans.scope_spans:
                    self.spans.extend((service, span) for span in scope.spans)
        return trace_service_pb2.ExportTraceServiceResponse()

    def of_request(self, request_id: str) -> list[tuple[str, Any]]:
        with self.lock:
            return [(service, span) for service, span in self.spans
                    if any(a.key == "kvpool.request_id" and a.value.string_value == request_id
                           for a in span.attributes)]


@pytest.fixture(scope="module")
def collector() -> Iterator[tuple[Collector, int]]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    received = Collector()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(received, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield received, port
    finally:
        server.stop(None)


@pytest.fixture(scope="module")
def cluster(collector: tuple[Collector, int], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    settings = UpSettings(pipelines=1, stages=2, decode_shards=1, stores=1, segment_size="64MiB", http_port=0,
                          grpc_port=0, device_cache_tokens=4096, workdir=str(tmp_path_factory.mktemp("traces")))
    saved = {key: os.environ.get(key) for key in (OTLP_ENV, "OTEL_BSP_SCHEDULE_DELAY")}
    os.environ[OTLP_ENV] = f"127.0.0.1:{collector[1]}"  # what kvpool up --otlp-endpoint sets for its services
    os.environ["OTEL_BSP_SCHEDULE_DELAY"] = "200"  # export every 0.2 s, not 5 s: the test waits less
    try:
        up = up_cluster(settings).start()
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    try:
        yield up
    finally:
        up.stop()


async def test_one_request_is_one_trace_with_a_span_for_every_hop(cluster: Cluster,
                                                                  collector: tuple[Collector, int]) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 3, "temperature": 0}
    async with httpx.AsyncClient(timeout=300) as http:
        response = await http.post(f"{cluster.http_url}/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    request_id = response.headers["x-request-id"]
    received = collector[0]

    def short(name: str) -> str:  # a gRPC method by its name, the HTTP request's span as it is
        return name.rsplit("/", 1)[-1] if name.startswith("/") else name

    def names() -> set[str]:
        return {short(span.name) for _, span in received.of_request(request_id)}

    hops = {"POST /v1/chat/completions", "Serve", "Prefill", "Lookup", "ForwardPieces", "PutStart", "PutEnd"}
    try:
        await eventually(lambda: hops <= names(), timeout_s=60, what=f"spans of {sorted(hops)}")
    except AssertionError:
        with received.lock:
            seen = sorted({(service, span.name) for service, span in received.spans})
        raise AssertionError(f"got {sorted(names())} for the request; every span received: {seen}") from None
    spans = received.of_request(request_id)
    assert len({span.trace_id for _, span in spans}) == 1, "one trace id for the whole request"
    by_id = {span.span_id: span for _, span in spans}
    roots = [span for span in by_id.values() if span.parent_span_id not in by_id]
    assert [root.name for root in roots] == ["POST /v1/chat/completions"]  # every other span hangs below it
    services = {service for service, _ in spans}
    assert {"kvpool-router", "kvpool-decode", "kvpool-prefill", "kvpool-master"} <= services, services
    kinds = {short(span.name): next(a.value.string_value for a in span.attributes
                                               if a.key == "kvpool.call_kind") for _, span in spans}
    assert kinds["Lookup"] == "session" and kinds["PutStart"] == "session"  # messages on the master's stream
    assert kinds["POST /v1/chat/completions"] == "http" and kinds["Serve"] in ("unary_stream", "stream_stream")
    # the master's lookup is stage 0's child: its Prefill span is the lookup's parent
    lookup = next(span for _, span in spans if span.name.endswith("/Lookup"))
    assert by_id[lookup.parent_span_id].name.endswith("/Prefill")
    started = time.time()
    while time.time() - started < 1:  # spans of this request only: a later export adds no other trace
        await asyncio.sleep(0.25)
    assert len({span.trace_id for _, span in received.of_request(request_id)}) == 1
