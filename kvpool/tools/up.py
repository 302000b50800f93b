"""``kvpool up``: a whole cluster on this host — master, stores, prefill pipelines, decode shards, router.

It needs no file: the embedded default is one master, two stores, one
four-stage prefill pipeline, one decode shard and the router with the
OpenAI-compatible HTTP API on port 8000. ``--config cluster.toml`` reads the
``[up]`` table for the shape (and every child reads its own ``[<role>]``
table from the same file); flags win over both.

The shape is a ``kvpool.tools.cluster`` topology, started by the one
launcher in dependency order (master, stores, later prefill stages first and
decode beside them, router), each child on a free port reported through its
ready file. ``up`` waits for every service to be healthy, prints where each
listens, and on Ctrl-C or SIGTERM stops them a tier at a time, the router
first and the master last: every child gets SIGTERM (stores unmount, ports
are freed) and, past a grace period, SIGKILL. Children
also die with ``up`` itself (PR_SET_PDEATHSIG), so none is left orphaned.
While it serves, ``up`` supervises: a process that dies is restarted on its
ports with backoff (the master first), and one that keeps dying is given up
on, loudly (``kvpool.tools.cluster.supervisor``); the router's ``/health``
shows every service's restarts.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import tempfile
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from kvpool import service
from kvpool.core.supervision.memory_budget import memory_refusal
from kvpool.core.setting import setting
from kvpool.core.tenancy.shares import parse_weights
from kvpool.host_memory import available_bytes
from kvpool.sizes import format_size
from kvpool.model.config import CONFIGS
from kvpool.secret_files import UnsafeFolder, write_secret
from kvpool.tools.api_key import API_KEY_ENV, auth_headers
from kvpool.settings import read_config
from kvpool.tools.certs import Identity, ThrowawayCA
from kvpool.tools.cluster.etcd import TlsFiles
from kvpool.tools.cluster import (
    Cluster,
    DecodeSpec,
    MasterSpec,
    PipelineSpec,
    RouterSpec,
    ServerSpec,
    ServiceFailed,
    ServiceProcess,
    StoreSpec,
    Topology,
)
from kvpool.tools.cluster.supervisor import Supervisor
from kvpool import host_numa

log = structlog.get_logger(__name__)

API_KEYS_FILE = "api_keys"  # in the workdir: the router's --api-keys-file

@dataclass(slots=True)
class UpSettings:
    """The cluster's shape; each service's own settings come from its ``[<role>]`` table."""

    host: str = setting("127.0.0.1", help="address every service listens on")
    http_port: int = setting(8000, help="the router's OpenAI-compatible HTTP port (0 picks a free one)")
    grpc_port: int = setting(7900, help="the router's gRPC port (0 picks a free one)")
    pipelines: int = setting(1, help="prefill pipelines")
    stages: int = setting(4, help="stages per prefill pipeline")
    decode_shards: int = setting(1, help="decode shards")
    stores: int = setting(2, help="store daemons, store i on the i-th NUMA node that has CPUs, round robin "
                          "(one per node in production; a [store] table's numa_node wins)")
    segment_size: str | None = setting(None, help="DRAM each store contributes to the pool", metavar="SIZE",
                                       default_text="512MiB, unless the [store] table sets it")
    pool: bool = setting(True, help="share a KV pool (--no-pool: the pipelines use their device cache only)")
    master_standbys: int = setting(0, help="pool master standbys beside the leader: with 1 or more, up starts an "
                                   "etcd (Debian's etcd-server) in the workdir, and the masters elect their leader "
                                   "there; stores and stages follow it (0: one master, no etcd)", metavar="N")
    model: str = setting("tiny", help="model config of every service", choices=tuple(CONFIGS))
    model_dir: str = setting("", help="serve a Hugging Face DeepSeek-V3-architecture directory (config.json, "
                             "safetensors weights, tokenizer.json, chat template): every prefill stage, decode "
                             "shard and the router read it; overrides --model", metavar="DIR",
                             default_text="the built-in --model")
    kv_dtype: str = setting("float32", help="KV storage dtype of prefill and decode",
                            choices=("float32", "bfloat16", "float8_e4m3fn"))
    device_cache_tokens: int | None = setting(None, help="each prefill stage's device KV capacity in tokens (the "
                                              "longest prompt it serves)",
                                              default_text="32768, unless the [prefill] table sets it")
    region_arena_bytes: str | None = setting(None, help="each decode shard's receive arena (the prompts' KV in "
                                             "flight from prefill; 128MiB holds a 32K-token tiny prompt)",
                                             metavar="SIZE", default_text="128MiB, unless the [decode] table sets it")
    # no flag: a key on a command line is readable by every local user (/proc/PID/cmdline)
    api_key: list[str] = setting(help="API keys of the HTTP API, each KEY or TENANT=KEY", factory=list,
                                 flag=False)
    api_keys_file: str = setting("", help="API keys of the HTTP API, a file of lines KEY or TENANT=KEY (# "
                                 f"comments); ${API_KEY_ENV} adds KEY or TENANT=KEY,... . Keys turn on --secure "
                                 "(mutual TLS between the services); the router gets them in a file of the workdir",
                                 metavar="PATH", default_text=f"none: the API is open unless ${API_KEY_ENV} is set")
    tenant_weights: list[str] = setting(help="each tenant's weight in the pool, the device caches and the prefill "
                                        "queues' fair share, TENANT=WEIGHT (handed to the master, every prefill "
                                        "stage and the router); a tenant not named weighs 1", factory=list,
                                        metavar="TENANT=WEIGHT,...",
                                        default_text="none: equal shares")
    secure: bool = setting(False, help="mutual TLS between every service: a throwaway CA and one certificate per "
                           "service (its role its common name) in the workdir's certs/")
    insecure: bool = setting(False, help="let services on a non-loopback --host serve plaintext gRPC")
    transfer_engine: bool = setting(False, help="run a transfer engine in every store, stage and decode shard. "
                                    "Off: every bulk byte of this one-host cluster moves through shared memory "
                                    "only its user can map, and no engine port is opened")
    workdir: str = setting("", help="where logs and ready files go", metavar="DIR", default_text="a temporary folder")
    supervise: bool = setting(True, help="restart a process that dies, with backoff; give up on one that dies more "
                                         "than 5 times in 2 minutes (--no-supervise: leave it dead)")

    def __post_init__(self) -> None:
        if isinstance(self.api_key, str):
            self.api_key = [k for k in self.api_key.split(",") if k]
        if isinstance(self.tenant_weights, str):
            self.tenant_weights = [w for w in self.tenant_weights.split(",") if w]
        parse_weights(self.tenant_weights)  # raises naming the bad entry
        if self.api_keys_file and not Path(self.api_keys_file).is_file():
            raise ValueError(f"api_keys_file: {self.api_keys_file} is not a file")
        for name in ("pipelines", "stages", "decode_shards"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.stores < 0:
            raise ValueError(f"stores: must be >= 0, got {self.stores}")
        if not 0 <= self.master_standbys <= 8:
            raise ValueError(f"master_standbys: must be in 0..8, got {self.master_standbys}")
        if self.stores == 0:
            self.pool = False
        for name in ("http_port", "grpc_port"):
            if not 0 <= getattr(self, name) <= 65535:
                raise ValueError(f"{name}: {getattr(self, name)} is not a TCP port")
        if self.model_dir:  # checked whole before any process starts; every child gets the absolute path
            from kvpool.model.hf_checkpoint import checked_model_dir

            self.model_dir = str(Path(self.model_dir).resolve())
            layers = checked_model_dir(self.model_dir).config.num_hidden_layers
            if self.stages > layers:
                raise ValueError(f"stages: {self.stages} stages for the model's {layers} layers")


    def keys(self, environ: Mapping[str, str] = os.environ) -> list[str]:
        """Every API key entry (``KEY`` or ``TENANT=KEY``): ``api_key``, the file's lines, ``$KVPOOL_API_KEY``.
        The router checks each entry when it reads the file ``up`` writes it."""
        entries = [*self.api_key, *environ.get(API_KEY_ENV, "").split(",")]
        if self.api_keys_file:
            path = Path(self.api_keys_file)
            if not path.is_file():
                raise ValueError(f"api_keys_file: {path} is not a file")
            entries += path.read_text().splitlines()
        return [e.strip() for e in entries if e.strip() and not e.strip().startswith("#")]

    def handed(self, config_tables: dict[str, Any]) -> dict[str, dict[str, Any]]:
        """The settings ``up`` puts on each role's command line (flags win over the role's table): one
        given to ``up`` (flag or ``[up]``) always; else ``up``'s default, unless the role's own table sets
        it, which the child then reads itself."""
        handed: dict[str, dict[str, Any]] = {role: {} for role, _, _ in SIZED_BY_UP}
        for role, name, default in SIZED_BY_UP:
            table = config_tables.get(role, {})
            value = getattr(self, name)
            if value is not None:
                handed[role][name] = value
            elif name not in table and name.replace("_", "-") not in table:
                handed[role][name] = default
        return handed


# each service's own setting that ``up`` sizes for a cluster on one host: (role's table, setting, up's default)
SIZED_BY_UP: tuple[tuple[str, str, Any], ...] = (
    ("store", "segment_size", "512MiB"),
    ("prefill", "device_cache_tokens", 32768),
    ("decode", "region_arena_bytes", "128MiB"),
)


def store_numa_nodes(num_stores: int, nodes: dict[int, list[int]]) -> list[int]:
    """The NUMA node of each store ``up`` starts: the nodes that have CPUs, round robin (one store per
    node is the production shape; a store pins to its node's CPUs, so a memory-only node cannot take one)."""
    usable = sorted(node for node, cpus in nodes.items() if cpus) or [0]
    return [usable[i % len(usable)] for i in range(num_stores)]


def _flags(values: dict[str, Any]) -> tuple[str, ...]:
    return tuple(part for name, value in values.items() for part in ("--" + name.replace("_", "-"), str(value)))


def up_topology(settings: UpSettings, config: str | None = None, log_level: str = "warning",
                supervisor_status: str = "") -> Topology:
    """The cluster ``kvpool up`` starts: one host, its processes named ``master``, ``store{i}``,
    ``p{i}-stage{s}``, ``decode{i}`` and ``router``."""
    s = settings
    model_dir = ("--model-dir", s.model_dir) if s.model_dir else ()
    model = ("--model", s.model, *model_dir, "--kv-dtype", s.kv_dtype)
    weights = ("--tenant-weights", ",".join(s.tenant_weights)) if s.tenant_weights else ()
    tables = read_config(config) if config else {}
    handed = s.handed(tables)
    num_stores = s.stores if s.pool else 0
    store_table = tables.get("store", {})
    if "numa_node" in store_table or "numa-node" in store_table:
        nodes: list[tuple[str, ...]] = [()] * num_stores  # the [store] table's node, read by each store
    else:
        nodes = [("--numa-node", str(n)) for n in store_numa_nodes(num_stores, host_numa.numa_nodes())]
    # one host: shared memory carries every bulk byte, so no process needs an engine (or opens its port)
    engine = () if s.transfer_engine else ("--no-transfer-engine",)
    stores = tuple(StoreSpec(f"store{i}", (*_flags(handed["store"]), *nodes[i], "--segment-id", f"up-store{i}",
                                           *engine))
                   for i in range(num_stores))
    pipelines = tuple(PipelineSpec(f"p{i}-", s.stages, (*model, *_flags(handed["prefill"]), *engine, *weights),
                                   pool=s.pool) for i in range(s.pipelines))
    shards = tuple(DecodeSpec(f"decode{i}", (*model, *_flags(handed["decode"]), *engine))
                   for i in range(s.decode_shards))
    common = ("--log-level", log_level, "--log-format", "json", *(("--config", config) if config else ()))
    return Topology((ServerSpec(stores=stores, pipelines=pipelines, decode_shards=shards),),
                    master=MasterSpec(args=weights, standbys=s.master_standbys) if s.pool else None,
                    # --reuse-port: a rolling restart hands the router over to a second one on its ports
                    router=RouterSpec(port=s.grpc_port, http_port=s.http_port, args=(
                        "--model", s.model, *model_dir, "--reuse-port", *weights,
                        *(("--supervisor-status", supervisor_status) if supervisor_status else ()))),
                    host=s.host, common_args=common)


@dataclass(slots=True)
class UpAccess:
    """What ``kvpool up`` hands each process beyond the topology's flags: the router's keys file, and with
    ``secure`` each process's certificate of a throwaway CA made in the workdir on the first call."""

    api_keys: list[str]
    secure: bool = False
    insecure: bool = False
    ca: ThrowawayCA | None = None
    client: Identity | None = None  # an operator's tools (role "client"): kvpool generate, pool stats
    monitor: Identity | None = None  # a metrics scraper's (role "monitor"): the admin ports, nothing else

    def __call__(self, name: str, args: list[str], host: str, workdir: Path) -> list[str]:
        extra: list[str] = []
        if self.secure:
            if self.ca is None:
                self.ca = ThrowawayCA(workdir / "certs", hosts=(host,))
                self.client = self.ca.issue("client")
                self.monitor = self.ca.issue("monitor")
            # the certificate names the role, and a store's segment (it may unmount only its own)
            role = args[0] if args[0] != "store" else f"store/{args[args.index('--segment-id') + 1]}"
            extra += self.ca.issue(role, file_stem=name).flags()
        elif self.insecure:
            extra.append("--insecure")
        if args[0] == "router" and self.api_keys:
            keys_file = write_secret(workdir / API_KEYS_FILE, "\n".join(self.api_keys) + "\n")
            extra += ["--api-keys-file", str(keys_file)]  # a file: keys never show on a command line
        return extra

    def etcd_tls(self, workdir: Path, host: str) -> TlsFiles | None:
        """With ``secure``: etcd's certificate of the same CA (it asks every client for one of that CA)."""
        if not self.secure:
            return None
        if self.ca is None:  # etcd starts before every other process: the CA is made here
            self.ca = ThrowawayCA(workdir / "certs", hosts=(host,))
            self.client = self.ca.issue("client")
            self.monitor = self.ca.issue("monitor")
        identity = self.ca.issue("etcd")  # on loopback, as every certificate of the CA may serve
        return TlsFiles(identity.ca, identity.cert, identity.key)

    def bearer(self) -> dict[str, str]:
        """The header that authenticates ``up``'s own calls to the router (the first key), if keys are set."""
        return auth_headers(self.api_keys[0]) if self.api_keys else {}


def up_cluster(settings: UpSettings, config: str | None = None, log_level: str = "warning",
               supervisor_status: str = "") -> Cluster:
    """Not started yet: ``.start()`` it (logs and ready files go to ``settings.workdir`` or a temporary folder).

    API keys imply ``secure``: a key gates the HTTP API only, so without mutual TLS stage 0's ``Prefill``
    and every internal port would serve anyone on the host in plaintext."""
    workdir = Path(settings.workdir) if settings.workdir else None
    keys = settings.keys()
    access = UpAccess(keys, settings.secure or bool(keys), settings.insecure)
    return Cluster(up_topology(settings, config, log_level, supervisor_status), workdir=workdir, access=access,
                   etcd_tls=access.etcd_tls)


def wait_for_stop_signal(tick: Callable[[], None] | None = None, on_hangup: Callable[[], None] | None = None,
                         ready: Callable[[], None] | None = None) -> int:
    """Block until SIGINT or SIGTERM, calling ``tick`` twice a second (and ``on_hangup`` after a SIGHUP);
    returns the signal number. ``ready`` runs once the handlers are in place: what tells a user (or a
    script) to press Ctrl-C or send SIGHUP goes there, since before it SIGINT is Python's
    KeyboardInterrupt (exit 130) and SIGHUP the default's (the process dies, its services orphaned).

    The handlers only append to a list: a handler that takes a lock (``Event.set``) deadlocks when a second
    signal arrives while the first handler holds it (Ctrl-C pressed twice, or a wrapper forwarding a
    signal), and ``kvpool up`` then hung with every service stopped. The signal's byte on a wakeup pipe
    ends the wait at once.
    """
    received: list[int] = []
    hangups: list[int] = []
    wake_r, wake_w = os.pipe()
    for fd in (wake_r, wake_w):
        os.set_blocking(fd, False)
    previous = {sig: signal.signal(sig, lambda signum, _frame: received.append(signum))
                for sig in (signal.SIGINT, signal.SIGTERM)}
    if on_hangup is not None:
        previous[signal.SIGHUP] = signal.signal(signal.SIGHUP, lambda signum, _frame: hangups.append(signum))
    previous_wakeup = signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
    try:
        if ready is not None:
            ready()
        while not received:
            select.select([wake_r], [], [], 0.5)
            with contextlib.suppress(BlockingIOError):
                os.read(wake_r, 512)
            if received:
                break
            if tick is not None:
                tick()
            if hangups and on_hangup is not None:
                hangups.clear()
                on_hangup()
    finally:
        signal.set_wakeup_fd(previous_wakeup)
        for sig, old in previous.items():
            signal.signal(sig, old)
        os.close(wake_r)
        os.close(wake_w)
    return received[0]


def backend_healthy(cluster: Cluster, proc: ServiceProcess) -> bool:
    """Whether the router sees ``proc``'s pipeline or shard healthy again (other roles: alive is enough)."""
    if not proc.alive:
        return False
    role = proc.args[0] if proc.args else ""
    if role not in ("prefill", "decode"):
        return True
    server = next(s for s in cluster.servers if proc in s.services)
    backend = server.address_of(proc)
    if role == "prefill":
        backend = next(server.address_of(stages[0]) for stages in server.stages if proc in stages)
    headers = cluster.access.bearer() if isinstance(cluster.access, UpAccess) else {}
    try:  # with keys set, only a keyed /health names its targets
        with urllib.request.urlopen(urllib.request.Request(f"{cluster.http_url}/health", headers=headers),
                                    timeout=5) as response:
            body = json.loads(response.read())
    except urllib.error.HTTPError as exc:  # 503 while anything is unhealthy: the body still says what
        body = json.loads(exc.read())
    except OSError:
        return False
    return bool(body.get("targets", {}).get(backend))


def run_up(settings: UpSettings, config: str | None, log_level: str, demo: Any = None,
           budget: dict[str, int] | None = None, ready_file: str | None = None) -> int:
    """Start the cluster, print where everything listens (and, with ``ready_file``, write the router's ports
    there as JSON), serve until a signal (or the demo ends), stop."""
    status_dir = tempfile.TemporaryDirectory(prefix="kvpool-up-")
    status_file = Path(status_dir.name) / "supervisor.json"
    cluster = up_cluster(settings, config, log_level, str(status_file) if settings.supervise else "")
    print(f"kvpool up: starting {settings.pipelines} pipeline(s) of {settings.stages} stages, "
          f"{settings.decode_shards} decode shard(s), {settings.stores} store(s) — logs in "
          f"{settings.workdir or 'a temporary folder'}", flush=True)
    if budget:  # by role, from the settings every child reads (services/memory_budget.py)
        print(f"kvpool up: memory budget {format_size(sum(budget.values()))} "
              f"({', '.join(f'{what} {format_size(n)}' for what, n in budget.items())}; each process's runtime "
              "comes on top)", flush=True)
        refusal = memory_refusal("up", budget, available_bytes())
        if refusal is not None:
            status_dir.cleanup()
            print(f"kvpool {refusal}", flush=True)
            return 1
    access = cluster.access
    if isinstance(access, UpAccess) and access.api_keys and not settings.secure:
        log.info("keys_imply_mutual_tls")
        print("kvpool up: API keys are set, so the services talk mutual TLS as with --secure (a throwaway CA "
              "in the workdir's certs/): no internal port serves plaintext", flush=True)
    try:
        cluster.start()
    except ServiceFailed as exc:
        status_dir.cleanup()
        print(f"kvpool up: a service failed to start:\n{exc}", flush=True)
        return 1
    except UnsafeFolder as exc:
        status_dir.cleanup()
        print(f"kvpool up: {exc}", flush=True)
        return 1
    try:
        print("kvpool up: every service is healthy", flush=True)
        for line in cluster.describe():
            print(line, flush=True)
        print(f"kvpool up: OpenAI-compatible API at {cluster.http_url}/v1", flush=True)
        router = cluster.find("router").ready
        service.write_ready_file(ready_file, grpc_port=router["port"], http_port=router.get("http_port"),
                                 http_url=cluster.http_url)
        if isinstance(cluster.access, UpAccess) and cluster.access.client is not None:
            print("kvpool up: mutual TLS; tools use the client certificate: "
                  + " ".join(f"{k}={v}" for k, v in cluster.access.client.env().items()), flush=True)
            if cluster.access.monitor is not None:
                monitor = cluster.access.monitor
                print(f"kvpool up: admin ports serve HTTPS to the monitor certificate: {monitor.cert} "
                      f"(key {monitor.key}, CA {monitor.ca})", flush=True)
        if demo is not None:
            return int(demo(cluster))
        supervisor = Supervisor(cluster, status_file=status_file, say=lambda line: print(line, flush=True))
        if settings.supervise:
            print("kvpool up: a process that dies is restarted (--no-supervise: left dead)", flush=True)

        def ready() -> None:  # the handlers are in place: a signal sent on reading these lines is handled
            print(f"kvpool up: `kill -HUP {os.getpid()}` restarts every service one at a time, draining each "
                  "(the router last: a second router takes its ports before it drains)", flush=True)
            print("kvpool up: Ctrl-C stops the cluster", flush=True)

        wait_for_stop_signal(supervisor.tick if settings.supervise else None,
                             on_hangup=lambda: supervisor.rolling_restart(lambda p: backend_healthy(cluster, p)),
                             ready=ready)
        return 0
    except KeyboardInterrupt:
        return 130
    finally:
        print("kvpool up: stopping", flush=True)
        cluster.stop()
        status_dir.cleanup()
        print("kvpool up: stopped", flush=True)
