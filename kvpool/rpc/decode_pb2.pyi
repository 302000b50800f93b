from kvpool.rpc import handoff_pb2 as _handoff_pb2
from kvpool.rpc import prefill_pb2 as _prefill_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WatchRoomRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RoomEvent(_message.Message):
    __slots__ = ("epoch",)
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    def __init__(self, epoch: _Optional[int] = ...) -> None: ...

class ReserveRequest(_message.Message):
    __slots__ = ("num_tokens", "layer_split", "entry_bytes", "kv_dtype", "max_tokens", "hold_s", "with_logits")
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LAYER_SPLIT_FIELD_NUMBER: _ClassVar[int]
    ENTRY_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_DTYPE_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HOLD_S_FIELD_NUMBER: _ClassVar[int]
    WITH_LOGITS_FIELD_NUMBER: _ClassVar[int]
    num_tokens: int
    layer_split: _containers.RepeatedCompositeFieldContainer[_handoff_pb2.LayerRange]
    entry_bytes: int
    kv_dtype: str
    max_tokens: int
    hold_s: float
    with_logits: bool
    def __init__(self, num_tokens: _Optional[int] = ..., layer_split: _Optional[_Iterable[_Union[_handoff_pb2.LayerRange, _Mapping]]] = ..., entry_bytes: _Optional[int] = ..., kv_dtype: _Optional[str] = ..., max_tokens: _Optional[int] = ..., hold_s: _Optional[float] = ..., with_logits: _Optional[bool] = ...) -> None: ...

class ReserveResponse(_message.Message):
    __slots__ = ("target",)
    TARGET_FIELD_NUMBER: _ClassVar[int]
    target: _handoff_pb2.HandoffTarget
    def __init__(self, target: _Optional[_Union[_handoff_pb2.HandoffTarget, _Mapping]] = ...) -> None: ...

class ServeRequest(_message.Message):
    __slots__ = ("prompt_token_ids", "sampling", "max_tokens", "stop_token_ids", "request_id", "prefill_address", "layer_split", "session_key", "tenant", "cache_salt", "prefill_timeout_s", "room_at_once", "first_token_early")
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PREFILL_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LAYER_SPLIT_FIELD_NUMBER: _ClassVar[int]
    SESSION_KEY_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    ROOM_AT_ONCE_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_EARLY_FIELD_NUMBER: _ClassVar[int]
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: DecodeSampling
    max_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    request_id: str
    prefill_address: str
    layer_split: _containers.RepeatedCompositeFieldContainer[_handoff_pb2.LayerRange]
    session_key: str
    tenant: str
    cache_salt: str
    prefill_timeout_s: float
    room_at_once: bool
    first_token_early: bool
    def __init__(self, prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[DecodeSampling, _Mapping]] = ..., max_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., request_id: _Optional[str] = ..., prefill_address: _Optional[str] = ..., layer_split: _Optional[_Iterable[_Union[_handoff_pb2.LayerRange, _Mapping]]] = ..., session_key: _Optional[str] = ..., tenant: _Optional[str] = ..., cache_salt: _Optional[str] = ..., prefill_timeout_s: _Optional[float] = ..., room_at_once: _Optional[bool] = ..., first_token_early: _Optional[bool] = ...) -> None: ...

class ServeResponse(_message.Message):
    __slots__ = ("reserved", "prefilled", "token_id", "figures")
    RESERVED_FIELD_NUMBER: _ClassVar[int]
    PREFILLED_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    FIGURES_FIELD_NUMBER: _ClassVar[int]
    reserved: Reserved
    prefilled: _prefill_pb2.PrefillResponse
    token_id: int
    figures: DecodeFigures
    def __init__(self, reserved: _Optional[_Union[Reserved, _Mapping]] = ..., prefilled: _Optional[_Union[_prefill_pb2.PrefillResponse, _Mapping]] = ..., token_id: _Optional[int] = ..., figures: _Optional[_Union[DecodeFigures, _Mapping]] = ...) -> None: ...

class Reserved(_message.Message):
    __slots__ = ("room_epoch",)
    ROOM_EPOCH_FIELD_NUMBER: _ClassVar[int]
    room_epoch: int
    def __init__(self, room_epoch: _Optional[int] = ...) -> None: ...

