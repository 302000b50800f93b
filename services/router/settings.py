"""Settings of the router."""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvpool.core.prefill.queue import QueueOrder
from kvpool.core.prefill.queue_settings import (
    check_queue_settings,
    queue_order,
    sched_max_bypass_setting,
    sched_max_wait_setting,
    sched_reorder_below_setting,
    sched_setting,
    tenant_fair_setting,
)
from kvpool.core.setting import setting
from kvpool.core.tenancy.shares import parse_weights
from kvpool.model.config import CONFIGS
from kvpool.model.model_setting import ModelSetting

COMMAND_LINE_KEY = ("keys on a command line are readable by every local user through /proc/PID/cmdline; use "
                    "--api-keys-file PATH (lines KEY or TENANT=KEY) or KVPOOL_API_KEY")


@dataclass(slots=True)
class RouterSettings(ModelSetting):
    host: str = setting("127.0.0.1", help="listen address of the gRPC and HTTP APIs")
    port: int = setting(7900, help="gRPC port (0 picks a free one)")
    http_port: int = setting(8000, help="OpenAI-compatible HTTP port (0 picks a free one)")
    admin_port: int = setting(9900, help="Prometheus /metrics port, the only one serving it (0 picks a free one)")
    pipelines: list[str] = setting(
        help="stage-0 addresses of the prefill pipelines", factory=list, metavar="ADDR,...", default_text="none"
    )
    shards: list[str] = setting(
        help="addresses of the decode shards", factory=list, metavar="ADDR,...", default_text="none"
    )
    model: str = setting("tiny", help="model config (its vocabulary and context)", choices=tuple(CONFIGS))
    model_dir: str = setting(
        "", help="serve a Hugging Face DeepSeek-V3-architecture directory: its context and vocabulary, its "
        "tokenizer.json and chat template (the prefill and decode serve its weights); overrides --model",
        metavar="DIR", default_text="the built-in --model and the byte-level tokenizer",
    )
    served_model_name: str = setting("", help="the model name clients send", default_text="the model config's name")
    affinity_max_queue: int = setting(
        4, help="a session stays on its pipeline while fewer than this many requests are in flight there"
    )
    # a flag only to refuse it by name (unknown, argparse would take it for --api-keys-file)
    api_key: list[str] = setting(
        help=f"refused: {COMMAND_LINE_KEY}", factory=list, metavar="KEY,...", default_text="none")
    api_keys_file: str = setting(
        "", help="a file of the API keys clients send as 'Authorization: Bearer KEY' (HTTP) or gRPC metadata "
        "'authorization: Bearer KEY', one KEY or TENANT=KEY a line; re-read on SIGHUP. Also KVPOOL_API_KEY; "
        "neither: the API is open", metavar="FILE", default_text="none")
    max_requests_per_key: int = setting(
        64, help="requests one API key may have open at once, over HTTP and gRPC together; one more is answered "
        "429 (HTTP) or RESOURCE_EXHAUSTED (gRPC)")
    tenant_rate: float = setting(0.0, help="requests a second each tenant (API key's) may start; 0: no limit")
    tenant_burst: int = setting(8, help="requests a tenant may start at once within its rate")
    cors_origins: list[str] = setting(
        help="browser origins allowed to call the HTTP API (others are refused)", factory=list, metavar="URL,...",
        default_text="none")
    http_read_timeout_s: float = setting(
        30.0, help="a request's head (request line and headers) must arrive within this many seconds of its "
        "connection opening or the previous response, and its body within as many after the head; else 408 and "
        "the connection closes, so slow or silent clients cannot hold connections")
    http_max_connections: int = setting(4096, help="HTTP connections open at once at most; one more is answered "
                                        "429 and closed at once")
    http_max_connections_per_client: int = setting(
        256, help="HTTP connections one client address may hold open before one of its requests carries a valid "
        "API key (without keys: all its connections). With keys, one more closes that address's oldest idle "
        "keyless connection to make room, and unauthenticated connections hold at most 3/4 of "
        "--http-max-connections; else, or when none is idle, 429 and closed at once. 0: no such bound (behind a "
        "proxy every client has the proxy's address)")
    grpc_max_concurrent_rpcs: int = setting(
        4096, help="calls open at once on the gRPC port at most (streams included); one more is answered "
        "RESOURCE_EXHAUSTED at once, so a flood of held streams cannot grow the router without bound")
    max_in_flight: int = setting(256, help="requests in flight at most; more are answered 429")
    max_queue: int = setting(64, help="requests waiting for decode room at most; more are answered 429")
    queue_timeout_s: float = setting(30.0, help="a request waits this long for decode room, then 429")
    health_wait_s: float = setting(10.0, help="while no prefill pipeline or no decode shard is healthy (one is "
                                   "restarting), a request waits this long for one, then 503; and a request whose "
                                   "only pipeline failed before any token waits as long to retry once it serves "
                                   "again. 0: 503 at once")
    locality: bool = setting(True, help="prefer the decode shard on the prefill pipeline's own server")
    sched: str = sched_setting("the admission queue (requests waiting for decode room and device blocks; in both "
                               "orders a head that does not fit holds back the rest)")
    sched_max_wait_s: float = sched_max_wait_setting()
    sched_max_bypass_s: float = sched_max_bypass_setting(
        "the pipelines' seconds (StageInfo's work_scale, asked every 10 health rounds)")
    sched_reorder_below_s: float = sched_reorder_below_setting("the pipelines' seconds")
    tenant_fair: bool = tenant_fair_setting()
    tenant_weights: list[str] = setting(
        help="each tenant's weight in the admission queue's fair share, TENANT=WEIGHT (comma-separated); a tenant "
        "not named weighs 1 (docs/security.md)", factory=list, metavar="TENANT=WEIGHT,...",
        default_text="none: equal shares")
    servers: list[str] = setting(
        help="the server of each pipeline or shard, where its address's host does not say it",
        factory=list, metavar="ADDR=SERVER,...", default_text="the address's host",
    )
    health_interval_s: float = setting(1.0, help="seconds between health checks of every prefill pipeline and decode shard")
    health_late_checks: int = setting(2, help="health checks in a row without an answer within their deadline that take "
                                      "a pipeline or shard out of rotation (one that refuses or answers not-serving "
                                      "goes out at once; a late one may only be busy)")
    request_timeout_s: float = setting(600.0, help="longest a request may take end to end, in seconds")
    supervisor_status: str = setting(
        "", help="a JSON file where the local supervisor (kvpool up) reports restarts; shown in /health",
        metavar="FILE")
    reuse_port: bool = setting(
        False, help="bind the gRPC and HTTP ports with SO_REUSEPORT, so that a successor router can listen on them "
        "before this one drains (kvpool up hands its router over this way in a rolling restart)")
    drain_s: float = setting(20.0, help="on SIGTERM: seconds to keep serving what is in flight after turning "
                                         "not-ready (new calls still served until callers notice)")

    def __post_init__(self) -> None:
        if self.drain_s < 0:
            raise ValueError(f"drain_s: must be >= 0, got {self.drain_s}")
        if self.tenant_rate < 0 or self.tenant_burst < 1:
            raise ValueError("tenant_rate must be >= 0 and tenant_burst >= 1")
        for name in ("pipelines", "shards", "api_key", "cors_origins", "servers", "tenant_weights"):
            value = getattr(self, name)
            if isinstance(value, str):
                setattr(self, name, [a for a in value.split(",") if a])
        if self.api_key:
            raise ValueError(f"api_key: {COMMAND_LINE_KEY}")
        if self.max_requests_per_key < 1:
            raise ValueError(f"max_requests_per_key: must be >= 1, got {self.max_requests_per_key}")
        for name in ("port", "http_port", "admin_port"):
            if not 0 <= getattr(self, name) <= 65535:
                raise ValueError(f"{name}: {getattr(self, name)} is not a TCP port")
        if not self.pipelines:
            raise ValueError("pipelines: the router needs at least one prefill pipeline (stage 0's address)")
        if not self.shards:
            raise ValueError("shards: the router needs at least one decode shard")
        if len(set(self.pipelines)) != len(self.pipelines):
            raise ValueError("pipelines: an address is named twice")
        if len(set(self.shards)) != len(self.shards):
            raise ValueError("shards: an address is named twice")
        if self.affinity_max_queue < 1:
            raise ValueError(f"affinity_max_queue: must be >= 1, got {self.affinity_max_queue}")
        if not (self.http_read_timeout_s > 0 and math.isfinite(self.http_read_timeout_s)):
            raise ValueError(f"http_read_timeout_s: must be a positive number of seconds, got {self.http_read_timeout_s}")
        if self.http_max_connections < 1:
            raise ValueError(f"http_max_connections: must be >= 1, got {self.http_max_connections}")
        if self.http_max_connections_per_client < 0:
            raise ValueError("http_max_connections_per_client: must be >= 0 (0: no bound), got "
                             f"{self.http_max_connections_per_client}")
        if self.grpc_max_concurrent_rpcs < 1:
            raise ValueError(f"grpc_max_concurrent_rpcs: must be >= 1, got {self.grpc_max_concurrent_rpcs}")
        if self.max_in_flight < 1:
            raise ValueError(f"max_in_flight: must be >= 1, got {self.max_in_flight}")
        if self.max_queue < 0:
            raise ValueError(f"max_queue: must be >= 0, got {self.max_queue}")
        if self.health_wait_s < 0:
            raise ValueError(f"health_wait_s: must be >= 0, got {self.health_wait_s}")
        if self.queue_timeout_s <= 0:
            raise ValueError(f"queue_timeout_s: must be positive, got {self.queue_timeout_s}")
        check_queue_settings(self)
        parse_weights(self.tenant_weights)  # raises naming the bad entry
        bad = [s for s in self.servers if "=" not in s]
        if bad:
            raise ValueError(f"servers: {bad[0]!r} is not ADDR=SERVER")
        if self.health_late_checks < 1:
            raise ValueError(f"health_late_checks: must be >= 1, got {self.health_late_checks}")
        if self.health_interval_s <= 0 or self.request_timeout_s <= 0:
            raise ValueError("health_interval_s and request_timeout_s must be positive")
        self.model_config()  # raises on an unknown model or a directory it cannot serve

    @property
    def queue_order(self) -> QueueOrder:
        """The admission queue's order (``--sched``)."""
        return queue_order(self)

    @property
    def server_of(self) -> dict[str, str]:
        return dict(s.split("=", 1) for s in self.servers)  # type: ignore[misc]

    @property
    def model_name(self) -> str:
        return self.served_model_name or (self.model_config().name if self.model_dir else self.model)
