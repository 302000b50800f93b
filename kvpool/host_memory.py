"""What memory this host (or this process's cgroup) has available now, for refusing to start what cannot fit."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from kvpool.core.supervision.memory_budget import memory_refusal


def available_bytes() -> int | None:
    """``MemAvailable`` from /proc/meminfo, lowered to the cgroup's ``memory.max`` headroom when that is smaller;
    None where neither can be read."""
    available: int | None = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
                break
    except OSError:
        pass
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        current = int(Path("/sys/fs/cgroup/memory.current").read_text().strip())
        if limit != "max":
            headroom = int(limit) - current
            available = headroom if available is None else min(available, headroom)
    except (OSError, ValueError):
        pass
    return available


def refuse_unless_fits(service: str, sizes: Mapping[str, int]) -> None:
    """Exit (SystemExit, no traceback) with a message naming the settings when ``sizes`` exceed what the host has
    available now; a service calls it before it allocates anything."""
    message = memory_refusal(service, sizes, available_bytes())
    if message is not None:
        raise SystemExit(f"kvpool {message}")
