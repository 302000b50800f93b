"""The two test tiers, enforced: only a test marked ``cluster`` may start a process.

A test that starts a process (subprocess, multiprocessing, a service, ``ip
netns``) carries ``@pytest.mark.cluster``; ``pytest -m "not cluster"`` is the
fast tier. During the setup, call and teardown of every other test, process
creation raises :class:`ProcessRefused` naming the test, and a refusal the
test swallowed still fails it after the phase.

Invariant: while a test not marked ``cluster`` runs, no Python-level path to
a new process (``_posixsubprocess.fork_exec`` under ``subprocess`` and
multiprocessing's helpers, ``os.fork``/``forkpty``/``posix_spawn``/``system``,
``multiprocessing`` process start, a fork asked of the launcher's zygote)
succeeds. An in-process transfer engine or
gRPC server is not a process and is allowed.

``--tier-audit`` prints, at the end, the tests marked ``cluster`` that started
no process in their own setup, call or teardown: a test on a cluster that an
earlier test of its module started is among them, so judge the list by hand.
"""

from __future__ import annotations

import _posixsubprocess
import multiprocessing.process
import os
import subprocess
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest

from kvpool.tools.cluster import zygote

MARKER = "cluster"


class ProcessRefused(RuntimeError):
    """A test not marked ``cluster`` tried to start a process."""


@dataclass(slots=True)
class _Scope:
    nodeid: str
    allowed: bool
    refused: list[str] = field(default_factory=list)
    started: int = 0


# innermost last: a pytester session run inside a test pushes its own scopes
_scopes: list[_Scope] = []
_originals: dict[tuple[object, str], Callable[..., Any]] = {}


def _check(what: str) -> None:
    if not _scopes:
        return
    scope = _scopes[-1]
    if scope.allowed:
        scope.started += 1
        return
    scope.refused.append(what)
    raise ProcessRefused(
        f"{scope.nodeid} started a process ({what}) but is not marked "
        f"@pytest.mark.{MARKER}; mark it, or test the behaviour without a process"
    )


def _wrap(owner: object, name: str, describe: Callable[..., str]) -> None:
    original = getattr(owner, name, None)
    if original is None or (owner, name) in _originals:
        return
    _originals[(owner, name)] = original

    def guarded(*args: Any, **kwargs: Any) -> Any:
        _check(describe(*args, **kwargs))
        return original(*args, **kwargs)

    guarded.__wrapped__ = original  # type: ignore[attr-defined]
    setattr(owner, name, guarded)


def _argv(args: tuple[Any, ...]) -> str:
    # fork_exec(args, executable_list, ...): args are bytes or str
    argv = args[0] if args else None
    if not argv:
        return "?"
    return " ".join(a.decode(errors="replace") if isinstance(a, bytes) else str(a) for a in argv)


def install() -> None:
    """Put the guards in place (idempotent); they act only while a test's scope is pushed."""
    _wrap(_posixsubprocess, "fork_exec", lambda *a, **k: f"exec {_argv(a)!r}")
    _wrap(subprocess, "_fork_exec", lambda *a, **k: f"exec {_argv(a)!r}")  # bound at its import
    _wrap(os, "fork", lambda *a, **k: "os.fork")
    _wrap(os, "forkpty", lambda *a, **k: "os.forkpty")
    _wrap(os, "posix_spawn", lambda path, *a, **k: f"os.posix_spawn {path!r}")
    _wrap(os, "posix_spawnp", lambda path, *a, **k: f"os.posix_spawnp {path!r}")
    _wrap(os, "system", lambda command, *a, **k: f"os.system {command!r}")
    _wrap(multiprocessing.process.BaseProcess, "start", lambda self, *a, **k: f"multiprocessing start of {self.name}")
    # a zygote already running forks without any of the above in this process
    _wrap(zygote.Zygote, "spawn", lambda self, module, args, *a, **k: f"zygote fork of {module} {' '.join(args)!r}")


def take_refusals() -> list[str]:
    """The refusals of the current test so far, cleared (a test that provokes them on purpose)."""
    refused = list(_scopes[-1].refused)
    _scopes[-1].refused.clear()
    return refused


@contextmanager
def _scope(item: pytest.Item, phase: str) -> Iterator[_Scope]:
    scope = _Scope(item.nodeid, allowed=item.get_closest_marker(MARKER) is not None)
    _scopes.append(scope)
    try:
        yield scope
    finally:
        _scopes.remove(scope)
        _started(item.config)[item.nodeid] = _started(item.config).get(item.nodeid, 0) + scope.started
    if scope.refused:
        pytest.fail(f"{item.nodeid} ({phase}) tried to start a process without @pytest.mark.{MARKER}: "
                    + "; ".join(scope.refused), pytrace=False)


_STARTED = pytest.StashKey[dict[str, int]]()


def _started(config: pytest.Config) -> dict[str, int]:
    return config.stash.setdefault(_STARTED, {})


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--tier-audit", action="store_true",
                     help=f"list tests marked {MARKER} that started no process")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", f"{MARKER}: starts a process or network namespace (the slow tier)")
    install()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    with _scope(item, "setup"):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    with _scope(item, "call"):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    with _scope(item, "teardown"):
        return (yield)


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    if not config.getoption("--tier-audit"):
        return
    if getattr(config.option, "numprocesses", None):  # the workers counted, not this process
        terminalreporter.section(f"tests marked {MARKER} that started no process themselves")
        terminalreporter.write_line("--tier-audit counts in the pytest process: run it with -n 0")
        return
    started = _started(config)
    idle = []
    for item in terminalreporter.stats.get("passed", []) + terminalreporter.stats.get("failed", []):
        if item.when != "call" or "cluster" not in item.keywords or started.get(item.nodeid, 0):
            continue
        idle.append(item.nodeid)
    terminalreporter.section(f"tests marked {MARKER} that started no process themselves")
    for nodeid in sorted(idle):
        terminalreporter.write_line(nodeid)
