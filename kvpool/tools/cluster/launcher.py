"""The one cluster launcher: starts a :class:`~kvpool.tools.cluster.topology.Topology` as real processes.

Used by ``kvpool up``, ``kvpool replay`` (and its ``--compare`` sides), the
benchmarks and the tests. Start order is dependency order, each tier at once:
masters, stores, decode shards and pipelines side by side (a pipeline's later
stages first: stage 0 checks the others), then the router over every
pipeline's stage 0 and every shard. Servers with a host name run under it
(``unshare --uts``) and, where the topology asks and this host can, in a
network namespace of their own on a shaped link (``netns``); where namespaces
cannot be made they share loopback and ``network_mode`` says why.

Invariants: ``start`` either returns with every process ready or leaves
nothing behind (processes stopped, namespaces removed); ``stop`` stops every
process a tier at a time (router, then stages and shards, then stores, masters
last: stores unmount on their way out), then removes the network; it is safe
to call twice. The workdir, which holds ``kvpool up``'s keys and certificates,
is this user's alone (``kvpool.secret_files.private_folder``): made mode 0700,
or refused when another user owns it, it has group or other bits, or it is a
symlink.
"""

from __future__ import annotations

import signal
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kvpool.secret_files import private_folder
from kvpool.tools.cluster.etcd import EtcdProcess, TlsFiles
from kvpool.tools.cluster.netns import BRIDGE_ADDRESS, NetnsUnavailable, Network, Place, ServerLink, uts_works
from kvpool.tools.cluster.process import ServiceProcess
from kvpool.tools.cluster.topology import MasterSpec, PipelineSpec, ServerSpec, StoreSpec, Topology

READY_TIMEOUT_S = 180.0


