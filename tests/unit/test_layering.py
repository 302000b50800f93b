"""Layering: who may depend on whom, and no import loops.

- Nothing under ``kvpool/`` imports ``services/``; outside ``kvpool/tools`` it
  does not import or start ``kvpool.tools`` either.
- The roles (``services/<role>/``) never import ``kvpool.tools``; only the
  command (``services/cli.py`` and its parser, ``services/cli_parser.py``)
  reaches into the tools.
- A module named after ``-m`` in a command line (``[sys.executable, "-m",
  "kvpool.services.cli", ...]``) is a dependency too: only the cluster launcher
  starts ``kvpool.services.cli``.
- The import graph of ``kvpool/`` and ``services/`` (imports at module level,
  inside functions and under ``TYPE_CHECKING`` alike) has no cycle.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SERVICES = "kvpool.services"  # the services/ folder, as it installs
LAUNCHER = "kvpool.tools.cluster.process"  # the one module that runs kvpool.services.cli


@cache
def modules() -> dict[str, Path]:
    """Every module under kvpool/ and services/ by the dotted name it installs as (services/ is
    ``kvpool.services``; a package by its own name)."""
    found = {}
    for top, prefix in (("kvpool", ["kvpool"]), ("services", ["kvpool", "services"])):
        for path in sorted((ROOT / top).rglob("*.py")):
            parts = prefix + list(path.relative_to(ROOT / top).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


@cache
def parsed(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def _module_strings(tree: ast.Module) -> dict[str, str]:
    """Module-level ``NAME = "text"`` constants (a ``-m`` argument may be one)."""
    return {target.id: node.value.value for node in tree.body if isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
            for target in node.targets if isinstance(target, ast.Name)}


def dash_m_modules(path: Path) -> set[str]:
    """Modules this file names after ``-m`` in a list, tuple or call's arguments."""
    tree = parsed(path)
    constants = _module_strings(tree)
    names: set[str] = set()
    for node in ast.walk(tree):
        items = node.elts if isinstance(node, ast.List | ast.Tuple) else node.args if isinstance(node, ast.Call) else []
        for flag, value in zip(items, items[1:]):
            if not (isinstance(flag, ast.Constant) and flag.value == "-m"):
                continue
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                names.add(value.value)
            elif isinstance(value, ast.Name) and value.id in constants:
                names.add(constants[value.id])
            else:
                raise AssertionError(f"{path}: a -m argument the scan cannot read: {ast.unparse(value)}")
    return names


