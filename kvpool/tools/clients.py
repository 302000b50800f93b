"""``kvpool generate`` (one prompt over gRPC) and ``kvpool chat`` (an interactive session over HTTP).

Both send the key of ``KVPOOL_API_KEY`` when it is set: as gRPC metadata ``authorization: Bearer KEY``, or the
HTTP header of that name.
"""

from __future__ import annotations

import asyncio
import sys
import uuid
from typing import Any

import grpc
import httpx

from kvpool import service
from kvpool.rpc import router_pb2, router_pb2_grpc
from kvpool.tools.api_key import auth_headers, client_key
from kvpool.tools.sse import StreamError, stream_events


async def generate(router: str, prompt: str, max_tokens: int, temperature: float, session: str) -> int:
    """Stream one answer to stdout, then its figures to stderr."""
    async with service.channel(router) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        request = router_pb2.GenerateRequest(text=prompt, session_key=session, sampling=router_pb2.SamplingParams(
            temperature=temperature, max_tokens=max_tokens))
        try:
            async for response in stub.Generate(request, timeout=600, metadata=grpc_auth_metadata()):
                if response.HasField("usage"):
                    u = response.usage
                    print(f"\n[{u.prompt_tokens} prompt tokens: device {u.device_tokens}, pool {u.pool_tokens}, "
                          f"computed {u.computed_tokens}; {u.completion_tokens} generated, "
                          f"TTFT {u.ttft_seconds * 1e3:.0f} ms, finish {u.finish_reason}]", file=sys.stderr)
                else:
                    print(response.text, end="", flush=True)
        except grpc.aio.AioRpcError as exc:
            print(f"\nkvpool generate: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    return 0


def grpc_auth_metadata() -> tuple[tuple[str, str], ...]:
    """The router's gRPC metadata for the key of ``KVPOOL_API_KEY`` (``services/router/grpc_auth``); none without."""
    key = client_key()
    return (("authorization", f"Bearer {key}"),) if key else ()


def chat(url: str, max_tokens: int, temperature: float) -> int:
    """Read user turns from stdin; each sends the whole conversation so far, as agents do."""
    session = f"chat-{uuid.uuid4().hex[:8]}"
    messages: list[dict[str, Any]] = []
    print(f"kvpool chat with {url} (session {session}); an empty line or Ctrl-D ends it", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            return 0
        if not line.strip():
            return 0
        messages.append({"role": "user", "content": line})
        body = {"messages": messages, "max_tokens": max_tokens, "temperature": temperature, "stream": True,
                "stream_options": {"include_usage": True}, "prompt_cache_key": session}
        try:
            reply = asyncio.run(_chat_turn(url, body))
        except StreamError as exc:
            print(f"error: {exc}", file=sys.stderr)
            messages.pop()
            continue
        print()
        messages.append({"role": "assistant", "content": reply})


async def _chat_turn(url: str, body: dict[str, Any]) -> str:
    """Stream one answer to stdout, its cache figures to stderr; returns the answer."""
    reply = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=10.0), headers=auth_headers()) as client:
        async for event in stream_events(client, url, "/v1/chat/completions", body):
            if event.get("usage"):
                ext = event["usage"].get("kvpool", {})
                print(f"\n  [cached {event['usage']['prompt_tokens_details']['cached_tokens']} of "
                      f"{event['usage']['prompt_tokens']} prompt tokens (device {ext.get('device_tokens')}, "
                      f"pool {ext.get('pool_tokens')})]", file=sys.stderr)
                continue
            for choice in event.get("choices", []):
                text = choice.get("delta", {}).get("content") or ""
                reply.append(text)
                print(text, end="", flush=True)
    return "".join(reply)
