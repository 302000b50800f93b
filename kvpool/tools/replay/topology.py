"""K logical servers on this host, their pool shared or split, behind one router.

Each logical server has its own prefill pipeline, its own decode shard and two
store daemons, the seed's NUMA halves: a prefill-side one and a decode-side one.

- ``pool="shared"``: one master over every store of every server.
- ``pool="split"``: one master per server over that server's prefill-side
  store only; the decode-side store is not started (in the seed it holds no
  history, so its DRAM is in nobody's pool).

One router over every server's pipeline and shard places sessions as it
always does. Each server's processes run under a host name of their own
(``kvr-s{i}``, placement's "the writer's own host first") and, where this
host can make them, in a network namespace of their own, reaching the others
over a veth link shaped to ``link_gbit`` (``topology_netns``). Where
namespaces cannot be made the servers share loopback and ``network_mode``
says why.

Invariants: ``start`` either returns with every service ready or leaves
nothing behind (processes stopped, namespaces removed); ``stop`` stops every
process (router first, masters last) and then removes the network, and is
safe to call twice.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from kvpool.tools.cluster import ServiceProcess
from kvpool.tools.replay.topology_netns import (
    BRIDGE_ADDRESS,
    NetnsUnavailable,
    Network,
    ServerLink,
    netns_prefix,
    uts_works,
)

READY_TIMEOUT_S = 180.0
POOL_MODES = ("shared", "split")


@dataclass(slots=True, frozen=True)
class TopologySettings:
    """The shape of one side of a comparison; sizes are per process."""

    servers: int = 2
    pool: str = "shared"
    stages: int = 2
    segment_size: str = "128MiB"  # each store's DRAM
    device_cache_tokens: int = 8192  # each prefill stage's device KV
    model: str = "tiny"
    kv_dtype: str = "float32"
    eviction: str = "group"  # the master's --eviction
    netns: bool = True  # False: loopback even where namespaces work
    link_gbit: float = 10.0
    netns_lock_wait_s: float = 30.0  # one run at a time holds the namespaces; wait this long, then loopback
    decode_args: tuple[str, ...] = ()
    master_args: tuple[str, ...] = ()
    log_level: str = "warning"

    def __post_init__(self) -> None:
        if self.servers < 1 or self.stages < 1:
            raise ValueError(f"servers and stages must be >= 1, got {self.servers} and {self.stages}")
        if self.pool not in POOL_MODES:
            raise ValueError(f"pool must be one of {POOL_MODES}, got {self.pool!r}")
        if self.link_gbit <= 0:
            raise ValueError(f"link_gbit must be positive, got {self.link_gbit}")


@dataclass(slots=True)
class Server:
    """One logical server: its processes, where they listen, what placement calls its host."""

    index: int
    host_name: str
    address: str
    prefix: list[str]
    link: ServerLink | None = None
    services: list[ServiceProcess] = field(default_factory=list)
    pipeline: str = ""  # stage 0's address
    shard: str = ""

    @property
    def alive(self) -> bool:
        return any(p.alive for p in self.services)

    def kill(self) -> list[str]:
        """kill -9 every process of this server at once (a lost host), then reap them; returns their names."""
        for proc in self.services:
            if proc.alive:
                proc.proc.kill()  # type: ignore[union-attr]
        for proc in self.services:
            proc.kill()
        return [p.name for p in self.services]

    def link_bytes(self) -> tuple[int, int] | None:
        """(bytes in, bytes out) over its link so far; None on loopback (no link of its own)."""
        return self.link.counters() if self.link is not None else None


@dataclass(slots=True)
class Topology:
    """The started servers, masters and router (see the module doc)."""

    settings: TopologySettings
    workdir: Path | None = None
    servers: list[Server] = field(default_factory=list)
    masters: list[ServiceProcess] = field(default_factory=list)
    router: ServiceProcess | None = None
    network: Network | None = None
    network_mode: str = ""  # "netns" or "loopback", with why
    _tmp: tempfile.TemporaryDirectory[str] | None = None

    # ---- the whole ------------------------------------------------------

    def start(self) -> Topology:
        if self.workdir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix=f"kvpool-topology-{self.settings.pool}-")
            self.workdir = Path(self._tmp.name)
        self.workdir.mkdir(parents=True, exist_ok=True)
        try:
            self._make_servers()
            masters = self._start_masters()
            self._start_stores(masters)
            decode = self._spawn_decode()  # no dependency on the pipelines: starts beside them
            self._start_pipelines(masters)
            for srv, proc in decode:
                srv.shard = f"{srv.address}:{proc.wait_ready(timeout_s=READY_TIMEOUT_S)['port']}"
            self._start_router()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Router first, then stages and shards, then stores, masters last (a tier at once); then the network."""
        def tier(kind: str) -> list[ServiceProcess]:
            return [p for srv in self.servers for p in srv.services if kind in p.name]

        try:
            for procs in ([self.router] if self.router else [], tier("-stage") + tier("-decode"), tier("-store"),
                          tier("-master") + self.masters):
                for proc in procs:  # SIGTERM to the whole tier, then wait for each
                    if proc.alive:
                        proc.proc.terminate()  # type: ignore[union-attr]
                for proc in procs:
                    proc.stop()
        finally:
            if self.network is not None:
                self.network.remove()
                self.network = None
            if self._tmp is not None:
                self._tmp.cleanup()
                self._tmp = None

    def __enter__(self) -> Topology:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def url(self) -> str:
        """The router's OpenAI-compatible HTTP base URL (in this namespace)."""
        assert self.router is not None, "start() first"
        return f"http://127.0.0.1:{self.router.ready['http_port']}"

    def kill_server(self, index: int) -> list[str]:
        return self.servers[index].kill()

    def link_bytes(self) -> list[tuple[int, int] | None]:
        return [s.link_bytes() for s in self.servers]

    # ---- network and identities -----------------------------------------

    def _make_servers(self) -> None:
        s = self.settings
        links: list[ServerLink | None] = [None] * s.servers
        reason = "loopback asked for" if not s.netns else ""
        if s.netns:
            try:
                self.network = Network(s.servers, s.link_gbit).create(s.netns_lock_wait_s)
                links = list(self.network.links)
            except NetnsUnavailable as exc:
                reason = f"no network namespaces ({exc})"
        uts = uts_works()
        for i, link in enumerate(links):
            host_name = f"kvr-s{i}"
            prefix = netns_prefix(link.netns if link else None, host_name if uts is None else None)
            self.servers.append(Server(i, host_name, link.address if link else "127.0.0.1", prefix, link))
        if self.network is not None:
            self.network_mode = (f"netns: {s.servers} namespaces on a bridge, links shaped to {s.link_gbit:g} "
                                 "Gbit/s each way, a host name per server")
        elif uts is None:
            self.network_mode = f"loopback: {reason}; a host name per server (unshare --uts), no link shaping"
        else:
            self.network_mode = f"loopback: {reason}; ONE host name for all servers ({uts}), no link shaping"

    # ---- roles ----------------------------------------------------------

    def _start_masters(self) -> list[str]:
        """The master address each server's stores and stages use."""
        s = self.settings
        args = ["master", "--port", "0", "--admin-port", "0", "--eviction", s.eviction, *s.master_args]
        if s.pool == "shared":
            # the root namespace, on the bridge: every server reaches it over its own link
            address = BRIDGE_ADDRESS if self.network is not None else "127.0.0.1"
            master = self._spawn("master", args, address, [])
            self.masters.append(master)
            port = master.wait_ready(timeout_s=READY_TIMEOUT_S)["port"]
            return [f"{address}:{port}"] * len(self.servers)
        # a split master is part of its server: it goes when the server goes
        started = [self._spawn(f"s{srv.index}-master", args, srv.address, srv.prefix, srv) for srv in self.servers]
        return [f"{srv.address}:{m.wait_ready(timeout_s=READY_TIMEOUT_S)['port']}"
                for srv, m in zip(self.servers, started, strict=True)]

    def _start_stores(self, masters: list[str]) -> None:
        s = self.settings
        sides = ("p", "d") if s.pool == "shared" else ("p",)
        started = []
        for srv, master in zip(self.servers, masters, strict=True):
            for side in sides:
                name = f"s{srv.index}-store-{side}"
                started.append(self._spawn(
                    name, ["store", "--master", master, "--port", "0", "--admin-port", "0",
                           "--segment-size", s.segment_size, "--numa-node", "0", "--segment-id", name,
                           "--transfer-host", srv.address], srv.address, srv.prefix, srv))
        for proc in started:
            proc.wait_ready(timeout_s=READY_TIMEOUT_S)

    def _start_pipelines(self, masters: list[str]) -> None:
        """Every server's pipeline at once, later stages first (stage 0 checks the others)."""
        s = self.settings
        later: list[list[str]] = [[] for _ in self.servers]
        for stage in range(s.stages - 1, -1, -1):
            started = []
            for srv, master in zip(self.servers, masters, strict=True):
                args = ["prefill", "--stage", str(stage), "--num-stages", str(s.stages), "--port", "0",
                        "--admin-port", "0", "--model", s.model, "--kv-dtype", s.kv_dtype,
                        "--device-cache-tokens", str(s.device_cache_tokens), "--master", master,
                        "--transfer-host", srv.address]
                if stage > 0 and later[srv.index]:
                    args += ["--next-stage", later[srv.index][0]]
                elif stage == 0 and later[srv.index]:
                    args += ["--stage-addresses", ",".join(later[srv.index])]
                started.append((srv, self._spawn(f"s{srv.index}-stage{stage}", args, srv.address, srv.prefix, srv)))
            for srv, proc in started:
                address = f"{srv.address}:{proc.wait_ready(timeout_s=READY_TIMEOUT_S)['port']}"
                if stage > 0:
                    later[srv.index].insert(0, address)
                else:
                    srv.pipeline = address

    def _spawn_decode(self) -> list[tuple[Server, ServiceProcess]]:
        s = self.settings
        return [(srv, self._spawn(f"s{srv.index}-decode",
                                  ["decode", "--port", "0", "--admin-port", "0", "--model", s.model,
                                   "--kv-dtype", s.kv_dtype, "--transfer-host", srv.address, *s.decode_args],
                                  srv.address, srv.prefix, srv)) for srv in self.servers]

    def _start_router(self) -> None:
        # the root namespace: it reaches every server over its link, the replay reaches it on loopback
        self.router = self._spawn(
            "router", ["router", "--port", "0", "--http-port", "0", "--admin-port", "0", "--model",
                       self.settings.model, "--pipelines", ",".join(srv.pipeline for srv in self.servers),
                       "--shards", ",".join(srv.shard for srv in self.servers)], "127.0.0.1", [])
        self.router.wait_ready(timeout_s=READY_TIMEOUT_S)

    def _spawn(self, name: str, args: list[str], host: str, prefix: list[str],
               server: Server | None = None) -> ServiceProcess:
        assert self.workdir is not None
        proc = ServiceProcess(name, [*args, "--host", host, "--log-level", self.settings.log_level,
                                     "--log-format", "json"], self.workdir, die_with_parent=True, prefix=prefix)
        if server is not None:
            server.services.append(proc)
        proc.start()
        return proc