def imported_modules(path: Path, name: str = "") -> set[str]:
    """Every module this file imports, anywhere in it; ``from a import b`` counts ``a.b`` where that is a module."""
    is_package = path.name == "__init__.py"
    names: set[str] = set()
    for node in ast.walk(parsed(path)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = name.split(".") if is_package else name.split(".")[:-1]
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                names.add(full if full in modules() else base)
    return names


def dependencies(name: str) -> set[str]:
    """What it imports and what it starts with ``-m`` (itself aside: a re-exec starts nothing new)."""
    path = modules()[name]
    return imported_modules(path, name) | (dash_m_modules(path) - {name})


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def test_kvpool_never_imports_services_and_only_tools_reach_the_tools() -> None:
    offenders = {}
    for name in modules():
        if _under(name, SERVICES):
            continue
        banned = (SERVICES,) if _under(name, "kvpool.tools") else (SERVICES, "kvpool.tools")
        allowed = {"kvpool.services.cli"} if name == LAUNCHER else set()  # what it starts, never imports
        bad = sorted(d for d in dependencies(name) - allowed if any(_under(d, b) for b in banned))
        if bad:
            offenders[name] = bad
    assert offenders == {}


def test_the_roles_never_import_the_tools() -> None:
    command = (SERVICES, "kvpool.services.cli", "kvpool.services.cli_parser")
    offenders = {name: sorted(d for d in dependencies(name) if _under(d, "kvpool.tools"))
                 for name in modules() if _under(name, SERVICES) and name not in command}
    assert {k: v for k, v in offenders.items() if v} == {}


def test_only_the_launcher_starts_services() -> None:
    # a module re-executing itself (kvpool.services.cli under the bind shim) starts nothing new
    starters = {name: sorted(m for m in dash_m_modules(path) - {name} if _under(m, SERVICES))
                for name, path in modules().items()}
    assert {k: v for k, v in starters.items() if v} == {LAUNCHER: ["kvpool.services.cli"]}


def test_the_scan_sees_imports_inside_functions_and_dash_m_names() -> None:
    # the CLI imports the roles lazily, inside functions; the scan must see those
    assert "kvpool.pool.stats" in imported_modules(ROOT / "services" / "cli.py", "kvpool.services.cli")
    # a -m module held in a constant counts too
    assert "kvpool.tools.bench.upstream" in dash_m_modules(modules()["kvpool.tools.bench.worker_protocol"])


def import_graph() -> dict[str, set[str]]:
    """Module → the modules of kvpool/ and services/ it imports (a ``-m`` start is a process, not an import)."""
    graph = {}
    for name, path in modules().items():
        targets = set()
        for imported in imported_modules(path, name):
            while imported and imported not in modules():
                imported = imported.rpartition(".")[0]
            if imported and imported != name:
                targets.add(imported)
        graph[name] = targets
    return graph


def strongly_connected(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """Tarjan's algorithm, iterative; only the components of more than one module (a self-import is dropped)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(frozenset(component))
    return found


def a_cycle(graph: dict[str, set[str]], component: frozenset[str]) -> list[str]:
    """A shortest import loop from the component's first module back to it, e.g. ``[a, b, a]``."""
    start = min(component)
    parents: dict[str, str] = {}
    frontier = [start]
    while frontier:  # breadth first, inside the component
        following = []
        for node in frontier:
            for child in sorted(graph[node] & component):
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(parents[path[-1]])
                    return [*reversed(path), start]
                if child not in parents:
                    parents[child] = node
                    following.append(child)
        frontier = following
    raise AssertionError(f"no loop through {sorted(component)}")


def test_no_import_cycles() -> None:
    graph = import_graph()
    components = strongly_connected(graph)
    loops = [" -> ".join(a_cycle(graph, c)) for c in components]
    assert loops == [], "import loops:\n" + "\n".join(loops)


def test_the_cycle_search_finds_direct_and_longer_loops() -> None:
    graph = {"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"e"}, "e": {"c", "f"}, "f": set()}
    components = strongly_connected(graph)
    assert sorted(sorted(c) for c in components) == [["a", "b"], ["c", "d", "e"]]
    assert a_cycle(graph, frozenset({"c", "d", "e"})) == ["c", "d", "e", "c"]
    assert a_cycle(graph, frozenset({"a", "b"})) == ["a", "b", "a"]


@pytest.mark.cluster
def test_reading_settings_does_not_import_torch() -> None:
    # a master, a store and the command line start without torch (seconds of a
    # master restart's recovery went to importing it)
    import subprocess
    import sys

    code = (
        "import sys, kvpool.services.cli, kvpool.services.cli_parser as c; c.build_parser(); "
        "from kvpool.services.master.server import serve; from kvpool.services.store.daemon import serve as s; "
        "print('torch' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


CORE_PRIMITIVES = {"errors", "setting", "chunk_hash"}  # what every core package shares


def test_the_core_is_packages_by_concern_with_a_few_shared_primitives() -> None:
    core = ROOT / "kvpool" / "core"
    top = {p.stem for p in core.glob("*.py")} - {"__init__"}
    assert top == CORE_PRIMITIVES
    packages = sorted(p.name for p in core.iterdir() if (p / "__init__.py").exists())
    assert packages == ["admission", "api", "decode", "ha", "handoff", "pool", "prefill", "sessions", "supervision",
                        "tenancy"]
    for name in packages:  # each package's __init__ says what it owns, and nothing more
        tree = parsed(core / name / "__init__.py")
        assert ast.get_docstring(tree), name
        assert len(tree.body) == 1, f"kvpool.core.{name}.__init__ holds code: keep it to its docstring"


def test_services_installs_under_kvpool_only() -> None:
    # the folder is kvpool.services; imported by its folder's name (cwd on sys.path) it refuses
    import importlib
    import sys

    assert str(ROOT) in sys.path or "" in sys.path or "." in sys.path  # where a bare `services` would resolve
    with pytest.raises(ImportError, match="kvpool.services"):
        importlib.import_module("services")
    assert "services" not in sys.modules
    assert importlib.import_module("kvpool.services").__file__ == str(ROOT / "services" / "__init__.py")


@pytest.mark.cluster
def test_no_top_level_services_package_in_the_venv() -> None:
    # from a folder outside the tree, only the installed distribution answers
    import subprocess
    import sys
    import tempfile

    with tempfile.TemporaryDirectory() as away:
        bare = subprocess.run([sys.executable, "-c", "import services"], capture_output=True, text=True, cwd=away,
                              timeout=60)
        assert bare.returncode != 0 and "No module named 'services'" in bare.stderr, bare.stderr
        here = subprocess.run([sys.executable, "-c", "import services"], capture_output=True, text=True, cwd=ROOT,
                              timeout=60)
        assert here.returncode != 0 and "import kvpool.services" in here.stderr, here.stderr
    # no installed distribution brings a top-level `services`: not as files, not as an editable mapping
    import site
    from importlib import metadata

    installed = metadata.distributions(path=site.getsitepackages())  # not the build's egg-info in the tree
    claims = sorted(d.metadata["Name"] for d in installed
                    if (d.read_text("top_level.txt") or "").split().count("services")
                    or any(str(f).split("/")[0] == "services" for f in d.files or ())
                    or any("'services'" in (f.read_text() if str(f).endswith("finder.py") else "")
                           for f in (d.locate_file(x) for x in d.files or ())))
    assert claims == []
