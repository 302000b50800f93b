"""Building the C sources in ``kvpool/native`` into shared libraries, once per source version.

A library is named after its source's digest (``lru-<sha256[:12]>.so``) and kept beside the source or, where that
is not writable, under ``$XDG_CACHE_HOME/kvpool``; a build goes to a temporary name and is renamed into place, so
processes starting together never load half a file. ``scripts/setup.sh`` builds every library ahead; ``find``
only looks (the core calls it), ``build`` runs the compiler.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

NATIVE = Path(__file__).with_name("native")


class NativeUnavailable(RuntimeError):
    """A library can be neither found nor built (no C compiler, no writable folder, a failed build)."""


def build_name(source: Path) -> str:
    return f"{source.stem}-{hashlib.sha256(source.read_bytes()).hexdigest()[:12]}.so"


def build_dirs(source: Path) -> list[Path]:
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvpool"
    return [source.parent, cache]


def find(source: Path) -> Path | None:
    """The built library for the current ``source``, if there is one."""
    name = build_name(source)
    for folder in build_dirs(source):
        if (folder / name).is_file():
            return folder / name
    return None


def build(source: Path, libs: tuple[str, ...] = ()) -> Path:
    """Build ``source`` (once per version); returns the library's path."""
    import shutil  # here, not at the top: finding a library (the core's orders do) starts no process
    import subprocess
    import tempfile

    found = find(source)
    if found is not None:
        return found
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        raise NativeUnavailable(f"no C compiler to build {source}: run scripts/setup.sh")
    errors = []
    for folder in build_dirs(source):
        try:
            folder.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=folder)
            os.close(fd)
        except OSError as exc:
            errors.append(f"{folder}: {exc}")
            continue
        done = subprocess.run([cc, "-O2", "-shared", "-fPIC", "-Wall", "-o", tmp, str(source), *libs],
                              capture_output=True, text=True)
        if done.returncode != 0:
            os.unlink(tmp)
            raise NativeUnavailable(f"building {source} failed:\n{done.stderr}")
        os.chmod(tmp, 0o755)
        target = folder / build_name(source)
        os.replace(tmp, target)
        return target
    raise NativeUnavailable(f"no writable folder for {source.name}'s library: " + "; ".join(errors))


def index_order() -> tuple[bool, str]:
    """Build the pool index's order of groups in C (``kvpool/native/lru.c``) where this checkout lacks it, unless
    switched off: whether new group tables use it, and if not, why (``""`` when switched off on purpose)."""
    from kvpool.core.pool import lru

    if os.environ.get(lru.SWITCH_ENV, "on") == "off":
        return False, ""
    try:
        build(lru.SOURCE)
    except NativeUnavailable as exc:
        return False, str(exc).splitlines()[0]
    return lru.native(), "" if lru.native() else "its library did not load"
