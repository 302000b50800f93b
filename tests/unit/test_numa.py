from __future__ import annotations

import ctypes
import errno
import json
import mmap
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvpool.host_numa import format_cpulist, numa_nodes, parse_cpulist
from kvpool.services.store import numa
from kvpool.services.store.numa import MPOL_BIND, bind_to_node, get_memory_policy, mbind_range

REPO_ROOT = Path(__file__).resolve().parents[2]


def mempolicy_allowed() -> bool:
    # containers under the default seccomp profile refuse all *mempolicy calls
    try:
        get_memory_policy()
    except OSError as exc:
        if exc.errno in (errno.EPERM, errno.ENOSYS):
            return False
        raise
    return True


def run_isolated(code: str) -> dict:
    """Run `code` in a fresh interpreter (binding changes the whole process)
    and return the JSON it prints last."""
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def fake_sysfs(root: Path, cpulists: dict[str, str]) -> Path:
    for name, cpulist in cpulists.items():
        (root / name).mkdir()
        (root / name / "cpulist").write_text(cpulist + "\n")
    (root / "possible").write_text("0-2\n")  # files next to node dirs are ignored
    (root / "has_cpu").write_text("0-1\n")
    return root


# -- parsing -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "cpus"),
    [
        ("0-3,8-11\n", [0, 1, 2, 3, 8, 9, 10, 11]),
        ("0-1", [0, 1]),
        ("5", [5]),
        ("0,2,4", [0, 2, 4]),
        ("8-9,0-1", [0, 1, 8, 9]),
        ("0-0", [0]),
        ("", []),
        ("\n", []),
    ],
)
def test_parse_cpulist(text: str, cpus: list[int]) -> None:
    assert parse_cpulist(text) == cpus


@pytest.mark.parametrize("text", ["a", "1-", "-1", "3-1", "0-3,x", "1:2"])
def test_parse_cpulist_rejects_malformed(text: str) -> None:
    with pytest.raises(ValueError, match="malformed cpulist"):
        parse_cpulist(text)


@pytest.mark.parametrize(
    ("cpus", "text"),
    [([0, 1, 2, 3, 8], "0-3,8"), ([0, 1], "0-1"), ([7], "7"), ([0, 2, 3, 5], "0,2-3,5"), ([], "")],
)
def test_format_cpulist(cpus: list[int], text: str) -> None:
    assert format_cpulist(cpus) == text
    assert parse_cpulist(text) == cpus


# -- node discovery ------------------------------------------------------------


def test_numa_nodes_reads_sysfs(tmp_path: Path) -> None:
    root = fake_sysfs(
        tmp_path, {"node0": "0-3,8-11", "node1": "4-7,12-15", "node10": "", "nodefoo": "0"}
    )
    assert numa_nodes(root) == {
        0: [0, 1, 2, 3, 8, 9, 10, 11],
        1: [4, 5, 6, 7, 12, 13, 14, 15],
        10: [],  # memory-only node (e.g. CXL)
    }
    assert list(numa_nodes(root)) == [0, 1, 10]


def test_numa_nodes_falls_back_to_one_node_without_sysfs(tmp_path: Path) -> None:
    assert numa_nodes(tmp_path) == {0: sorted(os.sched_getaffinity(0))}
    assert numa_nodes(tmp_path / "missing") == {0: sorted(os.sched_getaffinity(0))}


def test_numa_nodes_on_this_host() -> None:
    # the dev host: one node, cpus 0-1
    nodes = numa_nodes()
    if nodes != {0: [0, 1]}:
        pytest.skip(f"not the one-node 2-cpu dev host: {nodes}")
    assert nodes == {0: [0, 1]}


# -- binding -------------------------------------------------------------------


@pytest.mark.cluster
def test_bind_to_node_pins_every_thread() -> None:
    result = run_isolated(
        """
        import json, os, threading
        from kvpool.services.store.numa import bind_to_node, numa_nodes, get_memory_policy
        cpus = numa_nodes()[0]
        # start narrower than the node, so the bind has to widen the mask
        os.sched_setaffinity(0, cpus[:1])
        ready, stop = threading.Event(), threading.Event()
        worker = threading.Thread(target=lambda: (ready.set(), stop.wait()))
        worker.start()
        ready.wait()
        binding = bind_to_node(0)
        out = {
            "node_cpus": cpus,
            "binding": [binding.node, list(binding.cpus), binding.memory_policy_applied,
                        binding.single_node, binding.detail],
            "main": sorted(os.sched_getaffinity(0)),
            "worker": sorted(os.sched_getaffinity(worker.native_id)),
            "policy": list(get_memory_policy()) if binding.memory_policy_applied else None,
        }
        stop.set()
        worker.join()
        print(json.dumps(out))
        """
    )
    node_cpus = result["node_cpus"]
    node, cpus, applied, single_node, detail = result["binding"]
    assert node == 0
    assert cpus == node_cpus
    assert result["main"] == node_cpus
    assert result["worker"] == node_cpus  # an existing thread, not only the caller
    assert single_node == (len(numa_nodes()) == 1)
    if single_node:
        assert "one NUMA node; pinning is a no-op for memory" in detail
    if mempolicy_allowed():
        assert applied
        assert result["policy"] == [MPOL_BIND, [0]]
        assert "memory policy MPOL_BIND node 0" in detail
    else:
        assert not applied
        assert "set_mempolicy failed" in detail


