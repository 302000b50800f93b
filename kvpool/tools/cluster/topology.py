"""A cluster's shape as data: which processes, on which logical server, wired to what.

A :class:`Topology` names every process the launcher starts; nothing about
ports (every process binds port 0 unless a spec fixes one) or start order
(the launcher's) lives here. Builders for the usual shapes come last:
``kvpool up``'s one host, a bare pool, a bare pipeline, a bare decode shard.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class MasterSpec:
    """A pool master; ``port`` 0 picks a free one (a restart keeps the first)."""

    name: str = "master"
    port: int = 0
    args: tuple[str, ...] = ()
    # standbys: more candidates beside it, the leader elected through an etcd the launcher starts
    standbys: int = 0

    @property
    def names(self) -> tuple[str, ...]:
        """The candidates' process names: the first, then ``{name}-standby{i}``."""
        return (self.name, *(f"{self.name}-standby{i}" for i in range(1, self.standbys + 1)))


@dataclass(frozen=True, slots=True)
class StoreSpec:
    """A store daemon of its server's pool master; ``args`` adds e.g. ``--segment-id``."""

    name: str
    args: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class PipelineSpec:
    """A prefill pipeline: stage processes ``{name}stage{i}``, each given ``args``; ``pool`` False: ``--no-pool``."""

    name: str = ""
    stages: int = 4
    args: tuple[str, ...] = ()
    pool: bool = True


@dataclass(frozen=True, slots=True)
class DecodeSpec:
    name: str = "decode"
    args: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class RouterSpec:
    """The router over every pipeline and decode shard of every server."""

    name: str = "router"
    port: int = 0
    http_port: int = 0
    args: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class ServerSpec:
    """One logical server: its stores, pipelines and decode shards, and in a split pool its own master.

    ``host_name`` non-empty: its processes run under that host name (placement's
    "the writer's own host"), and in a network namespace of their own when the
    topology asks for namespaces.
    """

    host_name: str = ""
    master: MasterSpec | None = None
    stores: tuple[StoreSpec, ...] = ()
    pipelines: tuple[PipelineSpec, ...] = ()
    decode_shards: tuple[DecodeSpec, ...] = ()


@dataclass(frozen=True, slots=True)
class Topology:
    """Every process of a cluster.

    Invariants (checked): at least one server; process names are unique; a
    store has a master to mount on (the shared one, its server's, or
    ``master_address``), and so does every pipeline that uses the pool;
    ``netns`` only with named servers.
    """

    servers: tuple[ServerSpec, ...]
    master: MasterSpec | None = None  # shared by every server (runs in the root namespace)
    master_address: str = ""  # a master started apart (a pipeline joining a running pool)
    router: RouterSpec | None = None
    host: str = "127.0.0.1"  # where every process listens when not in a namespace
    common_args: tuple[str, ...] = ()  # every process: e.g. --config, --log-level
    netns: bool = False
    link_gbit: float = 10.0
    netns_lock_wait_s: float = 30.0  # one run at a time holds the namespaces; wait this long, then loopback
    die_with_parent: bool = True  # children get SIGTERM when the thread that started them exits
    names: tuple[str, ...] = field(init=False, default=())

    def __post_init__(self) -> None:
        if not self.servers:
            raise ValueError("servers: at least one")
        names = [*(self.master.names if self.master is not None else ()),
                 *((self.router.name,) if self.router is not None else ())]
        if self.master is not None and self.master.standbys and self.netns:
            raise ValueError("master standbys: etcd listens on this host's loopback, which namespaces do not reach")
        if self.master is not None and self.master.standbys < 0:
            raise ValueError(f"master standbys: must be >= 0, got {self.master.standbys}")
        for server in self.servers:
            names += [m.name for m in (server.master,) if m is not None]
            names += [s.name for s in server.stores] + [d.name for d in server.decode_shards]
            names += [f"{p.name}stage{i}" for p in server.pipelines for i in range(p.stages)]
            has_master = server.master is not None or self.master is not None or bool(self.master_address)
            if (server.stores or any(p.pool for p in server.pipelines)) and not has_master:
                raise ValueError(f"server {server.host_name!r}: stores or pool pipelines without a master")
            if any(p.stages < 1 for p in server.pipelines):
                raise ValueError("stages: must be >= 1")
        if len(set(names)) != len(names):
            raise ValueError(f"process names must be unique: {sorted(names)}")
        if self.netns and not all(s.host_name for s in self.servers):
            raise ValueError("netns: every server needs a host_name")
        if self.link_gbit <= 0:
            raise ValueError(f"link_gbit must be positive, got {self.link_gbit}")
        object.__setattr__(self, "names", tuple(names))


def pool_topology(num_stores: int, segment_size: str, master_args: tuple[str, ...] = (),
                  store_args: tuple[str, ...] = (), master_standbys: int = 0) -> Topology:
    """A master (and ``master_standbys`` standbys, with etcd) and ``num_stores`` stores named ``store{i}``."""
    stores = tuple(StoreSpec(f"store{i}", ("--segment-size", segment_size, *store_args)) for i in range(num_stores))
    return Topology((ServerSpec(stores=stores),), master=MasterSpec(args=master_args, standbys=master_standbys),
                    die_with_parent=False)


def pipeline_topology(num_stages: int, master: str, stage_args: tuple[str, ...] = ()) -> Topology:
    """One pipeline (stages ``stage{i}``) on the pool at ``master``, or without a pool when it is ""."""
    pipeline = PipelineSpec(stages=num_stages, args=stage_args, pool=bool(master))
    return Topology((ServerSpec(pipelines=(pipeline,)),), master_address=master, die_with_parent=False)


def decode_topology(name: str, args: tuple[str, ...]) -> Topology:
    """One decode shard."""
    return Topology((ServerSpec(decode_shards=(DecodeSpec(name, args),)),), die_with_parent=False)
