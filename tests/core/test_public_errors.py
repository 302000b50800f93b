"""A backend's failure as an API client reads it: named by its index, every internal address redacted."""

from __future__ import annotations

from kvpool.core.errors import InvalidArgument, ResourceExhausted, Unavailable
from kvpool.core.api.public_errors import backend_label, public_error, redact_addresses, served_by


def test_the_issue_message_loses_its_address() -> None:
    message = "prefill pipeline 127.0.0.1:45937: UNAVAILABLE: stage 1: DEADLINE_EXCEEDED: Deadline Exceeded"
    assert redact_addresses(message) == \
        "prefill pipeline <address>: UNAVAILABLE: stage 1: DEADLINE_EXCEEDED: Deadline Exceeded"


def test_every_address_form_is_redacted() -> None:
    assert redact_addresses("last error: UNKNOWN: ipv4:127.0.0.1:45937: Failed to connect to remote host") == \
        "last error: UNKNOWN: <address>: Failed to connect to remote host"
    assert redact_addresses("ipv6:[::1]:50051 refused") == "<address> refused"
    assert redact_addresses("writing to decode at prefill-0.internal:7001 failed") == \
        "writing to decode at <address> failed"
    assert redact_addresses("dial unix:/tmp/kv/router.sock, then") == "dial <address>, then"
    assert redact_addresses("host 10.0.0.12 is down") == "host <address> is down"
    assert redact_addresses("localhost:8000") == "<address>"


def test_numbers_and_field_prefixes_survive() -> None:
    for text in ("stage 1: DEADLINE_EXCEEDED", "token_ids[3]: 70000 is not below the vocabulary's 256",
                 "max_tokens: a 12-token prompt plus 20 tokens", "took 12:30 minutes", "version 1.2.3"):
        assert redact_addresses(text) == text


def test_backend_label_is_the_configured_index() -> None:
    names = ["127.0.0.1:45937", "127.0.0.1:45939"]
    assert backend_label("prefill pipeline", names, "127.0.0.1:45939") == "prefill pipeline 1"
    assert backend_label("decode shard", names, "10.0.0.1:1") == "decode shard <address>"


def test_served_by_names_both_backends_as_the_errors_do() -> None:
    pipelines, shards = ["127.0.0.1:45937", "127.0.0.1:45939"], ["127.0.0.1:5001", "127.0.0.1:5002"]
    assert served_by(pipelines, shards, "127.0.0.1:45939", "127.0.0.1:5001") == \
        ("prefill pipeline 1", "decode shard 0")
    assert served_by(pipelines, shards, "127.0.0.1:45937", "") == ("prefill pipeline 0", "")
    assert served_by(pipelines, shards, "", "") == ("", "")
    assert served_by(pipelines, shards, "10.0.0.1:1", "127.0.0.1:5002") == ("prefill pipeline <address>", "decode shard 1")


def test_public_error_keeps_class_field_and_retry_hint() -> None:
    exhausted = ResourceExhausted("decode 127.0.0.1:5001: no pages", field="max_tokens", retry_after_s=2.0)
    public = public_error(exhausted)
    assert type(public) is ResourceExhausted
    assert (public.message, public.field, public.retry_after_s) == ("decode <address>: no pages", "max_tokens", 2.0)
    # no field stays no field: never read back out of the redacted text
    unavailable = public_error(Unavailable("target: decode at 127.0.0.1:5001 down", field=""))
    assert (unavailable.message, unavailable.field) == ("target: decode at <address> down", None)
    clean = InvalidArgument("prompt: must not be empty", field="prompt")
    assert public_error(clean) is clean
