"""One ``kvpool <role>`` process: started, waited for, stopped, killed, paused.

The only place that starts ``kvpool.services.cli``. Every process binds port 0 and
reports its ports through a ready file, so nothing waits on a fixed sleep and
parallel runs never collide. A service picks its port-0 ports below the kernel's
ephemeral range (kvpool/ports.py), so ``restart`` finds them free: no outgoing
connection made while it was down can hold one.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvpool import bind_shim, tls
from kvpool.tools.api_key import API_KEY_ENV
from kvpool.tools.cluster.netns import Place
from kvpool.tools.cluster.zygote import LIGHT, TORCH, ForkedProcess, ZygoteGone, zygote

# Set in a child's environment: it asks for SIGTERM when this process goes
# (services/cli.py acts on it first thing). Not a preexec_fn: that would make
# Popen fork() a process that runs gRPC, and gRPC's fork handlers then crash the
# child before it can exec (grpc/grpc#43055).
PARENT_PID_ENV = "KVPOOL_DIE_WITH_PARENT_PID"
# roles that own a transfer engine: started with the bind shim preloaded (kvpool/bind_shim.py)
ENGINE_ROLES = ("store", "prefill", "decode")
# roles that run the model: forked from the zygote that has imported torch, the others from the one that
# has not (kvpool/tools/cluster/zygote.py)
TORCH_ROLES = ("prefill", "decode")
SERVICE_MODULE = "kvpool.services.cli"


def open_log(path: Path) -> int:
    """A process's log for appending, made 0600 if new; a symlink planted at its name is not followed."""
    return os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)


class ServiceFailed(RuntimeError):
    """A service exited or did not become ready in time; the message carries its log tail."""


@dataclass(slots=True)
class ServiceProcess:
    """One ``kvpool <role>`` process and its ready file and log."""

    name: str
    args: list[str]
    workdir: Path
    proc: subprocess.Popen[bytes] | ForkedProcess | None = None
    ready: dict[str, Any] = field(default_factory=dict)
    # the child gets SIGTERM when its starter goes (kvpool up: no orphans even
    # if up itself is killed). Started plainly, that is the thread that called
    # start(), which must live as long as the child; forked, it is the zygote,
    # which lives as long as this process
    die_with_parent: bool = False
    # where it runs: another network namespace, a host name of its own (forked, the child moves itself
    # there; started plainly, under ``ip netns exec`` and ``unshare --uts``)
    place: Place = field(default_factory=Place)

    @property
    def ready_file(self) -> Path:
        return self.workdir / f"{self.name}.ready.json"

    @property
    def log_file(self) -> Path:
        return self.workdir / f"{self.name}.log"

    def start(self) -> None:
        self.ready_file.unlink(missing_ok=True)
        env = self.child_env(os.environ)
        args = [*self.args, "--ready-file", str(self.ready_file)]
        if self.args and self.place.forkable():
            self.proc = self._fork(args, env)
            if self.proc is not None:
                return
        with os.fdopen(open_log(self.log_file), "ab") as log:
            self.proc = subprocess.Popen(
                [*self.place.prefix(), sys.executable, "-m", "kvpool.services.cli", *args],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
            )

    def _fork(self, args: list[str], env: dict[str, str]) -> ForkedProcess | None:
        """Fork it from this process's zygote; None when the zygote is off or gone (start it plainly)."""
        modules = TORCH if self.args[0] in TORCH_ROLES else LIGHT
        base = {k: v for k, v in env.items() if k not in (bind_shim.ADDRESS_ENV, PARENT_PID_ENV)}
        if self.args[0] not in ENGINE_ROLES:
            # the stores' zygote serves a master or router too: the shim it preloads rewrites nothing in a
            # process without KVPOOL_BIND_ADDRESS (and the child's own environment has no LD_PRELOAD)
            base = {k: v for k, v in bind_shim.child_env(self._transfer_host(), base).items()
                    if k != bind_shim.ADDRESS_ENV}
        found = zygote(base, modules)
        if found is None:
            return None
        if self.die_with_parent:  # its parent is the zygote, which goes when this process goes
            env = {**env, PARENT_PID_ENV: str(found.proc.pid)}
        try:
            return found.spawn(SERVICE_MODULE, args, env, str(self.log_file), self.place.netns, self.place.host_name)
        except ZygoteGone:
            return None

    def child_env(self, parent: dict[str, str] | os._Environ[str]) -> dict[str, str]:
        """The child's environment: ``parent``'s, less what is this process's own."""
        env = dict(parent, PYTHONUNBUFFERED="1")
        env.pop(PARENT_PID_ENV, None)
        env.pop(API_KEY_ENV, None)  # the router gets its keys in a file (kvpool up); no other child needs any
        # a child's identity comes from its flags (kvpool up --secure) only: KVPOOL_TLS_* here is this
        # process's own (a tool's, a bench's), and would give every child one role
        for name in tls.ENV.values():
            env.pop(name, None)
        if self.die_with_parent:
            env[PARENT_PID_ENV] = str(os.getpid())
        if self.args and self.args[0] in ENGINE_ROLES:
            env = bind_shim.child_env(self._transfer_host(), env)
        return env

    def _transfer_host(self) -> str:
        """The host this role's transfer engine serves on, as its flags say (else the settings' default)."""
        if "--transfer-host" in self.args[:-1]:
            return self.args[self.args.index("--transfer-host") + 1]
        return "127.0.0.1"

    def wait_ready(self, timeout_s: float = 60.0) -> dict[str, Any]:
        assert self.proc is not None, "start() first"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.ready_file.exists():
                self.ready = json.loads(self.ready_file.read_text())
                return self.ready
            if self.proc.poll() is not None:
                raise ServiceFailed(f"{self.name} exited with {self.proc.returncode}:\n{self.log_tail()}")
            time.sleep(0.02)  # polling a file the child writes, not standing in for work
        raise ServiceFailed(f"{self.name} not ready after {timeout_s}s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return "(no log)"

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout_s: float = 10.0) -> int | None:
        """SIGTERM, then SIGKILL after ``timeout_s``; returns the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def kill(self) -> None:
        """kill -9: no goodbye to anybody."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def restart(self, timeout_s: float = 120.0, stop_timeout_s: float = 10.0) -> dict[str, Any]:
        """Start again on the ports it had (peers keep their addresses), after it died or was stopped;
        a live one is stopped first (SIGTERM: it drains, SIGKILL after ``stop_timeout_s``)."""
        if self.alive:
            self.stop(stop_timeout_s)
        self.args = self._pinned_args({"--port": self.ready.get("port"), "--admin-port": self.ready.get("admin_port"),
                                       "--http-port": self.ready.get("http_port")})
        self.start()
        return self.wait_ready(timeout_s)

    def successor(self) -> ServiceProcess:
        """A second process of this service on the same gRPC and HTTP ports, not started yet.

        Both listen at once only if the service binds them with SO_REUSEPORT
        (a router started with ``--reuse-port``); the admin port is a new one.
        """
        args = self._pinned_args({"--port": self.ready.get("port"), "--admin-port": 0,
                                  "--http-port": self.ready.get("http_port")})
        return ServiceProcess(self.name, args, self.workdir, die_with_parent=self.die_with_parent,
                              place=self.place)

    def _pinned_args(self, ports: dict[str, Any]) -> list[str]:
        args = list(self.args)
        for i, arg in enumerate(args[:-1]):
            if arg in ports and ports[arg] is not None:
                args[i + 1] = str(ports[arg])
        return args

    def pause(self) -> None:
        """SIGSTOP: the process is frozen (a hung host), its memory kept."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT after :meth:`pause`."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
