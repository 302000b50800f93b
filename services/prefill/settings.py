"""Settings of a prefill stage worker."""

from __future__ import annotations

from dataclasses import dataclass

from kvpool.core.chunk_hash import namespace_fingerprint
from kvpool.core.prefill.queue_settings import (
    check_queue_settings,
    sched_max_bypass_setting,
    sched_max_wait_setting,
    sched_reorder_below_setting,
    sched_setting,
    tenant_fair_setting,
)
from kvpool.core.setting import setting
from kvpool.core.tenancy.shares import parse_weights
from kvpool.model.config import CONFIGS, KV_DTYPE_ITEMSIZES, split_layers
from kvpool.model.model_setting import ModelSetting
from kvpool.shared_memory import shared_memory_dir_setting

LAYOUT_VERSION = 1


BENCH_FORWARDS = ("streamed", "handoff-after-prefill", "stages-in-turn")


@dataclass(slots=True)
class PrefillSettings(ModelSetting):
    stage: int = setting(0, help="this stage's index")
    num_stages: int = setting(4, help="stages in the pipeline")
    host: str = setting("127.0.0.1", help="listen address")
    # -1: 7700 + stage (gRPC) and 9700 + stage (metrics)
    port: int = setting(-1, help="gRPC port (0 picks a free one)", default_text="7700 + stage")
    admin_port: int = setting(-1, help="Prometheus port (0 picks a free one)", default_text="9700 + stage")
    # "" runs without a pool (device cache only); --no-pool says so on the command line
    master: str = setting("127.0.0.1:7601", help="pool master address, or etcd://HOST:PORT: the leader of the "
                          "masters elected in that etcd (kvpool master --etcd), followed as it changes")
    pool_path: str = setting("auto", help="how pool bytes move: auto (shared memory with a store on this host, "
                             "else the transfer engine) or engine (the engine everywhere, for comparison)",
                             choices=("auto", "engine"))
    handoff_path: str = setting("auto", help="how handoff bytes move to decode: auto (shared memory with a decode "
                                "shard on this host, else the transfer engine) or engine (the engine everywhere, "
                                "for comparison)", choices=("auto", "engine"))
    model: str = setting("tiny", help="model config", choices=tuple(CONFIGS))
    model_dir: str = setting("", help="serve a Hugging Face DeepSeek-V3-architecture directory (config.json, "
                             "safetensors weights, tokenizer, chat template); overrides --model", metavar="DIR",
                             default_text="the built-in --model")
    model_id: str = setting(
        "", help="weights identity in the pool namespace", default_text="model name and seed; with --model-dir a hash of its config and weights"
    )
    weights: str = setting("", help="load weights from a safetensors directory", metavar="DIR",
                           default_text="seeded")
    kv_dtype: str = setting("float32", help="KV storage dtype", choices=tuple(sorted(KV_DTYPE_ITEMSIZES)))
    chunk_size: int = setting(256, help="tokens per chunk and device block")
    device_cache_tokens: int = setting(65536, help="device KV capacity in tokens")
    torch_threads: int = setting(1, help="torch compute threads")
    forward_piece_tokens: int = setting(
        2048, help="the forward runs in pieces of this many tokens (a multiple of chunk_size); each piece's KV "
                   "streams to decode as soon as the piece ends")
    inline_forward_tokens: int = setting(
        16, help="a piece of at most this many tokens computes on the event loop's thread when no other piece is "
                 "computing, skipping the compute thread's two wake-ups (a short piece is mostly fixed cost, "
                 "a one-token turn on a cached prompt most of all); 0: every piece on a compute thread")
    bench_forward: str = setting(
        "streamed", choices=BENCH_FORWARDS,
        help="benchmarks' baselines only, for every stage of a pipeline alike: streamed (the service: the handoff "
             "streams during the forward, the stages overlap on its pieces), handoff-after-prefill (every stage "
             "writes its KV once the last stage computed), stages-in-turn (each stage passes a request on whole, "
             "once it computed all of it)")
    next_stage: str = setting("", help="stages 1..N-2: the next stage's address", metavar="ADDR")
    stage_addresses: list[str] = setting(
        help="stage 0: addresses of stages 1..N-1, in order", factory=list, metavar="ADDR,...", default_text="none"
    )
    transfer_engine: bool = setting(True, help="run a transfer engine (it listens on a port): without one the "
                                    "stage moves bytes by shared memory only (a one-host cluster), and a move "
                                    "that needs the engine (a store or decode on another host) fails")
    shared_memory: bool = setting(True, help="offer the send arena as shared memory to the next stage on this host "
                                  "(same user only), so hidden states move by a memory copy, not the engine")
    shared_memory_dir: str = shared_memory_dir_setting()
    transfer_host: str = setting("127.0.0.1", help="address the transfer engine advertises")
    protocol: str = setting("tcp", help="transfer engine protocol", choices=("tcp", "rdma"))
    device: str = setting("", help="RDMA device names for the transfer engine (rdma only)")
    inline_activation_bytes: int = setting(
        65536, help="hidden states at or below this many bytes travel inside the RPC, larger ones in the send arena "
                    "(copied by the next stage on this host, else read with the engine)"
    )
    tenant_weights: list[str] = setting(
        help="stage 0: each tenant's weight in the device cache and in its gate's fair share (--tenant-fair), "
        "TENANT=WEIGHT (comma-separated); a tenant not named weighs 1. A tenant over its share (its weight over "
        "the weights of the tenants holding blocks) reuses its own oldest cached blocks first (docs/security.md)",
        factory=list, metavar="TENANT=WEIGHT,...",
        default_text="none: equal shares",
    )
    sched: str = sched_setting("stage 0's prefills waiting for a slot (--sched-slots)")
    sched_slots: int = setting(-1, help="stage 0: prefills running through the stages at once, the others "
                               "waiting in --sched's order; 0: no limit (every admitted prefill at once, the "
                               "stages interleaving their pieces)", default_text="0 with fifo; with session, one a stage (at least 2)")
    sched_max_wait_s: float = sched_max_wait_setting()
    sched_max_bypass_s: float = sched_max_bypass_setting("this stage's compute seconds (kvpool_prefill_work_scale)")
    sched_reorder_below_s: float = sched_reorder_below_setting("this stage's compute seconds")
    tenant_fair: bool = tenant_fair_setting("; and every stage computes each tenant's pieces on a thread of its "
                                            "own, so no tenant's piece waits behind another's that is computing")
    admission_timeout_s: float = setting(
        120.0, help="wait this long for free device blocks before answering RESOURCE_EXHAUSTED"
    )
    drain_s: float = setting(20.0, help="on SIGTERM: seconds to keep serving what is in flight after turning "
                                         "not-ready (new calls still served until callers notice)")

    def __post_init__(self) -> None:
        if self.drain_s < 0:
            raise ValueError(f"drain_s: must be >= 0, got {self.drain_s}")
        if self.sched_slots < 0:  # not given: no gate in arrival order; in the work-aware one a slot a stage
            # (at least 2), so every stage can compute while one-piece prompts pass through them in turn
            self.sched_slots = max(2, self.num_stages) if self.sched == "session" else 0
        if isinstance(self.tenant_weights, str):
            self.tenant_weights = [w for w in self.tenant_weights.split(",") if w]
        parse_weights(self.tenant_weights)  # raises naming the bad entry
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
        if self.kv_dtype not in KV_DTYPE_ITEMSIZES:
            raise ValueError(f"kv_dtype: {self.kv_dtype!r} is not one of {sorted(KV_DTYPE_ITEMSIZES)}")
        if self.weights and self.model_dir:
            raise ValueError("weights: --model-dir brings its own weights; give one of --weights and --model-dir")
        config = self.model_config()  # raises on an unknown model or a directory it cannot serve
        if self.num_stages > config.num_hidden_layers:
            raise ValueError(f"num_stages: {self.num_stages} stages for {config.num_hidden_layers} layers")
        if self.chunk_size <= 0:
            raise ValueError(f"chunk_size: must be positive, got {self.chunk_size}")
        if self.device_cache_tokens < self.chunk_size:
            raise ValueError(f"device_cache_tokens: {self.device_cache_tokens} is less than one chunk")
        if self.torch_threads < 1:
            raise ValueError(f"torch_threads: must be >= 1, got {self.torch_threads}")
        if self.bench_forward not in BENCH_FORWARDS:
            raise ValueError(f"bench_forward: {self.bench_forward!r} is not one of {', '.join(BENCH_FORWARDS)}")
        if self.forward_piece_tokens <= 0 or self.forward_piece_tokens % self.chunk_size:
            raise ValueError(f"forward_piece_tokens: {self.forward_piece_tokens} is not a positive multiple of "
                             f"chunk_size {self.chunk_size}")
        last = self.stage == self.num_stages - 1
        if self.stage == 0 and self.num_stages > 1 and len(self.stage_addresses) != self.num_stages - 1:
            raise ValueError(
                f"stage_addresses: stage 0 needs the {self.num_stages - 1} later stages' addresses, "
                f"got {len(self.stage_addresses)}"
            )
        if 0 < self.stage and not last and not self.next_stage:
            raise ValueError(f"next_stage: stage {self.stage} needs the address of stage {self.stage + 1}")
        check_queue_settings(self)
        if self.admission_timeout_s <= 0:
            raise ValueError(f"admission_timeout_s: must be positive, got {self.admission_timeout_s}")
        if self.inline_forward_tokens < 0:
            raise ValueError(f"inline_forward_tokens: must be >= 0, got {self.inline_forward_tokens}")
        if self.inline_activation_bytes < 0:
            raise ValueError(f"inline_activation_bytes: must be >= 0, got {self.inline_activation_bytes}")
        if not self.transfer_engine:
            for name in ("pool_path", "handoff_path"):
                if getattr(self, name) == "engine":
                    raise ValueError(f"{name}: engine needs a transfer engine (--no-transfer-engine was given)")
            if not self.shared_memory and self.num_stages > 1:
                raise ValueError("shared_memory: without a transfer engine, hidden states between stages move "
                                 "only by shared memory")


    @property
    def handoff_arena_bytes(self) -> int:
        """The handoff slab of the longest prompt the device cache holds, and the final logits after it."""
        return self.num_blocks * self.chunk_nbytes + self.model_config().vocab_size * 4

    @property
    def activation_arena_bytes(self) -> int:
        """One activation arena: twice the hidden states of the longest prompt the cache holds."""
        config = self.model_config()
        return 2 * min(config.max_position_embeddings, self.device_cache_tokens) * config.hidden_size * 4

    @property
    def handoff_after_prefill(self) -> bool:
        return self.bench_forward == "handoff-after-prefill"

    @property
    def forward_after_stage(self) -> bool:
        return self.bench_forward == "stages-in-turn"

    def memory(self) -> dict[str, int]:
        """Host bytes this stage allocates, by the setting that sizes them: the KV pages, the send arena, and
        with a transfer engine the receive and handoff arenas its reads and writes need (as ``StageRunner`` and
        ``StageHandoff`` allocate them); then its layers' float32 weights, experts included."""
        engine_arenas = self.activation_arena_bytes + self.handoff_arena_bytes if self.transfer_engine else 0
        return {"device_cache_tokens": self.num_blocks * self.chunk_nbytes + self.activation_arena_bytes
                + engine_arenas, **self.weight_memory(*self.layers)}

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
        if not self.model_id and self.model_dir:
            from kvpool.model.hf_checkpoint import model_fingerprint

            model_id = f"{config.name}:sha256:{model_fingerprint(self.model_dir)}"
        return namespace_fingerprint(model_id, self.kv_dtype, self.layer_split, self.chunk_size, LAYOUT_VERSION)

    @property
    def chunk_nbytes(self) -> int:
        """Bytes of one chunk's KV for this stage's layers: one pool object."""
        start, end = self.layers
        # = kvpool.model.kv_chunk_nbytes, without importing torch
        return (end - start) * self.chunk_size * self.model_config().kv_entry_dim * KV_DTYPE_ITEMSIZES[self.kv_dtype]
