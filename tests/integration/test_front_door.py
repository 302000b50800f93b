"""The front door as agent harnesses use it, against a real cluster: statuses before the stream, and a fuzz.

One small cluster (one one-stage pipeline, one decode shard, no pool, one
request in flight at most so overload is easy to reach) for the module.
Through the official ``openai`` client and raw HTTP: an over-limit streaming
request is a 400 and an overloaded one a 429 with ``Retry-After``, both
before any SSE byte; a failure after the first token ends the stream with
OpenAI's error event then ``data: [DONE]``; a session header keeps a session
in place; every token the built-in model streams is visible text. Hypothesis drives the OpenAI HTTP API with bodies built from every
field a client may send, each drawn from valid, boundary and hostile values
(NaN, infinities, 64-bit edges, lone surrogates, long strings, deep nesting),
and the gRPC ``Generate`` with random messages and raw bytes. Every answer
must be a success or a client error naming what is wrong; a stream that
starts must end with ``data: [DONE]``. Afterwards a fixed greedy prompt must
give the same tokens as before.
"""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from typing import Any

import grpc
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpool.rpc import router_pb2, router_pb2_grpc
from kvpool.tokenizer import ByteTokenizer
from kvpool.tools.cluster import Cluster
from tests.integration.conftest import front_door_cluster
from tests.integration.unparsed_bytes import HEALTH, assert_unparsable_bytes_refused

pytestmark = pytest.mark.cluster

FUZZ = settings(max_examples=40, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
GREEDY_PROMPT = "def fib(n):"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with front_door_cluster(tmp_path_factory.mktemp("front"), "max_in_flight = 1\n") as up:
        yield up


@pytest.fixture(scope="module")
def channel(cluster: Cluster) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(f"127.0.0.1:{cluster.find('router').ready['port']}") as ch:
        yield ch


@pytest.fixture(scope="module")
def client(cluster: Cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{cluster.http_url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def greedy_before(cluster: Cluster, channel: grpc.Channel) -> tuple[str, list[int]]:
    return greedy_now(cluster, channel)


def greedy_now(cluster: Cluster, channel: grpc.Channel) -> tuple[str, list[int]]:
    status, body = post(cluster, "/v1/completions", json.dumps(
        {"model": "tiny", "prompt": GREEDY_PROMPT, "max_tokens": 6, "temperature": 0}).encode())
    assert status == 200, body
    request = router_pb2.GenerateRequest(text=GREEDY_PROMPT, sampling=router_pb2.SamplingParams(max_tokens=6))
    tokens = [r.token_id for r in router_pb2_grpc.RouterStub(channel).Generate(request, timeout=120)
              if r.WhichOneof("event") == "token_id"]
    return json.loads(body)["choices"][0]["text"], tokens


def post(cluster: Cluster, path: str, raw: bytes, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    status, _, body = post_with_headers(cluster, path, raw, headers)
    return status, body


def post_with_headers(cluster: Cluster, path: str, raw: bytes,
                      headers: dict[str, str] | None = None) -> tuple[int, http.client.HTTPMessage, bytes]:
    host, port = cluster.http_url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    try:
        conn.request("POST", path, raw, {"Content-Type": "application/json", **(headers or {})})
        response = conn.getresponse()
        return response.status, response.headers, response.read()
    finally:
        conn.close()


def chat_body(**fields: Any) -> bytes:
    return json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hello"}], **fields}).encode()


def served_context(cluster: Cluster) -> int:
    host, port = cluster.http_url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        conn.request("GET", "/v1/models")
        return int(json.loads(conn.getresponse().read())["data"][0]["max_model_len"])
    finally:
        conn.close()


def wait_until_served(cluster: Cluster) -> None:
    """The router frees a cancelled request's slot as the cancellation reaches it: poll until one is free."""
    for _ in range(600):
        status, _ = post(cluster, "/v1/chat/completions", chat_body(max_tokens=1))
        if status != 429:
            assert status == 200
            return
    raise AssertionError("the router still refuses after the busy request was cancelled")


# ---- statuses before the stream ----------------------------------------------------


def test_the_advertised_context_is_what_the_cluster_serves(cluster: Cluster, client: openai.OpenAI) -> None:
    # the device cache (4,096 tokens) is the tightest limit: a 4,096-token prompt plus one token
    assert served_context(cluster) == 4097
    full = client.completions.create(model="tiny", prompt=[65] * 4096, max_tokens=1, temperature=0)
    assert full.usage.prompt_tokens == 4096 and full.usage.completion_tokens == 1


def test_over_limit_streaming_is_a_400_before_any_sse_byte(cluster: Cluster, client: openai.OpenAI) -> None:
    context = served_context(cluster)
    status, headers, raw = post_with_headers(cluster, "/v1/chat/completions", chat_body(
        max_tokens=context, stream=True, stream_options={"include_usage": True}))
    assert status == 400 and headers["content-type"] == "application/json", raw[:200]
    error = json.loads(raw)["error"]
    assert error["param"] == "max_tokens" and str(context) in error["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt="x" * context, max_tokens=4, stream=True)
    assert info.value.param == "prompt" and str(context) in info.value.message


def test_overloaded_is_a_429_with_retry_after_before_any_sse_byte(cluster: Cluster, client: openai.OpenAI) -> None:
    busy = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "go on"}],
                                          max_tokens=3000, temperature=0, stream=True)
    try:
        next(iter(busy))  # its first chunk: the router's one slot is taken
        status, headers, raw = post_with_headers(cluster, "/v1/chat/completions", chat_body(max_tokens=4, stream=True))
        assert status == 429 and int(headers["retry-after"]) >= 1, raw[:200]
        assert json.loads(raw)["error"]["type"] == "rate_limit_error"
        with pytest.raises(openai.RateLimitError) as info:
            client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                           stream=True)
        assert int(info.value.response.headers["retry-after"]) >= 1
    finally:
        busy.close()
    wait_until_served(cluster)


def test_a_session_header_keeps_the_session_in_place(cluster: Cluster, client: openai.OpenAI) -> None:
    def affinity() -> float:
        conn = http.client.HTTPConnection("127.0.0.1", int(cluster.find("router").ready["admin_port"]), timeout=60)
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
        conn.close()
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("kvpool_router_placements_total{") and 'kind="pipeline"' in line
                   and 'reason="affinity"' in line)

    before = affinity()
    for _ in range(2):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=1,
                                       extra_headers={"X-Session-ID": "harness-session-1"})
    assert affinity() == before + 1  # the second request found its session


