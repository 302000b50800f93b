"""Settings of the pool master: its index's settings plus what makes a process."""

from __future__ import annotations

from dataclasses import dataclass

from kvpool.core.ha.leadership import LeaseTimes
from kvpool.core.pool.settings import IndexSettings
from kvpool.core.setting import setting
from kvpool.ha.etcd_client import check_endpoint


@dataclass(slots=True)
class MasterSettings(IndexSettings):
    """Every index setting, inherited rather than copied, and the process's own."""

    host: str = setting("127.0.0.1", help="listen address")
    port: int = setting(7601, help="gRPC port (0 picks a free one)")
    admin_port: int = setting(9601, help="Prometheus /metrics port (0 picks a free one)")
    heartbeat_interval_s: float = setting(2.0, help="heartbeat period told to stores, in seconds")
    etcd: str = setting("", help="etcd endpoint: run as a candidate for the master elected there, the leader or a "
                        "standby; stores, stages and clients then name etcd://HOST:PORT as their master",
                        metavar="HOST:PORT", default_text="none: the one master, without etcd")
    advertise: str = setting("", help="with --etcd: the address stores and clients reach this master at",
                             metavar="HOST:PORT", default_text="host:port as bound")
    lease_ttl_s: float = setting(2.0, help="with --etcd: the leader's lease in whole seconds; a dead leader is "
                                 "replaced about this long after it died")
    lease_keepalive_s: float = setting(0.4, help="with --etcd: keep-alive period of the leader's lease")
    lease_margin_s: float = setting(0.3, help="with --etcd: the leader stops answering this long before its lease "
                                    "could expire in etcd")
    commit_timeout_s: float = setting(2.0, help="with --etcd: a PutEnd waits at most this long for the stores to "
                                      "hold its commit, then fails (the save is not stored)")
    adoption_grace_s: float = setting(1.0, help="with --etcd: a new leader answers lookups once every registered "
                                      "store has re-mounted, or after this long")

    def __post_init__(self) -> None:
        IndexSettings.__post_init__(self)  # watermarks, timeouts
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port: {self.port} is not a TCP port")
        if not 0 <= self.admin_port <= 65535:
            raise ValueError(f"admin_port: {self.admin_port} is not a TCP port")
        if self.etcd:
            check_endpoint(self.etcd, "etcd")
            self.lease_times()  # lease_ttl_s, lease_keepalive_s, lease_margin_s
            if self.commit_timeout_s <= 0:
                raise ValueError(f"commit_timeout_s: must be positive, got {self.commit_timeout_s}")
            if self.adoption_grace_s < 0:
                raise ValueError(f"adoption_grace_s: must not be negative, got {self.adoption_grace_s}")
        if self.advertise:
            check_endpoint(self.advertise, "advertise")
        if self.heartbeat_interval_s <= 0 or self.heartbeat_interval_s * 2 > self.segment_ttl_s:
            raise ValueError(
                f"heartbeat_interval_s ({self.heartbeat_interval_s}) must be positive and at most half "
                f"of segment_ttl_s ({self.segment_ttl_s}) so one lost heartbeat does not drop a store"
            )

    def lease_times(self) -> LeaseTimes:
        return LeaseTimes(self.lease_ttl_s, self.lease_keepalive_s, self.lease_margin_s)
