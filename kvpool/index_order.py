"""The pool index's order of groups in C (``kvpool/native/lru.c``, a module that also holds the passes over group
records and the segments' allocator): built where this checkout lacks it, and whether new group tables use it. The master calls ``ensure`` as it starts (``scripts/setup.sh`` builds it ahead); the core
only looks for the built module (``kvpool.core.pool.lru``)."""

from __future__ import annotations

import os

from kvpool import native_build
from kvpool.core.pool import lru


def ensure() -> tuple[bool, str]:
    """Build the order unless built or switched off (``KVPOOL_NATIVE_ORDER=off``): whether new group tables use
    it, and if not, why (``""`` when switched off on purpose)."""
    if os.environ.get(lru.SWITCH_ENV, "on") == "off":
        return False, ""
    try:
        native_build.build_index_order()
    except native_build.NativeUnavailable as exc:
        return False, str(exc).splitlines()[0]
    return (True, "") if lru.native() else (False, "its module was built but did not load")
