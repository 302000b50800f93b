"""Settings of a prefill stage worker."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpool.model import KV_DTYPES, get_config, kv_chunk_nbytes, kv_dtype, split_layers
from kvpool.model.config import ModelConfig
from services.prefill.chunk_hash import namespace_fingerprint

LAYOUT_VERSION = 1


@dataclass(slots=True)
class PrefillSettings:
    stage: int = 0
    num_stages: int = 4
    host: str = "127.0.0.1"
    # -1: 7700 + stage (gRPC) and 9700 + stage (metrics)
    port: int = -1
    admin_port: int = -1
    # the pool master; "" runs without a pool (device cache only)
    master: str = "127.0.0.1:7601"
    model: str = "tiny"
    # identifies the weights in the pool namespace; default: model name and seed
    model_id: str = ""
    weights: str = ""
    kv_dtype: str = "float32"
    chunk_size: int = 256
    device_cache_tokens: int = 65536
    torch_threads: int = 1
    # stage N < last: the next stage's address; stage 0: every later stage's, in order
    next_stage: str = ""
    stage_addresses: list[str] = field(default_factory=list)
    kv_hold_s: float = 30.0
    transfer_host: str = "127.0.0.1"
    protocol: str = "tcp"
    device: str = ""
    # hidden states at or below this many bytes travel inside the RPC
    inline_activation_bytes: int = 65536
    # waiting this long for free device blocks before answering RESOURCE_EXHAUSTED
    admission_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if isinstance(self.stage_addresses, str):
            self.stage_addresses = [a for a in self.stage_addresses.split(",") if a]
        if self.num_stages < 1:
            raise ValueError(f"num_stages: must be >= 1, got {self.num_stages}")
        if not 0 <= self.stage < self.num_stages:
            raise ValueError(f"stage: {self.stage} is not in 0..{self.num_stages - 1}")
        if self.port < 0:
            self.port = 7700 + self.stage
        if self.admin_port < 0:
            self.admin_port = 9700 + self.stage
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype: {self.kv_dtype!r} is not one of {sorted(KV_DTYPES)}")
        config = self.model_config()  # raises on an unknown model
        if self.num_stages > config.num_hidden_layers:
            raise ValueError(f"num_stages: {self.num_stages} stages for {config.num_hidden_layers} layers")
        if self.chunk_size <= 0:
            raise ValueError(f"chunk_size: must be positive, got {self.chunk_size}")
        if self.device_cache_tokens < self.chunk_size:
            raise ValueError(f"device_cache_tokens: {self.device_cache_tokens} is less than one chunk")
        if self.torch_threads < 1:
            raise ValueError(f"torch_threads: must be >= 1, got {self.torch_threads}")
        last = self.stage == self.num_stages - 1
        if self.stage == 0 and self.num_stages > 1 and len(self.stage_addresses) != self.num_stages - 1:
            raise ValueError(
                f"stage_addresses: stage 0 needs the {self.num_stages - 1} later stages' addresses, "
                f"got {len(self.stage_addresses)}"
            )
        if 0 < self.stage and not last and not self.next_stage:
            raise ValueError(f"next_stage: stage {self.stage} needs the address of stage {self.stage + 1}")
        if self.kv_hold_s <= 0:
            raise ValueError(f"kv_hold_s: must be positive, got {self.kv_hold_s}")

    def model_config(self) -> ModelConfig:
        try:
            return get_config(self.model)
        except (KeyError, ValueError) as exc:
            raise ValueError(f"model: {exc}") from None

    @property
    def num_blocks(self) -> int:
        return self.device_cache_tokens // self.chunk_size

    @property
    def layer_split(self) -> list[tuple[int, int]]:
        return split_layers(self.model_config().num_hidden_layers, self.num_stages)

    @property
    def layers(self) -> tuple[int, int]:
        return self.layer_split[self.stage]

    @property
    def next_address(self) -> str:
        if self.stage == self.num_stages - 1:
            return ""
        return self.stage_addresses[0] if self.stage == 0 else self.next_stage

    @property
    def namespace(self) -> str:
        config = self.model_config()
        model_id = self.model_id or f"{config.name}:seed{config.seed}"
        return namespace_fingerprint(model_id, self.kv_dtype, self.layer_split, self.chunk_size, LAYOUT_VERSION)

    @property
    def chunk_nbytes(self) -> int:
        """Bytes of one chunk's KV for this stage's layers: one pool object."""
        start, end = self.layers
        return kv_chunk_nbytes(self.model_config(), end - start, self.chunk_size, kv_dtype(self.kv_dtype))
