from kvpool.rpc import handoff_pb2 as _handoff_pb2
from kvpool.rpc import pool_pb2 as _pool_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PrefillRequest(_message.Message):
    __slots__ = ("token_ids", "session_key", "return_logits", "tenant", "cache_salt", "target")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SESSION_KEY_FIELD_NUMBER: _ClassVar[int]
    RETURN_LOGITS_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    session_key: str
    return_logits: bool
    tenant: str
    cache_salt: str
    target: _handoff_pb2.HandoffTarget
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., session_key: _Optional[str] = ..., return_logits: _Optional[bool] = ..., tenant: _Optional[str] = ..., cache_salt: _Optional[str] = ..., target: _Optional[_Union[_handoff_pb2.HandoffTarget, _Mapping]] = ...) -> None: ...

class PrefetchRequest(_message.Message):
    __slots__ = ("session_key", "tenant", "cache_salt", "session_end", "expected_next_s")
    SESSION_KEY_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    SESSION_END_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_NEXT_S_FIELD_NUMBER: _ClassVar[int]
    session_key: str
    tenant: str
    cache_salt: str
    session_end: bool
    expected_next_s: float
    def __init__(self, session_key: _Optional[str] = ..., tenant: _Optional[str] = ..., cache_salt: _Optional[str] = ..., session_end: _Optional[bool] = ..., expected_next_s: _Optional[float] = ...) -> None: ...

class PrefetchResponse(_message.Message):
    __slots__ = ("known", "num_blocks_released", "scheduled")
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_RELEASED_FIELD_NUMBER: _ClassVar[int]
    SCHEDULED_FIELD_NUMBER: _ClassVar[int]
    known: bool
    num_blocks_released: int
    scheduled: bool
    def __init__(self, known: _Optional[bool] = ..., num_blocks_released: _Optional[int] = ..., scheduled: _Optional[bool] = ...) -> None: ...

class StageRestoreFigures(_message.Message):
    __slots__ = ("stage", "num_chunks_requested", "num_chunks_restored", "bytes", "read_ms", "corrupt_chunk_indexes")
    STAGE_FIELD_NUMBER: _ClassVar[int]
    NUM_CHUNKS_REQUESTED_FIELD_NUMBER: _ClassVar[int]
    NUM_CHUNKS_RESTORED_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    READ_MS_FIELD_NUMBER: _ClassVar[int]
    CORRUPT_CHUNK_INDEXES_FIELD_NUMBER: _ClassVar[int]
    stage: int
    num_chunks_requested: int
    num_chunks_restored: int
    bytes: int
    read_ms: float
    corrupt_chunk_indexes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, stage: _Optional[int] = ..., num_chunks_requested: _Optional[int] = ..., num_chunks_restored: _Optional[int] = ..., bytes: _Optional[int] = ..., read_ms: _Optional[float] = ..., corrupt_chunk_indexes: _Optional[_Iterable[int]] = ...) -> None: ...

