"""NUMA pinning for a store daemon: CPU affinity plus an MPOL_BIND memory policy.

A store daemon serves one DRAM segment from one NUMA node. It calls
`bind_to_node` first thing, before it starts threads or maps the segment, so
that its threads run on that node's CPUs and the segment's pages come from
that node's memory. `mbind_range` binds an already-mapped (not yet touched)
range explicitly, which also covers pages first touched by other threads.

Memory policy is best-effort: containers often forbid set_mempolicy / mbind
(EPERM under the default seccomp profile) and non-NUMA kernels lack them
(ENOSYS). The daemon then still runs, with memory placed by first touch.
"""

from __future__ import annotations

import ctypes
import errno
import os
from dataclasses import dataclass
from pathlib import Path

from kvpool.host_numa import NODE_ROOT, format_cpulist, numa_nodes

MPOL_DEFAULT = 0
MPOL_BIND = 2
_MPOL_F_ADDR = 2  # get_mempolicy: report the policy of the page at addr

# per-architecture syscall numbers (asm/unistd.h)
_SYSCALL_NUMBERS: dict[str, dict[str, int]] = {
    "x86_64": {"mbind": 237, "set_mempolicy": 238, "get_mempolicy": 239},
    "aarch64": {"mbind": 235, "get_mempolicy": 236, "set_mempolicy": 237},
}
_ULONG_BITS = ctypes.sizeof(ctypes.c_ulong) * 8
_libc: ctypes.CDLL | None = None


@dataclass(frozen=True, slots=True)
class NumaBinding:
    """The outcome of `bind_to_node`. `cpus` is the affinity actually in force
    afterwards; memory placement is bound only if `memory_policy_applied`."""

    node: int
    cpus: tuple[int, ...]
    memory_policy_applied: bool
    single_node: bool
    detail: str


def bind_to_node(node: int, *, node_root: Path = NODE_ROOT) -> NumaBinding:
    """Pin every thread of this process to `node`'s CPUs and bind the calling
    thread's memory policy to `node` (MPOL_BIND).

    Call before the segment memory is touched and before starting threads:
    threads inherit affinity and memory policy from the thread that creates
    them, while memory policy is per thread, so threads that already exist
    keep theirs (use `mbind_range` on the segment to cover them).

    Raises ValueError if `node` does not exist or has no CPUs; OSError if the
    CPU affinity cannot be set. A refused memory policy is not an error: see
    `memory_policy_applied` and `detail`.
    """
    nodes = numa_nodes(node_root)
    cpus = _node_cpus(nodes, node)
    if not cpus:
        raise ValueError(
            f"NUMA node {node} has no CPUs (memory-only); nodes present: {sorted(nodes)}"
        )
    _set_affinity_all_threads(cpus)
    effective = tuple(sorted(os.sched_getaffinity(0)))

    notes = [f"cpus {format_cpulist(effective)}"]
    try:
        _syscall("set_mempolicy", ctypes.c_int(MPOL_BIND), *_nodemask(node))
        applied = True
        notes.append(f"memory policy MPOL_BIND node {node}")
    except OSError as exc:
        if exc.errno == errno.EFAULT:
            raise  # our own bad pointer: a bug, not a host limitation
        applied = False
        notes.append(f"set_mempolicy failed: {_errno_text(exc)}; memory placed by first touch")
    single_node = len(nodes) == 1
    if single_node:
        notes.append("one NUMA node; pinning is a no-op for memory")
    return NumaBinding(node, effective, applied, single_node, "; ".join(notes))


