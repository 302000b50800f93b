"""The suite's work units (``tests/conftest.py``): the fast tier's test files that build transformers' model run
on one worker, so only one process pays its import.

Read from the source: a file counts when it imports ``transformers`` (at any depth) or the helper that writes a
transformers checkpoint (``tests.model.hf_directory``), and is not wholly a ``cluster`` file (those run their own
processes, which import it themselves)."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import TRANSFORMERS_FILES, TRANSFORMERS_SCOPE, xdist_scope

ROOT = Path(__file__).resolve().parents[2]
BUILDERS = ("transformers", "tests.model.hf_directory")


def imports_a_builder(tree: ast.Module) -> bool:
    for node in ast.walk(tree):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module or ""] if isinstance(node, ast.ImportFrom) else []
        if any(n == b or n.startswith(b + ".") for n in names for b in BUILDERS):
            return True
    return False


def wholly_cluster(tree: ast.Module) -> bool:
    return any(isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in node.targets)
               and "cluster" in ast.unparse(node.value) for node in tree.body)


def test_every_fast_file_that_builds_transformers_model_is_one_work_unit() -> None:
    found = set()
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        tree = ast.parse(path.read_text())
        if imports_a_builder(tree) and not wholly_cluster(tree):
            found.add(path.relative_to(ROOT).as_posix())
    assert found == TRANSFORMERS_FILES
    assert {xdist_scope(f"{name}::test_x") for name in found} == {TRANSFORMERS_SCOPE}


def test_any_other_file_is_its_own_work_unit() -> None:
    assert xdist_scope("tests/core/test_allocator.py::TestAllocatorMachine::runTest") == "tests/core/test_allocator.py"
    assert xdist_scope("tests/unit/test_admin_http.py::test_other_paths_are_404") == "tests/unit/test_admin_http.py"
