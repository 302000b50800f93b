"""The live router's ``GET /openapi.json``, fuzzed with schemathesis against the router itself.

One small cluster (one one-stage pipeline, one decode shard, no pool). The
document is fetched from the router, loaded with
``schemathesis.openapi.from_dict``, and every operation in it gets a few
derandomized cases generated from its schema (request bodies from the request
models); as most generated bodies are refused (the ranges are the
validators', not the schema's), a POST's case is as often replaced by a body
that is served, as one JSON answer, a stream, or a stream with usage. Each answer must be no 5xx, a documented status, a documented
content type and a body that conforms to the documented schema. Generated
bodies get ``max_tokens`` capped at 4 (``_capped``): the schema cannot bound it
(the bound is the context left after the prompt), and the tiny model decodes
on a CPU.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import checks

from kvpool.tools.cluster import Cluster
from tests.integration.conftest import front_door_cluster

pytestmark = pytest.mark.cluster

EXAMPLES = 12  # per operation
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))
CHECKS = [checks.not_a_server_error, checks.status_code_conformance, checks.content_type_conformance,
          checks.response_schema_conformance]
MAX_TOKENS = 4
# what a body needs to be served (the schema alone mostly draws refusals: ranges are the validators')
SERVABLE = {"/v1/completions": {"prompt": "def fib(n):"},
            "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}]}}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with front_door_cluster(tmp_path_factory.mktemp("openapi"), "") as up:
        yield up


@pytest.fixture(scope="module")
def base_url(cluster: Cluster) -> str:
    return f"http://127.0.0.1:{cluster.find('router').ready['http_port']}"


@pytest.fixture(scope="module")
def document(base_url: str) -> dict[str, Any]:
    response = httpx.get(f"{base_url}/openapi.json", timeout=30)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("application/json")
    return response.json()


def _capped(body: Any) -> Any:
    """At most ``MAX_TOKENS`` new tokens: a generated integer is capped, and a body without one gets it."""
    if not isinstance(body, dict):
        return body
    given_any = False
    for name in ("max_tokens", "max_completion_tokens"):
        value = body.get(name)
        if isinstance(value, int) and not isinstance(value, bool):
            body[name] = min(value, MAX_TOKENS)
            given_any = True
    if not given_any:
        body["max_tokens"] = MAX_TOKENS
    return body


def _servable(path: str, mode: str) -> dict[str, Any]:
    """A body that is served: one JSON answer, a stream, or a stream ending with the usage chunk."""
    servable: dict[str, Any] = {**SERVABLE[path], "max_tokens": MAX_TOKENS, "stream": mode != "json"}
    if mode == "usage":
        servable["stream_options"] = {"include_usage": True}
    return servable


def test_the_live_document_covers_the_api(document: dict[str, Any]) -> None:
    assert document["openapi"] == "3.1.0"
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/openapi.json"} <= set(
        document["paths"])


def test_every_operation_answers_as_documented(base_url: str, document: dict[str, Any]) -> None:
    schema = schemathesis.openapi.from_dict(document)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {(op.method.lower(), op.path) for op in operations} == {
        (method, path) for path, methods in document["paths"].items() for method in methods}
    session = requests.Session()
    for operation in operations:
        @FUZZ
        @given(case=operation.as_strategy(), mode=st.sampled_from(["generated", "json", "stream", "usage"]))
        def answers_as_documented(case: schemathesis.Case, mode: str) -> None:
            if case.method == "POST":
                case.body = _capped(case.body) if mode == "generated" else _servable(case.path, mode)
            response = case.call(base_url=base_url, session=session, timeout=30)
            case.validate_response(response, checks=CHECKS)

        answers_as_documented()
