"""The zygote's own loop (see :mod:`kvpool.tools.cluster.zygote`): import once, fork on request, report exits.

Run as ``python -m kvpool.tools.cluster.zygote_server FD MODULE...``, FD being
its end of the socket pair and the modules those it imports before forking.
Nothing here runs a thread, listens, or touches gRPC before a fork.
"""

from __future__ import annotations

import os
import random
import runpy
import selectors
import signal
import socket
import sys
from typing import Any

from kvpool.tools.cluster.netns import enter
from kvpool.tools.cluster.zygote import receive, send


def _serve(sock: socket.socket) -> dict[str, Any] | None:
    """Fork a child per request and report exits; returns the request in a child, None in the zygote at EOF."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so the wakeup fd hears of each exit
    selector = selectors.DefaultSelector()
    selector.register(sock, selectors.EVENT_READ)
    selector.register(wake_r, selectors.EVENT_READ)
    while True:
        for key, _ in selector.select():
            if key.fileobj is sock:
                request, _fds = receive(sock)
                if request is None:
                    _reap(sock)
                    return None
                pid = os.fork()
                if pid == 0:
                    selector.close()
                    signal.set_wakeup_fd(-1)
                    for fd in (wake_r, wake_w):
                        os.close(fd)
                    sock.close()
                    return request
                # the launcher signals and watches it through this: a pid could be reused once reaped
                pidfd = os.pidfd_open(pid)
                send(sock, {"id": request["id"], "pid": pid}, [pidfd])
                os.close(pidfd)
            else:
                os.read(wake_r, 512)
            _reap(sock)


def _reap(sock: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        try:
            send(sock, {"exit": pid, "returncode": os.waitstatus_to_exitcode(status)})
        except OSError:
            pass  # the launcher is gone; nobody asks any more


def _become(request: dict[str, Any]) -> None:
    """Turn this fork of the zygote into the requested process, before any of its code runs."""
    for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if request.get("netns") or request.get("host_name"):
        try:
            enter(request.get("netns"), request.get("host_name"))
        except OSError as exc:  # as `ip netns exec` would: said on its log, and it does not start
            with os.fdopen(os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o600),
                           "a") as log:
                log.write(f"kvpool zygote: cannot enter {request.get('netns')} / {request.get('host_name')}: {exc}\n")
            os._exit(1)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    null = os.open(os.devnull, os.O_RDONLY)
    log = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o600)  # no planted link
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(null)
    os.close(log)
    sys.argv = [request["module"], *request["args"]]
    # every fork would otherwise draw the same "random" numbers the zygote was seeded with
    random.seed()


def main() -> int:
    sock = socket.socket(fileno=int(sys.argv[1]))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is for the launcher and the services
    # one OpenMP thread here, so that importing torch starts no thread pool (children set their own count)
    os.environ["OMP_NUM_THREADS"] = "1"
    modules = sys.argv[2:]
    for name in modules:
        __import__(name)
    threads = len(os.listdir("/proc/self/task"))
    if threads != 1:  # a fork would leave them behind mid-state: refuse, and the launcher starts processes plainly
        print(f"kvpool zygote: {threads} threads after importing {modules}; not forking", file=sys.stderr)
        return 1
    send(sock, {"ready": os.getpid()})
    request = _serve(sock)
    if request is None:
        # nothing to flush or tear down: skip unloading torch, which on a busy host outlasts close()'s wait
        os._exit(0)
    _become(request)
    module = sys.modules.get(request["module"])
    if module is not None and callable(getattr(module, "main", None)):
        # imported before the fork (kvpool.services.cli is): run its main, not the whole module a second time as
        # __main__, which runpy warns of at the top of every service's log
        return int(module.main() or 0)
    runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
