"""One part of a cluster on its own — a pool, a pipeline, a decode shard — for the benchmarks and tests.

Each is a topology of that one part (``topology.pool_topology`` and its
siblings) started by the one launcher, with the handles its users reach for.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

from kvpool.tools.cluster.launcher import Cluster
from kvpool.tools.cluster.process import ServiceProcess
from kvpool.tools.cluster.topology import StoreSpec, decode_topology, pipeline_topology, pool_topology


class _Part:
    """A started part's ``stop`` and ``with`` support; the subclass has ``cluster`` and ``start()``."""

    __slots__ = ()
    cluster: Cluster | None

    def start(self) -> Self:
        raise NotImplementedError

    def stop(self) -> None:
        if self.cluster is not None:
            self.cluster.stop()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclass(slots=True)
class LocalPool(_Part):
    """A master (and its standbys, with etcd) and N stores on this host."""

    num_stores: int = 2
    segment_size: str = "64MiB"
    master_args: list[str] = field(default_factory=list)
    store_args: list[str] = field(default_factory=list)
    workdir: Path | None = None
    cluster: Cluster | None = None
    master_standbys: int = 0

    def start(self) -> LocalPool:
        topology = pool_topology(self.num_stores, self.segment_size, tuple(self.master_args), tuple(self.store_args),
                                 self.master_standbys)
        self.cluster = Cluster(topology, workdir=self.workdir).start()
        return self

    def _started(self) -> Cluster:
        assert self.cluster is not None, "start() first"
        return self.cluster

    @property
    def master(self) -> ServiceProcess | None:
        return self._started().master

    @property
    def candidates(self) -> list[ServiceProcess]:
        """The master and its standbys."""
        return self._started().masters

    def candidate_at(self, address: str) -> ServiceProcess:
        """The candidate serving at ``address`` (as the leader key names it)."""
        return next(p for p in self.candidates if address.endswith(f":{p.ready['port']}"))

    @property
    def stores(self) -> list[ServiceProcess]:
        return self._started().servers[0].stores

    @property
    def master_port(self) -> int:
        master = self.master
        return int(master.ready["port"]) if master is not None else 0

    @property
    def master_address(self) -> str:
        return self._started().master_address

    def start_master(self) -> None:
        """(Re)start the master on the same port as before."""
        self._started().restart_master()

    def add_store(self, name: str, extra: list[str] | None = None) -> ServiceProcess:
        """One more store (not waited for)."""
        args = ("--segment-size", self.segment_size, *self.store_args, *(extra or []))
        return self._started().add_store(0, StoreSpec(name, args))


@dataclass(slots=True)
class LocalPipeline(_Part):
    """A prefill pipeline of ``num_stages`` stage processes (``master`` "": without a pool)."""

    num_stages: int = 4
    master: str = ""
    stage_args: list[str] = field(default_factory=list)
    workdir: Path | None = None
    cluster: Cluster | None = None

    @property
    def stages(self) -> list[ServiceProcess]:
        """Stage 0 first."""
        assert self.cluster is not None, "start() first"
        return self.cluster.servers[0].stages[0]

    @property
    def address(self) -> str:
        """Stage 0: the Prefill API."""
        return f"127.0.0.1:{self.stages[0].ready['port']}"

    def start(self) -> LocalPipeline:
        topology = pipeline_topology(self.num_stages, self.master, tuple(self.stage_args))
        self.cluster = Cluster(topology, workdir=self.workdir).start()
        return self


@dataclass(slots=True)
class LocalDecode(_Part):
    """One decode shard process (``kvpool decode``) on this host."""

    args: list[str] = field(default_factory=list)
    name: str = "decode"
    workdir: Path | None = None
    cluster: Cluster | None = None

    @property
    def process(self) -> ServiceProcess:
        assert self.cluster is not None, "start() first"
        return self.cluster.servers[0].decode[0]

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.process.ready['port']}"

    @property
    def admin_port(self) -> int:
        return int(self.process.ready["admin_port"])

    def start(self) -> LocalDecode:
        self.cluster = Cluster(decode_topology(self.name, tuple(self.args)), workdir=self.workdir).start()
        return self
