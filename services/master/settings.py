"""Settings of the pool master: its index's settings plus what makes a process."""

from __future__ import annotations

from dataclasses import dataclass

from kvpool.core.pool.settings import IndexSettings
from kvpool.core.setting import setting


@dataclass(slots=True)
class MasterSettings(IndexSettings):
    """Every index setting, inherited rather than copied, and the process's own."""

    host: str = setting("127.0.0.1", help="listen address")
    port: int = setting(7601, help="gRPC port (0 picks a free one)")
    admin_port: int = setting(9601, help="Prometheus /metrics port (0 picks a free one)")
    heartbeat_interval_s: float = setting(2.0, help="heartbeat period told to stores, in seconds")

    def __post_init__(self) -> None:
        IndexSettings.__post_init__(self)  # watermarks, timeouts
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port: {self.port} is not a TCP port")
        if not 0 <= self.admin_port <= 65535:
            raise ValueError(f"admin_port: {self.admin_port} is not a TCP port")
        if self.heartbeat_interval_s <= 0 or self.heartbeat_interval_s * 2 > self.segment_ttl_s:
            raise ValueError(
                f"heartbeat_interval_s ({self.heartbeat_interval_s}) must be positive and at most half "
                f"of segment_ttl_s ({self.segment_ttl_s}) so one lost heartbeat does not drop a store"
            )
