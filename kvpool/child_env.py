"""An environment variable the processes started within a block inherit (a trace or a record to write)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator


@contextlib.contextmanager
def children_env(name: str, value: str) -> Iterator[None]:
    """Within: ``name`` is ``value`` for the processes started here; the variable is as it was afterwards."""
    previous = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = previous
