"""What an API client may read of a backend's failure: the failure, never an internal address.

The router names its backends to clients by their place in its configuration
(``prefill pipeline 0``, ``decode shard 1``), never by host:port: in errors and
in a served request's usage alike (``served_by``). A
backend's own message (which may quote a stage's, a decode's or a transfer
engine's address, or gRPC's ``ipv4:127.0.0.1:45937``) reaches the client with
every address replaced by ``<address>``. The full message stays in the
router's log, bound to the request id.
"""

from __future__ import annotations

import re

from kvpool.core.errors import KvpoolError

REDACTED = "<address>"

# an optional gRPC scheme, then a host (dotted IPv4, [IPv6] or a name starting with a letter) and a
# port; a unix socket path; a bare IPv4. Names must start with a letter so "stage 1: 12:30" keeps its numbers.
_ADDRESS = re.compile(
    r"(?:\b(?:ipv4|ipv6|dns):)?"
    r"(?:\[[0-9A-Fa-f:.%\w]*\]|\b\d{1,3}(?:\.\d{1,3}){3}|\b[A-Za-z][A-Za-z0-9-]*(?:\.[A-Za-z0-9-]+)*):\d{1,5}\b"
    r"|\bunix(?:-abstract)?:[^\s,;)]+"
    r"|\b\d{1,3}(?:\.\d{1,3}){3}\b"
)


def redact_addresses(text: str) -> str:
    """``text`` with every host:port, unix socket path and IPv4 address replaced by ``<address>``."""
    return _ADDRESS.sub(REDACTED, text)


def backend_label(kind: str, names: list[str], name: str) -> str:
    """A backend as a client may see it: ``kind`` and its index among the configured ``names``."""
    return f"{kind} {names.index(name)}" if name in names else f"{kind} {REDACTED}"


PIPELINE = "prefill pipeline"
SHARD = "decode shard"


def served_by(pipelines: list[str], shards: list[str], pipeline: str, shard: str) -> tuple[str, str]:
    """The pipeline and shard that served a request, as its usage names them to the client (the
    same labels its errors use); ``""`` for one the request never reached."""
    return (backend_label(PIPELINE, pipelines, pipeline) if pipeline else "",
            backend_label(SHARD, shards, shard) if shard else "")


def public_error(error: KvpoolError) -> KvpoolError:
    """The same error (class, field, retry hint) with every address redacted from its message."""
    message = redact_addresses(error.message)
    if message == error.message:
        return error
    # field "" keeps "no field" from being read back out of the redacted text
    return type(error)(message, field=error.field or "", retry_after_s=error.retry_after_s)
