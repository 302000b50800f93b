"""The router process: gRPC ``Generate``, the OpenAI-compatible HTTP API (Starlette on http_server), health, metrics.

Both APIs take the same API keys (``auth.KeyRing``); SIGHUP re-reads them, and a file that does not parse keeps
the keys in force (logged as ``api_keys_reload_failed`` with the reason).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import structlog

from kvpool import ports, service
from kvpool.core.errors import InvalidArgument, KvpoolError
from kvpool.core.tenancy.shares import TenantShares
from kvpool.core.api.generation_fields import (
    GRPC_FIELDS,
    check_length,
    check_prompt_text,
    check_sampling,
    check_session_key,
    check_token_ids,
)
from kvpool.request_id import METADATA_KEY, bound_request_id, from_metadata, new_request_id
from kvpool.rpc import router_pb2, router_pb2_grpc
from kvpool.status import abort
from kvpool.tokenizer import ByteTokenizer, load_tokenizer
from kvpool.services.router.auth import KeyRing, gate
from kvpool.services.router.generation_request import GenerationRequest, ModelLimits
from kvpool.services.router.grpc_auth import GrpcGate
from kvpool.services.router.http_api import HttpApi, Usage
from kvpool.services.router.http_connections import ConnectionLimits, ensure_open_files
from kvpool.services.router.http_server import LISTEN_BACKLOG, HttpServer
from kvpool.services.router.json_body import MAX_BODY_BYTES
from kvpool.services.router.metrics import RouterMetrics
from kvpool.services.router.open_requests import OpenRequests
from kvpool.services.router.openai_errors import api_error_of
from kvpool.services.router.router import Router
from kvpool.services.router.settings import RouterSettings

log = structlog.get_logger(__name__)



class RouterServicer(router_pb2_grpc.RouterServicer):
    """gRPC Generate: the same path as the HTTP API, token ids or text in, tokens then usage out; the caller
    authenticated and bounded by ``gate`` (``grpc_auth``) first."""

    def __init__(self, router: Router, tokenizer: Any, limits: ModelLimits, gate: GrpcGate) -> None:
        self.router = router
        self.tokenizer = tokenizer
        self.limits = limits
        self.gate = gate

    async def Generate(self, request: router_pb2.GenerateRequest,
                       context: Any) -> AsyncIterator[router_pb2.GenerateResponse]:
        # the request's id goes back as initial metadata; a client's own is only logged beside it
        request_id = new_request_id()
        client_id = from_metadata(context.invocation_metadata())
        extra = {"client_request_id": client_id} if client_id else {}
        await context.send_initial_metadata(((METADATA_KEY, request_id),))
        with bound_request_id(request_id, **extra):
            async with self.gate.admitted(context) as tenant:
                async for response in self._generate(request, context, request_id, tenant):
                    yield response

    async def _generate(self, request: router_pb2.GenerateRequest, context: Any, request_id: str,
                        tenant: str) -> AsyncIterator[router_pb2.GenerateResponse]:
        try:
            # in a worker thread: a model directory's tokenizer takes seconds over a long prompt
            generation = await asyncio.to_thread(self._validate, request)
        except KvpoolError as exc:
            await abort(context, exc, "Generate")
            return
        generation.request_id = request_id
        generation.tenant = tenant
        usage = Usage(prompt_tokens=len(generation.prompt_ids))
        decoder = self.tokenizer.decoder() if request.text else None
        tokens = self.router.generate(generation, usage)
        try:
            async for token_id in tokens:
                usage.completion_tokens += 1
                text = decoder.feed(token_id) if decoder is not None else ""
                yield router_pb2.GenerateResponse(token_id=token_id, text=text)
        except KvpoolError as exc:
            self.router.metrics.requests.labels("grpc", "error").inc()
            await abort(context, exc, "Generate")
            return
        finally:
            await tokens.aclose()
        self.router.metrics.requests.labels("grpc", "ok").inc()
        yield router_pb2.GenerateResponse(usage=router_pb2.GenerateUsage(
            prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens,
            device_tokens=usage.device_tokens, pool_tokens=usage.pool_tokens, computed_tokens=usage.computed_tokens,
            handoff_transfers=usage.handoff_transfers, handoff_bytes=usage.handoff_bytes,
            ttft_seconds=usage.ttft_seconds, decode_seconds=usage.decode_seconds,
            finish_reason=usage.finish_reason, pipeline=usage.pipeline_label, shard=usage.shard_label,
        ))

    def _validate(self, request: router_pb2.GenerateRequest) -> GenerationRequest:
        """The same checks as the HTTP API (``kvpool.core.api.generation_fields``), with this API's field names."""
        limits = self.limits
        if request.token_ids and request.text:
            raise InvalidArgument("token_ids: give the prompt as token_ids or as text, not both", field="token_ids")
        if request.text:
            check_prompt_text(len(request.text), self.tokenizer.max_token_bytes, limits.context, "text")
        prompt = self.tokenizer.encode(request.text) if request.text else list(request.token_ids)
        if not prompt:
            raise InvalidArgument("token_ids: the prompt must not be empty", field="token_ids")
        check_token_ids(prompt, limits.vocab_size, GRPC_FIELDS.prompt)
        sampling = request.sampling
        max_tokens = sampling.max_tokens or 16
        check_length(len(prompt), max_tokens, limits.context, "text" if request.text else "token_ids",
                     GRPC_FIELDS.max_tokens)
        checked = check_sampling(sampling.temperature, sampling.top_p or 1.0, sampling.top_k,
                                 sampling.seed if sampling.HasField("seed") else None, limits.vocab_size, GRPC_FIELDS)
        check_token_ids(sampling.stop_token_ids, limits.vocab_size, GRPC_FIELDS.stop_token_ids)
        check_session_key(request.session_key, GRPC_FIELDS.session_key)
        check_session_key(request.cache_salt, "cache_salt")
        return GenerationRequest(
            kind="completion", model=limits.name, prompt_ids=prompt, max_tokens=max_tokens,
            temperature=checked.temperature, top_p=checked.top_p, top_k=checked.top_k, seed=checked.seed,
            stop_token_ids=list(sampling.stop_token_ids) or list(self.tokenizer.eos_token_ids),
            session_key=request.session_key, cache_salt=request.cache_salt,
        )


