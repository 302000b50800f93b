"""Engine port windows (kvpool.engine_ports): handed out in turn, never a busy one, one process's at a time."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from kvpool import engine_ports
from kvpool.engine_ports import NoWindow, bindable, reserve


@pytest.fixture
def busy(monkeypatch: pytest.MonkeyPatch) -> set[int]:
    """Ports taken, as ``bindable`` sees them: deterministic, whatever else this host listens on."""
    taken: set[int] = set()
    monkeypatch.setattr(engine_ports, "bindable", lambda port: port not in taken)
    return taken


def cursor(folder: Path, index: int) -> None:
    (folder / engine_ports.CURSOR_NAME).write_text(f"{index}\n")


def test_windows_are_handed_out_in_turn_and_wrap(tmp_path: Path, busy: set[int]) -> None:
    folder = tmp_path / "run"
    folder.mkdir(mode=0o700)
    cursor(folder, 1)
    got = [reserve(folder, width=4, first=100, last=112) for _ in range(4)]
    assert got == [(104, 107), (108, 111), (100, 103), (104, 107)]  # three windows; the fourth call wraps


def test_a_window_with_a_busy_port_is_skipped(tmp_path: Path, busy: set[int]) -> None:
    cursor(tmp_path, 0)
    busy.add(102)
    assert reserve(tmp_path, width=4, first=100, last=112) == (104, 107)
    assert reserve(tmp_path, width=4, first=100, last=112) == (108, 111)
    busy.update({105, 110})
    with pytest.raises(NoWindow, match="every window of 4 ports in \\[100, 112\\) has a port in use"):
        reserve(tmp_path, width=4, first=100, last=112)


def test_a_new_cursor_starts_at_some_window(tmp_path: Path, busy: set[int]) -> None:
    low, high = reserve(tmp_path, width=4, first=100, last=140)
    assert (low - 100) % 4 == 0 and high == low + 3 and 100 <= low < 140
    assert reserve(tmp_path, width=4, first=100, last=140)[0] == 100 + (low - 100 + 4) % 40


def test_an_unsafe_folder_or_cursor_gives_no_window(tmp_path: Path, busy: set[int]) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(NoWindow, match="mode 0777"):
        reserve(shared)
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    (tmp_path / "elsewhere").write_text("0\n")
    (private / engine_ports.CURSOR_NAME).symlink_to(tmp_path / "elsewhere")
    with pytest.raises(NoWindow, match="cannot open"):
        reserve(private)


def test_bindable_sees_a_listener() -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        assert not bindable(listener.getsockname()[1])
    with socket.socket() as probe:
        probe.bind(("0.0.0.0", 0))
        port = probe.getsockname()[1]
    assert bindable(port)


def test_pinned_sets_the_engines_range_for_the_import_alone(tmp_path: Path, busy: set[int],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    monkeypatch.delenv(engine_ports.MIN_ENV, raising=False)
    monkeypatch.delenv(engine_ports.MAX_ENV, raising=False)
    monkeypatch.setattr(engine_ports, "_window", None)
    with engine_ports.pinned():
        low, high = int(os.environ[engine_ports.MIN_ENV]), int(os.environ[engine_ports.MAX_ENV])
    assert high - low == engine_ports.WIDTH - 1 and engine_ports.FIRST <= low < engine_ports.LAST
    assert engine_ports.window() == (low, high)
    assert engine_ports.MIN_ENV not in os.environ and engine_ports.MAX_ENV not in os.environ  # children reserve theirs
    assert (tmp_path / "kvpool" / engine_ports.CURSOR_NAME).exists()


@pytest.mark.parametrize("env", [{engine_ports.MIN_ENV: "16000"}, {engine_ports.SWITCH_ENV: "off"}])
def test_an_operators_range_or_the_switch_reserves_nothing(tmp_path: Path, busy: set[int], env: dict[str, str],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    monkeypatch.setattr(engine_ports, "_window", None)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with engine_ports.pinned():
        assert os.environ.get(engine_ports.MAX_ENV) is None
    assert engine_ports.window() is None
    assert not (tmp_path / "kvpool").exists()
