"""This host's NUMA nodes and their CPUs, from sysfs; the kernel's cpulist form.

Read by a store daemon to pin itself (``kvpool.services.store.numa``) and by ``kvpool up`` to place one
store per node.
"""

from __future__ import annotations

import os
from pathlib import Path

NODE_ROOT = Path("/sys/devices/system/node")


def parse_cpulist(text: str) -> list[int]:
    """Parse a kernel cpulist ("0-3,8-11", "5", "" for no CPUs) into sorted CPU ids."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        first, sep, last = part.partition("-")
        try:
            lo = int(first)
            hi = int(last) if sep else lo
        except ValueError:
            raise ValueError(f"malformed cpulist {text!r}: bad range {part!r}") from None
        if lo < 0 or hi < lo:
            raise ValueError(f"malformed cpulist {text!r}: bad range {part!r}")
        cpus.update(range(lo, hi + 1))
    return sorted(cpus)


def format_cpulist(cpus: tuple[int, ...] | list[int]) -> str:
    """Sorted CPU ids back to kernel cpulist form: (0, 1, 2, 3, 8) -> "0-3,8"."""
    ranges: list[str] = []
    i = 0
    while i < len(cpus):
        j = i
        while j + 1 < len(cpus) and cpus[j + 1] == cpus[j] + 1:
            j += 1
        ranges.append(str(cpus[i]) if i == j else f"{cpus[i]}-{cpus[j]}")
        i = j + 1
    return ",".join(ranges)


def numa_nodes(node_root: Path = NODE_ROOT) -> dict[int, list[int]]:
    """NUMA node id -> its CPU ids, from sysfs. A memory-only node maps to [].
    Without node directories (no NUMA support or no /sys), the whole host is
    node 0 with the CPUs this process may run on."""
    nodes: dict[int, list[int]] = {}
    for path in node_root.glob("node*"):
        suffix = path.name.removeprefix("node")
        if suffix.isdigit():
            nodes[int(suffix)] = parse_cpulist((path / "cpulist").read_text())
    if not nodes:
        return {0: sorted(os.sched_getaffinity(0))}
    return dict(sorted(nodes.items()))
