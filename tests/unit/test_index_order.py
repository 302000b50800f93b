"""Building the index's C order (kvpool/native_build.py, kvpool/index_order.py): built where missing, loaded by the
core, and a failure says why and leaves the Python order running."""

from __future__ import annotations

import shutil
from array import array
from pathlib import Path

import pytest

from kvpool import index_order, native_build
from kvpool.core.pool import lru


def test_a_checkout_with_a_compiler_runs_the_c_order() -> None:
    assert index_order.ensure() == (True, "")
    assert native_build.find(lru.SOURCE, extension=True) is not None


def test_switched_off_it_is_neither_built_nor_used_and_that_is_no_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(lru.SWITCH_ENV, "off")
    monkeypatch.setattr(native_build, "build_index_order", lambda: pytest.fail("built while switched off"))
    assert index_order.ensure() == (False, "")


def test_a_failed_build_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail() -> Path:
        raise native_build.NativeUnavailable("no C compiler to build lru.c: run scripts/setup.sh\nmore")

    monkeypatch.setattr(native_build, "build_index_order", fail)
    assert index_order.ensure() == (False, "no C compiler to build lru.c: run scripts/setup.sh")


@pytest.mark.cluster  # runs the compiler
def test_a_build_compiles_the_source_into_a_module_named_by_its_digest_and_abi(tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    source = tmp_path / "lru.c"
    shutil.copy(lru.SOURCE, source)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert native_build.find(source, extension=True) is None
    built = native_build.build(source, extension=True)
    assert built.parent == tmp_path and built.name == native_build.build_name(source, extension=True)
    assert built.name.endswith(native_build._ext_suffix()) and native_build.find(source, extension=True) == built
    order = lru._load_type(built)(4)  # type: ignore[misc]
    order.push_back(2)
    order.push_back(0)
    assert order.touch(array("i", [2])) == 1 and [order.first(), order.after(order.first())] == [0, 2]
    source.write_text(source.read_text() + "\n/* changed */\n")
    assert native_build.find(source, extension=True) is None  # another version of the source: built anew
    others = [tmp_path / f"lru-notadigest{native_build._ext_suffix()}", tmp_path / "lru-0123456789ab.txt",
              tmp_path / f"other-0123456789ab{native_build._ext_suffix()}"]
    for other in others:
        other.write_bytes(b"")
    rebuilt = native_build.build(source, extension=True)
    assert rebuilt != built and rebuilt.is_file() and not built.exists()  # the earlier version's build is gone
    assert all(other.exists() for other in others)  # and nothing that is not one


@pytest.mark.cluster  # runs the compiler
def test_a_compiler_that_cannot_run_or_fails_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source = tmp_path / "bad.c"
    source.write_text("this is not C\n")
    with pytest.raises(native_build.NativeUnavailable, match="bad.c failed"):
        native_build.build(source)
    assert list(tmp_path.glob("*.so")) == []  # no half-built file left
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    with pytest.raises(native_build.NativeUnavailable, match="cannot run the C compiler"):
        native_build.build(source)
    assert list(tmp_path.glob("*.so")) == []