def mbind_range(addr: int, length: int, node: int, *, node_root: Path = NODE_ROOT) -> bool:
    """Bind the pages of [addr, addr + length) to `node` (MPOL_BIND) before they
    are first touched. `addr` must be page-aligned (mmap'd memory is).

    Returns False if the host refuses (EPERM in a container, ENOSYS without
    NUMA): the memory still works, placed by first touch. Raises ValueError for
    bad arguments or an unknown node; OSError(EFAULT) for an unmapped range.
    """
    if isinstance(addr, bool) or not isinstance(addr, int) or addr <= 0:
        raise ValueError(f"addr must be a positive int, got {addr!r}")
    if addr % os.sysconf("SC_PAGE_SIZE"):
        raise ValueError(f"addr {addr:#x} is not page-aligned")
    if isinstance(length, bool) or not isinstance(length, int) or length <= 0:
        raise ValueError(f"length must be a positive int, got {length!r}")
    _node_cpus(numa_nodes(node_root), node)
    mask, maxnode = _nodemask(node)
    try:
        _syscall(
            "mbind",
            ctypes.c_void_p(addr),
            ctypes.c_ulong(length),
            ctypes.c_int(MPOL_BIND),
            mask,
            maxnode,
            ctypes.c_uint(0),  # no MPOL_MF_MOVE: the pages are not touched yet
        )
    except OSError as exc:
        if exc.errno == errno.EFAULT:
            raise
        return False
    return True


def get_memory_policy(addr: int | None = None) -> tuple[int, tuple[int, ...]]:
    """(mode, nodes) of the calling thread's memory policy, or of the page at
    `addr` if given. Raises OSError where the host forbids get_mempolicy."""
    mode = ctypes.c_int(-1)
    words = 1024 // _ULONG_BITS  # room for 1024 nodes, the usual MAX_NUMNODES
    mask = (ctypes.c_ulong * words)()
    flags = 0 if addr is None else _MPOL_F_ADDR
    _syscall(
        "get_mempolicy",
        ctypes.byref(mode),
        mask,
        ctypes.c_ulong(words * _ULONG_BITS + 1),
        ctypes.c_void_p(addr),
        ctypes.c_ulong(flags),
    )
    nodes = tuple(
        w * _ULONG_BITS + b for w in range(words) for b in range(_ULONG_BITS) if mask[w] >> b & 1
    )
    return mode.value, nodes


# -- internals -----------------------------------------------------------------


def _node_cpus(nodes: dict[int, list[int]], node: int) -> list[int]:
    if isinstance(node, bool) or not isinstance(node, int) or node not in nodes:
        raise ValueError(f"NUMA node {node!r} does not exist; nodes present: {sorted(nodes)}")
    return nodes[node]


def _set_affinity_all_threads(cpus: list[int]) -> None:
    # repeat until no new thread shows up: one created mid-scan may have
    # inherited the old mask from a thread we had not reached yet
    done: set[int] = set()
    while True:
        tids = {int(name) for name in os.listdir("/proc/self/task")} - done
        if not tids:
            return
        for tid in tids:
            try:
                os.sched_setaffinity(tid, cpus)
            except ProcessLookupError:
                pass  # the thread exited meanwhile
        done |= tids


def _nodemask(node: int) -> tuple[ctypes.Array[ctypes.c_ulong], ctypes.c_ulong]:
    words = node // _ULONG_BITS + 1
    mask = (ctypes.c_ulong * words)()
    mask[node // _ULONG_BITS] = 1 << (node % _ULONG_BITS)
    # the kernel reads maxnode - 1 bits, hence the + 1
    return mask, ctypes.c_ulong(words * _ULONG_BITS + 1)


def _syscall(name: str, *args: object) -> int:
    """Raw syscall by name; raises OSError with the errno on failure."""
    number = _SYSCALL_NUMBERS.get(os.uname().machine, {}).get(name)
    if number is None:
        raise OSError(errno.ENOSYS, os.strerror(errno.ENOSYS), f"{name} on {os.uname().machine}")
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.syscall.restype = ctypes.c_long
    result = _libc.syscall(ctypes.c_long(number), *args)
    if result == -1:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), name)
    return int(result)


def _errno_text(exc: OSError) -> str:
    code = errno.errorcode.get(exc.errno or 0, str(exc.errno))
    return f"{code} ({exc.strerror})"
