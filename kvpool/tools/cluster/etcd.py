"""One etcd process for a cluster on this host (``kvpool up --master-standbys``, the tests, ``bench faults``).

Debian's ``etcd-server`` (3.4): a single member with its data in the
cluster's work folder, its client and peer ports picked free, over mutual TLS
when the cluster is secure. Never the system's own etcd service.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

ETCD_BINARY = "etcd"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def etcd_binary() -> str:
    found = shutil.which(ETCD_BINARY) or ("/usr/bin/etcd" if Path("/usr/bin/etcd").exists() else None)
    if found is None:
        raise FileNotFoundError("etcd: not installed (Debian: apt-get install etcd-server; scripts/setup.sh does)")
    return found


@dataclass(slots=True)
class TlsFiles:
    """The cluster's CA and a certificate for etcd, as files (``kvpool up --secure`` writes them)."""

    ca: Path
    cert: Path
    key: Path


@dataclass(slots=True)
class EtcdProcess:
    """A single-member etcd: ``endpoint`` (host:port) once started."""

    workdir: Path
    name: str = "etcd"
    client_port: int = 0
    tls: TlsFiles | None = None
    process: subprocess.Popen[bytes] | None = None
    peer_port: int = 0
    log_path: Path = field(default_factory=Path)

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    def command(self) -> list[str]:
        scheme = "https" if self.tls is not None else "http"
        client_url = f"{scheme}://127.0.0.1:{self.client_port}"
        peer_url = f"http://127.0.0.1:{self.peer_port}"
        args = [
            etcd_binary(), "--name", self.name, "--data-dir", str(self.workdir / f"{self.name}.data"),
            "--listen-client-urls", client_url, "--advertise-client-urls", client_url,
            "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
            "--initial-cluster", f"{self.name}={peer_url}", "--initial-cluster-state", "new",
            # a busy 2-core host: no fsync stall should look like a dead member
            "--heartbeat-interval", "100", "--election-timeout", "1000",
            "--logger", "zap", "--log-outputs", "stderr",
        ]
        if self.tls is not None:
            args += ["--cert-file", str(self.tls.cert), "--key-file", str(self.tls.key),
                     "--trusted-ca-file", str(self.tls.ca), "--client-cert-auth"]
        return args

    def start(self, timeout_s: float = 20.0) -> EtcdProcess:
        self.workdir.mkdir(parents=True, exist_ok=True)
        if not self.client_port:
            self.client_port = free_port()
        if not self.peer_port:
            self.peer_port = free_port()
        self.log_path = self.workdir / f"{self.name}.log"
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(self.command(), stdout=log, stderr=log, stdin=subprocess.DEVNULL,
                                            start_new_session=True)
        self.wait_ready(timeout_s)
        return self

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(f"etcd exited with {self.process.returncode}: see {self.log_path}")
            if self.healthy():
                return
            time.sleep(0.05)
        raise TimeoutError(f"etcd not healthy after {timeout_s} s: see {self.log_path}")

    def healthy(self) -> bool:
        if self.tls is not None:  # the log says when it serves: its client port answers TLS only
            with socket.socket() as s:
                return s.connect_ex(("127.0.0.1", self.client_port)) == 0
        try:
            with urllib.request.urlopen(f"http://{self.endpoint}/health", timeout=1.0) as response:
                return b'"true"' in response.read()
        except OSError:
            return False

    def pause(self) -> None:
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGCONT)

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        os.kill(self.process.pid, signal.SIGCONT)
        self.process.terminate()
        try:
            self.process.wait(5.0)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def __enter__(self) -> EtcdProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
