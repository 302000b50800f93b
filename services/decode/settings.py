"""Settings of a decode shard."""

from __future__ import annotations

from dataclasses import dataclass

from kvpool.core.setting import setting
from kvpool.model.config import CONFIGS, KV_DTYPE_ITEMSIZES
from kvpool.model.model_setting import ModelSetting
from kvpool.shared_memory import shared_memory_dir_setting
from kvpool.sizes import parse_size


@dataclass(slots=True)
class DecodeSettings(ModelSetting):
    host: str = setting("127.0.0.1", help="listen address")
    port: int = setting(7800, help="gRPC port (0 picks a free one)")
    admin_port: int = setting(9800, help="Prometheus port (0 picks a free one)")
    model: str = setting("tiny", help="model config", choices=tuple(CONFIGS))
    model_dir: str = setting("", help="serve a Hugging Face DeepSeek-V3-architecture directory (config.json, "
                             "safetensors weights, tokenizer, chat template); overrides --model", metavar="DIR",
                             default_text="the built-in --model")
    weights: str = setting("", help="load weights from a safetensors directory", metavar="DIR",
                           default_text="seeded")
    kv_dtype: str = setting("float32", help="KV storage dtype (the prefill's)", choices=tuple(sorted(KV_DTYPE_ITEMSIZES)))
    page_size: int = setting(16, help="tokens per KV page")
    num_pages: int = setting(0, help="KV pages; 0: as many as --kv-bytes holds", default_text="from --kv-bytes")
    kv_bytes: int | str = setting("256MiB", help="KV page memory when --num-pages is 0, e.g. 1GiB", metavar="SIZE")
    max_batch_size: int = setting(64, help="sequences in one decode step at most")
    region_arena_bytes: int | str = setting(
        "64MiB", help="registered memory for receive regions (prompts' KV in flight from prefill)", metavar="SIZE"
    )
    region_deadline_s: float = setting(30.0, help="reclaim a reserved region not claimed by Generate after this")
    torch_threads: int = setting(1, help="torch compute threads (the shard's one compute thread uses them)")
    transfer_host: str = setting("127.0.0.1", help="address the transfer engine advertises")
    protocol: str = setting("tcp", help="transfer engine protocol", choices=("tcp", "rdma"))
    device: str = setting("", help="RDMA device names for the transfer engine (rdma only)")
    transfer_engine: bool = setting(True, help="run a transfer engine for prefill stages on other hosts; without "
                                    "one (a one-host cluster) the arena is reached by shared memory only and no "
                                    "engine port is opened")
    shared_memory: bool = setting(True, help="offer the receive arena as shared memory to prefill stages on this "
                                  "host (same user only), so their handoff bytes move by a memory copy, not the "
                                  "transfer engine")
    shared_memory_dir: str = shared_memory_dir_setting()
    drain_s: float = setting(20.0, help="on SIGTERM: seconds to keep serving what is in flight after turning "
                                         "not-ready (new calls still served until callers notice)")
    pipelines: str = setting("", help="the prefill pipelines' stage 0 addresses (host:port, comma-separated) a "
                                      "Serve call may name; empty: any", metavar="ADDRESSES")
    room_wait_s: float = setting(5.0, help="how long a Serve call of a router of the last version waits for pages "
                                           "and a receive region a request that just ended is still freeing, "
                                           "before RESOURCE_EXHAUSTED (this version's router asks to be refused "
                                           "at once and is told when room comes back)")

    def __post_init__(self) -> None:
        if not self.transfer_engine and not self.shared_memory:
            raise ValueError("transfer_engine: without an engine only shared memory reaches the arena; "
                             "keep --shared-memory or --transfer-engine")
        if self.drain_s < 0:
            raise ValueError(f"drain_s: must be >= 0, got {self.drain_s}")
        if not 0 <= self.room_wait_s <= 600:
            raise ValueError(f"room_wait_s: must be in [0, 600], got {self.room_wait_s}")
        for address in self.pipeline_addresses:
            host, _, port = address.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"pipelines: {address!r} is not host:port")
        self.kv_bytes = parse_size(self.kv_bytes, "kv_bytes")
        self.region_arena_bytes = parse_size(self.region_arena_bytes, "region_arena_bytes")
        if self.kv_dtype not in KV_DTYPE_ITEMSIZES:
            raise ValueError(f"kv_dtype: {self.kv_dtype!r} is not one of {sorted(KV_DTYPE_ITEMSIZES)}")
        if self.weights and self.model_dir:
            raise ValueError("weights: --model-dir brings its own weights; give one of --weights and --model-dir")
        self.model_config()  # raises on an unknown model or a directory it cannot serve
        for name in ("page_size", "max_batch_size", "torch_threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.num_pages < 0:
            raise ValueError(f"num_pages: must be >= 0, got {self.num_pages}")
        if self.num_pages == 0:
            self.num_pages = self.kv_bytes // self.page_nbytes
            if self.num_pages == 0:
                raise ValueError(f"kv_bytes: {self.kv_bytes} bytes hold no {self.page_nbytes}-byte page")
        if self.region_arena_bytes <= 0:
            raise ValueError("region_arena_bytes: must be positive")
        if self.region_deadline_s <= 0:
            raise ValueError(f"region_deadline_s: must be positive, got {self.region_deadline_s}")


    @property
    def pipeline_addresses(self) -> list[str]:
        return [a.strip() for a in self.pipelines.split(",") if a.strip()]

    def memory(self) -> dict[str, int]:
        """Host bytes this shard allocates, by the setting that sizes them; then the whole model's float32
        weights, every expert included (decode runs every layer)."""
        return {"kv_bytes": self.num_pages * self.page_nbytes, "region_arena_bytes": int(self.region_arena_bytes),
                **self.weight_memory(0, self.model_config().num_hidden_layers)}

    @property
    def entry_bytes(self) -> int:
        return self.model_config().kv_entry_dim * KV_DTYPE_ITEMSIZES[self.kv_dtype]

    @property
    def page_nbytes(self) -> int:
        """One page: page_size tokens × every layer's entry."""
        return self.page_size * self.model_config().num_hidden_layers * self.entry_bytes
