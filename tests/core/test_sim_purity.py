"""The simulator drives the core without the services' libraries: every kvpool.tools.sim module imports with
grpc, protobuf, torch and mooncake blocked (matplotlib is imported only inside the plot function)."""

from __future__ import annotations

import pkgutil
import subprocess
import sys

import pytest

import kvpool.tools.sim
from tests.core.test_purity import PROBE, ROOT

pytestmark = pytest.mark.cluster

BLOCKED = ("grpc", "google.protobuf", "torch", "mooncake", "numpy", "matplotlib")


def sim_modules() -> list[str]:
    return ["kvpool.tools.sim"] + [f"kvpool.tools.sim.{m.name}" for m in pkgutil.iter_modules(kvpool.tools.sim.__path__)]


def run_probe(modules: list[str]) -> subprocess.CompletedProcess[str]:
    code = PROBE.format(blocked=BLOCKED, modules=modules)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)


def test_every_sim_module_imports_without_service_libraries() -> None:
    modules = sim_modules()
    assert {"kvpool.tools.sim.engine", "kvpool.tools.sim.prefill_sim", "kvpool.tools.sim.decode_sim"} <= set(modules)
    result = run_probe(modules)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"imported {len(modules)}"


def test_the_probe_catches_a_module_that_needs_grpc() -> None:
    result = run_probe(["kvpool.status"])
    assert result.returncode != 0
    assert "the core must not import grpc" in result.stderr