class _OpenAiRouter:
    """The router as the HTTP API sees it (``RouterView``): generate, with its errors in OpenAI's shape, and health."""

    def __init__(self, router: Router, supervisor_status: str = "") -> None:
        self.router = router
        self.supervisor_status = supervisor_status

    async def generate(self, request: GenerationRequest, usage: Usage) -> AsyncIterator[int]:
        api = "chat" if request.kind == "chat" else "completions"
        tokens = self.router.generate(request, usage)
        try:
            async for token in tokens:
                yield token
        except KvpoolError as exc:
            self.router.metrics.requests.labels(api, "error").inc()
            raise api_error_of(exc) from None
        finally:
            await tokens.aclose()
        self.router.metrics.requests.labels(api, "ok").inc()

    async def health(self) -> dict[str, bool]:
        return await self.router.check_health()

    def supervision(self) -> dict[str, Any] | None:
        if not self.supervisor_status:
            return None
        try:
            return dict(json.loads(Path(self.supervisor_status).read_text()))
        except (OSError, ValueError) as exc:
            return {"error": f"supervisor status unreadable: {exc}"}


def listen_http(host: str, port: int, reuse_port: bool = False) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:  # a successor router listens beside this one during a handover
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        # port 0: a free one below the ephemeral range (kvpool.ports), so a restart can have it again
        ports.listen(host, port, lambda p: sock.bind((host, p)))
    except OSError as exc:
        sock.close()
        raise OSError(f"http_port: cannot listen on {host}:{port}: {exc.strerror}") from None
    sock.listen(LISTEN_BACKLOG)
    sock.setblocking(False)
    return sock


def _reload_keys(ring: KeyRing) -> None:
    """SIGHUP: the keys file again. Requests already admitted finish; each new one is checked against the new keys."""
    try:
        keys = ring.reload()
    except (ValueError, OSError) as exc:
        log.error("api_keys_reload_failed", reason=str(exc), kept_keys=len(ring.keys.tenants))
        return
    log.info("api_keys_reloaded", api_keys=len(keys.tenants), tenants=len(set(keys.tenants.values())))


