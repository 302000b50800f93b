from __future__ import annotations

import ast
import os
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

# the tier guard: only tests marked ``cluster`` may start processes
from tests.process_guard import (  # noqa: F401  (pytest finds hooks by name)
    pytest_addoption,
    pytest_configure,
    pytest_runtest_call,
    pytest_runtest_setup,
    pytest_runtest_teardown,
    pytest_terminal_summary,
)

# pytest keeps each test module's rewritten asserts as bytecode, unless bytecode writing is off. Where the
# environment turns it off (PYTHONDONTWRITEBYTECODE, as the development hosts' image does), every worker of
# every run rewrote the whole suite again: 13 s to collect the fast tier in one process, 7.6 s with the
# rewrites kept. Kept here (in the test tree's git-ignored __pycache__), only a checkout's first run pays.
# The processes the tests start keep the environment as it is.
sys.dont_write_bytecode = False

# pytester runs an inner pytest session in this process (the guard's own test)
pytest_plugins = ("pytester",)

# keep every process in the tests to one compute thread (CI has 2 cores)
os.environ.setdefault("OMP_NUM_THREADS", "1")
# no transparent huge pages for the suite's buffers: on a host whose memory is fragmented, each 2 MiB fault
# in a madvised region compacts memory first, and a 4-stage pipeline then cost 7.8-11.4 s of CPU to start
# instead of 4.0-5.2 s (the suite starts hundreds of processes). They are a throughput setting, on by
# default and measured by the benches; tests/unit/test_handoff_transfer.py checks a buffer asks for them.
os.environ.setdefault("KVPOOL_HUGE_PAGES", "0")

# Hypothesis's own clocks are wall-clock assertions: a 200 ms deadline per example and a health check
# that data generation is not "too slow". On a host shared by a parallel run they failed examples that
# were right (test_handoff_landing, test_served_context, at load 12-20). Examples and strategies are
# as each test sets them; only the clocks are off.
settings.register_profile("kvpool", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("kvpool")


def fast_tier_alone(config: pytest.Config) -> bool:
    """The run is ``-m "not cluster"``: no test marked ``cluster`` runs."""
    return " ".join(str(config.getoption("markexpr", "")).split()) == "not cluster"


def wholly_cluster(source: str) -> bool:
    """The module marks every test of it ``cluster``: its ``pytestmark`` is ``pytest.mark.cluster`` or a list or
    tuple holding it (read from the source, not imported)."""
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "pytestmark"
                                                for t in node.targets):
            marks = node.value.elts if isinstance(node.value, (ast.List, ast.Tuple)) else [node.value]
            return any(ast.unparse(mark) == "pytest.mark.cluster" for mark in marks)
    return False


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """The fast tier alone does not import the modules whose every test it would deselect: their imports (the
    ``openai`` client, the cluster fixtures) were a second of CPU in each worker."""
    if collection_path.suffix == ".py" and collection_path.name.startswith("test_") and fast_tier_alone(config):
        return True if wholly_cluster(collection_path.read_text()) else None
    return None


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto``: half again as many workers as cores. A cluster test spends much of its time waiting on
    its processes (one request through a pipeline computes on one stage at a time), so one worker per
    core leaves cores idle. The fast tier alone (``-m "not cluster"``) only computes: a worker per core,
    since every worker imports and collects the whole suite first (torch, transformers: seconds each)."""
    cores = len(os.sched_getaffinity(0))
    if fast_tier_alone(config):
        return max(1, cores)
    return max(2, (3 * cores + 1) // 2)


# Test files whose tests import transformers and build its DeepSeek-V3 model: seconds of CPU in each process, the
# first time (0.8 s the package, 2.5 s the model's modules). One worker runs them all, so the fast tier pays it
# once, not once a worker. ``tests/unit/test_tier_collection.py`` checks every such file of the fast tier is named.
TRANSFORMERS_FILES = frozenset({
    "tests/model/test_hf_directory.py",
    "tests/model/test_hf_moe.py",
    "tests/model/test_hf_reference.py",
    "tests/model/test_moe.py",
    "tests/model/test_published_configs.py",
})
TRANSFORMERS_SCOPE = "tests/model (transformers)"


def xdist_scope(nodeid: str) -> str:
    """The work unit a test belongs to: its file, except that the files in ``TRANSFORMERS_FILES`` are one."""
    path = nodeid.split("::", 1)[0]
    return TRANSFORMERS_SCOPE if path in TRANSFORMERS_FILES else path


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object | None:
    """``--dist loadfile`` (addopts) with ``xdist_scope``'s work units; any other mode as xdist has it."""
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class FileScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return xdist_scope(nodeid)

    return FileScheduling(config, log)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Cluster tests first, those allowed the longest timeout first among them, opt-in tests skipped
    here last: the parallel workers each start on a long file and the short ones fill the tail
    (the order is kept: addopts has --no-loadscope-reorder)."""

    def timeout(item: pytest.Item) -> float:
        marker = item.get_closest_marker("timeout")
        return float(marker.args[0] if marker is not None and marker.args else item.config.getini("timeout"))

    def skipped(item: pytest.Item) -> bool:
        return any(m.args and m.args[0] is True for m in item.iter_markers("skipif"))

    items.sort(key=lambda item: (skipped(item), item.get_closest_marker("cluster") is None, -timeout(item)))
