from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PutStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PUT_STATUS_UNSPECIFIED: _ClassVar[PutStatus]
    PUT_STATUS_RESERVED: _ClassVar[PutStatus]
    PUT_STATUS_ALREADY_EXISTS: _ClassVar[PutStatus]
    PUT_STATUS_NO_SPACE: _ClassVar[PutStatus]
    PUT_STATUS_GROUP_FAILED: _ClassVar[PutStatus]
PUT_STATUS_UNSPECIFIED: PutStatus
PUT_STATUS_RESERVED: PutStatus
PUT_STATUS_ALREADY_EXISTS: PutStatus
PUT_STATUS_NO_SPACE: PutStatus
PUT_STATUS_GROUP_FAILED: PutStatus

class MountSegmentRequest(_message.Message):
    __slots__ = ("segment_id", "endpoint", "host", "base_address", "size", "numa_node", "records", "shared_memory")
    SEGMENT_ID_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    BASE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    NUMA_NODE_FIELD_NUMBER: _ClassVar[int]
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    SHARED_MEMORY_FIELD_NUMBER: _ClassVar[int]
    segment_id: str
    endpoint: str
    host: str
    base_address: int
    size: int
    numa_node: int
    records: _containers.RepeatedCompositeFieldContainer[ObjectRecord]
    shared_memory: SharedMemory
    def __init__(self, segment_id: _Optional[str] = ..., endpoint: _Optional[str] = ..., host: _Optional[str] = ..., base_address: _Optional[int] = ..., size: _Optional[int] = ..., numa_node: _Optional[int] = ..., records: _Optional[_Iterable[_Union[ObjectRecord, _Mapping]]] = ..., shared_memory: _Optional[_Union[SharedMemory, _Mapping]] = ...) -> None: ...

class SharedMemory(_message.Message):
    __slots__ = ("socket_path", "name", "token")
    SOCKET_PATH_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    socket_path: str
    name: str
    token: str
    def __init__(self, socket_path: _Optional[str] = ..., name: _Optional[str] = ..., token: _Optional[str] = ...) -> None: ...

class SegmentAccess(_message.Message):
    __slots__ = ("segment_id", "host", "base_address", "shared_memory", "number", "endpoint")
    SEGMENT_ID_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    BASE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SHARED_MEMORY_FIELD_NUMBER: _ClassVar[int]
    NUMBER_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    segment_id: str
    host: str
    base_address: int
    shared_memory: SharedMemory
    number: int
    endpoint: str
    def __init__(self, segment_id: _Optional[str] = ..., host: _Optional[str] = ..., base_address: _Optional[int] = ..., shared_memory: _Optional[_Union[SharedMemory, _Mapping]] = ..., number: _Optional[int] = ..., endpoint: _Optional[str] = ...) -> None: ...

class MountSegmentResponse(_message.Message):
    __slots__ = ("master_incarnation", "heartbeat_interval_s", "rejected_keys", "sequence", "num_adopted", "epoch")
    MASTER_INCARNATION_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    REJECTED_KEYS_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    NUM_ADOPTED_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    master_incarnation: str
    heartbeat_interval_s: float
    rejected_keys: _containers.RepeatedScalarFieldContainer[str]
    sequence: int
    num_adopted: int
    epoch: int
    def __init__(self, master_incarnation: _Optional[str] = ..., heartbeat_interval_s: _Optional[float] = ..., rejected_keys: _Optional[_Iterable[str]] = ..., sequence: _Optional[int] = ..., num_adopted: _Optional[int] = ..., epoch: _Optional[int] = ...) -> None: ...

class ObjectRecord(_message.Message):
    __slots__ = ("key", "group_id", "group_size", "offset", "size", "checksum", "tenant")
    KEY_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    key: str
    group_id: str
    group_size: int
    offset: int
    size: int
    checksum: int
    tenant: str
    def __init__(self, key: _Optional[str] = ..., group_id: _Optional[str] = ..., group_size: _Optional[int] = ..., offset: _Optional[int] = ..., size: _Optional[int] = ..., checksum: _Optional[int] = ..., tenant: _Optional[str] = ...) -> None: ...

class SegmentChange(_message.Message):
    __slots__ = ("sequence", "added", "removed_key")
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    ADDED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_KEY_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    added: ObjectRecord
    removed_key: str
    def __init__(self, sequence: _Optional[int] = ..., added: _Optional[_Union[ObjectRecord, _Mapping]] = ..., removed_key: _Optional[str] = ...) -> None: ...

