"""The library never imports the processes: nothing under kvpool/ imports services/."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def imported_modules(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_kvpool_never_imports_services() -> None:
    offenders = {
        str(path.relative_to(ROOT)): sorted(n for n in imported_modules(path) if n.split(".")[0] == "services")
        for path in sorted((ROOT / "kvpool").rglob("*.py"))
    }
    offenders = {k: v for k, v in offenders.items() if v}
    assert offenders == {}


def test_the_scan_sees_imports_inside_functions() -> None:
    # the CLI imports the roles lazily, inside functions; the scan must see those
    assert "services.master.server" in imported_modules(ROOT / "services" / "cli.py")