def router_of(settings: RouterSettings, metrics: RouterMetrics, limits: ModelLimits | None = None) -> Router:
    """The router's core as its settings configure it (``serve``'s; tests read what a flag set from it)."""
    return Router(settings.pipelines, settings.shards, metrics, affinity_max_queue=settings.affinity_max_queue,
                  max_in_flight=settings.max_in_flight, request_timeout_s=settings.request_timeout_s,
                  max_queue=settings.max_queue, queue_timeout_s=settings.queue_timeout_s,
                  locality=settings.locality, servers=settings.server_of,
                  limits=limits, order=settings.queue_order, max_wait_s=settings.sched_max_wait_s,
                  max_bypass_s=settings.sched_max_bypass_s, reorder_below_s=settings.sched_reorder_below_s,
                  late_checks_out=settings.health_late_checks, health_wait_s=settings.health_wait_s,
                  shares=TenantShares.parse(settings.tenant_weights), fair=settings.tenant_fair)


async def serve(settings: RouterSettings, ready_file: str | None = None) -> None:
    try:
        ring = KeyRing.load(settings.api_keys_file)
    except ValueError as exc:
        raise SystemExit(f"kvpool router: {exc}") from None
    keys = ring.keys
    open_requests = OpenRequests(settings.max_requests_per_key)  # a key's HTTP and gRPC requests together
    config = settings.model_config()
    tokenizer = load_tokenizer(settings.model_dir or None, config.vocab_size)
    limits = ModelLimits(settings.model_name, context=config.max_position_embeddings, vocab_size=config.vocab_size)
    metrics = RouterMetrics()
    router = router_of(settings, metrics, limits)
    servicer = RouterServicer(router, tokenizer, limits, GrpcGate(ring, open_requests))
    handle = await service.create_server(
        settings.host, settings.port, lambda s: router_pb2_grpc.add_RouterServicer_to_server(servicer, s),
        service_names=["kvpool.rpc.Router"], inbound_request_ids=False, reuse_port=settings.reuse_port,
        max_receive_bytes=MAX_BODY_BYTES,  # the public port takes what the HTTP API takes
        max_concurrent_rpcs=settings.grpc_max_concurrent_rpcs,
    )
    await handle.set_serving(False)
    roles = ByteTokenizer.roles() if isinstance(tokenizer, ByteTokenizer) else frozenset(
        {"system", "developer", "user", "assistant", "tool"})
    def refused(reason: str) -> None:
        metrics.http_refused.labels(reason).inc()
        log.info("http_refused", reason=reason)

    api = HttpApi(_OpenAiRouter(router, settings.supervisor_status), tokenizer, limits, metrics.registry, roles,
                  read_timeout_s=settings.http_read_timeout_s, refused=refused)
    sock = listen_http(settings.host, settings.http_port, settings.reuse_port)
    # origins, API keys, tenants and their request rates (auth.py)
    app = gate(api.app(), ring, settings.cors_origins, settings.tenant_rate, settings.tenant_burst, open_requests)
    # stopped in the finally below, once the process's signal handlers set ``stop``
    http = HttpServer(app, ConnectionLimits(
        read_timeout_s=settings.http_read_timeout_s, max_connections=settings.http_max_connections,
        max_per_client=settings.http_max_connections_per_client, make_room=bool(keys), refused=refused,
        open_now=metrics.http_connections.set))
    ensure_open_files(settings.http_max_connections)
    await http.start(sock)
    admin_port = service.start_metrics(settings.host, settings.admin_port, metrics.registry)
    stop = asyncio.Event()
    service.install_stop_signals(stop)
    asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, _reload_keys, ring)
    health = asyncio.create_task(router.health_forever(settings.health_interval_s))
    try:
        await router.check_health()
        await handle.set_serving(True)
        http_port = sock.getsockname()[1]
        log.info("router_serving", address=f"{settings.host}:{handle.port}", http_port=http_port,
                 admin_port=admin_port, pipelines=settings.pipelines, shards=settings.shards, model=limits.name,
                 api_keys=len(keys.tenants), tenants=len(set(keys.tenants.values())))
        service.write_ready_file(ready_file, port=handle.port, http_port=http_port, admin_port=admin_port)
        await stop.wait()
        log.info("router_stopping")
        await handle.set_serving(False)
    finally:
        health.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await asyncio.wait_for(http.stop(grace_s=max(1.0, settings.drain_s)), settings.drain_s + 5)
        # streams in flight finish within the drain period
        await handle.server.stop(grace=settings.drain_s)
        await router.close()
        sock.close()
        log.info("router_stopped")