class UnmountSegmentRequest(_message.Message):
    __slots__ = ("segment_id",)
    SEGMENT_ID_FIELD_NUMBER: _ClassVar[int]
    segment_id: str
    def __init__(self, segment_id: _Optional[str] = ...) -> None: ...

class UnmountSegmentResponse(_message.Message):
    __slots__ = ("objects_dropped",)
    OBJECTS_DROPPED_FIELD_NUMBER: _ClassVar[int]
    objects_dropped: int
    def __init__(self, objects_dropped: _Optional[int] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("segment_id", "acked_sequence", "wait_ms", "packed", "grouped")
    SEGMENT_ID_FIELD_NUMBER: _ClassVar[int]
    ACKED_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    PACKED_FIELD_NUMBER: _ClassVar[int]
    GROUPED_FIELD_NUMBER: _ClassVar[int]
    segment_id: str
    acked_sequence: int
    wait_ms: int
    packed: bool
    grouped: bool
    def __init__(self, segment_id: _Optional[str] = ..., acked_sequence: _Optional[int] = ..., wait_ms: _Optional[int] = ..., packed: _Optional[bool] = ..., grouped: _Optional[bool] = ...) -> None: ...

class PackedChanges(_message.Message):
    __slots__ = ("sequence", "key", "group_id", "group_size", "offset", "size", "checksum", "tenant")
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    sequence: _containers.RepeatedScalarFieldContainer[int]
    key: _containers.RepeatedScalarFieldContainer[str]
    group_id: _containers.RepeatedScalarFieldContainer[str]
    group_size: _containers.RepeatedScalarFieldContainer[int]
    offset: _containers.RepeatedScalarFieldContainer[int]
    size: _containers.RepeatedScalarFieldContainer[int]
    checksum: _containers.RepeatedScalarFieldContainer[int]
    tenant: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, sequence: _Optional[_Iterable[int]] = ..., key: _Optional[_Iterable[str]] = ..., group_id: _Optional[_Iterable[str]] = ..., group_size: _Optional[_Iterable[int]] = ..., offset: _Optional[_Iterable[int]] = ..., size: _Optional[_Iterable[int]] = ..., checksum: _Optional[_Iterable[int]] = ..., tenant: _Optional[_Iterable[str]] = ...) -> None: ...

class GroupedChanges(_message.Message):
    __slots__ = ("first", "count", "prefix", "group_id", "group_size", "tenant", "part", "offset", "size", "checksum")
    FIRST_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    PART_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    first: _containers.RepeatedScalarFieldContainer[int]
    count: _containers.RepeatedScalarFieldContainer[int]
    prefix: _containers.RepeatedScalarFieldContainer[str]
    group_id: _containers.RepeatedScalarFieldContainer[str]
    group_size: _containers.RepeatedScalarFieldContainer[int]
    tenant: _containers.RepeatedScalarFieldContainer[str]
    part: _containers.RepeatedScalarFieldContainer[str]
    offset: _containers.RepeatedScalarFieldContainer[int]
    size: _containers.RepeatedScalarFieldContainer[int]
    checksum: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, first: _Optional[_Iterable[int]] = ..., count: _Optional[_Iterable[int]] = ..., prefix: _Optional[_Iterable[str]] = ..., group_id: _Optional[_Iterable[str]] = ..., group_size: _Optional[_Iterable[int]] = ..., tenant: _Optional[_Iterable[str]] = ..., part: _Optional[_Iterable[str]] = ..., offset: _Optional[_Iterable[int]] = ..., size: _Optional[_Iterable[int]] = ..., checksum: _Optional[_Iterable[int]] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("master_incarnation", "changes", "more", "epoch", "packed_changes", "grouped_changes")
    MASTER_INCARNATION_FIELD_NUMBER: _ClassVar[int]
    CHANGES_FIELD_NUMBER: _ClassVar[int]
    MORE_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    PACKED_CHANGES_FIELD_NUMBER: _ClassVar[int]
    GROUPED_CHANGES_FIELD_NUMBER: _ClassVar[int]
    master_incarnation: str
    changes: _containers.RepeatedCompositeFieldContainer[SegmentChange]
    more: bool
    epoch: int
    packed_changes: PackedChanges
    grouped_changes: GroupedChanges
    def __init__(self, master_incarnation: _Optional[str] = ..., changes: _Optional[_Iterable[_Union[SegmentChange, _Mapping]]] = ..., more: _Optional[bool] = ..., epoch: _Optional[int] = ..., packed_changes: _Optional[_Union[PackedChanges, _Mapping]] = ..., grouped_changes: _Optional[_Union[GroupedChanges, _Mapping]] = ...) -> None: ...

