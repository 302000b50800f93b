"""How the suite is collected and shared out (``tests/conftest.py``).

The fast tier's test files that build transformers' model are one work unit, so only one worker pays its import;
the fast tier alone does not import a module whose every test is ``cluster``.

Read from the source: a file counts when it imports ``transformers`` (at any depth) or the helper that writes a
transformers checkpoint (``tests.model.hf_directory``), and is not wholly a ``cluster`` file (those run their own
processes, which import it themselves)."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import TRANSFORMERS_FILES, TRANSFORMERS_SCOPE, wholly_cluster, xdist_scope
from tests.unit.test_layering import _under, imported_modules

ROOT = Path(__file__).resolve().parents[2]
BUILDERS = ("transformers", "tests.model.hf_directory")


def test_every_fast_file_that_builds_transformers_model_is_one_work_unit() -> None:
    found = set()
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        builds = any(_under(name, builder) for name in imported_modules(path) for builder in BUILDERS)
        if builds and not wholly_cluster(path.read_text()):
            found.add(path.relative_to(ROOT).as_posix())
    assert found == TRANSFORMERS_FILES
    assert {xdist_scope(f"{name}::test_x") for name in found} == {TRANSFORMERS_SCOPE}


def test_any_other_file_is_its_own_work_unit() -> None:
    assert xdist_scope("tests/core/test_allocator.py::TestAllocatorMachine::runTest") == "tests/core/test_allocator.py"
    assert xdist_scope("tests/unit/test_admin_http.py::test_other_paths_are_404") == "tests/unit/test_admin_http.py"


def test_a_module_is_wholly_cluster_only_when_its_pytestmark_holds_the_cluster_mark() -> None:
    assert wholly_cluster("import pytest\npytestmark = pytest.mark.cluster\n")
    assert wholly_cluster("pytestmark = [pytest.mark.cluster, pytest.mark.timeout(180)]\n")
    assert wholly_cluster("pytestmark = (\n    pytest.mark.timeout(60),\n    pytest.mark.cluster,\n)\n")
    assert not wholly_cluster("pytestmark = pytest.mark.timeout(60)\n")
    assert not wholly_cluster('pytestmark = pytest.mark.skipif(True, reason="not on a cluster")\n')
    assert not wholly_cluster("@pytest.mark.cluster\ndef test_x() -> None:\n    pass\n")  # one test, not the module
    assert not wholly_cluster("def f() -> None:\n    pytestmark = pytest.mark.cluster\n")  # not at module level