@dataclass(slots=True)
class Server:
    """One logical server's processes, where they listen, and its link when it has a namespace."""

    index: int
    spec: ServerSpec
    address: str
    place: Place  # its namespace and host name
    link: ServerLink | None = None
    master: ServiceProcess | None = None  # a split pool's own master
    stores: list[ServiceProcess] = field(default_factory=list)
    stages: list[list[ServiceProcess]] = field(default_factory=list)  # per pipeline, stage 0 first
    decode: list[ServiceProcess] = field(default_factory=list)

    @property
    def host_name(self) -> str:
        return self.spec.host_name

    @property
    def services(self) -> list[ServiceProcess]:
        master = [self.master] if self.master is not None else []
        return [*master, *self.stores, *(s for stages in self.stages for s in stages), *self.decode]

    def address_of(self, proc: ServiceProcess) -> str:
        return f"{self.address}:{proc.ready['port']}"

    @property
    def pipelines(self) -> list[str]:
        """Each pipeline's stage 0 address (the Prefill API)."""
        return [self.address_of(stages[0]) for stages in self.stages]

    @property
    def shards(self) -> list[str]:
        return [self.address_of(d) for d in self.decode]

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
class Cluster:
    """The started processes of one topology (see the module doc)."""

    topology: Topology
    workdir: Path | None = None
    servers: list[Server] = field(default_factory=list)
    master: ServiceProcess | None = None  # the shared one (with standbys: the first candidate started)
    standbys: list[ServiceProcess] = field(default_factory=list)  # the shared master's other candidates
    etcd: EtcdProcess | None = None  # where the candidates elect a leader (standbys only)
    router: ServiceProcess | None = None
    network: Network | None = None
    network_mode: str = ""  # with named servers: "netns: ..." or "loopback: ..." and why
    # more flags per process (name, args, host, workdir): its credentials (kvpool up's keys and certificates)
    access: Callable[[str, list[str], str, Path], list[str]] | None = None
    # a secure cluster's etcd certificate (kvpool up --secure), made in the workdir
    etcd_tls: Callable[[Path, str], TlsFiles | None] | None = None
    _tmp: tempfile.TemporaryDirectory[str] | None = None

    # ---- the whole ------------------------------------------------------

    def start(self) -> Cluster:
        if self.workdir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="kvpool-cluster-")
            self.workdir = Path(self._tmp.name)
        private_folder(self.workdir, "workdir")  # keys, certificates and logs: ours alone, 0700
        try:
            self._make_servers()
            self._start_masters()
            for proc in [self.add_store(srv.index, spec) for srv in self.servers for spec in srv.spec.stores]:
                proc.wait_ready(timeout_s=READY_TIMEOUT_S)
            for srv in self.servers:
                srv.decode = [self._spawn(spec.name, ["decode", "--port", "0", "--admin-port", "0", *spec.args], srv)
                              for spec in srv.spec.decode_shards]  # no dependency on the pipelines: beside them
            self._start_pipelines()
            for proc in (p for srv in self.servers for p in srv.decode):
                proc.wait_ready(timeout_s=READY_TIMEOUT_S)
            self._start_router()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Router, then stages and shards, then stores, masters last (a tier at once); then the network."""
        tiers = [[self.router] if self.router else [],
                 [p for s in self.servers for p in (*(x for st in s.stages for x in st), *s.decode)],
                 [p for s in self.servers for p in s.stores],
                 [p for s in self.servers if (p := s.master) is not None] + self.masters]
        try:
            for i, procs in enumerate(tiers):
                # the router drains (SIGTERM); behind it nobody routes any more, so the rest only
                # finish what they hold (SIGINT: no wait for callers to notice, kvpool/service.py Stop)
                for proc in procs:  # the whole tier at once, then wait for each
                    if proc.alive:
                        proc.proc.send_signal(signal.SIGTERM if i == 0 else signal.SIGINT)  # type: ignore[union-attr]
                for proc in procs:
                    proc.stop()
        finally:
            if self.etcd is not None:
                self.etcd.stop()
                self.etcd = None
            if self.network is not None:
                self.network.remove()
                self.network = None
            if self._tmp is not None:
                self._tmp.cleanup()
                self._tmp = None

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- what runs where --------------------------------------------------

    @property
    def services(self) -> list[ServiceProcess]:
        """Every process: the shared master, each server's, the router."""
        shared = self.masters
        router = [self.router] if self.router is not None else []
        return [*shared, *(p for s in self.servers for p in s.services), *router]

    @property
    def masters(self) -> list[ServiceProcess]:
        """The shared master and its standbys, when there is one (a split pool's masters belong to their
        servers)."""
        return [self.master, *self.standbys] if self.master is not None else []

    def find(self, name: str) -> ServiceProcess:
        return next(p for p in self.services if p.name == name)

    @property
    def master_address(self) -> str:
        """The shared master's address as the servers reach it (or the topology's master started apart)."""
        if self.master is None:
            return self.topology.master_address
        if self.etcd is not None:  # the leader, wherever etcd says it is
            return f"etcd://{self.etcd.endpoint}"
        return f"{BRIDGE_ADDRESS if self.network is not None else self.topology.host}:{self.master.ready['port']}"

    @property
    def http_url(self) -> str:
        """The router's OpenAI-compatible HTTP base URL (in this namespace)."""
        assert self.router is not None, "no router in this topology"
        return f"http://{self.topology.host}:{self.router.ready['http_port']}"

    def kill_server(self, index: int) -> list[str]:
        return self.servers[index].kill()

    def link_bytes(self) -> list[tuple[int, int] | None]:
        return [s.link_bytes() for s in self.servers]

    def describe(self) -> list[str]:
        """One line per process: name, where it listens, pid, other ports."""
        lines = []
        where = {id(p): self.topology.host for p in self.services}
        where |= {id(p): s.address for s in self.servers for p in s.services}
        for proc in self.services:
            ready = proc.ready
            address = f"{where[id(proc)]}:{ready.get('port')}"
            extra = [f"{k}={ready[k]}" for k in ("http_port", "admin_port", "endpoint") if k in ready]
            lines.append(f"  {proc.name:<14} {address:<22} pid {ready.get('pid')}  {' '.join(extra)}")
        return lines

    # ---- changes while running ------------------------------------------

    def restart_master(self) -> ServiceProcess:
        """(Re)start the shared master on the port it had (stores re-mount, clients reconnect)."""
        spec = self.topology.master or MasterSpec()
        if spec.standbys:
            return self.restart_candidate(spec.name)
        port = int(self.master.ready["port"]) if self.master is not None and self.master.ready else spec.port
        self.master = self._spawn(spec.name, ["master", "--port", str(port), "--admin-port", "0", *spec.args],
                                  None)
        self.master.wait_ready(timeout_s=READY_TIMEOUT_S)
        return self.master

    def restart_candidate(self, name: str) -> ServiceProcess:
        """(Re)start one master candidate (with standbys) on the port it had: it comes back as a standby."""
        spec = self.topology.master or MasterSpec()
        assert self.etcd is not None and name in spec.names
        old = next((p for p in self.masters if p.name == name), None)
        port = int(old.ready["port"]) if old is not None and old.ready else 0
        proc = self._spawn(name, ["master", "--port", str(port), "--admin-port", "0", "--etcd", self.etcd.endpoint,
                                  *spec.args], None)
        proc.wait_ready(timeout_s=READY_TIMEOUT_S)
        if name == spec.name:
            self.master = proc
        else:
            self.standbys = [proc if p.name == name else p for p in self.standbys]
            if old is None:
                self.standbys.append(proc)
        return proc

    def add_store(self, server: int, spec: StoreSpec) -> ServiceProcess:
        """Start one more store of server ``server`` (not waited for: ``wait_ready`` it)."""
        srv = self.servers[server]
        master = srv.address_of(srv.master) if srv.master is not None else self.master_address
        proc = self._spawn(spec.name, ["store", "--master", master, "--port", "0", "--admin-port", "0", *spec.args],
                           srv)
        srv.stores.append(proc)
        return proc

    # ---- start-up steps ---------------------------------------------------

    def _make_servers(self) -> None:
        t = self.topology
        named = [s for s in t.servers if s.host_name]
        links: list[ServerLink | None] = [None] * len(t.servers)
        reason = "loopback asked for"
        if t.netns:
            try:
                self.network = Network(len(t.servers), t.link_gbit).create(t.netns_lock_wait_s)
                links = list(self.network.links)
            except NetnsUnavailable as exc:
                reason = f"no network namespaces ({exc})"
        uts = uts_works() if named else None
        for i, (spec, link) in enumerate(zip(t.servers, links, strict=True)):
            place = Place(link.netns if link else None, spec.host_name if spec.host_name and uts is None else None)
            address = link.address if link else t.host
            self.servers.append(Server(i, spec, address, place, link))
        if not named:
            return
        if self.network is not None:
            self.network_mode = (f"netns: {len(t.servers)} namespaces on a bridge, links shaped to {t.link_gbit:g} "
                                 "Gbit/s each way, a host name per server")
        elif uts is None:
            self.network_mode = f"loopback: {reason}; a host name per server (unshare --uts), no link shaping"
        else:
            self.network_mode = f"loopback: {reason}; ONE host name for all servers ({uts}), no link shaping"

    def _start_masters(self) -> None:
        spec = self.topology.master
        if spec is not None and spec.standbys:
            assert self.workdir is not None
            tls = self.etcd_tls(self.workdir, self.topology.host) if self.etcd_tls is not None else None
            self.etcd = EtcdProcess(self.workdir / "etcd", tls=tls).start()
            for name in spec.names:  # the first started is the first leader (it campaigns first)
                self.restart_candidate(name)
        elif spec is not None:
            self.restart_master()  # the root namespace, on the bridge: every server reaches it over its link
        # a split master is part of its server: it goes when the server goes
        for srv in self.servers:
            if srv.spec.master is not None:
                spec = srv.spec.master
                srv.master = self._spawn(spec.name, ["master", "--port", str(spec.port), "--admin-port", "0",
                                                     *spec.args], srv)
        for srv in self.servers:
            if srv.master is not None:
                srv.master.wait_ready(timeout_s=READY_TIMEOUT_S)

    def _start_pipelines(self) -> None:
        """Every pipeline of every server at once, later stages first (stage 0 checks the others)."""
        pipelines: list[tuple[Server, PipelineSpec, list[ServiceProcess]]] = [
            (srv, spec, []) for srv in self.servers for spec in srv.spec.pipelines]
        for srv, _, stages in pipelines:
            srv.stages.append(stages)  # filled from the last stage down, so stage 0 ends up first
        for stage in range(max((p.stages for _, p, _ in pipelines), default=0) - 1, -1, -1):
            started = []
            for srv, spec, stages in pipelines:
                if stage < spec.stages:
                    args = self._stage_args(srv, spec, stage, [srv.address_of(p) for p in stages])
                    started.append(self._spawn(f"{spec.name}stage{stage}", args, srv))
                    stages.insert(0, started[-1])
            for proc in started:
                proc.wait_ready(timeout_s=READY_TIMEOUT_S)

    def _stage_args(self, srv: Server, spec: PipelineSpec, stage: int, later: list[str]) -> list[str]:
        if not spec.pool:
            pool = ["--no-pool"]
        else:
            pool = ["--master", srv.address_of(srv.master) if srv.master is not None else self.master_address]
        args = ["prefill", "--stage", str(stage), "--num-stages", str(spec.stages), "--port", "0", "--admin-port",
                "0", *pool, *spec.args]
        if stage > 0 and later:
            args += ["--next-stage", later[0]]
        elif stage == 0 and later:
            args += ["--stage-addresses", ",".join(later)]
        return args

    def _start_router(self) -> None:
        spec = self.topology.router
        if spec is None:
            return
        # every backend's server by name: on loopback their addresses alone would not tell them apart
        servers = ",".join(f"{a}={s.host_name}" for s in self.servers if s.host_name
                           for a in (*s.pipelines, *s.shards))
        # the root namespace: it reaches every server over its link, clients reach it here
        self.router = self._spawn(spec.name, [
            "router", "--port", str(spec.port), "--http-port", str(spec.http_port), "--admin-port", "0", *spec.args,
            "--pipelines", ",".join(a for s in self.servers for a in s.pipelines),
            "--shards", ",".join(a for s in self.servers for a in s.shards),
            *(["--servers", servers] if servers else [])], None)
        self.router.wait_ready(timeout_s=READY_TIMEOUT_S)

    def _spawn(self, name: str, args: list[str], server: Server | None) -> ServiceProcess:
        """Start one process on ``server`` (None: the root namespace: the router at the topology's host, a
        shared master on the bridge where there is one, so every server reaches it over its link)."""
        assert self.workdir is not None
        host = server.address if server is not None else self.topology.host
        if server is None and args[0] == "master" and self.network is not None:
            host = BRIDGE_ADDRESS
        if server is not None and server.spec.host_name and args[0] != "master":
            args = [*args, "--transfer-host", server.address]  # its transfer engine listens on its own address
        if self.access is not None:
            args = [*args, *self.access(name, args, host, self.workdir)]
        elif self.network is not None and host != self.topology.host:
            # the per-server namespaces are a private bridge this launcher made on this host: nothing
            # outside it reaches their addresses, so plaintext there is consented to here, explicitly
            args = [*args, "--insecure"]
        proc = ServiceProcess(name, [*args, "--host", host, *self.topology.common_args], self.workdir,
                              die_with_parent=self.topology.die_with_parent,
                              place=server.place if server is not None else Place())
        proc.start()
        return proc
