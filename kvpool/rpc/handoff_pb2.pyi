from kvpool.rpc import pool_pb2 as _pool_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LayerRange(_message.Message):
    __slots__ = ("start", "end")
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    start: int
    end: int
    def __init__(self, start: _Optional[int] = ..., end: _Optional[int] = ...) -> None: ...

class HandoffLayout(_message.Message):
    __slots__ = ("num_tokens", "layer_split", "entry_bytes", "trailer_bytes")
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LAYER_SPLIT_FIELD_NUMBER: _ClassVar[int]
    ENTRY_BYTES_FIELD_NUMBER: _ClassVar[int]
    TRAILER_BYTES_FIELD_NUMBER: _ClassVar[int]
    num_tokens: int
    layer_split: _containers.RepeatedCompositeFieldContainer[LayerRange]
    entry_bytes: int
    trailer_bytes: int
    def __init__(self, num_tokens: _Optional[int] = ..., layer_split: _Optional[_Iterable[_Union[LayerRange, _Mapping]]] = ..., entry_bytes: _Optional[int] = ..., trailer_bytes: _Optional[int] = ...) -> None: ...

class HandoffTarget(_message.Message):
    __slots__ = ("region_id", "endpoint", "address", "size", "deadline_unix_ms", "layout", "notify_address", "host", "shared_memory", "shared_base_address", "control_offset")
    REGION_ID_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    NOTIFY_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    SHARED_MEMORY_FIELD_NUMBER: _ClassVar[int]
    SHARED_BASE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    CONTROL_OFFSET_FIELD_NUMBER: _ClassVar[int]
    region_id: str
    endpoint: str
    address: int
    size: int
    deadline_unix_ms: int
    layout: HandoffLayout
    notify_address: str
    host: str
    shared_memory: _pool_pb2.SharedMemory
    shared_base_address: int
    control_offset: int
    def __init__(self, region_id: _Optional[str] = ..., endpoint: _Optional[str] = ..., address: _Optional[int] = ..., size: _Optional[int] = ..., deadline_unix_ms: _Optional[int] = ..., layout: _Optional[_Union[HandoffLayout, _Mapping]] = ..., notify_address: _Optional[str] = ..., host: _Optional[str] = ..., shared_memory: _Optional[_Union[_pool_pb2.SharedMemory, _Mapping]] = ..., shared_base_address: _Optional[int] = ..., control_offset: _Optional[int] = ...) -> None: ...

class HandoffRequest(_message.Message):
    __slots__ = ("request_id", "target")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    target: HandoffTarget
    def __init__(self, request_id: _Optional[str] = ..., target: _Optional[_Union[HandoffTarget, _Mapping]] = ...) -> None: ...

class StageHandoffFigures(_message.Message):
    __slots__ = ("stage", "transfers", "bytes", "gather_seconds", "write_seconds", "scatter_seconds", "ranges", "forward_end_unix_ms", "last_write_end_unix_ms")
    STAGE_FIELD_NUMBER: _ClassVar[int]
    TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    GATHER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    WRITE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SCATTER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    RANGES_FIELD_NUMBER: _ClassVar[int]
    FORWARD_END_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    LAST_WRITE_END_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    stage: int
    transfers: int
    bytes: int
    gather_seconds: float
    write_seconds: float
    scatter_seconds: float
    ranges: int
    forward_end_unix_ms: float
    last_write_end_unix_ms: float
    def __init__(self, stage: _Optional[int] = ..., transfers: _Optional[int] = ..., bytes: _Optional[int] = ..., gather_seconds: _Optional[float] = ..., write_seconds: _Optional[float] = ..., scatter_seconds: _Optional[float] = ..., ranges: _Optional[int] = ..., forward_end_unix_ms: _Optional[float] = ..., last_write_end_unix_ms: _Optional[float] = ...) -> None: ...

class HandoffResponse(_message.Message):
    __slots__ = ("region_id", "stages", "transfers", "bytes", "seconds")
    REGION_ID_FIELD_NUMBER: _ClassVar[int]
    STAGES_FIELD_NUMBER: _ClassVar[int]
    TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    region_id: str
    stages: _containers.RepeatedCompositeFieldContainer[StageHandoffFigures]
    transfers: int
    bytes: int
    seconds: float
    def __init__(self, region_id: _Optional[str] = ..., stages: _Optional[_Iterable[_Union[StageHandoffFigures, _Mapping]]] = ..., transfers: _Optional[int] = ..., bytes: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class WriteLayersRequest(_message.Message):
    __slots__ = ("request_id", "block_table", "target")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TABLE_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    block_table: _containers.RepeatedScalarFieldContainer[int]
    target: HandoffTarget
    def __init__(self, request_id: _Optional[str] = ..., block_table: _Optional[_Iterable[int]] = ..., target: _Optional[_Union[HandoffTarget, _Mapping]] = ...) -> None: ...