def test_every_streamed_token_is_visible_text_and_the_text_retokenizes_to_the_count(client: openai.OpenAI) -> None:
    chunks = list(client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Write a haiku about caches."}], max_tokens=40,
        temperature=0.8, seed=11, stream=True, stream_options={"include_usage": True}))
    deltas = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    text = "".join(deltas)
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == 40
    assert len(deltas) == 40 and all(d.isprintable() for d in deltas)  # one visible character per token
    assert len(ByteTokenizer(1024).encode(text)) == usage.completion_tokens


# ---- strategies ---------------------------------------------------------------

HOSTILE_TEXT = ["", "\ud800", "a\udfffb", "x" * 300, "\x00", "é" * 3, "<|eos|>"]
text = st.one_of(st.sampled_from(HOSTILE_TEXT), st.text(max_size=12))
edge_ints = st.sampled_from([-(2**63) - 1, -(2**63), -2, -1, 0, 1, 2, 3, 2**31, 2**32, 2**63, 2**64 - 1, 2**64,
                             10**30])
edge_floats = st.one_of(st.sampled_from([0.0, -0.0, 1e-30, 1e-6, 0.5, 1.0, 1.0000001, 2.0, 2.5, -1.0]),
                        st.floats(allow_nan=True, allow_infinity=True))
leaf = st.one_of(st.none(), st.booleans(), edge_ints, edge_floats, text)
json_value = st.recursive(leaf, lambda inner: st.lists(inner, max_size=3)
                          | st.dictionaries(st.text(max_size=4), inner, max_size=3), max_leaves=6)
# valid lengths stay tiny so every served request is quick; the rest are refused
max_tokens = st.sampled_from([0, 1, 2, 3, -1, 2**31, 2**64, 1.5, "2", True, 40000])
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "tool", "wizard", 3])},
    optional={"content": st.one_of(text, st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image"]),
                                                                          "text": text}), max_size=2), json_value),
              "tool_calls": json_value, "name": text},
)
tool = st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
    {"name": text}, optional={"parameters": json_value, "description": text})})