class PutItem(_message.Message):
    __slots__ = ("key", "group_id", "group_size", "size")
    KEY_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    key: str
    group_id: str
    group_size: int
    size: int
    def __init__(self, key: _Optional[str] = ..., group_id: _Optional[str] = ..., group_size: _Optional[int] = ..., size: _Optional[int] = ...) -> None: ...

class PutStartRequest(_message.Message):
    __slots__ = ("client_host", "items", "tenant", "release_lease_id", "release_corrupt_group_ids", "packed", "groups")
    CLIENT_HOST_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    RELEASE_LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    RELEASE_CORRUPT_GROUP_IDS_FIELD_NUMBER: _ClassVar[int]
    PACKED_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    client_host: str
    items: _containers.RepeatedCompositeFieldContainer[PutItem]
    tenant: str
    release_lease_id: int
    release_corrupt_group_ids: _containers.RepeatedScalarFieldContainer[str]
    packed: bool
    groups: PutGroups
    def __init__(self, client_host: _Optional[str] = ..., items: _Optional[_Iterable[_Union[PutItem, _Mapping]]] = ..., tenant: _Optional[str] = ..., release_lease_id: _Optional[int] = ..., release_corrupt_group_ids: _Optional[_Iterable[str]] = ..., packed: _Optional[bool] = ..., groups: _Optional[_Union[PutGroups, _Mapping]] = ...) -> None: ...

class PutGroups(_message.Message):
    __slots__ = ("group_ids", "member_sizes", "by_member")
    GROUP_IDS_FIELD_NUMBER: _ClassVar[int]
    MEMBER_SIZES_FIELD_NUMBER: _ClassVar[int]
    BY_MEMBER_FIELD_NUMBER: _ClassVar[int]
    group_ids: _containers.RepeatedScalarFieldContainer[str]
    member_sizes: _containers.RepeatedScalarFieldContainer[int]
    by_member: bool
    def __init__(self, group_ids: _Optional[_Iterable[str]] = ..., member_sizes: _Optional[_Iterable[int]] = ..., by_member: _Optional[bool] = ...) -> None: ...

class Location(_message.Message):
    __slots__ = ("segment_id", "endpoint", "address", "size")
    SEGMENT_ID_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    segment_id: str
    endpoint: str
    address: int
    size: int
    def __init__(self, segment_id: _Optional[str] = ..., endpoint: _Optional[str] = ..., address: _Optional[int] = ..., size: _Optional[int] = ...) -> None: ...

class PutStartResult(_message.Message):
    __slots__ = ("status", "location")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    LOCATION_FIELD_NUMBER: _ClassVar[int]
    status: PutStatus
    location: Location
    def __init__(self, status: _Optional[_Union[PutStatus, str]] = ..., location: _Optional[_Union[Location, _Mapping]] = ...) -> None: ...

class PutStartResponse(_message.Message):
    __slots__ = ("results", "segments", "packed", "commits_groups")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    PACKED_FIELD_NUMBER: _ClassVar[int]
    COMMITS_GROUPS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[PutStartResult]
    segments: _containers.RepeatedCompositeFieldContainer[SegmentAccess]
    packed: PackedPutResults
    commits_groups: bool
    def __init__(self, results: _Optional[_Iterable[_Union[PutStartResult, _Mapping]]] = ..., segments: _Optional[_Iterable[_Union[SegmentAccess, _Mapping]]] = ..., packed: _Optional[_Union[PackedPutResults, _Mapping]] = ..., commits_groups: _Optional[bool] = ...) -> None: ...

class PackedPutResults(_message.Message):
    __slots__ = ("status", "segment", "address")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    status: _containers.RepeatedScalarFieldContainer[PutStatus]
    segment: _containers.RepeatedScalarFieldContainer[int]
    address: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, status: _Optional[_Iterable[_Union[PutStatus, str]]] = ..., segment: _Optional[_Iterable[int]] = ..., address: _Optional[_Iterable[int]] = ...) -> None: ...