class DecodeSampling(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "seed")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    seed: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("region_id", "prompt_token_ids", "first_token", "sampling", "max_tokens", "stop_token_ids", "request_id")
    REGION_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    region_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    first_token: int
    sampling: DecodeSampling
    max_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    request_id: str
    def __init__(self, region_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., first_token: _Optional[int] = ..., sampling: _Optional[_Union[DecodeSampling, _Mapping]] = ..., max_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., request_id: _Optional[str] = ...) -> None: ...

class DecodeFigures(_message.Message):
    __slots__ = ("num_tokens", "finish_reason", "decode_seconds", "queue_seconds", "scatter_seconds", "first_token_unix_ms")
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    DECODE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SCATTER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    num_tokens: int
    finish_reason: str
    decode_seconds: float
    queue_seconds: float
    scatter_seconds: float
    first_token_unix_ms: float
    def __init__(self, num_tokens: _Optional[int] = ..., finish_reason: _Optional[str] = ..., decode_seconds: _Optional[float] = ..., queue_seconds: _Optional[float] = ..., scatter_seconds: _Optional[float] = ..., first_token_unix_ms: _Optional[float] = ...) -> None: ...

class DecodeResponse(_message.Message):
    __slots__ = ("token_id", "figures")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    FIGURES_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    figures: DecodeFigures
    def __init__(self, token_id: _Optional[int] = ..., figures: _Optional[_Union[DecodeFigures, _Mapping]] = ...) -> None: ...

class LandedRequest(_message.Message):
    __slots__ = ("region_id", "stage", "token_start", "token_end", "trailer")
    REGION_ID_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_START_FIELD_NUMBER: _ClassVar[int]
    TOKEN_END_FIELD_NUMBER: _ClassVar[int]
    TRAILER_FIELD_NUMBER: _ClassVar[int]
    region_id: str
    stage: int
    token_start: int
    token_end: int
    trailer: bool
    def __init__(self, region_id: _Optional[str] = ..., stage: _Optional[int] = ..., token_start: _Optional[int] = ..., token_end: _Optional[int] = ..., trailer: _Optional[bool] = ...) -> None: ...

class LandedResponse(_message.Message):
    __slots__ = ("scatter_seconds", "complete")
    SCATTER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    scatter_seconds: float
    complete: bool
    def __init__(self, scatter_seconds: _Optional[float] = ..., complete: _Optional[bool] = ...) -> None: ...

class ReleaseRegionRequest(_message.Message):
    __slots__ = ("region_id",)
    REGION_ID_FIELD_NUMBER: _ClassVar[int]
    region_id: str
    def __init__(self, region_id: _Optional[str] = ...) -> None: ...

class ReleaseRegionResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class DecodeStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DecodeStats(_message.Message):
    __slots__ = ("model", "num_layers", "entry_bytes", "kv_dtype", "max_context", "page_size", "num_pages", "num_pages_used", "num_running", "num_waiting", "max_batch_size", "num_regions", "region_arena_bytes", "region_bytes_used", "steps", "region_trailer_bytes", "num_reserved")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    ENTRY_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_DTYPE_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_USED_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_REGIONS_FIELD_NUMBER: _ClassVar[int]
    REGION_ARENA_BYTES_FIELD_NUMBER: _ClassVar[int]
    REGION_BYTES_USED_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    REGION_TRAILER_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_RESERVED_FIELD_NUMBER: _ClassVar[int]
    model: str
    num_layers: int
    entry_bytes: int
    kv_dtype: str
    max_context: int
    page_size: int
    num_pages: int
    num_pages_used: int
    num_running: int
    num_waiting: int
    max_batch_size: int
    num_regions: int
    region_arena_bytes: int
    region_bytes_used: int
    steps: int
    region_trailer_bytes: int
    num_reserved: int
    def __init__(self, model: _Optional[str] = ..., num_layers: _Optional[int] = ..., entry_bytes: _Optional[int] = ..., kv_dtype: _Optional[str] = ..., max_context: _Optional[int] = ..., page_size: _Optional[int] = ..., num_pages: _Optional[int] = ..., num_pages_used: _Optional[int] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., max_batch_size: _Optional[int] = ..., num_regions: _Optional[int] = ..., region_arena_bytes: _Optional[int] = ..., region_bytes_used: _Optional[int] = ..., steps: _Optional[int] = ..., region_trailer_bytes: _Optional[int] = ..., num_reserved: _Optional[int] = ...) -> None: ...