common = {
    "model": st.sampled_from(["tiny", "", "gpt-4o", 5]),
    "temperature": edge_floats, "top_p": edge_floats, "top_k": edge_ints, "seed": edge_ints,
    "stop": st.one_of(text, st.lists(text, max_size=5), json_value),
    "stream": st.one_of(st.booleans(), leaf),
    "stream_options": st.one_of(st.fixed_dictionaries({"include_usage": st.one_of(st.booleans(), leaf)}), leaf),
    "prompt_cache_key": text, "user": text, "n": edge_ints, "logprobs": st.one_of(st.booleans(), edge_ints),
    "frequency_penalty": edge_floats, "extra": json_value,
}
completion_bodies = st.fixed_dictionaries({"max_tokens": max_tokens}, optional={
    **common, "prompt": st.one_of(text, st.lists(st.one_of(edge_ints, st.integers(0, 255)), max_size=6), json_value),
    "echo": leaf, "best_of": edge_ints, "suffix": text,
})
chat_bodies = st.fixed_dictionaries({"max_tokens": max_tokens}, optional={
    **common, "messages": st.one_of(st.lists(message, max_size=3), json_value),
    "tools": st.one_of(st.lists(tool, max_size=2), json_value),
    "tool_choice": st.one_of(st.sampled_from(["auto", "none", "required"]), json_value),
    "response_format": st.one_of(st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object"])}),
                                 json_value),
    "parallel_tool_calls": leaf, "top_logprobs": edge_ints, "max_completion_tokens": max_tokens,
})
session_headers = st.dictionaries(st.sampled_from(["X-Session-ID", "X-Session-Affinity"]),
                                  st.text(st.characters(min_codepoint=33, max_codepoint=126), max_size=300),
                                  max_size=2)


def check_http_answer(status: int, raw: bytes) -> None:
    assert status < 500, (status, raw[:500])
    if status != 200:
        error = json.loads(raw)["error"]
        assert error["message"] and error["type"], raw
        return
    if raw.startswith(b"data: "):
        events = [line for line in raw.split(b"\n\n") if line]
        assert events[-1] == b"data: [DONE]", raw[-300:]
        for event in events[:-1]:
            assert "error" not in json.loads(event.removeprefix(b"data: ")), event
    else:
        assert json.loads(raw)["usage"]["completion_tokens"] >= 1


@FUZZ
@given(path_and_body=st.one_of(st.tuples(st.just("/v1/completions"), completion_bodies),
                               st.tuples(st.just("/v1/chat/completions"), chat_bodies)),
       headers=session_headers)
def test_http_answers_every_body_with_a_success_or_a_client_error(
    cluster: Cluster, greedy_before: tuple[str, list[int]], path_and_body: tuple[str, dict[str, Any]],
    headers: dict[str, str],
) -> None:
    path, body = path_and_body
    status, raw = post(cluster, path, json.dumps(body, allow_nan=True).encode(), headers)
    check_http_answer(status, raw)


@FUZZ
@given(raw=st.one_of(st.binary(max_size=40), st.sampled_from([
    b"[" * 100_000 + b"]" * 100_000, b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}",
    b'{"prompt": "hi", "seed": ' + b"9" * 5000 + b"}", b'{"prompt": "hi", "temperature": NaN}',
    b'{"prompt": "hi", "top_p": -Infinity}', b'{"prompt": "\\ud800"}', b"\xff\xfe", b"null", b'"a"',
])), path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
def test_http_answers_raw_bytes_with_a_client_error(
    cluster: Cluster, greedy_before: tuple[str, list[int]], raw: bytes, path: str
) -> None:
    status, answer = post(cluster, path, raw)
    check_http_answer(status, answer)


int32 = st.one_of(st.integers(-(2**31), 2**31 - 1), st.integers(0, 300))
sampling = st.builds(
    router_pb2.SamplingParams,
    temperature=st.floats(width=32, allow_nan=True, allow_infinity=True),
    top_p=st.floats(width=32, allow_nan=True, allow_infinity=True),
    top_k=st.one_of(st.integers(0, 2**32 - 1), st.sampled_from([0, 1, 5])),
    seed=st.one_of(st.integers(0, 2**64 - 1), st.sampled_from([0, 2**63, 2**64 - 1])),
    max_tokens=st.sampled_from([0, 1, 2, 3, 2**32 - 1, 40000]),
    stop_token_ids=st.lists(int32, max_size=3),
)
grpc_request = st.builds(
    router_pb2.GenerateRequest,
    token_ids=st.lists(int32, max_size=6),
    text=st.text(st.characters(blacklist_categories=("Cs",)), max_size=12),
    session_key=st.text(st.characters(blacklist_categories=("Cs",)), max_size=300),
    sampling=sampling,
)
CLIENT_ERRORS = {grpc.StatusCode.INVALID_ARGUMENT}