class PutCommit(_message.Message):
    __slots__ = ("key", "checksum")
    KEY_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    key: str
    checksum: int
    def __init__(self, key: _Optional[str] = ..., checksum: _Optional[int] = ...) -> None: ...

class PutEndRequest(_message.Message):
    __slots__ = ("items", "keys", "checksums", "groups")
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[PutCommit]
    keys: _containers.RepeatedScalarFieldContainer[str]
    checksums: _containers.RepeatedScalarFieldContainer[int]
    groups: CommitGroups
    def __init__(self, items: _Optional[_Iterable[_Union[PutCommit, _Mapping]]] = ..., keys: _Optional[_Iterable[str]] = ..., checksums: _Optional[_Iterable[int]] = ..., groups: _Optional[_Union[CommitGroups, _Mapping]] = ...) -> None: ...

class CommitGroups(_message.Message):
    __slots__ = ("group_ids", "members", "by_member")
    GROUP_IDS_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    BY_MEMBER_FIELD_NUMBER: _ClassVar[int]
    group_ids: _containers.RepeatedScalarFieldContainer[str]
    members: int
    by_member: bool
    def __init__(self, group_ids: _Optional[_Iterable[str]] = ..., members: _Optional[int] = ..., by_member: _Optional[bool] = ...) -> None: ...

class PutEndResponse(_message.Message):
    __slots__ = ("num_committed",)
    NUM_COMMITTED_FIELD_NUMBER: _ClassVar[int]
    num_committed: int
    def __init__(self, num_committed: _Optional[int] = ...) -> None: ...

class PutRevokeRequest(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, keys: _Optional[_Iterable[str]] = ...) -> None: ...

class PutRevokeResponse(_message.Message):
    __slots__ = ("num_revoked",)
    NUM_REVOKED_FIELD_NUMBER: _ClassVar[int]
    num_revoked: int
    def __init__(self, num_revoked: _Optional[int] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("group_ids", "lease_ms", "held_prefix", "packed", "packed_bytes", "compact", "history", "history_groups")
    GROUP_IDS_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    HELD_PREFIX_FIELD_NUMBER: _ClassVar[int]
    PACKED_FIELD_NUMBER: _ClassVar[int]
    PACKED_BYTES_FIELD_NUMBER: _ClassVar[int]
    COMPACT_FIELD_NUMBER: _ClassVar[int]
    HISTORY_FIELD_NUMBER: _ClassVar[int]
    HISTORY_GROUPS_FIELD_NUMBER: _ClassVar[int]
    group_ids: _containers.RepeatedScalarFieldContainer[str]
    lease_ms: int
    held_prefix: int
    packed: bool
    packed_bytes: bool
    compact: bool
    history: int
    history_groups: int
    def __init__(self, group_ids: _Optional[_Iterable[str]] = ..., lease_ms: _Optional[int] = ..., held_prefix: _Optional[int] = ..., packed: _Optional[bool] = ..., packed_bytes: _Optional[bool] = ..., compact: _Optional[bool] = ..., history: _Optional[int] = ..., history_groups: _Optional[int] = ...) -> None: ...

class ObjectLocation(_message.Message):
    __slots__ = ("key", "location", "checksum")
    KEY_FIELD_NUMBER: _ClassVar[int]
    LOCATION_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    key: str
    location: Location
    checksum: int
    def __init__(self, key: _Optional[str] = ..., location: _Optional[_Union[Location, _Mapping]] = ..., checksum: _Optional[int] = ...) -> None: ...

class GroupLocation(_message.Message):
    __slots__ = ("group_id", "members")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    members: _containers.RepeatedCompositeFieldContainer[ObjectLocation]
    def __init__(self, group_id: _Optional[str] = ..., members: _Optional[_Iterable[_Union[ObjectLocation, _Mapping]]] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("num_complete", "groups", "lease_id", "lease_ms", "segments", "packed", "packed_bytes", "compact", "history", "history_unknown", "history_groups")
    NUM_COMPLETE_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    PACKED_FIELD_NUMBER: _ClassVar[int]
    PACKED_BYTES_FIELD_NUMBER: _ClassVar[int]
    COMPACT_FIELD_NUMBER: _ClassVar[int]
    HISTORY_FIELD_NUMBER: _ClassVar[int]
    HISTORY_UNKNOWN_FIELD_NUMBER: _ClassVar[int]
    HISTORY_GROUPS_FIELD_NUMBER: _ClassVar[int]
    num_complete: int
    groups: _containers.RepeatedCompositeFieldContainer[GroupLocation]
    lease_id: int
    lease_ms: int
    segments: _containers.RepeatedCompositeFieldContainer[SegmentAccess]
    packed: PackedGroups
    packed_bytes: bytes
    compact: bool
    history: int
    history_unknown: bool
    history_groups: int
    def __init__(self, num_complete: _Optional[int] = ..., groups: _Optional[_Iterable[_Union[GroupLocation, _Mapping]]] = ..., lease_id: _Optional[int] = ..., lease_ms: _Optional[int] = ..., segments: _Optional[_Iterable[_Union[SegmentAccess, _Mapping]]] = ..., packed: _Optional[_Union[PackedGroups, _Mapping]] = ..., packed_bytes: _Optional[bytes] = ..., compact: _Optional[bool] = ..., history: _Optional[int] = ..., history_unknown: _Optional[bool] = ..., history_groups: _Optional[int] = ...) -> None: ...

class PackedGroups(_message.Message):
    __slots__ = ("group_id", "num_members", "key", "segment", "address", "size", "checksum")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_MEMBERS_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    group_id: _containers.RepeatedScalarFieldContainer[str]
    num_members: _containers.RepeatedScalarFieldContainer[int]
    key: _containers.RepeatedScalarFieldContainer[str]
    segment: _containers.RepeatedScalarFieldContainer[int]
    address: _containers.RepeatedScalarFieldContainer[int]
    size: _containers.RepeatedScalarFieldContainer[int]
    checksum: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, group_id: _Optional[_Iterable[str]] = ..., num_members: _Optional[_Iterable[int]] = ..., key: _Optional[_Iterable[str]] = ..., segment: _Optional[_Iterable[int]] = ..., address: _Optional[_Iterable[int]] = ..., size: _Optional[_Iterable[int]] = ..., checksum: _Optional[_Iterable[int]] = ...) -> None: ...

class ReleaseLeaseRequest(_message.Message):
    __slots__ = ("lease_id", "corrupt_group_ids")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    CORRUPT_GROUP_IDS_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    corrupt_group_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, lease_id: _Optional[int] = ..., corrupt_group_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class ReleaseLeaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class ExistsRequest(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, keys: _Optional[_Iterable[str]] = ...) -> None: ...

class ExistsResponse(_message.Message):
    __slots__ = ("exists",)
    EXISTS_FIELD_NUMBER: _ClassVar[int]
    exists: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, exists: _Optional[_Iterable[bool]] = ...) -> None: ...

