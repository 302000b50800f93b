"""``kvpool up``: a whole cluster on this host — master, stores, prefill pipelines, decode shards, router.

It needs no file: the embedded default is one master, two stores, one
four-stage prefill pipeline, one decode shard and the router with the
OpenAI-compatible HTTP API on port 8000. ``--config cluster.toml`` reads the
``[up]`` table for the shape (and every child reads its own ``[<role>]``
table from the same file); flags win over both.

Start order is dependency order (master, stores, later prefill stages first,
decode, router), each child on a free port reported through its ready file.
``up`` waits for every service to be healthy, prints where each listens, and
on Ctrl-C or SIGTERM stops them in reverse order: every child gets SIGTERM
(stores unmount, ports are freed) and, past a grace period, SIGKILL. Children
also die with ``up`` itself (PR_SET_PDEATHSIG), so none is left orphaned.
"""

from __future__ import annotations

import signal
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from kvpool.core.setting import setting
from kvpool.tools.cluster import ServiceFailed, ServiceProcess
from kvpool.model.config import CONFIGS

log = structlog.get_logger(__name__)

READY_TIMEOUT_S = 180.0


@dataclass(slots=True)
class UpSettings:
    """The cluster's shape; each service's own settings come from its ``[<role>]`` table."""

    host: str = setting("127.0.0.1", help="address every service listens on")
    http_port: int = setting(8000, help="the router's OpenAI-compatible HTTP port (0 picks a free one)")
    grpc_port: int = setting(7900, help="the router's gRPC port (0 picks a free one)")
    pipelines: int = setting(1, help="prefill pipelines")
    stages: int = setting(4, help="stages per prefill pipeline")
    decode_shards: int = setting(1, help="decode shards")
    stores: int = setting(2, help="store daemons (one per NUMA node in production)")
    segment_size: str = setting("512MiB", help="DRAM each store contributes to the pool", metavar="SIZE")
    pool: bool = setting(True, help="share a KV pool (--no-pool: the pipelines use their device cache only)")
    model: str = setting("tiny", help="model config of every service", choices=tuple(CONFIGS))
    kv_dtype: str = setting("float32", help="KV storage dtype of prefill and decode",
                            choices=("float32", "bfloat16", "float8_e4m3fn"))
    device_cache_tokens: int = setting(16384, help="each prefill stage's device KV capacity in tokens")
    workdir: str = setting("", help="where logs and ready files go", metavar="DIR", default_text="a temporary folder")

    def __post_init__(self) -> None:
        for name in ("pipelines", "stages", "decode_shards"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.stores < 0:
            raise ValueError(f"stores: must be >= 0, got {self.stores}")
        if self.stores == 0:
            self.pool = False
        for name in ("http_port", "grpc_port"):
            if not 0 <= getattr(self, name) <= 65535:
                raise ValueError(f"{name}: {getattr(self, name)} is not a TCP port")


@dataclass(slots=True)
class Cluster:
    """The started services, in start order."""

    settings: UpSettings
    config: str | None = None
    log_level: str = "warning"
    services: list[ServiceProcess] = field(default_factory=list)
    workdir: Path = field(default_factory=Path)
    _tmp: tempfile.TemporaryDirectory[str] | None = None

    def start(self) -> Cluster:
        s = self.settings
        if s.workdir:
            self.workdir = Path(s.workdir)
            self.workdir.mkdir(parents=True, exist_ok=True)
        else:
            self._tmp = tempfile.TemporaryDirectory(prefix="kvpool-up-")
            self.workdir = Path(self._tmp.name)
        try:
            master = self._start_pool() if s.pool else ""
            stage0 = [self._start_pipeline(p, master) for p in range(s.pipelines)]
            shards = [self._start_decode(d) for d in range(s.decode_shards)]
            self._start_router(stage0, shards)
        except BaseException:
            self.stop()
            raise
        return self

    # ---- roles ----------------------------------------------------------

    def _start_pool(self) -> str:
        s = self.settings
        master = self._run("master", ["master", "--port", "0", "--admin-port", "0"])
        address = f"{s.host}:{master.ready['port']}"
        stores = [self._spawn(f"store{i}", ["store", "--master", address, "--port", "0", "--admin-port", "0",
                                            "--segment-size", s.segment_size, "--numa-node", "0",
                                            "--segment-id", f"up-store{i}"]) for i in range(s.stores)]
        for store in stores:
            self._ready(store)
        return address

    def _start_pipeline(self, index: int, master: str) -> str:
        s = self.settings
        common = ["--num-stages", str(s.stages), "--port", "0", "--admin-port", "0", "--model", s.model,
                  "--kv-dtype", s.kv_dtype, "--device-cache-tokens", str(s.device_cache_tokens),
                  *(["--master", master] if master else ["--no-pool"])]
        later: list[str] = []
        next_address = ""
        for stage in range(s.stages - 1, 0, -1):
            extra = ["--next-stage", next_address] if next_address else []
            proc = self._run(f"p{index}-stage{stage}", ["prefill", "--stage", str(stage), *common, *extra])
            next_address = f"{s.host}:{proc.ready['port']}"
            later.insert(0, next_address)
        extra = ["--stage-addresses", ",".join(later)] if later else []
        first = self._run(f"p{index}-stage0", ["prefill", "--stage", "0", *common, *extra])
        return f"{s.host}:{first.ready['port']}"

    def _start_decode(self, index: int) -> str:
        s = self.settings
        proc = self._run(f"decode{index}", ["decode", "--port", "0", "--admin-port", "0", "--model", s.model,
                                            "--kv-dtype", s.kv_dtype])
        return f"{s.host}:{proc.ready['port']}"

    def _start_router(self, pipelines: list[str], shards: list[str]) -> None:
        s = self.settings
        self._run("router", ["router", "--port", str(s.grpc_port), "--http-port", str(s.http_port),
                             "--admin-port", "0", "--model", s.model, "--pipelines", ",".join(pipelines),
                             "--shards", ",".join(shards)])

    # ---- processes ------------------------------------------------------

    def _spawn(self, name: str, args: list[str]) -> ServiceProcess:
        common = ["--host", self.settings.host, "--log-level", self.log_level, "--log-format", "json"]
        if self.config:
            common += ["--config", self.config]
        proc = ServiceProcess(name, [*args, *common], self.workdir, die_with_parent=True)
        proc.start()
        self.services.append(proc)
        return proc

    def _ready(self, proc: ServiceProcess) -> dict[str, Any]:
        return proc.wait_ready(timeout_s=READY_TIMEOUT_S)

    def _run(self, name: str, args: list[str]) -> ServiceProcess:
        proc = self._spawn(name, args)
        self._ready(proc)
        return proc

    def stop(self) -> None:
        """Reverse start order: the router first, the master last (stores unmount on the way out)."""
        for proc in reversed(self.services):
            proc.stop()
        self.services.clear()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def find(self, name: str) -> ServiceProcess:
        return next(p for p in self.services if p.name == name)

    @property
    def http_url(self) -> str:
        return f"http://{self.settings.host}:{self.find('router').ready['http_port']}"

    def describe(self) -> list[str]:
        lines = []
        for proc in self.services:
            ready = proc.ready
            where = f"{self.settings.host}:{ready.get('port')}"
            extra = [f"{k}={ready[k]}" for k in ("http_port", "admin_port", "endpoint") if k in ready]
            lines.append(f"  {proc.name:<14} {where:<22} pid {ready.get('pid')}  {' '.join(extra)}")
        return lines


def wait_for_stop_signal() -> int:
    """Block until SIGINT or SIGTERM; returns the signal number."""
    received: list[int] = []
    event = threading.Event()

    def handler(signum: int, _frame: Any) -> None:
        received.append(signum)
        event.set()

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        while not event.wait(0.5):
            pass
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
    return received[0]


def run_up(settings: UpSettings, config: str | None, log_level: str, demo: Any = None) -> int:
    """Start the cluster, print where everything listens, serve until a signal (or the demo ends), stop."""
    cluster = Cluster(settings, config=config, log_level=log_level)
    print(f"kvpool up: starting {settings.pipelines} pipeline(s) of {settings.stages} stages, "
          f"{settings.decode_shards} decode shard(s), {settings.stores} store(s) — logs in "
          f"{settings.workdir or 'a temporary folder'}", flush=True)
    try:
        cluster.start()
    except ServiceFailed as exc:
        print(f"kvpool up: a service failed to start:\n{exc}", flush=True)
        return 1
    try:
        print("kvpool up: every service is healthy", flush=True)
        for line in cluster.describe():
            print(line, flush=True)
        print(f"kvpool up: OpenAI-compatible API at {cluster.http_url}/v1", flush=True)
        if demo is not None:
            return int(demo(cluster))
        print("kvpool up: Ctrl-C stops the cluster", flush=True)
        wait_for_stop_signal()
        return 0
    except KeyboardInterrupt:
        return 130
    finally:
        print("kvpool up: stopping", flush=True)
        cluster.stop()
        print("kvpool up: stopped", flush=True)
