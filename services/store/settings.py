"""Settings of a store daemon."""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from kvpool.core.setting import setting
from kvpool.shared_memory import shared_memory_dir_setting
from kvpool.sizes import parse_size


@dataclass(slots=True)
class StoreSettings:
    master: str = setting("127.0.0.1:7601", help="pool master address, or etcd://HOST:PORT: the leader of the "
                          "masters elected in that etcd (kvpool master --etcd), followed as it changes")
    host: str = setting("127.0.0.1", help="listen address for health and metrics")
    # -1: 7610 + numa_node (and 9610 + numa_node), so one store per node on a
    # host gets distinct ports without configuration
    port: int = setting(-1, help="gRPC health port (0 picks a free one)", default_text="7610 + NUMA node")
    admin_port: int = setting(-1, help="Prometheus port (0 picks a free one)", default_text="9610 + NUMA node")
    segment_size: int | str = setting("1GiB", help="segment size, e.g. 512MiB, 4GiB", metavar="SIZE")
    numa_node: int = setting(0, help="NUMA node to pin CPUs and memory to")
    segment_id: str = setting(
        help="stable id of the segment", factory=lambda: uuid.uuid4().hex, default_text="random per process"
    )
    transfer_host: str = setting("127.0.0.1", help="address the transfer engine binds and advertises")
    protocol: str = setting("tcp", help="transfer engine protocol", choices=("tcp", "rdma"))
    device: str = setting("", help="RDMA device names for the transfer engine (rdma only)")
    heartbeat_interval_s: float = setting(2.0, help="heartbeat period in seconds (the master may ask for less)")
    transfer_engine: bool = setting(True, help="run a transfer engine for pool clients on other hosts; without one "
                                    "(a one-host cluster) the segment is reached by shared memory only and no "
                                    "engine port is opened")
    shared_memory: bool = setting(True, help="offer the segment as shared memory to pool clients on this host "
                                  "(same user only), so their bytes move by a memory copy, not the transfer engine")
    shared_memory_dir: str = shared_memory_dir_setting()

    def __post_init__(self) -> None:
        self.segment_size = parse_size(self.segment_size, "segment_size")
        if self.numa_node < 0:
            raise ValueError(f"numa_node: must be >= 0, got {self.numa_node}")
        if self.port < 0:
            self.port = 7610 + self.numa_node
        if self.admin_port < 0:
            self.admin_port = 9610 + self.numa_node
        if self.heartbeat_interval_s <= 0:
            raise ValueError(f"heartbeat_interval_s: must be positive, got {self.heartbeat_interval_s}")
        if not self.transfer_engine and not self.shared_memory:
            raise ValueError("transfer_engine: without an engine only shared memory reaches the segment; "
                             "keep --shared-memory or --transfer-engine")

    def memory(self) -> dict[str, int]:
        """Host bytes this store allocates, by the setting that sizes them."""
        return {"segment_size": int(self.segment_size)}