class RemoveRequest(_message.Message):
    __slots__ = ("group_ids",)
    GROUP_IDS_FIELD_NUMBER: _ClassVar[int]
    group_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, group_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class RemoveResponse(_message.Message):
    __slots__ = ("num_removed", "busy_group_ids")
    NUM_REMOVED_FIELD_NUMBER: _ClassVar[int]
    BUSY_GROUP_IDS_FIELD_NUMBER: _ClassVar[int]
    num_removed: int
    busy_group_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, num_removed: _Optional[int] = ..., busy_group_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class DemoteRequest(_message.Message):
    __slots__ = ("group_ids",)
    GROUP_IDS_FIELD_NUMBER: _ClassVar[int]
    group_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, group_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class DemoteResponse(_message.Message):
    __slots__ = ("num_demoted",)
    NUM_DEMOTED_FIELD_NUMBER: _ClassVar[int]
    num_demoted: int
    def __init__(self, num_demoted: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SegmentStats(_message.Message):
    __slots__ = ("segment_id", "endpoint", "host", "numa_node", "capacity_bytes", "used_bytes", "num_objects", "largest_free_bytes", "sequence", "acked_sequence")
    SEGMENT_ID_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    NUMA_NODE_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_OBJECTS_FIELD_NUMBER: _ClassVar[int]
    LARGEST_FREE_BYTES_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    ACKED_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    segment_id: str
    endpoint: str
    host: str
    numa_node: int
    capacity_bytes: int
    used_bytes: int
    num_objects: int
    largest_free_bytes: int
    sequence: int
    acked_sequence: int
    def __init__(self, segment_id: _Optional[str] = ..., endpoint: _Optional[str] = ..., host: _Optional[str] = ..., numa_node: _Optional[int] = ..., capacity_bytes: _Optional[int] = ..., used_bytes: _Optional[int] = ..., num_objects: _Optional[int] = ..., largest_free_bytes: _Optional[int] = ..., sequence: _Optional[int] = ..., acked_sequence: _Optional[int] = ...) -> None: ...

class TenantStats(_message.Message):
    __slots__ = ("tenant", "bytes", "num_groups", "evicted_groups", "share_bytes")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_GROUPS_FIELD_NUMBER: _ClassVar[int]
    EVICTED_GROUPS_FIELD_NUMBER: _ClassVar[int]
    SHARE_BYTES_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    bytes: int
    num_groups: int
    evicted_groups: int
    share_bytes: int
    def __init__(self, tenant: _Optional[str] = ..., bytes: _Optional[int] = ..., num_groups: _Optional[int] = ..., evicted_groups: _Optional[int] = ..., share_bytes: _Optional[int] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("capacity_bytes", "used_bytes", "num_objects", "num_groups", "num_complete_groups", "num_puts_in_flight", "num_leases", "evicted_groups", "evicted_bytes", "revoked_puts", "high_watermark", "low_watermark", "segments", "master_incarnation", "failed_groups", "adopted_objects", "rejected_records", "abandoned_groups", "tenants", "index_order")
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_OBJECTS_FIELD_NUMBER: _ClassVar[int]
    NUM_GROUPS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPLETE_GROUPS_FIELD_NUMBER: _ClassVar[int]
    NUM_PUTS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    NUM_LEASES_FIELD_NUMBER: _ClassVar[int]
    EVICTED_GROUPS_FIELD_NUMBER: _ClassVar[int]
    EVICTED_BYTES_FIELD_NUMBER: _ClassVar[int]
    REVOKED_PUTS_FIELD_NUMBER: _ClassVar[int]
    HIGH_WATERMARK_FIELD_NUMBER: _ClassVar[int]
    LOW_WATERMARK_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    MASTER_INCARNATION_FIELD_NUMBER: _ClassVar[int]
    FAILED_GROUPS_FIELD_NUMBER: _ClassVar[int]
    ADOPTED_OBJECTS_FIELD_NUMBER: _ClassVar[int]
    REJECTED_RECORDS_FIELD_NUMBER: _ClassVar[int]
    ABANDONED_GROUPS_FIELD_NUMBER: _ClassVar[int]
    TENANTS_FIELD_NUMBER: _ClassVar[int]
    INDEX_ORDER_FIELD_NUMBER: _ClassVar[int]
    capacity_bytes: int
    used_bytes: int
    num_objects: int
    num_groups: int
    num_complete_groups: int
    num_puts_in_flight: int
    num_leases: int
    evicted_groups: int
    evicted_bytes: int
    revoked_puts: int
    high_watermark: float
    low_watermark: float
    segments: _containers.RepeatedCompositeFieldContainer[SegmentStats]
    master_incarnation: str
    failed_groups: int
    adopted_objects: int
    rejected_records: int
    abandoned_groups: int
    tenants: _containers.RepeatedCompositeFieldContainer[TenantStats]
    index_order: str
    def __init__(self, capacity_bytes: _Optional[int] = ..., used_bytes: _Optional[int] = ..., num_objects: _Optional[int] = ..., num_groups: _Optional[int] = ..., num_complete_groups: _Optional[int] = ..., num_puts_in_flight: _Optional[int] = ..., num_leases: _Optional[int] = ..., evicted_groups: _Optional[int] = ..., evicted_bytes: _Optional[int] = ..., revoked_puts: _Optional[int] = ..., high_watermark: _Optional[float] = ..., low_watermark: _Optional[float] = ..., segments: _Optional[_Iterable[_Union[SegmentStats, _Mapping]]] = ..., master_incarnation: _Optional[str] = ..., failed_groups: _Optional[int] = ..., adopted_objects: _Optional[int] = ..., rejected_records: _Optional[int] = ..., abandoned_groups: _Optional[int] = ..., tenants: _Optional[_Iterable[_Union[TenantStats, _Mapping]]] = ..., index_order: _Optional[str] = ...) -> None: ...

class SessionRequest(_message.Message):
    __slots__ = ("call", "request_id", "traceparent", "sent", "detached", "lookup", "release_lease", "put_start", "put_end", "put_revoke", "rides")
    CALL_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    SENT_FIELD_NUMBER: _ClassVar[int]
    DETACHED_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_FIELD_NUMBER: _ClassVar[int]
    RELEASE_LEASE_FIELD_NUMBER: _ClassVar[int]
    PUT_START_FIELD_NUMBER: _ClassVar[int]
    PUT_END_FIELD_NUMBER: _ClassVar[int]
    PUT_REVOKE_FIELD_NUMBER: _ClassVar[int]
    RIDES_FIELD_NUMBER: _ClassVar[int]
    call: int
    request_id: str
    traceparent: str
    sent: float
    detached: bool
    lookup: LookupRequest
    release_lease: ReleaseLeaseRequest
    put_start: PutStartRequest
    put_end: PutEndRequest
    put_revoke: PutRevokeRequest
    rides: _containers.RepeatedCompositeFieldContainer[SessionRide]
    def __init__(self, call: _Optional[int] = ..., request_id: _Optional[str] = ..., traceparent: _Optional[str] = ..., sent: _Optional[float] = ..., detached: _Optional[bool] = ..., lookup: _Optional[_Union[LookupRequest, _Mapping]] = ..., release_lease: _Optional[_Union[ReleaseLeaseRequest, _Mapping]] = ..., put_start: _Optional[_Union[PutStartRequest, _Mapping]] = ..., put_end: _Optional[_Union[PutEndRequest, _Mapping]] = ..., put_revoke: _Optional[_Union[PutRevokeRequest, _Mapping]] = ..., rides: _Optional[_Iterable[_Union[SessionRide, _Mapping]]] = ...) -> None: ...

class SessionRide(_message.Message):
    __slots__ = ("request_id", "traceparent", "sent", "detached", "release_lease", "put_end")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    SENT_FIELD_NUMBER: _ClassVar[int]
    DETACHED_FIELD_NUMBER: _ClassVar[int]
    RELEASE_LEASE_FIELD_NUMBER: _ClassVar[int]
    PUT_END_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    traceparent: str
    sent: float
    detached: bool
    release_lease: ReleaseLeaseRequest
    put_end: PutEndRequest
    def __init__(self, request_id: _Optional[str] = ..., traceparent: _Optional[str] = ..., sent: _Optional[float] = ..., detached: _Optional[bool] = ..., release_lease: _Optional[_Union[ReleaseLeaseRequest, _Mapping]] = ..., put_end: _Optional[_Union[PutEndRequest, _Mapping]] = ...) -> None: ...

class RideFailure(_message.Message):
    __slots__ = ("index", "code", "message", "field")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    FIELD_FIELD_NUMBER: _ClassVar[int]
    index: int
    code: int
    message: str
    field: str
    def __init__(self, index: _Optional[int] = ..., code: _Optional[int] = ..., message: _Optional[str] = ..., field: _Optional[str] = ...) -> None: ...

class SessionResponse(_message.Message):
    __slots__ = ("call", "code", "message", "field", "lookup", "release_lease", "put_start", "put_end", "put_revoke", "rides_taken", "ride_failures")
    CALL_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    FIELD_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_FIELD_NUMBER: _ClassVar[int]
    RELEASE_LEASE_FIELD_NUMBER: _ClassVar[int]
    PUT_START_FIELD_NUMBER: _ClassVar[int]
    PUT_END_FIELD_NUMBER: _ClassVar[int]
    PUT_REVOKE_FIELD_NUMBER: _ClassVar[int]
    RIDES_TAKEN_FIELD_NUMBER: _ClassVar[int]
    RIDE_FAILURES_FIELD_NUMBER: _ClassVar[int]
    call: int
    code: int
    message: str
    field: str
    lookup: LookupResponse
    release_lease: ReleaseLeaseResponse
    put_start: PutStartResponse
    put_end: PutEndResponse
    put_revoke: PutRevokeResponse
    rides_taken: int
    ride_failures: _containers.RepeatedCompositeFieldContainer[RideFailure]
    def __init__(self, call: _Optional[int] = ..., code: _Optional[int] = ..., message: _Optional[str] = ..., field: _Optional[str] = ..., lookup: _Optional[_Union[LookupResponse, _Mapping]] = ..., release_lease: _Optional[_Union[ReleaseLeaseResponse, _Mapping]] = ..., put_start: _Optional[_Union[PutStartResponse, _Mapping]] = ..., put_end: _Optional[_Union[PutEndResponse, _Mapping]] = ..., put_revoke: _Optional[_Union[PutRevokeResponse, _Mapping]] = ..., rides_taken: _Optional[int] = ..., ride_failures: _Optional[_Iterable[_Union[RideFailure, _Mapping]]] = ...) -> None: ...
