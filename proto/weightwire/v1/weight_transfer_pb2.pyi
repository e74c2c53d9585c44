from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DeviceKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DEVICE_KIND_UNSPECIFIED: _ClassVar[DeviceKind]
    DEVICE_KIND_CUDA: _ClassVar[DeviceKind]
    DEVICE_KIND_HOST: _ClassVar[DeviceKind]

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    DTYPE_FLOAT32: _ClassVar[DType]
    DTYPE_FLOAT16: _ClassVar[DType]
    DTYPE_BFLOAT16: _ClassVar[DType]
    DTYPE_FLOAT64: _ClassVar[DType]
    DTYPE_INT8: _ClassVar[DType]
    DTYPE_UINT8: _ClassVar[DType]
    DTYPE_INT16: _ClassVar[DType]
    DTYPE_INT32: _ClassVar[DType]
    DTYPE_INT64: _ClassVar[DType]
    DTYPE_BOOL: _ClassVar[DType]
    DTYPE_FLOAT8_E4M3FN: _ClassVar[DType]
    DTYPE_FLOAT8_E5M2: _ClassVar[DType]

class DeltaEncoding(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DELTA_ENCODING_UNSPECIFIED: _ClassVar[DeltaEncoding]
    DELTA_ENCODING_INDICES: _ClassVar[DeltaEncoding]
    DELTA_ENCODING_BITMAP: _ClassVar[DeltaEncoding]
    DELTA_ENCODING_DENSE: _ClassVar[DeltaEncoding]

class UpdateEncoding(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    UPDATE_ENCODING_UNSPECIFIED: _ClassVar[UpdateEncoding]
    UPDATE_ENCODING_FULL: _ClassVar[UpdateEncoding]
    UPDATE_ENCODING_DELTA: _ClassVar[UpdateEncoding]

class DeltaFallback(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DELTA_FALLBACK_UNSPECIFIED: _ClassVar[DeltaFallback]
    DELTA_FALLBACK_NONE: _ClassVar[DeltaFallback]
    DELTA_FALLBACK_NO_BASE: _ClassVar[DeltaFallback]
    DELTA_FALLBACK_BASE_MISMATCH: _ClassVar[DeltaFallback]
    DELTA_FALLBACK_TRANSPORT: _ClassVar[DeltaFallback]
    DELTA_FALLBACK_NOT_SMALLER: _ClassVar[DeltaFallback]

class ChecksumAlgorithm(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CHECKSUM_ALGORITHM_UNSPECIFIED: _ClassVar[ChecksumAlgorithm]
    CHECKSUM_ALGORITHM_CRC32: _ClassVar[ChecksumAlgorithm]
    CHECKSUM_ALGORITHM_WEIGHTED_SUM64: _ClassVar[ChecksumAlgorithm]
    CHECKSUM_ALGORITHM_CRC32C: _ClassVar[ChecksumAlgorithm]

class UpdateScope(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    UPDATE_SCOPE_UNSPECIFIED: _ClassVar[UpdateScope]
    UPDATE_SCOPE_FULL: _ClassVar[UpdateScope]
    UPDATE_SCOPE_PARTIAL: _ClassVar[UpdateScope]

class TransportKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRANSPORT_KIND_UNSPECIFIED: _ClassVar[TransportKind]
    TRANSPORT_KIND_CUDA_IPC: _ClassVar[TransportKind]
    TRANSPORT_KIND_HOST_SHM: _ClassVar[TransportKind]
    TRANSPORT_KIND_INLINE: _ClassVar[TransportKind]
    TRANSPORT_KIND_TRANSFER_GROUP: _ClassVar[TransportKind]

class WorkerState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WORKER_STATE_UNSPECIFIED: _ClassVar[WorkerState]
    WORKER_STATE_CONSISTENT: _ClassVar[WorkerState]
    WORKER_STATE_UPDATING: _ClassVar[WorkerState]
    WORKER_STATE_INCONSISTENT: _ClassVar[WorkerState]

class TransferBackend(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRANSFER_BACKEND_UNSPECIFIED: _ClassVar[TransferBackend]
    TRANSFER_BACKEND_GLOO: _ClassVar[TransferBackend]
    TRANSFER_BACKEND_NCCL: _ClassVar[TransferBackend]

class TransferRole(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRANSFER_ROLE_UNSPECIFIED: _ClassVar[TransferRole]
    TRANSFER_ROLE_TRAINER: _ClassVar[TransferRole]
    TRANSFER_ROLE_WORKER: _ClassVar[TransferRole]

class TransferMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRANSFER_MODE_UNSPECIFIED: _ClassVar[TransferMode]
    TRANSFER_MODE_POINT_TO_POINT: _ClassVar[TransferMode]
    TRANSFER_MODE_BROADCAST: _ClassVar[TransferMode]
    TRANSFER_MODE_SLICES: _ClassVar[TransferMode]

class TransferGroupState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRANSFER_GROUP_STATE_UNSPECIFIED: _ClassVar[TransferGroupState]
    TRANSFER_GROUP_STATE_NONE: _ClassVar[TransferGroupState]
    TRANSFER_GROUP_STATE_FORMING: _ClassVar[TransferGroupState]
    TRANSFER_GROUP_STATE_READY: _ClassVar[TransferGroupState]

class ErrorReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ERROR_REASON_UNSPECIFIED: _ClassVar[ErrorReason]
    ERROR_REASON_MALFORMED_STREAM: _ClassVar[ErrorReason]
    ERROR_REASON_SCOPE_UNSPECIFIED: _ClassVar[ErrorReason]
    ERROR_REASON_INVALID_VERSION: _ClassVar[ErrorReason]
    ERROR_REASON_DTYPE_UNSPECIFIED: _ClassVar[ErrorReason]
    ERROR_REASON_DEVICE_KIND_UNSPECIFIED: _ClassVar[ErrorReason]
    ERROR_REASON_INVALID_SHAPE: _ClassVar[ErrorReason]
    ERROR_REASON_INVALID_OFFSET: _ClassVar[ErrorReason]
    ERROR_REASON_INVALID_SIZE: _ClassVar[ErrorReason]
    ERROR_REASON_TENSOR_OUT_OF_BOUNDS: _ClassVar[ErrorReason]
    ERROR_REASON_PAYLOAD_COUNT_MISMATCH: _ClassVar[ErrorReason]
    ERROR_REASON_PAYLOAD_LABEL_MISSING: _ClassVar[ErrorReason]
    ERROR_REASON_DUPLICATE_PAYLOAD_LABEL: _ClassVar[ErrorReason]
    ERROR_REASON_HANDLE_MISSING: _ClassVar[ErrorReason]
    ERROR_REASON_INVALID_SHM_NAME: _ClassVar[ErrorReason]
    ERROR_REASON_DUPLICATE_TENSOR: _ClassVar[ErrorReason]
    ERROR_REASON_DUPLICATE_BUCKET: _ClassVar[ErrorReason]
    ERROR_REASON_INVALID_CHECKSUM: _ClassVar[ErrorReason]
    ERROR_REASON_INVALID_GROUP_SPEC: _ClassVar[ErrorReason]
    ERROR_REASON_INVALID_DELTA: _ClassVar[ErrorReason]
    ERROR_REASON_NO_PAYLOAD_FOR_DEVICE: _ClassVar[ErrorReason]
    ERROR_REASON_PEER_DEVICE_UNAVAILABLE: _ClassVar[ErrorReason]
    ERROR_REASON_SHAPE_MISMATCH: _ClassVar[ErrorReason]
    ERROR_REASON_DTYPE_MISMATCH: _ClassVar[ErrorReason]
    ERROR_REASON_STALE_VERSION: _ClassVar[ErrorReason]
    ERROR_REASON_MANIFEST_CHANGED: _ClassVar[ErrorReason]
    ERROR_REASON_INCOMPLETE_UPDATE: _ClassVar[ErrorReason]
    ERROR_REASON_BUCKET_COUNT_MISMATCH: _ClassVar[ErrorReason]
    ERROR_REASON_TRANSPORT_UNAVAILABLE: _ClassVar[ErrorReason]
    ERROR_REASON_HANDLE_OPEN_FAILED: _ClassVar[ErrorReason]
    ERROR_REASON_ENGINE_NOT_PAUSED: _ClassVar[ErrorReason]
    ERROR_REASON_GROUP_UNKNOWN_MEMBER: _ClassVar[ErrorReason]
    ERROR_REASON_GROUP_DUPLICATE_RANK: _ClassVar[ErrorReason]
    ERROR_REASON_GROUP_WRONG_WORLD_SIZE: _ClassVar[ErrorReason]
    ERROR_REASON_GROUP_PLAN_MISMATCH: _ClassVar[ErrorReason]
    ERROR_REASON_GROUP_NOT_JOINED: _ClassVar[ErrorReason]
    ERROR_REASON_DELTA_BASE_MISMATCH: _ClassVar[ErrorReason]
    ERROR_REASON_ENGINE_ASLEEP: _ClassVar[ErrorReason]
    ERROR_REASON_LAYOUT_UNKNOWN: _ClassVar[ErrorReason]
    ERROR_REASON_STORAGE_SET_UNKNOWN: _ClassVar[ErrorReason]
    ERROR_REASON_UPDATE_IN_PROGRESS: _ClassVar[ErrorReason]
    ERROR_REASON_CHECKSUM_MISMATCH: _ClassVar[ErrorReason]
    ERROR_REASON_MESSAGE_TRUNCATED: _ClassVar[ErrorReason]
    ERROR_REASON_DELTA_RESULT_MISMATCH: _ClassVar[ErrorReason]
    ERROR_REASON_MESSAGE_TOO_LONG: _ClassVar[ErrorReason]
    ERROR_REASON_LOAD_FAILED: _ClassVar[ErrorReason]
    ERROR_REASON_INTERNAL: _ClassVar[ErrorReason]
    ERROR_REASON_MISSING_TOKEN: _ClassVar[ErrorReason]
    ERROR_REASON_INVALID_TOKEN: _ClassVar[ErrorReason]
    ERROR_REASON_GROUP_STORE_UNREACHABLE: _ClassVar[ErrorReason]
    ERROR_REASON_TRANSFER_FAILED: _ClassVar[ErrorReason]
    ERROR_REASON_GROUP_TIMEOUT: _ClassVar[ErrorReason]
    ERROR_REASON_UNKNOWN_TENSOR: _ClassVar[ErrorReason]
    ERROR_REASON_BUFFER_NOT_CONTIGUOUS: _ClassVar[ErrorReason]
    ERROR_REASON_SHARDED_BUFFER: _ClassVar[ErrorReason]
    ERROR_REASON_CANCELLED: _ClassVar[ErrorReason]
    ERROR_REASON_DEADLINE_EXCEEDED: _ClassVar[ErrorReason]
    ERROR_REASON_UNAVAILABLE: _ClassVar[ErrorReason]
    ERROR_REASON_RPC_FAILED: _ClassVar[ErrorReason]
    ERROR_REASON_TRAINER_RANKS_DISAGREE: _ClassVar[ErrorReason]
    ERROR_REASON_TRAINER_RANK_FAILED: _ClassVar[ErrorReason]
    ERROR_REASON_TRAINER_RANK_LOST: _ClassVar[ErrorReason]
DEVICE_KIND_UNSPECIFIED: DeviceKind
DEVICE_KIND_CUDA: DeviceKind
DEVICE_KIND_HOST: DeviceKind
DTYPE_UNSPECIFIED: DType
DTYPE_FLOAT32: DType
DTYPE_FLOAT16: DType
DTYPE_BFLOAT16: DType
DTYPE_FLOAT64: DType
DTYPE_INT8: DType
DTYPE_UINT8: DType
DTYPE_INT16: DType
DTYPE_INT32: DType
DTYPE_INT64: DType
DTYPE_BOOL: DType
DTYPE_FLOAT8_E4M3FN: DType
DTYPE_FLOAT8_E5M2: DType
DELTA_ENCODING_UNSPECIFIED: DeltaEncoding
DELTA_ENCODING_INDICES: DeltaEncoding
DELTA_ENCODING_BITMAP: DeltaEncoding
DELTA_ENCODING_DENSE: DeltaEncoding
UPDATE_ENCODING_UNSPECIFIED: UpdateEncoding
UPDATE_ENCODING_FULL: UpdateEncoding
UPDATE_ENCODING_DELTA: UpdateEncoding
DELTA_FALLBACK_UNSPECIFIED: DeltaFallback
DELTA_FALLBACK_NONE: DeltaFallback
DELTA_FALLBACK_NO_BASE: DeltaFallback
DELTA_FALLBACK_BASE_MISMATCH: DeltaFallback
DELTA_FALLBACK_TRANSPORT: DeltaFallback
DELTA_FALLBACK_NOT_SMALLER: DeltaFallback
CHECKSUM_ALGORITHM_UNSPECIFIED: ChecksumAlgorithm
CHECKSUM_ALGORITHM_CRC32: ChecksumAlgorithm
CHECKSUM_ALGORITHM_WEIGHTED_SUM64: ChecksumAlgorithm
CHECKSUM_ALGORITHM_CRC32C: ChecksumAlgorithm
UPDATE_SCOPE_UNSPECIFIED: UpdateScope
UPDATE_SCOPE_FULL: UpdateScope
UPDATE_SCOPE_PARTIAL: UpdateScope
TRANSPORT_KIND_UNSPECIFIED: TransportKind
TRANSPORT_KIND_CUDA_IPC: TransportKind
TRANSPORT_KIND_HOST_SHM: TransportKind
TRANSPORT_KIND_INLINE: TransportKind
TRANSPORT_KIND_TRANSFER_GROUP: TransportKind
WORKER_STATE_UNSPECIFIED: WorkerState
WORKER_STATE_CONSISTENT: WorkerState
WORKER_STATE_UPDATING: WorkerState
WORKER_STATE_INCONSISTENT: WorkerState
TRANSFER_BACKEND_UNSPECIFIED: TransferBackend
TRANSFER_BACKEND_GLOO: TransferBackend
TRANSFER_BACKEND_NCCL: TransferBackend
TRANSFER_ROLE_UNSPECIFIED: TransferRole
TRANSFER_ROLE_TRAINER: TransferRole
TRANSFER_ROLE_WORKER: TransferRole
TRANSFER_MODE_UNSPECIFIED: TransferMode
TRANSFER_MODE_POINT_TO_POINT: TransferMode
TRANSFER_MODE_BROADCAST: TransferMode
TRANSFER_MODE_SLICES: TransferMode
TRANSFER_GROUP_STATE_UNSPECIFIED: TransferGroupState
TRANSFER_GROUP_STATE_NONE: TransferGroupState
TRANSFER_GROUP_STATE_FORMING: TransferGroupState
TRANSFER_GROUP_STATE_READY: TransferGroupState
ERROR_REASON_UNSPECIFIED: ErrorReason
ERROR_REASON_MALFORMED_STREAM: ErrorReason
ERROR_REASON_SCOPE_UNSPECIFIED: ErrorReason
ERROR_REASON_INVALID_VERSION: ErrorReason
ERROR_REASON_DTYPE_UNSPECIFIED: ErrorReason
ERROR_REASON_DEVICE_KIND_UNSPECIFIED: ErrorReason
ERROR_REASON_INVALID_SHAPE: ErrorReason
ERROR_REASON_INVALID_OFFSET: ErrorReason
ERROR_REASON_INVALID_SIZE: ErrorReason
ERROR_REASON_TENSOR_OUT_OF_BOUNDS: ErrorReason
ERROR_REASON_PAYLOAD_COUNT_MISMATCH: ErrorReason
ERROR_REASON_PAYLOAD_LABEL_MISSING: ErrorReason
ERROR_REASON_DUPLICATE_PAYLOAD_LABEL: ErrorReason
ERROR_REASON_HANDLE_MISSING: ErrorReason
ERROR_REASON_INVALID_SHM_NAME: ErrorReason
ERROR_REASON_DUPLICATE_TENSOR: ErrorReason
ERROR_REASON_DUPLICATE_BUCKET: ErrorReason
ERROR_REASON_INVALID_CHECKSUM: ErrorReason
ERROR_REASON_INVALID_GROUP_SPEC: ErrorReason
ERROR_REASON_INVALID_DELTA: ErrorReason
ERROR_REASON_NO_PAYLOAD_FOR_DEVICE: ErrorReason
ERROR_REASON_PEER_DEVICE_UNAVAILABLE: ErrorReason
ERROR_REASON_SHAPE_MISMATCH: ErrorReason
ERROR_REASON_DTYPE_MISMATCH: ErrorReason
ERROR_REASON_STALE_VERSION: ErrorReason
ERROR_REASON_MANIFEST_CHANGED: ErrorReason
ERROR_REASON_INCOMPLETE_UPDATE: ErrorReason
ERROR_REASON_BUCKET_COUNT_MISMATCH: ErrorReason
ERROR_REASON_TRANSPORT_UNAVAILABLE: ErrorReason
ERROR_REASON_HANDLE_OPEN_FAILED: ErrorReason
ERROR_REASON_ENGINE_NOT_PAUSED: ErrorReason
ERROR_REASON_GROUP_UNKNOWN_MEMBER: ErrorReason
ERROR_REASON_GROUP_DUPLICATE_RANK: ErrorReason
ERROR_REASON_GROUP_WRONG_WORLD_SIZE: ErrorReason
ERROR_REASON_GROUP_PLAN_MISMATCH: ErrorReason
ERROR_REASON_GROUP_NOT_JOINED: ErrorReason
ERROR_REASON_DELTA_BASE_MISMATCH: ErrorReason
ERROR_REASON_ENGINE_ASLEEP: ErrorReason
ERROR_REASON_LAYOUT_UNKNOWN: ErrorReason
ERROR_REASON_STORAGE_SET_UNKNOWN: ErrorReason
ERROR_REASON_UPDATE_IN_PROGRESS: ErrorReason
ERROR_REASON_CHECKSUM_MISMATCH: ErrorReason
ERROR_REASON_MESSAGE_TRUNCATED: ErrorReason
ERROR_REASON_DELTA_RESULT_MISMATCH: ErrorReason
ERROR_REASON_MESSAGE_TOO_LONG: ErrorReason
ERROR_REASON_LOAD_FAILED: ErrorReason
ERROR_REASON_INTERNAL: ErrorReason
ERROR_REASON_MISSING_TOKEN: ErrorReason
ERROR_REASON_INVALID_TOKEN: ErrorReason
ERROR_REASON_GROUP_STORE_UNREACHABLE: ErrorReason
ERROR_REASON_TRANSFER_FAILED: ErrorReason
ERROR_REASON_GROUP_TIMEOUT: ErrorReason
ERROR_REASON_UNKNOWN_TENSOR: ErrorReason
ERROR_REASON_BUFFER_NOT_CONTIGUOUS: ErrorReason
ERROR_REASON_SHARDED_BUFFER: ErrorReason
ERROR_REASON_CANCELLED: ErrorReason
ERROR_REASON_DEADLINE_EXCEEDED: ErrorReason
ERROR_REASON_UNAVAILABLE: ErrorReason
ERROR_REASON_RPC_FAILED: ErrorReason
ERROR_REASON_TRAINER_RANKS_DISAGREE: ErrorReason
ERROR_REASON_TRAINER_RANK_FAILED: ErrorReason
ERROR_REASON_TRAINER_RANK_LOST: ErrorReason

class DeviceId(_message.Message):
    __slots__ = ("kind", "uuid")
    KIND_FIELD_NUMBER: _ClassVar[int]
    UUID_FIELD_NUMBER: _ClassVar[int]
    kind: DeviceKind
    uuid: str
    def __init__(self, kind: _Optional[_Union[DeviceKind, str]] = ..., uuid: _Optional[str] = ...) -> None: ...

class TensorSpec(_message.Message):
    __slots__ = ("name", "dtype", "shape", "offset_bytes", "delta")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    offset_bytes: int
    delta: TensorDelta
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., offset_bytes: _Optional[int] = ..., delta: _Optional[_Union[TensorDelta, _Mapping]] = ...) -> None: ...

class TensorDelta(_message.Message):
    __slots__ = ("encoding", "changed_count", "index_dtype", "values_offset_bytes", "result_checksums")
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    CHANGED_COUNT_FIELD_NUMBER: _ClassVar[int]
    INDEX_DTYPE_FIELD_NUMBER: _ClassVar[int]
    VALUES_OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    RESULT_CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    encoding: DeltaEncoding
    changed_count: int
    index_dtype: DType
    values_offset_bytes: int
    result_checksums: _containers.RepeatedCompositeFieldContainer[DeltaChecksum]
    def __init__(self, encoding: _Optional[_Union[DeltaEncoding, str]] = ..., changed_count: _Optional[int] = ..., index_dtype: _Optional[_Union[DType, str]] = ..., values_offset_bytes: _Optional[int] = ..., result_checksums: _Optional[_Iterable[_Union[DeltaChecksum, _Mapping]]] = ...) -> None: ...

class DeltaChecksum(_message.Message):
    __slots__ = ("piece", "checksum")
    PIECE_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    piece: TensorPiece
    checksum: Checksum
    def __init__(self, piece: _Optional[_Union[TensorPiece, _Mapping]] = ..., checksum: _Optional[_Union[Checksum, _Mapping]] = ...) -> None: ...

class DeltaBase(_message.Message):
    __slots__ = ("base_version",)
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    base_version: int
    def __init__(self, base_version: _Optional[int] = ...) -> None: ...

class CudaIpcHandle(_message.Message):
    __slots__ = ("memory_handle", "storage_offset_bytes", "storage_size_bytes", "ref_counter_handle", "ref_counter_offset", "event_handle", "event_sync_required", "storages", "storages_complete", "storage_set_id")
    MEMORY_HANDLE_FIELD_NUMBER: _ClassVar[int]
    STORAGE_OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    STORAGE_SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_HANDLE_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_OFFSET_FIELD_NUMBER: _ClassVar[int]
    EVENT_HANDLE_FIELD_NUMBER: _ClassVar[int]
    EVENT_SYNC_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    STORAGES_FIELD_NUMBER: _ClassVar[int]
    STORAGES_COMPLETE_FIELD_NUMBER: _ClassVar[int]
    STORAGE_SET_ID_FIELD_NUMBER: _ClassVar[int]
    memory_handle: bytes
    storage_offset_bytes: int
    storage_size_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    storages: _containers.RepeatedCompositeFieldContainer[CudaIpcStorage]
    storages_complete: bool
    storage_set_id: bytes
    def __init__(self, memory_handle: _Optional[bytes] = ..., storage_offset_bytes: _Optional[int] = ..., storage_size_bytes: _Optional[int] = ..., ref_counter_handle: _Optional[bytes] = ..., ref_counter_offset: _Optional[int] = ..., event_handle: _Optional[bytes] = ..., event_sync_required: bool = ..., storages: _Optional[_Iterable[_Union[CudaIpcStorage, _Mapping]]] = ..., storages_complete: bool = ..., storage_set_id: _Optional[bytes] = ...) -> None: ...

class CudaIpcStorage(_message.Message):
    __slots__ = ("memory_handle", "storage_offset_bytes", "storage_size_bytes", "ref_counter_handle", "ref_counter_offset", "payload_offset_bytes")
    MEMORY_HANDLE_FIELD_NUMBER: _ClassVar[int]
    STORAGE_OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    STORAGE_SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_HANDLE_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_OFFSET_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    memory_handle: bytes
    storage_offset_bytes: int
    storage_size_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    payload_offset_bytes: int
    def __init__(self, memory_handle: _Optional[bytes] = ..., storage_offset_bytes: _Optional[int] = ..., storage_size_bytes: _Optional[int] = ..., ref_counter_handle: _Optional[bytes] = ..., ref_counter_offset: _Optional[int] = ..., payload_offset_bytes: _Optional[int] = ...) -> None: ...

class HostShmHandle(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class Payload(_message.Message):
    __slots__ = ("device", "size_bytes", "cuda_ipc", "host_shm", "inline_data", "transfer_group")
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    CUDA_IPC_FIELD_NUMBER: _ClassVar[int]
    HOST_SHM_FIELD_NUMBER: _ClassVar[int]
    INLINE_DATA_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_GROUP_FIELD_NUMBER: _ClassVar[int]
    device: DeviceId
    size_bytes: int
    cuda_ipc: CudaIpcHandle
    host_shm: HostShmHandle
    inline_data: bytes
    transfer_group: TransferGroupHandle
    def __init__(self, device: _Optional[_Union[DeviceId, _Mapping]] = ..., size_bytes: _Optional[int] = ..., cuda_ipc: _Optional[_Union[CudaIpcHandle, _Mapping]] = ..., host_shm: _Optional[_Union[HostShmHandle, _Mapping]] = ..., inline_data: _Optional[bytes] = ..., transfer_group: _Optional[_Union[TransferGroupHandle, _Mapping]] = ...) -> None: ...

class Checksum(_message.Message):
    __slots__ = ("algorithm", "value")
    ALGORITHM_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    algorithm: ChecksumAlgorithm
    value: int
    def __init__(self, algorithm: _Optional[_Union[ChecksumAlgorithm, str]] = ..., value: _Optional[int] = ...) -> None: ...

class Bucket(_message.Message):
    __slots__ = ("index", "tensors", "payloads", "checksum", "layout_id")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    PAYLOADS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_ID_FIELD_NUMBER: _ClassVar[int]
    index: int
    tensors: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    payloads: _containers.RepeatedCompositeFieldContainer[Payload]
    checksum: Checksum
    layout_id: bytes
    def __init__(self, index: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., payloads: _Optional[_Iterable[_Union[Payload, _Mapping]]] = ..., checksum: _Optional[_Union[Checksum, _Mapping]] = ..., layout_id: _Optional[bytes] = ...) -> None: ...

class UpdateHeader(_message.Message):
    __slots__ = ("version", "scope", "manifest_fingerprint", "verify_checksums", "allow_peer_device_import", "update_id", "delta_base", "delta_fallback")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    VERIFY_CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    ALLOW_PEER_DEVICE_IMPORT_FIELD_NUMBER: _ClassVar[int]
    UPDATE_ID_FIELD_NUMBER: _ClassVar[int]
    DELTA_BASE_FIELD_NUMBER: _ClassVar[int]
    DELTA_FALLBACK_FIELD_NUMBER: _ClassVar[int]
    version: int
    scope: UpdateScope
    manifest_fingerprint: str
    verify_checksums: bool
    allow_peer_device_import: bool
    update_id: str
    delta_base: DeltaBase
    delta_fallback: DeltaFallback
    def __init__(self, version: _Optional[int] = ..., scope: _Optional[_Union[UpdateScope, str]] = ..., manifest_fingerprint: _Optional[str] = ..., verify_checksums: bool = ..., allow_peer_device_import: bool = ..., update_id: _Optional[str] = ..., delta_base: _Optional[_Union[DeltaBase, _Mapping]] = ..., delta_fallback: _Optional[_Union[DeltaFallback, str]] = ...) -> None: ...

class UpdateCommit(_message.Message):
    __slots__ = ("bucket_count",)
    BUCKET_COUNT_FIELD_NUMBER: _ClassVar[int]
    bucket_count: int
    def __init__(self, bucket_count: _Optional[int] = ...) -> None: ...

class PushWeightsRequest(_message.Message):
    __slots__ = ("header", "bucket", "commit")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    BUCKET_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    header: UpdateHeader
    bucket: Bucket
    commit: UpdateCommit
    def __init__(self, header: _Optional[_Union[UpdateHeader, _Mapping]] = ..., bucket: _Optional[_Union[Bucket, _Mapping]] = ..., commit: _Optional[_Union[UpdateCommit, _Mapping]] = ...) -> None: ...

class BucketAck(_message.Message):
    __slots__ = ("index", "tensors_loaded", "tensors_skipped", "bytes_loaded", "source_device", "transport", "peer_device_import", "handle_opened", "open_duration_ns", "load_duration_ns", "bytes_received", "layout_kept", "storage_set_kept")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TENSORS_LOADED_FIELD_NUMBER: _ClassVar[int]
    TENSORS_SKIPPED_FIELD_NUMBER: _ClassVar[int]
    BYTES_LOADED_FIELD_NUMBER: _ClassVar[int]
    SOURCE_DEVICE_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    PEER_DEVICE_IMPORT_FIELD_NUMBER: _ClassVar[int]
    HANDLE_OPENED_FIELD_NUMBER: _ClassVar[int]
    OPEN_DURATION_NS_FIELD_NUMBER: _ClassVar[int]
    LOAD_DURATION_NS_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_KEPT_FIELD_NUMBER: _ClassVar[int]
    STORAGE_SET_KEPT_FIELD_NUMBER: _ClassVar[int]
    index: int
    tensors_loaded: int
    tensors_skipped: int
    bytes_loaded: int
    source_device: DeviceId
    transport: TransportKind
    peer_device_import: bool
    handle_opened: bool
    open_duration_ns: int
    load_duration_ns: int
    bytes_received: int
    layout_kept: bool
    storage_set_kept: bytes
    def __init__(self, index: _Optional[int] = ..., tensors_loaded: _Optional[int] = ..., tensors_skipped: _Optional[int] = ..., bytes_loaded: _Optional[int] = ..., source_device: _Optional[_Union[DeviceId, _Mapping]] = ..., transport: _Optional[_Union[TransportKind, str]] = ..., peer_device_import: bool = ..., handle_opened: bool = ..., open_duration_ns: _Optional[int] = ..., load_duration_ns: _Optional[int] = ..., bytes_received: _Optional[int] = ..., layout_kept: bool = ..., storage_set_kept: _Optional[bytes] = ...) -> None: ...

class UpdateResult(_message.Message):
    __slots__ = ("version", "previous_version", "scope", "bucket_count", "tensors_loaded", "bytes_loaded", "handles_opened", "duration_ns", "state", "update_id", "finish_time", "bytes_received", "encoding", "base_version", "delta_fallback", "delta_tensors", "changed_elements", "result_checksums_verified")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_VERSION_FIELD_NUMBER: _ClassVar[int]
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    BUCKET_COUNT_FIELD_NUMBER: _ClassVar[int]
    TENSORS_LOADED_FIELD_NUMBER: _ClassVar[int]
    BYTES_LOADED_FIELD_NUMBER: _ClassVar[int]
    HANDLES_OPENED_FIELD_NUMBER: _ClassVar[int]
    DURATION_NS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    UPDATE_ID_FIELD_NUMBER: _ClassVar[int]
    FINISH_TIME_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    DELTA_FALLBACK_FIELD_NUMBER: _ClassVar[int]
    DELTA_TENSORS_FIELD_NUMBER: _ClassVar[int]
    CHANGED_ELEMENTS_FIELD_NUMBER: _ClassVar[int]
    RESULT_CHECKSUMS_VERIFIED_FIELD_NUMBER: _ClassVar[int]
    version: int
    previous_version: int
    scope: UpdateScope
    bucket_count: int
    tensors_loaded: int
    bytes_loaded: int
    handles_opened: int
    duration_ns: int
    state: WorkerState
    update_id: str
    finish_time: _timestamp_pb2.Timestamp
    bytes_received: int
    encoding: UpdateEncoding
    base_version: int
    delta_fallback: DeltaFallback
    delta_tensors: int
    changed_elements: int
    result_checksums_verified: int
    def __init__(self, version: _Optional[int] = ..., previous_version: _Optional[int] = ..., scope: _Optional[_Union[UpdateScope, str]] = ..., bucket_count: _Optional[int] = ..., tensors_loaded: _Optional[int] = ..., bytes_loaded: _Optional[int] = ..., handles_opened: _Optional[int] = ..., duration_ns: _Optional[int] = ..., state: _Optional[_Union[WorkerState, str]] = ..., update_id: _Optional[str] = ..., finish_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., bytes_received: _Optional[int] = ..., encoding: _Optional[_Union[UpdateEncoding, str]] = ..., base_version: _Optional[int] = ..., delta_fallback: _Optional[_Union[DeltaFallback, str]] = ..., delta_tensors: _Optional[int] = ..., changed_elements: _Optional[int] = ..., result_checksums_verified: _Optional[int] = ...) -> None: ...

class PushWeightsResponse(_message.Message):
    __slots__ = ("ack", "result")
    ACK_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    ack: BucketAck
    result: UpdateResult
    def __init__(self, ack: _Optional[_Union[BucketAck, _Mapping]] = ..., result: _Optional[_Union[UpdateResult, _Mapping]] = ...) -> None: ...

class PushUpdateRequest(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[PushWeightsRequest]
    def __init__(self, messages: _Optional[_Iterable[_Union[PushWeightsRequest, _Mapping]]] = ...) -> None: ...

class PushUpdateResponse(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[PushWeightsResponse]
    def __init__(self, messages: _Optional[_Iterable[_Union[PushWeightsResponse, _Mapping]]] = ...) -> None: ...

class ParallelRank(_message.Message):
    __slots__ = ("tp_rank", "tp_size", "pp_rank", "pp_size", "dp_rank", "dp_size", "sp_rank", "sp_size")
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    PP_RANK_FIELD_NUMBER: _ClassVar[int]
    PP_SIZE_FIELD_NUMBER: _ClassVar[int]
    DP_RANK_FIELD_NUMBER: _ClassVar[int]
    DP_SIZE_FIELD_NUMBER: _ClassVar[int]
    SP_RANK_FIELD_NUMBER: _ClassVar[int]
    SP_SIZE_FIELD_NUMBER: _ClassVar[int]
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    dp_rank: int
    dp_size: int
    sp_rank: int
    sp_size: int
    def __init__(self, tp_rank: _Optional[int] = ..., tp_size: _Optional[int] = ..., pp_rank: _Optional[int] = ..., pp_size: _Optional[int] = ..., dp_rank: _Optional[int] = ..., dp_size: _Optional[int] = ..., sp_rank: _Optional[int] = ..., sp_size: _Optional[int] = ...) -> None: ...

class OwnedTensor(_message.Message):
    __slots__ = ("name", "dtype", "shape", "pieces")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    PIECES_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    pieces: _containers.RepeatedCompositeFieldContainer[TensorPiece]
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., pieces: _Optional[_Iterable[_Union[TensorPiece, _Mapping]]] = ...) -> None: ...

class TensorPiece(_message.Message):
    __slots__ = ("dim", "offset", "length")
    DIM_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    dim: int
    offset: int
    length: int
    def __init__(self, dim: _Optional[int] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ...) -> None: ...

class LayerRange(_message.Message):
    __slots__ = ("start_layer", "end_layer", "num_layers")
    START_LAYER_FIELD_NUMBER: _ClassVar[int]
    END_LAYER_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    start_layer: int
    end_layer: int
    num_layers: int
    def __init__(self, start_layer: _Optional[int] = ..., end_layer: _Optional[int] = ..., num_layers: _Optional[int] = ...) -> None: ...

class ShardManifest(_message.Message):
    __slots__ = ("device", "rank", "tensors", "layer_range", "fingerprint", "engine", "worker_id", "transports", "instance_id", "waits_for_cuda_ipc_events", "imports_cuda_ipc_storages", "receives_slices", "delta_checksum_algorithms")
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    LAYER_RANGE_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSPORTS_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    WAITS_FOR_CUDA_IPC_EVENTS_FIELD_NUMBER: _ClassVar[int]
    IMPORTS_CUDA_IPC_STORAGES_FIELD_NUMBER: _ClassVar[int]
    RECEIVES_SLICES_FIELD_NUMBER: _ClassVar[int]
    DELTA_CHECKSUM_ALGORITHMS_FIELD_NUMBER: _ClassVar[int]
    device: DeviceId
    rank: ParallelRank
    tensors: _containers.RepeatedCompositeFieldContainer[OwnedTensor]
    layer_range: LayerRange
    fingerprint: str
    engine: str
    worker_id: str
    transports: _containers.RepeatedScalarFieldContainer[TransportKind]
    instance_id: str
    waits_for_cuda_ipc_events: bool
    imports_cuda_ipc_storages: bool
    receives_slices: bool
    delta_checksum_algorithms: _containers.RepeatedScalarFieldContainer[ChecksumAlgorithm]
    def __init__(self, device: _Optional[_Union[DeviceId, _Mapping]] = ..., rank: _Optional[_Union[ParallelRank, _Mapping]] = ..., tensors: _Optional[_Iterable[_Union[OwnedTensor, _Mapping]]] = ..., layer_range: _Optional[_Union[LayerRange, _Mapping]] = ..., fingerprint: _Optional[str] = ..., engine: _Optional[str] = ..., worker_id: _Optional[str] = ..., transports: _Optional[_Iterable[_Union[TransportKind, str]]] = ..., instance_id: _Optional[str] = ..., waits_for_cuda_ipc_events: bool = ..., imports_cuda_ipc_storages: bool = ..., receives_slices: bool = ..., delta_checksum_algorithms: _Optional[_Iterable[_Union[ChecksumAlgorithm, str]]] = ...) -> None: ...

class GetManifestRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetManifestResponse(_message.Message):
    __slots__ = ("manifest",)
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    manifest: ShardManifest
    def __init__(self, manifest: _Optional[_Union[ShardManifest, _Mapping]] = ...) -> None: ...

class ErrorDetail(_message.Message):
    __slots__ = ("code", "reason", "message", "time", "version")
    CODE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    code: str
    reason: str
    message: str
    time: _timestamp_pb2.Timestamp
    version: int
    def __init__(self, code: _Optional[str] = ..., reason: _Optional[str] = ..., message: _Optional[str] = ..., time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., version: _Optional[int] = ...) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetStatusResponse(_message.Message):
    __slots__ = ("weights_version", "state", "last_result", "last_error", "device", "rank", "manifest_fingerprint", "worker_id", "updates_succeeded", "updates_failed", "open_mappings", "instance_id", "transfer_group")
    WEIGHTS_VERSION_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    LAST_RESULT_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    UPDATES_SUCCEEDED_FIELD_NUMBER: _ClassVar[int]
    UPDATES_FAILED_FIELD_NUMBER: _ClassVar[int]
    OPEN_MAPPINGS_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_GROUP_FIELD_NUMBER: _ClassVar[int]
    weights_version: int
    state: WorkerState
    last_result: UpdateResult
    last_error: ErrorDetail
    device: DeviceId
    rank: ParallelRank
    manifest_fingerprint: str
    worker_id: str
    updates_succeeded: int
    updates_failed: int
    open_mappings: int
    instance_id: str
    transfer_group: TransferGroupStatus
    def __init__(self, weights_version: _Optional[int] = ..., state: _Optional[_Union[WorkerState, str]] = ..., last_result: _Optional[_Union[UpdateResult, _Mapping]] = ..., last_error: _Optional[_Union[ErrorDetail, _Mapping]] = ..., device: _Optional[_Union[DeviceId, _Mapping]] = ..., rank: _Optional[_Union[ParallelRank, _Mapping]] = ..., manifest_fingerprint: _Optional[str] = ..., worker_id: _Optional[str] = ..., updates_succeeded: _Optional[int] = ..., updates_failed: _Optional[int] = ..., open_mappings: _Optional[int] = ..., instance_id: _Optional[str] = ..., transfer_group: _Optional[_Union[TransferGroupStatus, _Mapping]] = ...) -> None: ...

class TransferGroupMember(_message.Message):
    __slots__ = ("group_rank", "role", "worker_id", "rank", "instance_id", "trainer_rank")
    GROUP_RANK_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    TRAINER_RANK_FIELD_NUMBER: _ClassVar[int]
    group_rank: int
    role: TransferRole
    worker_id: str
    rank: ParallelRank
    instance_id: str
    trainer_rank: int
    def __init__(self, group_rank: _Optional[int] = ..., role: _Optional[_Union[TransferRole, str]] = ..., worker_id: _Optional[str] = ..., rank: _Optional[_Union[ParallelRank, _Mapping]] = ..., instance_id: _Optional[str] = ..., trainer_rank: _Optional[int] = ...) -> None: ...

class TransferSubgroup(_message.Message):
    __slots__ = ("subgroup_id", "member_ranks", "root_rank")
    SUBGROUP_ID_FIELD_NUMBER: _ClassVar[int]
    MEMBER_RANKS_FIELD_NUMBER: _ClassVar[int]
    ROOT_RANK_FIELD_NUMBER: _ClassVar[int]
    subgroup_id: int
    member_ranks: _containers.RepeatedScalarFieldContainer[int]
    root_rank: int
    def __init__(self, subgroup_id: _Optional[int] = ..., member_ranks: _Optional[_Iterable[int]] = ..., root_rank: _Optional[int] = ...) -> None: ...

class TransferGroupSpec(_message.Message):
    __slots__ = ("group_id", "backend", "store_address", "world_size", "members", "subgroups", "timeout_ms", "max_bucket_bytes")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    STORE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    SUBGROUPS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    MAX_BUCKET_BYTES_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    backend: TransferBackend
    store_address: str
    world_size: int
    members: _containers.RepeatedCompositeFieldContainer[TransferGroupMember]
    subgroups: _containers.RepeatedCompositeFieldContainer[TransferSubgroup]
    timeout_ms: int
    max_bucket_bytes: int
    def __init__(self, group_id: _Optional[str] = ..., backend: _Optional[_Union[TransferBackend, str]] = ..., store_address: _Optional[str] = ..., world_size: _Optional[int] = ..., members: _Optional[_Iterable[_Union[TransferGroupMember, _Mapping]]] = ..., subgroups: _Optional[_Iterable[_Union[TransferSubgroup, _Mapping]]] = ..., timeout_ms: _Optional[int] = ..., max_bucket_bytes: _Optional[int] = ...) -> None: ...

class JoinTransferGroupRequest(_message.Message):
    __slots__ = ("spec",)
    SPEC_FIELD_NUMBER: _ClassVar[int]
    spec: TransferGroupSpec
    def __init__(self, spec: _Optional[_Union[TransferGroupSpec, _Mapping]] = ...) -> None: ...

class JoinTransferGroupResponse(_message.Message):
    __slots__ = ("group_rank", "group")
    GROUP_RANK_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    group_rank: int
    group: TransferGroupStatus
    def __init__(self, group_rank: _Optional[int] = ..., group: _Optional[_Union[TransferGroupStatus, _Mapping]] = ...) -> None: ...

class LeaveTransferGroupRequest(_message.Message):
    __slots__ = ("group_id",)
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    def __init__(self, group_id: _Optional[str] = ...) -> None: ...

class LeaveTransferGroupResponse(_message.Message):
    __slots__ = ("left",)
    LEFT_FIELD_NUMBER: _ClassVar[int]
    left: bool
    def __init__(self, left: bool = ...) -> None: ...

class SliceTransfer(_message.Message):
    __slots__ = ("tensor", "source_rank", "start", "stop", "delta")
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    SOURCE_RANK_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    tensor: str
    source_rank: int
    start: _containers.RepeatedScalarFieldContainer[int]
    stop: _containers.RepeatedScalarFieldContainer[int]
    delta: TensorDelta
    def __init__(self, tensor: _Optional[str] = ..., source_rank: _Optional[int] = ..., start: _Optional[_Iterable[int]] = ..., stop: _Optional[_Iterable[int]] = ..., delta: _Optional[_Union[TensorDelta, _Mapping]] = ...) -> None: ...

class ByteRange(_message.Message):
    __slots__ = ("offset_bytes", "size_bytes")
    OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    offset_bytes: int
    size_bytes: int
    def __init__(self, offset_bytes: _Optional[int] = ..., size_bytes: _Optional[int] = ...) -> None: ...

class TransferGroupHandle(_message.Message):
    __slots__ = ("group_id", "mode", "source_rank", "subgroup_id", "sequence", "ranges", "slices", "plan_fingerprint", "max_message_bytes")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    SOURCE_RANK_FIELD_NUMBER: _ClassVar[int]
    SUBGROUP_ID_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    RANGES_FIELD_NUMBER: _ClassVar[int]
    SLICES_FIELD_NUMBER: _ClassVar[int]
    PLAN_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    mode: TransferMode
    source_rank: int
    subgroup_id: int
    sequence: int
    ranges: _containers.RepeatedCompositeFieldContainer[ByteRange]
    slices: _containers.RepeatedCompositeFieldContainer[SliceTransfer]
    plan_fingerprint: str
    max_message_bytes: int
    def __init__(self, group_id: _Optional[str] = ..., mode: _Optional[_Union[TransferMode, str]] = ..., source_rank: _Optional[int] = ..., subgroup_id: _Optional[int] = ..., sequence: _Optional[int] = ..., ranges: _Optional[_Iterable[_Union[ByteRange, _Mapping]]] = ..., slices: _Optional[_Iterable[_Union[SliceTransfer, _Mapping]]] = ..., plan_fingerprint: _Optional[str] = ..., max_message_bytes: _Optional[int] = ...) -> None: ...

class TransferGroupStatus(_message.Message):
    __slots__ = ("group_id", "state", "backend", "group_rank", "world_size", "staging_buffers", "staging_bytes", "max_staging_buffers", "bytes_received", "last_teardown")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    GROUP_RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    STAGING_BUFFERS_FIELD_NUMBER: _ClassVar[int]
    STAGING_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_STAGING_BUFFERS_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    LAST_TEARDOWN_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    state: TransferGroupState
    backend: TransferBackend
    group_rank: int
    world_size: int
    staging_buffers: int
    staging_bytes: int
    max_staging_buffers: int
    bytes_received: int
    last_teardown: str
    def __init__(self, group_id: _Optional[str] = ..., state: _Optional[_Union[TransferGroupState, str]] = ..., backend: _Optional[_Union[TransferBackend, str]] = ..., group_rank: _Optional[int] = ..., world_size: _Optional[int] = ..., staging_buffers: _Optional[int] = ..., staging_bytes: _Optional[int] = ..., max_staging_buffers: _Optional[int] = ..., bytes_received: _Optional[int] = ..., last_teardown: _Optional[str] = ...) -> None: ...