class PrefillFigures(_message.Message):
    __slots__ = ("num_prompt_tokens", "num_device_tokens", "num_pool_tokens", "num_computed_tokens", "num_pool_chunks_lost", "restore", "restore_wait_ms", "compute_ms", "lookup_ms", "total_ms", "stage_compute_ms")
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_DEVICE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_POOL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_POOL_CHUNKS_LOST_FIELD_NUMBER: _ClassVar[int]
    RESTORE_FIELD_NUMBER: _ClassVar[int]
    RESTORE_WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_MS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_MS_FIELD_NUMBER: _ClassVar[int]
    STAGE_COMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    num_prompt_tokens: int
    num_device_tokens: int
    num_pool_tokens: int
    num_computed_tokens: int
    num_pool_chunks_lost: int
    restore: _containers.RepeatedCompositeFieldContainer[StageRestoreFigures]
    restore_wait_ms: float
    compute_ms: float
    lookup_ms: float
    total_ms: float
    stage_compute_ms: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, num_prompt_tokens: _Optional[int] = ..., num_device_tokens: _Optional[int] = ..., num_pool_tokens: _Optional[int] = ..., num_computed_tokens: _Optional[int] = ..., num_pool_chunks_lost: _Optional[int] = ..., restore: _Optional[_Iterable[_Union[StageRestoreFigures, _Mapping]]] = ..., restore_wait_ms: _Optional[float] = ..., compute_ms: _Optional[float] = ..., lookup_ms: _Optional[float] = ..., total_ms: _Optional[float] = ..., stage_compute_ms: _Optional[_Iterable[float]] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("first_token", "request_id", "logits", "figures", "block_table", "block_size", "handoff")
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LOGITS_FIELD_NUMBER: _ClassVar[int]
    FIGURES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TABLE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_FIELD_NUMBER: _ClassVar[int]
    first_token: int
    request_id: str
    logits: bytes
    figures: PrefillFigures
    block_table: _containers.RepeatedScalarFieldContainer[int]
    block_size: int
    handoff: _handoff_pb2.HandoffResponse
    def __init__(self, first_token: _Optional[int] = ..., request_id: _Optional[str] = ..., logits: _Optional[bytes] = ..., figures: _Optional[_Union[PrefillFigures, _Mapping]] = ..., block_table: _Optional[_Iterable[int]] = ..., block_size: _Optional[int] = ..., handoff: _Optional[_Union[_handoff_pb2.HandoffResponse, _Mapping]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class StageInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StageInfoResponse(_message.Message):
    __slots__ = ("stage", "num_stages", "layer_start", "layer_end", "num_blocks", "block_size", "namespace", "transfer_endpoint", "work_scale", "restore_on_chain", "chunk_bytes", "saves_when_told")
    STAGE_FIELD_NUMBER: _ClassVar[int]
    NUM_STAGES_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    WORK_SCALE_FIELD_NUMBER: _ClassVar[int]
    RESTORE_ON_CHAIN_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    SAVES_WHEN_TOLD_FIELD_NUMBER: _ClassVar[int]
    stage: int
    num_stages: int
    layer_start: int
    layer_end: int
    num_blocks: int
    block_size: int
    namespace: str
    transfer_endpoint: str
    work_scale: float
    restore_on_chain: bool
    chunk_bytes: int
    saves_when_told: bool
    def __init__(self, stage: _Optional[int] = ..., num_stages: _Optional[int] = ..., layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ..., num_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., namespace: _Optional[str] = ..., transfer_endpoint: _Optional[str] = ..., work_scale: _Optional[float] = ..., restore_on_chain: _Optional[bool] = ..., chunk_bytes: _Optional[int] = ..., saves_when_told: _Optional[bool] = ...) -> None: ...

class RestoreChunk(_message.Message):
    __slots__ = ("chunk_index", "block_id", "endpoint", "address", "size", "checksum", "key", "segment_id")
    CHUNK_INDEX_FIELD_NUMBER: _ClassVar[int]
    BLOCK_ID_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_ID_FIELD_NUMBER: _ClassVar[int]
    chunk_index: int
    block_id: int
    endpoint: str
    address: int
    size: int
    checksum: int
    key: str
    segment_id: str
    def __init__(self, chunk_index: _Optional[int] = ..., block_id: _Optional[int] = ..., endpoint: _Optional[str] = ..., address: _Optional[int] = ..., size: _Optional[int] = ..., checksum: _Optional[int] = ..., key: _Optional[str] = ..., segment_id: _Optional[str] = ...) -> None: ...

class RestoreRequest(_message.Message):
    __slots__ = ("request_id", "chunks", "segments")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    chunks: _containers.RepeatedCompositeFieldContainer[RestoreChunk]
    segments: _containers.RepeatedCompositeFieldContainer[_pool_pb2.SegmentAccess]
    def __init__(self, request_id: _Optional[str] = ..., chunks: _Optional[_Iterable[_Union[RestoreChunk, _Mapping]]] = ..., segments: _Optional[_Iterable[_Union[_pool_pb2.SegmentAccess, _Mapping]]] = ...) -> None: ...

class RestoreResponse(_message.Message):
    __slots__ = ("figures",)
    FIGURES_FIELD_NUMBER: _ClassVar[int]
    figures: StageRestoreFigures
    def __init__(self, figures: _Optional[_Union[StageRestoreFigures, _Mapping]] = ...) -> None: ...

class Activation(_message.Message):
    __slots__ = ("inline", "endpoint", "address", "size", "num_tokens", "hidden_size", "host", "shared_memory", "shared_base_address")
    INLINE_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    SHARED_MEMORY_FIELD_NUMBER: _ClassVar[int]
    SHARED_BASE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    inline: bytes
    endpoint: str
    address: int
    size: int
    num_tokens: int
    hidden_size: int
    host: str
    shared_memory: _pool_pb2.SharedMemory
    shared_base_address: int
    def __init__(self, inline: _Optional[bytes] = ..., endpoint: _Optional[str] = ..., address: _Optional[int] = ..., size: _Optional[int] = ..., num_tokens: _Optional[int] = ..., hidden_size: _Optional[int] = ..., host: _Optional[str] = ..., shared_memory: _Optional[_Union[_pool_pb2.SharedMemory, _Mapping]] = ..., shared_base_address: _Optional[int] = ...) -> None: ...

class ForwardRequest(_message.Message):
    __slots__ = ("request_id", "block_table", "compute_start", "num_tokens", "activation", "save_first_chunk", "save_chunk_hashes", "return_logits", "tenant", "target", "piece_start", "piece_end", "restores", "plan_only", "save_when_told")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TABLE_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_START_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACTIVATION_FIELD_NUMBER: _ClassVar[int]
    SAVE_FIRST_CHUNK_FIELD_NUMBER: _ClassVar[int]
    SAVE_CHUNK_HASHES_FIELD_NUMBER: _ClassVar[int]
    RETURN_LOGITS_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    PIECE_START_FIELD_NUMBER: _ClassVar[int]
    PIECE_END_FIELD_NUMBER: _ClassVar[int]
    RESTORES_FIELD_NUMBER: _ClassVar[int]
    PLAN_ONLY_FIELD_NUMBER: _ClassVar[int]
    SAVE_WHEN_TOLD_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    block_table: _containers.RepeatedScalarFieldContainer[int]
    compute_start: int
    num_tokens: int
    activation: Activation
    save_first_chunk: int
    save_chunk_hashes: _containers.RepeatedScalarFieldContainer[str]
    return_logits: bool
    tenant: str
    target: _handoff_pb2.HandoffTarget
    piece_start: int
    piece_end: int
    restores: _containers.RepeatedCompositeFieldContainer[RestoreRequest]
    plan_only: bool
    save_when_told: bool
    def __init__(self, request_id: _Optional[str] = ..., block_table: _Optional[_Iterable[int]] = ..., compute_start: _Optional[int] = ..., num_tokens: _Optional[int] = ..., activation: _Optional[_Union[Activation, _Mapping]] = ..., save_first_chunk: _Optional[int] = ..., save_chunk_hashes: _Optional[_Iterable[str]] = ..., return_logits: _Optional[bool] = ..., tenant: _Optional[str] = ..., target: _Optional[_Union[_handoff_pb2.HandoffTarget, _Mapping]] = ..., piece_start: _Optional[int] = ..., piece_end: _Optional[int] = ..., restores: _Optional[_Iterable[_Union[RestoreRequest, _Mapping]]] = ..., plan_only: _Optional[bool] = ..., save_when_told: _Optional[bool] = ...) -> None: ...

class HandoffDoneRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class ForwardResponse(_message.Message):
    __slots__ = ("first_token", "logits", "stage_compute_ms", "handoff_stages", "restore_stages")
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    LOGITS_FIELD_NUMBER: _ClassVar[int]
    STAGE_COMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_STAGES_FIELD_NUMBER: _ClassVar[int]
    RESTORE_STAGES_FIELD_NUMBER: _ClassVar[int]
    first_token: int
    logits: bytes
    stage_compute_ms: _containers.RepeatedScalarFieldContainer[float]
    handoff_stages: _containers.RepeatedCompositeFieldContainer[_handoff_pb2.StageHandoffFigures]
    restore_stages: _containers.RepeatedCompositeFieldContainer[StageRestoreFigures]
    def __init__(self, first_token: _Optional[int] = ..., logits: _Optional[bytes] = ..., stage_compute_ms: _Optional[_Iterable[float]] = ..., handoff_stages: _Optional[_Iterable[_Union[_handoff_pb2.StageHandoffFigures, _Mapping]]] = ..., restore_stages: _Optional[_Iterable[_Union[StageRestoreFigures, _Mapping]]] = ...) -> None: ...

class SaveDoneRequest(_message.Message):
    __slots__ = ("request_id", "told", "writes", "segments")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOLD_FIELD_NUMBER: _ClassVar[int]
    WRITES_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    told: bool
    writes: _containers.RepeatedCompositeFieldContainer[RestoreChunk]
    segments: _containers.RepeatedCompositeFieldContainer[_pool_pb2.SegmentAccess]
    def __init__(self, request_id: _Optional[str] = ..., told: _Optional[bool] = ..., writes: _Optional[_Iterable[_Union[RestoreChunk, _Mapping]]] = ..., segments: _Optional[_Iterable[_Union[_pool_pb2.SegmentAccess, _Mapping]]] = ...) -> None: ...

class SaveDoneResponse(_message.Message):
    __slots__ = ("stage", "num_stored", "num_exists", "num_not_stored", "bytes", "put_ms", "written_keys", "written_checksums")
    STAGE_FIELD_NUMBER: _ClassVar[int]
    NUM_STORED_FIELD_NUMBER: _ClassVar[int]
    NUM_EXISTS_FIELD_NUMBER: _ClassVar[int]
    NUM_NOT_STORED_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    PUT_MS_FIELD_NUMBER: _ClassVar[int]
    WRITTEN_KEYS_FIELD_NUMBER: _ClassVar[int]
    WRITTEN_CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    stage: int
    num_stored: int
    num_exists: int
    num_not_stored: int
    bytes: int
    put_ms: float
    written_keys: _containers.RepeatedScalarFieldContainer[str]
    written_checksums: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, stage: _Optional[int] = ..., num_stored: _Optional[int] = ..., num_exists: _Optional[int] = ..., num_not_stored: _Optional[int] = ..., bytes: _Optional[int] = ..., put_ms: _Optional[float] = ..., written_keys: _Optional[_Iterable[str]] = ..., written_checksums: _Optional[_Iterable[int]] = ...) -> None: ...
