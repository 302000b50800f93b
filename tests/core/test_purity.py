"""The core is pure: every module imports with grpc, protobuf, torch, mooncake and networking blocked."""

from __future__ import annotations

import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import kvpool.core

pytestmark = pytest.mark.cluster

ROOT = Path(__file__).resolve().parents[2]
BLOCKED = ("grpc", "google.protobuf", "torch", "mooncake", "asyncio", "socket", "ssl", "selectors", "numpy")

PROBE = """
import importlib, importlib.abc, sys

BLOCKED = {blocked!r}

class Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if any(name == b or name.startswith(b + ".") for b in BLOCKED):
            raise ImportError(f"the core must not import {{name}}")
        return None

for name in list(sys.modules):
    if any(name == b or name.startswith(b + ".") for b in BLOCKED):
        del sys.modules[name]
sys.meta_path.insert(0, Blocker())
for module in {modules!r}:
    importlib.import_module(module)
leaked = sorted(n for n in sys.modules if any(n == b or n.startswith(b + ".") for b in BLOCKED))
assert not leaked, leaked
print("imported", len({modules!r}))
"""


def core_modules() -> list[str]:
    return ["kvpool.core"] + [m.name for m in pkgutil.walk_packages(kvpool.core.__path__, "kvpool.core.")]


def run_probe(modules: list[str]) -> subprocess.CompletedProcess[str]:
    code = PROBE.format(blocked=BLOCKED, modules=modules)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)


def test_every_core_module_imports_without_io_libraries() -> None:
    modules = core_modules()
    assert len(modules) >= 10  # the walk found the core, not an empty package
    result = run_probe(modules)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"imported {len(modules)}"


def test_the_probe_catches_an_impure_module() -> None:
    # the same probe fails on a module that needs grpc, so a pass above means something
    result = run_probe(["kvpool.status"])
    assert result.returncode != 0
    assert "the core must not import grpc" in result.stderr
