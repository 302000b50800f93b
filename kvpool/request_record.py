"""What each request saw, recorded on request: one JSON object a line, in the order it happened in the
writing process, for ``kvpool simulate --validate`` (which reads these, never a service's log).

Set ``KVPOOL_REQUEST_RECORD`` to a file (``recording_children``) and the services started with it append:

- the router: ``{"source": "router", "kind": "effect", "event": ..., "effect": ..., ...}`` for every effect
  of its request driver (``kvpool.core.admission.request_driver.effect_fields``), in order, once the request
  ended;
- stage 0: ``{"source": "stage0", "kind": "touch", ...}`` at a turn's arrival (it touches its session's
  cached blocks), and ``{"kind": "effect", "effect": ..., ...}`` for every effect of its request driver
  (``kvpool.core.prefill.driver.effect_fields``), as the driver returns them, and after each admission
  ``{"kind": "blocks", "evicted": N}``: the device cache's evictions so far (``BlockManager.num_evicted``);
- the master: ``{"source": "master", "kind": "pool_op", "op": ..., ...}`` for each lookup, lease release,
  put start and put end, with its outcome.

Every line carries the request's id (the router's and stage 0's, its session key too). Unset, nothing is written and
nothing is paid. Lines are written whole with one append each, so several processes may share the file.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from kvpool.child_env import children_env

RECORD_ENV = "KVPOOL_REQUEST_RECORD"


class RequestRecord:
    """Appends records to the file ``KVPOOL_REQUEST_RECORD`` names (nothing when it names none)."""

    def __init__(self, source: str, path: str | None = None) -> None:
        self.source = source
        self.path = os.environ.get(RECORD_ENV, "") if path is None else path
        self._fd = -1

    @property
    def on(self) -> bool:
        return bool(self.path)

    def write(self, kind: str, request_id: str, **fields: Any) -> None:
        if not self.path:
            return
        if self._fd < 0:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        line = json.dumps({"source": self.source, "kind": kind, "request_id": request_id, **fields},
                          separators=(",", ":"), default=str)
        os.write(self._fd, (line + "\n").encode())


@contextmanager
def recording_children(path: Path) -> Iterator[None]:
    """Within: the processes started here record what their requests saw into ``path``."""
    with children_env(RECORD_ENV, str(path)):
        yield


def effects_by_request(records: list[dict[str, Any]], source: str) -> dict[str, list[dict[str, Any]]]:
    """Each request's driver effects that ``source`` recorded, in their order, as ``effect_fields`` gave them."""
    effects: dict[str, list[dict[str, Any]]] = {}
    for record in records:
        if record.get("source") == source and record.get("kind") == "effect":
            effects.setdefault(str(record.get("request_id")), []).append(
                {k: v for k, v in record.items() if k not in ("source", "kind", "request_id", "session_key")})
    return effects


def read_records(path: Path) -> list[dict[str, Any]]:
    """Every record in the file, in its order (a torn last line, of a process killed mid-write, is left out)."""
    records = []
    for line in path.read_text(errors="replace").splitlines() if path.exists() else []:
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    return records
