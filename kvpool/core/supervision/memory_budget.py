"""Whether a service's configured memory fits the host: refuse to start rather than be killed later.

Pure: the caller reads what the host has (``kvpool.host_memory``) and names
its settings; the answer is the message to refuse with, or None.
"""

from __future__ import annotations

from collections.abc import Mapping


def _size(num_bytes: int) -> str:
    if num_bytes < 2**30:
        return f"{num_bytes / 2**20:.0f} MiB"
    return f"{num_bytes / 2**30:.1f} GiB" if num_bytes < 2**40 else f"{num_bytes / 2**40:.1f} TiB"


def memory_refusal(service: str, sizes: Mapping[str, int], available_bytes: int | None) -> str | None:
    """None when the sum of ``sizes`` (setting name → bytes it allocates) fits ``available_bytes`` (unknown: fits);
    else a message naming every setting, its bytes, the sum and what the host has."""
    total = sum(sizes.values())
    if available_bytes is None or total <= available_bytes:
        return None
    parts = ", ".join(f"{name} {_size(num_bytes)}" for name, num_bytes in sizes.items())
    return (f"{service}: the configured memory ({parts}: {_size(total)} in all) exceeds the "
            f"{_size(available_bytes)} this host has available; lower {' or '.join(sizes)}")
