"""Services start by forking a process that has imported their code, not by starting Python again.

Importing torch costs a prefill stage or a decode shard about 2.5 s of CPU
before it does anything, and a 4-stage ``kvpool up`` starts its stages one
after another (each learns the next one's port); a master, store or router
spends ~0.4 s importing gRPC, protobuf and its own modules. So the launcher
keeps a *zygote* (``python -m kvpool.tools.cluster.zygote_server``) per set of
modules and preloaded library: one imports torch and the model (``TORCH``),
one the torch-free roles (``LIGHT``: a router never carries torch). Each then
forks a ``kvpool <role>`` child per request, in ~50 ms.

Invariants:

- the zygote runs no thread, opens no listening socket and creates no gRPC
  object before it forks: every child starts as a fresh process would, apart
  from the modules already imported (its environment, working directory,
  argv, signal dispositions and stdio are the requester's);
- the zygote is every child's parent: it reaps them and reports each exit
  status over its socket, and hands over a pidfd per child, so
  :class:`ForkedProcess` answers like ``Popen`` and never signals a reused pid;
- the zygote lives as long as the process that started it (its socket's
  other end); a child asked to die with its parent gets SIGTERM when the
  zygote goes (``PR_SET_PDEATHSIG``), hence when the launcher goes.

The zygote's own loop is ``zygote_server``. The protocol is one JSON object
per message over a Unix ``SOCK_SEQPACKET`` pair, file descriptors beside it.
``KVPOOL_ZYGOTE=off`` starts every process with a plain ``Popen``.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import weakref
from typing import Any

SWITCH_ENV = "KVPOOL_ZYGOTE"
# what a zygote imports before it forks: fork-safe modules (no thread, socket or gRPC object at import;
# the zygote checks that it still runs one thread)
TORCH = ("torch", "kvpool.model.stage", "kvpool.model.decode", "kvpool.model.weights", "kvpool.services.cli",
         "kvpool.services.prefill.server", "kvpool.services.decode.server")
LIGHT = ("kvpool.services.cli", "kvpool.services.master.server", "kvpool.services.router.server",
         "kvpool.services.store.daemon")
_MAX_MESSAGE = 1 << 20
# a child whose exit status went with its zygote (it outlived the zygote)
UNKNOWN_EXIT = 255


def send(sock: socket.socket, message: dict[str, Any], fds: list[int] | None = None) -> None:
    """One protocol message: a JSON object, with file descriptors passed beside it."""
    socket.send_fds(sock, [json.dumps(message).encode()], fds or [])


def receive(sock: socket.socket) -> tuple[dict[str, Any] | None, list[int]]:
    """The next message and the descriptors that came with it; None at the other end's close."""
    data, fds, _flags, _addr = socket.recv_fds(sock, _MAX_MESSAGE, 4)
    return (json.loads(data) if data else None), fds


class ZygoteGone(RuntimeError):
    """The zygote exited or could not start; the caller starts its process the plain way."""


