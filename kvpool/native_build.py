"""Building the C sources in ``kvpool/native`` into shared libraries, once per source version.

A library is named after its source's digest (``bind_shim-<sha256[:12]>.so``; an extension module's name adds the
interpreter's ABI) and kept beside the source or, where that is not writable, under ``$XDG_CACHE_HOME/kvpool``; a
build goes to a temporary name and is renamed into place, so processes starting together never load half a file,
and the builds of earlier versions beside the source go once a new one is in place.
``scripts/setup.sh`` builds every library ahead; ``find`` only looks (the core calls it), ``build`` runs the
compiler.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

NATIVE = Path(__file__).with_name("native")


class NativeUnavailable(RuntimeError):
    """A library can be neither found nor built (no C compiler, no writable folder, a failed build)."""


def build_name(source: Path, extension: bool = False) -> str:
    """The library's file name: the source's digest, and for a Python extension module this interpreter's ABI
    (``EXT_SUFFIX``), so another Python never loads it."""
    digest = hashlib.sha256(source.read_bytes()).hexdigest()[:12]
    return f"{source.stem}-{digest}{_ext_suffix()}" if extension else f"{source.stem}-{digest}.so"


def _ext_suffix() -> str:
    import sysconfig

    return str(sysconfig.get_config_var("EXT_SUFFIX") or ".so")


def build_dirs(source: Path) -> list[Path]:
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvpool"
    return [source.parent, cache]


def find(source: Path, extension: bool = False) -> Path | None:
    """The built library for the current ``source``, if there is one."""
    name = build_name(source, extension)
    for folder in build_dirs(source):
        if (folder / name).is_file():
            return folder / name
    return None


def build(source: Path, libs: tuple[str, ...] = (), extension: bool = False) -> Path:
    """Build ``source`` (once per version); returns the library's path. ``extension``: a Python extension module,
    built against this interpreter's headers (Debian's ``python3-dev`` where the interpreter is Debian's)."""
    import shutil  # here, not at the top: finding a library (the core's orders do) starts no process
    import subprocess
    import tempfile

    found = find(source, extension)
    if found is not None:
        return found
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        raise NativeUnavailable(f"no C compiler to build {source}: run scripts/setup.sh")
    flags = []
    if extension:
        import sysconfig

        include = sysconfig.get_paths()["include"]
        if not (Path(include) / "Python.h").is_file():
            raise NativeUnavailable(f"no Python.h in {include} to build {source}: install python3-dev "
                                    "(scripts/setup.sh does)")
        flags = [f"-I{include}"]
    errors = []
    for folder in build_dirs(source):
        try:
            folder.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=folder)
            os.close(fd)
        except OSError as exc:
            errors.append(f"{folder}: {exc}")
            continue
        try:
            done = subprocess.run([cc, "-O2", "-shared", "-fPIC", "-Wall", *flags, "-o", tmp, str(source), *libs],
                                  capture_output=True, text=True)
        except OSError as exc:
            os.unlink(tmp)
            raise NativeUnavailable(f"cannot run the C compiler {cc!r} to build {source}: {exc}") from None
        if done.returncode != 0:
            os.unlink(tmp)
            raise NativeUnavailable(f"building {source} failed:\n{done.stderr}")
        os.chmod(tmp, 0o755)
        target = folder / build_name(source, extension)
        os.replace(tmp, target)
        if folder == source.parent:
            _forget_older(source, extension, target)
        return target
    raise NativeUnavailable(f"no writable folder for {source.name}'s library: " + "; ".join(errors))


def _forget_older(source: Path, extension: bool, kept: Path) -> None:
    """Remove the builds of earlier versions of ``source`` beside it (a process that loaded one keeps its
    mapping); the shared cache is left alone, where another checkout's version may be in use."""
    suffix = _ext_suffix() if extension else ".so"
    for old in source.parent.glob(f"{source.stem}-*{suffix}"):
        digest = old.name[len(source.stem) + 1:len(old.name) - len(suffix)]
        if old != kept and len(digest) == 12 and all(c in "0123456789abcdef" for c in digest):
            try:
                old.unlink()
            except OSError:
                pass


def build_index_order() -> Path:
    """Build the pool index's order of groups (``kvpool/native/lru.c``, an extension module); its path."""
    return build(NATIVE / "lru.c", extension=True)