@pytest.mark.cluster
def test_bind_to_node_carries_on_when_mempolicy_is_refused() -> None:
    result = run_isolated(
        """
        import errno, json, os
        from kvpool.services.store import numa
        def refuse(name, *args):
            raise OSError(errno.EPERM, os.strerror(errno.EPERM), name)
        numa._syscall = refuse
        b = numa.bind_to_node(0)
        print(json.dumps([list(b.cpus), b.memory_policy_applied, b.detail]))
        """
    )
    cpus, applied, detail = result
    assert cpus == numa_nodes()[0]
    assert applied is False
    assert "set_mempolicy failed: EPERM (Operation not permitted)" in detail


def test_bind_to_unknown_node_raises(tmp_path: Path) -> None:
    before = os.sched_getaffinity(0)
    present = sorted(numa_nodes())
    with pytest.raises(ValueError, match=rf"NUMA node 7 does not exist; nodes present: \{present}"):
        bind_to_node(7)
    root = fake_sysfs(tmp_path, {"node0": "0-1", "node2": "2-3"})
    with pytest.raises(ValueError, match=r"NUMA node 1 does not exist; nodes present: \[0, 2\]"):
        bind_to_node(1, node_root=root)
    with pytest.raises(ValueError, match="NUMA node -1 does not exist"):
        bind_to_node(-1)
    assert os.sched_getaffinity(0) == before  # nothing was changed


def test_bind_to_memory_only_node_raises(tmp_path: Path) -> None:
    root = fake_sysfs(tmp_path, {"node0": "0-1", "node1": ""})
    with pytest.raises(ValueError, match="NUMA node 1 has no CPUs"):
        bind_to_node(1, node_root=root)


# -- mbind ---------------------------------------------------------------------


def mapped(length: int) -> tuple[mmap.mmap, int]:
    region = mmap.mmap(-1, length)
    anchor = ctypes.c_char.from_buffer(region)
    addr = ctypes.addressof(anchor)
    del anchor  # release the buffer export so the map can close
    return region, addr


def test_mbind_range_binds_untouched_pages() -> None:
    if not mempolicy_allowed():
        pytest.skip("this host forbids memory-policy syscalls")
    region, addr = mapped(4 << 20)
    try:
        assert mbind_range(addr, len(region), 0) is True
        assert get_memory_policy(addr) == (MPOL_BIND, (0,))
        region[:4] = b"kvpl"  # first touch after the bind still works
        assert region[:4] == b"kvpl"
    finally:
        region.close()


def test_mbind_range_reports_refusal(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(name: str, *args: object) -> int:
        raise OSError(errno.ENOSYS, os.strerror(errno.ENOSYS), name)

    region, addr = mapped(mmap.PAGESIZE)
    try:
        monkeypatch.setattr(numa, "_syscall", refuse)
        assert mbind_range(addr, len(region), 0) is False
    finally:
        region.close()


def test_mbind_range_rejects_bad_arguments() -> None:
    region, addr = mapped(2 * mmap.PAGESIZE)
    try:
        with pytest.raises(ValueError, match="not page-aligned"):
            mbind_range(addr + 64, mmap.PAGESIZE, 0)
        with pytest.raises(ValueError, match="length must be a positive int"):
            mbind_range(addr, 0, 0)
        with pytest.raises(ValueError, match="addr must be a positive int"):
            mbind_range(0, mmap.PAGESIZE, 0)
        with pytest.raises(ValueError, match="NUMA node 9 does not exist"):
            mbind_range(addr, mmap.PAGESIZE, 9)
    finally:
        region.close()


def test_mbind_range_of_unmapped_memory_raises() -> None:
    if not mempolicy_allowed():
        pytest.skip("this host forbids memory-policy syscalls")
    region, addr = mapped(mmap.PAGESIZE)
    region.close()  # a caller bug, not a host limitation: must not read as "refused"
    with pytest.raises(OSError) as excinfo:
        mbind_range(addr, mmap.PAGESIZE, 0)
    assert excinfo.value.errno == errno.EFAULT