class ForkedProcess:
    """A process the zygote forked, with the part of ``subprocess.Popen``'s interface the launcher uses.

    Invariant: signals go through the pidfd, so they reach this process or nobody.
    """

    def __init__(self, zygote: Zygote, pid: int, pidfd: int) -> None:
        self._zygote = zygote
        self.pid = pid
        self._pidfd = pidfd
        self.returncode: int | None = None
        weakref.finalize(self, os.close, pidfd)  # not at exit: another thread may be watching it

    def _exited(self, returncode: int) -> None:
        self.returncode = returncode

    def poll(self) -> int | None:
        if self.returncode is None and self._zygote.gone:
            # nobody reaps it for us any more: it counts as exited once its pidfd says so
            if select.select([self._pidfd], [], [], 0)[0]:
                with self._zygote.changed:
                    if self.returncode is None:
                        self._exited(UNKNOWN_EXIT)
                    self._zygote.changed.notify_all()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        with self._zygote.changed:
            if not self._zygote.changed.wait_for(lambda: self.returncode is not None or self._zygote.gone, timeout):
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
        if self.poll() is None:  # outlived its zygote: wait on the pidfd itself
            if not select.select([self._pidfd], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
            self.poll()
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        with self._zygote.changed:
            if self.returncode is None:
                try:
                    signal.pidfd_send_signal(self._pidfd, sig)
                except ProcessLookupError:
                    pass  # exited; its status is on its way

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Zygote:
    """The launching process's zygote: started on first use, forks on request, gone with its starter."""

    def __init__(self, env: dict[str, str], modules: tuple[str, ...] = TORCH) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._sock = ours
        self.changed = threading.Condition()
        self._children: dict[int, ForkedProcess] = {}
        self._answers: dict[int, tuple[dict[str, Any], list[int]]] = {}
        self._next_id = 0
        self._ready: int | None = None
        self.gone = False
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvpool.tools.cluster.zygote_server", str(theirs.fileno()), *modules],
            pass_fds=[theirs.fileno()], env=env, stdin=subprocess.DEVNULL)
        theirs.close()
        threading.Thread(target=self._read, name="zygote-reader", daemon=True).start()
        atexit.register(self.close)

    def _read(self) -> None:
        while True:
            try:
                message, fds = receive(self._sock)
            except OSError:
                message, fds = None, []
            with self.changed:
                if message is None:
                    self.gone = True
                    self.changed.notify_all()
                    return
                if "ready" in message:
                    self._ready = int(message["ready"])
                elif "exit" in message:
                    child = self._children.pop(int(message["exit"]), None)
                    if child is not None:
                        child._exited(int(message["returncode"]))
                else:
                    self._answers[int(message["id"])] = (message, fds)
                self.changed.notify_all()

    def spawn(self, module: str, args: list[str], env: dict[str, str], log: str, netns: str | None = None,
              host_name: str | None = None, timeout_s: float = 120.0) -> ForkedProcess:
        """Fork ``python -m module *args`` with ``env``, stdout and stderr appended to ``log``, in network
        namespace ``netns`` and under ``host_name`` (a UTS namespace of its own) where given."""
        with self.changed:
            if not self.changed.wait_for(lambda: self._ready is not None or self.gone, timeout_s) or self.gone:
                raise ZygoteGone(f"the zygote did not start (exit code {self.proc.poll()})")
            request_id, self._next_id = self._next_id, self._next_id + 1
            try:
                send(self._sock, {"id": request_id, "module": module, "args": args, "env": env, "log": log,
                                  "cwd": os.getcwd(), "netns": netns, "host_name": host_name})
            except OSError as exc:
                raise ZygoteGone(f"the zygote is gone: {exc}") from None
            if not self.changed.wait_for(lambda: request_id in self._answers or self.gone, timeout_s) or (
                    request_id not in self._answers):
                raise ZygoteGone("the zygote did not answer")
            answer, fds = self._answers.pop(request_id)
            child = ForkedProcess(self, int(answer["pid"]), fds[0])
            self._children[child.pid] = child
            return child

    @property
    def alive(self) -> bool:
        return not self.gone and self.proc.poll() is None

    def close(self, timeout_s: float = 5.0) -> None:
        """End the zygote (its socket closes) and reap it; the children it forked keep running."""
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


_lock = threading.Lock()
_zygotes: dict[tuple[tuple[str, ...], str], Zygote] = {}


def zygote(env: dict[str, str], modules: tuple[str, ...] = TORCH) -> Zygote | None:
    """This process's zygote for ``modules`` and ``env``'s preload, started with ``env`` on first use
    and again if it died (the old one keeps serving the children it has); None when switched off."""
    if os.environ.get(SWITCH_ENV, "on") == "off":
        return None
    # a preload is fixed at the zygote's exec: a child needing another (the bind shim built meanwhile)
    # needs another zygote
    key = (modules, env.get("LD_PRELOAD", ""))
    with _lock:
        found = _zygotes.get(key)
        if found is None or not found.alive:
            found = _zygotes[key] = Zygote(env, modules)
        return found
