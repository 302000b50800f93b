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


def test_reading_settings_does_not_import_torch() -> None:
    # a master, a store and the command line start without torch (seconds of a
    # master restart's recovery went to importing it)
    import subprocess
    import sys

    code = (
        "import sys, services.cli as c; c.build_parser(); "
        "from services.master.server import serve; from services.store.daemon import serve as s; "
        "print('torch' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"