@FUZZ
@given(request=grpc_request)
def test_grpc_answers_every_request_with_tokens_or_invalid_argument(
    channel: grpc.Channel, greedy_before: tuple[str, list[int]], request: router_pb2.GenerateRequest
) -> None:
    try:
        answers = list(router_pb2_grpc.RouterStub(channel).Generate(request, timeout=120))
    except grpc.RpcError as exc:
        assert exc.code() in CLIENT_ERRORS, (exc.code(), exc.details())
        assert exc.details().split(":")[0] in {"token_ids", "text", "session_key"} or \
            exc.details().startswith(("sampling.", "token_ids[")), exc.details()
        return
    assert answers[-1].WhichOneof("event") == "usage"
    assert answers[-1].usage.completion_tokens == len(answers) - 1 >= 1


@FUZZ
@given(raw=st.one_of(st.binary(max_size=40), st.just(b"\x12\x02\xed\xa0")))
def test_grpc_answers_bytes_that_do_not_parse_with_invalid_argument(
    channel: grpc.Channel, greedy_before: tuple[str, list[int]], raw: bytes
) -> None:
    generate = channel.unary_stream("/kvpool.rpc.Router/Generate")
    try:
        list(generate(raw, timeout=120))
    except grpc.RpcError as exc:
        assert exc.code() in CLIENT_ERRORS, (exc.code(), exc.details())


def test_every_service_answers_bytes_that_do_not_parse_with_invalid_argument_naming_the_message(
    cluster: Cluster,
) -> None:
    """The one mapping every server shares (``kvpool.service.ParseRequests``): prefill, decode and router here,
    the master and the stores in test_master_bad_input.py."""
    def address(name: str) -> str:
        return f"127.0.0.1:{cluster.find(name).ready['port']}"

    assert assert_unparsable_bytes_refused(address("p0-stage0"), [
        "kvpool.rpc.Prefill", "kvpool.rpc.PrefillStage", HEALTH]) >= 6
    assert assert_unparsable_bytes_refused(address("decode0"), ["kvpool.rpc.Decode", HEALTH]) >= 6
    assert assert_unparsable_bytes_refused(address("router"), ["kvpool.rpc.Router", HEALTH]) >= 3


def test_temperature_nan_over_grpc_is_invalid_argument_naming_it(channel: grpc.Channel) -> None:
    request = router_pb2.GenerateRequest(token_ids=[1, 2], sampling=router_pb2.SamplingParams(
        temperature=float("nan"), max_tokens=2))
    with pytest.raises(grpc.RpcError) as info:
        list(router_pb2_grpc.RouterStub(channel).Generate(request, timeout=60))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith("sampling.temperature:")


def test_grpc_text_past_the_context_is_refused_untokenized_and_past_the_body_limit_unread(channel: grpc.Channel) -> None:
    stub = router_pb2_grpc.RouterStub(channel)
    request = router_pb2.GenerateRequest(text="a" * 100_000, sampling=router_pb2.SamplingParams(max_tokens=2))
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(request, timeout=60))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith("text: the prompt's text has 100000 characters")
    huge = router_pb2.GenerateRequest(text="a" * (33 << 20))  # past the 32 MiB the HTTP API takes too
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(huge, timeout=60))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_greedy_output_is_unchanged_after_the_fuzz(
    cluster: Cluster, channel: grpc.Channel, greedy_before: tuple[str, list[int]]
) -> None:
    assert greedy_now(cluster, channel) == greedy_before
    assert len(greedy_before[1]) >= 1


def test_a_failure_after_the_first_token_ends_the_stream_with_an_error_event_then_done(cluster: Cluster) -> None:
    """Last: it kills the decode shard."""
    host, port = cluster.http_url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    try:
        conn.request("POST", "/v1/chat/completions", chat_body(max_tokens=3000, temperature=0, stream=True),
                     {"Content-Type": "application/json"})
        response = conn.getresponse()
        assert response.status == 200
        assert json.loads(response.readline().removeprefix(b"data: "))["choices"][0]["delta"]["role"] == "assistant"
        cluster.find("decode0").kill()
        events = [line.strip() for line in response.read().split(b"\n\n") if line.strip()]
    finally:
        conn.close()
    assert events[-1] == b"data: [DONE]"
    error = json.loads(events[-2].removeprefix(b"data: "))["error"]
    assert error["type"] == "server_error" and error["message"]
