"""``GET /openapi.json``: the document covers every route the app registers, and every ``$ref`` resolves.

Built in-process from ``HttpApi(...).app()``, no cluster; the live document is fuzzed against a cluster in
``tests/integration/test_openapi_fuzz.py``.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from starlette.routing import Route
from starlette.testclient import TestClient

from kvpool.services.router import openapi
from kvpool.services.router.auth import ApiKeys, gate
from kvpool.services.router.generation_request import ModelLimits
from kvpool.services.router.http_api import HttpApi
from kvpool.tokenizer import ByteTokenizer


class _NoRouter:
    def generate(self, request, usage):  # type: ignore[no-untyped-def]
        raise AssertionError("not called")

    async def health(self) -> dict[str, bool]:
        return {}

    def supervision(self) -> None:
        return None


def _app():  # type: ignore[no-untyped-def]
    return HttpApi(_NoRouter(), ByteTokenizer(1024), ModelLimits("tiny", context=64, vocab_size=1024),  # type: ignore[arg-type]
                   CollectorRegistry(), frozenset({"user", "assistant", "system"})).app()


@pytest.fixture(scope="module")
def document() -> dict[str, Any]:
    with TestClient(_app()) as client:
        response = client.get("/openapi.json")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("application/json")
    return response.json()


def _refs(node: Any) -> list[str]:
    if isinstance(node, dict):
        return [v for k, v in node.items() if k == "$ref" and isinstance(v, str)] + \
            [r for v in node.values() for r in _refs(v)]
    if isinstance(node, list):
        return [r for v in node for r in _refs(v)]
    return []


def _operations(document: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    return [(path, method, op) for path, ops in document["paths"].items() for method, op in ops.items()]


def test_version(document: dict[str, Any]) -> None:
    assert document["openapi"] == "3.1.0"


def test_every_route_of_the_app_is_documented_with_its_methods(document: dict[str, Any]) -> None:
    routes = [r for r in _app().routes if isinstance(r, Route)]
    assert {r.path for r in routes} >= {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health",
                                        "/openapi.json"}
    for route in routes:
        assert route.path in document["paths"], route.path
        methods = {m.lower() for m in route.methods or ()} - {"head"}
        assert methods and methods == set(document["paths"][route.path]), route.path


def test_every_ref_resolves(document: dict[str, Any]) -> None:
    refs = _refs(document)
    assert refs
    for ref in refs:
        assert ref.startswith("#/components/schemas/"), ref
        node: Any = document
        for part in ref[2:].split("/"):
            assert part in node, f"{ref} does not resolve"
            node = node[part]
    assert "$defs" not in json.dumps(document)


def test_every_operation_answers_a_2xx_and_a_4xx_in_openai_error_shape(document: dict[str, Any]) -> None:
    for path, method, op in _operations(document):
        statuses = set(op["responses"])
        assert any(s.startswith("2") for s in statuses), (method, path)
        client_errors = [s for s in statuses if s.startswith("4")]
        assert client_errors, (method, path)
        for status in client_errors:
            schema = op["responses"][status]["content"]["application/json"]["schema"]
            assert schema == {"$ref": "#/components/schemas/ErrorResponse"}, (method, path, status)
    error = document["components"]["schemas"]["ErrorDetail"]
    assert set(error["required"]) == {"message", "type", "param", "code"}


def test_posts_have_their_request_bodies_and_stream(document: dict[str, Any]) -> None:
    for path, request in (("/v1/completions", "CompletionRequest"), ("/v1/chat/completions", "ChatCompletionRequest")):
        op = document["paths"][path]["post"]
        assert op["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/" + request)
        assert {"application/json", "text/event-stream"} <= set(op["responses"]["200"]["content"])
        assert {"400", "408", "413", "429", "503"} <= set(op["responses"])


def test_chat_request_requires_messages_and_not_model(document: dict[str, Any]) -> None:
    """``messages`` is refused when missing; ``model`` is lenient (missing means the one served model)."""
    chat = document["components"]["schemas"]["ChatCompletionRequest"]
    assert "messages" in chat["required"] and "model" in chat["properties"]
    assert "model" not in chat["required"]
    assert "prompt" in document["components"]["schemas"]["CompletionRequest"]["required"]


def test_the_models_agree_with_what_is_answered() -> None:
    """The success models accept the app's own answers (health and models need no cluster)."""
    with TestClient(_app()) as client:
        openapi.ModelList.model_validate(client.get("/v1/models").json())
        health = client.get("/health")
        assert health.status_code == 503
        openapi.Health.model_validate(health.json())


def test_a_route_without_documentation_is_refused() -> None:
    with pytest.raises(ValueError, match="not documented"):
        openapi.build([("/v1/embeddings", ["POST"])])


def test_keys_gate_the_document_but_not_health() -> None:
    gated = gate(_app(), ApiKeys.parse(["secret-key-1"], "test"))
    with TestClient(gated) as client:
        refused = client.get("/openapi.json")
        assert refused.status_code == 401 and set(refused.json()["error"]) == {"message", "type", "param", "code"}
        assert client.get("/openapi.json", headers={"Authorization": "Bearer secret-key-1"}).status_code == 200
        assert client.get("/health").status_code == 503  # open (and unhealthy: no targets here)
