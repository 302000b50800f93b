"""Start kvpool services as real processes on this host.

Used by ``kvpool bench``, the integration tests and the main job. Every
process binds port 0 and reports its ports through a ready file, so nothing
waits on a fixed sleep and parallel runs never collide.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Set in a child's environment: it asks for SIGTERM when this process goes
# (services/cli.py acts on it first thing). Not a preexec_fn: that would make
# Popen fork() a process that runs gRPC, and gRPC's fork handlers then crash the
# child before it can exec (grpc/grpc#43055).
PARENT_PID_ENV = "KVPOOL_DIE_WITH_PARENT_PID"


class ServiceFailed(RuntimeError):
    """A service exited or did not become ready in time; the message carries its log tail."""


@dataclass(slots=True)
class ServiceProcess:
    """One ``kvpool <role>`` process and its ready file and log."""

    name: str
    args: list[str]
    workdir: Path
    proc: subprocess.Popen[bytes] | None = None
    ready: dict[str, Any] = field(default_factory=dict)
    # the child gets SIGTERM when the thread that started it exits (kvpool up:
    # no orphans even if up itself is killed); start() must run on a thread
    # that lives as long as the child
    die_with_parent: bool = False
    # run under these first, e.g. ``ip netns exec NAME`` (each must exec, keeping the pid)
    prefix: list[str] = field(default_factory=list)

    @property
    def ready_file(self) -> Path:
        return self.workdir / f"{self.name}.ready.json"

    @property
    def log_file(self) -> Path:
        return self.workdir / f"{self.name}.log"

    def start(self) -> None:
        self.ready_file.unlink(missing_ok=True)
        log = self.log_file.open("ab")
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env.pop(PARENT_PID_ENV, None)
        if self.die_with_parent:
            env[PARENT_PID_ENV] = str(os.getpid())
        self.proc = subprocess.Popen(
            [*self.prefix, sys.executable, "-m", "services.cli", *self.args, "--ready-file", str(self.ready_file)],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
        )
        log.close()

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

    def pause(self) -> None:
        """SIGSTOP: the process is frozen (a hung host), its memory kept."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT after :meth:`pause`."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)


@dataclass(slots=True)
class LocalPool:
    """A master and N stores on this host."""

    num_stores: int = 2
    segment_size: str = "64MiB"
    master_args: list[str] = field(default_factory=list)
    store_args: list[str] = field(default_factory=list)
    workdir: Path | None = None
    master: ServiceProcess | None = None
    stores: list[ServiceProcess] = field(default_factory=list)
    master_port: int = 0
    _tmp: tempfile.TemporaryDirectory[str] | None = None

    @property
    def master_address(self) -> str:
        return f"127.0.0.1:{self.master_port}"

    def start(self) -> LocalPool:
        if self.workdir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="kvpool-")
            self.workdir = Path(self._tmp.name)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.start_master()
        for i in range(self.num_stores):
            self.add_store(f"store{i}")
        for store in self.stores:
            store.wait_ready()
        return self

    def start_master(self) -> None:
        """(Re)start the master on the same port as before, if it had one."""
        assert self.workdir is not None
        self.master = ServiceProcess(
            "master", ["master", "--port", str(self.master_port), "--admin-port", "0", *self.master_args],
            self.workdir,
        )
        self.master.start()
        self.master_port = int(self.master.wait_ready()["port"])

    def add_store(self, name: str, extra: list[str] | None = None) -> ServiceProcess:
        assert self.workdir is not None
        store = ServiceProcess(
            name,
            ["store", "--master", self.master_address, "--port", "0", "--admin-port", "0",
             "--segment-size", self.segment_size, *self.store_args, *(extra or [])],
            self.workdir,
        )
        store.start()
        self.stores.append(store)
        return store

    def stop(self) -> None:
        for store in self.stores:
            store.stop()
        if self.master is not None:
            self.master.stop()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> LocalPool:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclass(slots=True)
class LocalPipeline:
    """A prefill pipeline of ``num_stages`` stage processes, later stages started first."""

    num_stages: int = 4
    master: str = ""
    stage_args: list[str] = field(default_factory=list)
    workdir: Path | None = None
    stages: list[ServiceProcess] = field(default_factory=list)
    _tmp: tempfile.TemporaryDirectory[str] | None = None

    @property
    def address(self) -> str:
        """Stage 0: the Prefill API."""
        return f"127.0.0.1:{self.stages[0].ready['port']}"

    def start(self) -> LocalPipeline:
        if self.workdir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="kvpool-prefill-")
            self.workdir = Path(self._tmp.name)
        self.workdir.mkdir(parents=True, exist_ok=True)
        pool = ["--master", self.master] if self.master else ["--no-pool"]
        common = ["--num-stages", str(self.num_stages), "--port", "0", "--admin-port", "0", *pool, *self.stage_args]
        later: list[ServiceProcess] = []
        next_address = ""
        for stage in range(self.num_stages - 1, 0, -1):
            extra = ["--next-stage", next_address] if next_address else []
            proc = ServiceProcess(f"stage{stage}", ["prefill", "--stage", str(stage), *common, *extra], self.workdir)
            proc.start()
            next_address = f"127.0.0.1:{proc.wait_ready()['port']}"
            later.insert(0, proc)
        addresses = ",".join(f"127.0.0.1:{p.ready['port']}" for p in later)
        extra = ["--stage-addresses", addresses] if addresses else []
        first = ServiceProcess("stage0", ["prefill", "--stage", "0", *common, *extra], self.workdir)
        first.start()
        self.stages = [first, *later]
        first.wait_ready(timeout_s=180)
        return self

    def stop(self) -> None:
        for stage in self.stages:
            stage.stop()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> LocalPipeline:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclass(slots=True)
class LocalDecode:
    """One decode shard process (``kvpool decode``) on this host."""

    args: list[str] = field(default_factory=list)
    name: str = "decode"
    workdir: Path | None = None
    process: ServiceProcess | None = None
    _tmp: tempfile.TemporaryDirectory[str] | None = None

    @property
    def address(self) -> str:
        assert self.process is not None, "start() first"
        return f"127.0.0.1:{self.process.ready['port']}"

    @property
    def admin_port(self) -> int:
        assert self.process is not None, "start() first"
        return int(self.process.ready["admin_port"])

    def start(self) -> LocalDecode:
        if self.workdir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="kvpool-decode-")
            self.workdir = Path(self._tmp.name)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.process = ServiceProcess(self.name, ["decode", "--port", "0", "--admin-port", "0", *self.args],
                                      self.workdir)
        self.process.start()
        self.process.wait_ready(timeout_s=120)
        return self

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> LocalDecode:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
