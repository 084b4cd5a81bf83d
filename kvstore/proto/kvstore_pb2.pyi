from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Layout(_message.Message):
    __slots__ = ("num_layers", "num_kv_heads", "head_dim", "dtype")
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    def __init__(self, num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., dtype: _Optional[str] = ...) -> None: ...

class BlockMeta(_message.Message):
    __slots__ = ("key", "namespace", "layout", "tokens", "codec", "codec_params_json", "payload_len")
    KEY_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    CODEC_PARAMS_JSON_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_LEN_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    namespace: bytes
    layout: Layout
    tokens: int
    codec: str
    codec_params_json: str
    payload_len: int
    def __init__(self, key: _Optional[bytes] = ..., namespace: _Optional[bytes] = ..., layout: _Optional[_Union[Layout, _Mapping]] = ..., tokens: _Optional[int] = ..., codec: _Optional[str] = ..., codec_params_json: _Optional[str] = ..., payload_len: _Optional[int] = ...) -> None: ...

class ArenaSlice(_message.Message):
    __slots__ = ("arena_id", "offset", "length")
    ARENA_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    arena_id: int
    offset: int
    length: int
    def __init__(self, arena_id: _Optional[int] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ...) -> None: ...

class KeysRequest(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class CountResponse(_message.Message):
    __slots__ = ("count",)
    COUNT_FIELD_NUMBER: _ClassVar[int]
    count: int
    def __init__(self, count: _Optional[int] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("keys", "lease_ms")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    lease_ms: int
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ..., lease_ms: _Optional[int] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("hits", "tiers")
    HITS_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    hits: int
    tiers: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, hits: _Optional[int] = ..., tiers: _Optional[_Iterable[str]] = ...) -> None: ...

class PutItem(_message.Message):
    __slots__ = ("meta", "inline", "slice", "parent", "row_bytes", "row_stride", "token_ids")
    META_FIELD_NUMBER: _ClassVar[int]
    INLINE_FIELD_NUMBER: _ClassVar[int]
    SLICE_FIELD_NUMBER: _ClassVar[int]
    PARENT_FIELD_NUMBER: _ClassVar[int]
    ROW_BYTES_FIELD_NUMBER: _ClassVar[int]
    ROW_STRIDE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    meta: BlockMeta
    inline: bytes
    slice: ArenaSlice
    parent: bytes
    row_bytes: int
    row_stride: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, meta: _Optional[_Union[BlockMeta, _Mapping]] = ..., inline: _Optional[bytes] = ..., slice: _Optional[_Union[ArenaSlice, _Mapping]] = ..., parent: _Optional[bytes] = ..., row_bytes: _Optional[int] = ..., row_stride: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class PutRequest(_message.Message):
    __slots__ = ("items", "durable")
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    DURABLE_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[PutItem]
    durable: bool
    def __init__(self, items: _Optional[_Iterable[_Union[PutItem, _Mapping]]] = ..., durable: _Optional[bool] = ...) -> None: ...

class PutResponse(_message.Message):
    __slots__ = ("stored",)
    STORED_FIELD_NUMBER: _ClassVar[int]
    stored: int
    def __init__(self, stored: _Optional[int] = ...) -> None: ...

class GetItem(_message.Message):
    __slots__ = ("key", "dest", "row_bytes", "row_stride")
    KEY_FIELD_NUMBER: _ClassVar[int]
    DEST_FIELD_NUMBER: _ClassVar[int]
    ROW_BYTES_FIELD_NUMBER: _ClassVar[int]
    ROW_STRIDE_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    dest: ArenaSlice
    row_bytes: int
    row_stride: int
    def __init__(self, key: _Optional[bytes] = ..., dest: _Optional[_Union[ArenaSlice, _Mapping]] = ..., row_bytes: _Optional[int] = ..., row_stride: _Optional[int] = ...) -> None: ...

class GetRequest(_message.Message):
    __slots__ = ("items", "allow_missing", "gpu_direct")
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    ALLOW_MISSING_FIELD_NUMBER: _ClassVar[int]
    GPU_DIRECT_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[GetItem]
    allow_missing: bool
    gpu_direct: bool
    def __init__(self, items: _Optional[_Iterable[_Union[GetItem, _Mapping]]] = ..., allow_missing: _Optional[bool] = ..., gpu_direct: _Optional[bool] = ...) -> None: ...

class GetResult(_message.Message):
    __slots__ = ("found", "meta", "tier", "inline", "gpu_offset", "on_gpu")
    FOUND_FIELD_NUMBER: _ClassVar[int]
    META_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    INLINE_FIELD_NUMBER: _ClassVar[int]
    GPU_OFFSET_FIELD_NUMBER: _ClassVar[int]
    ON_GPU_FIELD_NUMBER: _ClassVar[int]
    found: bool
    meta: BlockMeta
    tier: str
    inline: bytes
    gpu_offset: int
    on_gpu: bool
    def __init__(self, found: _Optional[bool] = ..., meta: _Optional[_Union[BlockMeta, _Mapping]] = ..., tier: _Optional[str] = ..., inline: _Optional[bytes] = ..., gpu_offset: _Optional[int] = ..., on_gpu: _Optional[bool] = ...) -> None: ...

class LayerReady(_message.Message):
    __slots__ = ("layer", "results")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    layer: int
    results: _containers.RepeatedCompositeFieldContainer[GetResult]
    def __init__(self, layer: _Optional[int] = ..., results: _Optional[_Iterable[_Union[GetResult, _Mapping]]] = ...) -> None: ...

class ExportGpuPoolRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ExportGpuPoolResponse(_message.Message):
    __slots__ = ("handle", "size", "device")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    handle: bytes
    size: int
    device: str
    def __init__(self, handle: _Optional[bytes] = ..., size: _Optional[int] = ..., device: _Optional[str] = ...) -> None: ...

class GetResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[GetResult]
    def __init__(self, results: _Optional[_Iterable[_Union[GetResult, _Mapping]]] = ...) -> None: ...

class ClearRequest(_message.Message):
    __slots__ = ("tiers",)
    TIERS_FIELD_NUMBER: _ClassVar[int]
    tiers: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, tiers: _Optional[_Iterable[str]] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TierStats(_message.Message):
    __slots__ = ("name", "blocks", "used_bytes", "capacity_bytes", "hits", "evictions", "promotions_in", "demotions_in", "corrupt", "bytes_in", "bytes_out")
    NAME_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    PROMOTIONS_IN_FIELD_NUMBER: _ClassVar[int]
    DEMOTIONS_IN_FIELD_NUMBER: _ClassVar[int]
    CORRUPT_FIELD_NUMBER: _ClassVar[int]
    BYTES_IN_FIELD_NUMBER: _ClassVar[int]
    BYTES_OUT_FIELD_NUMBER: _ClassVar[int]
    name: str
    blocks: int
    used_bytes: int
    capacity_bytes: int
    hits: int
    evictions: int
    promotions_in: int
    demotions_in: int
    corrupt: int
    bytes_in: int
    bytes_out: int
    def __init__(self, name: _Optional[str] = ..., blocks: _Optional[int] = ..., used_bytes: _Optional[int] = ..., capacity_bytes: _Optional[int] = ..., hits: _Optional[int] = ..., evictions: _Optional[int] = ..., promotions_in: _Optional[int] = ..., demotions_in: _Optional[int] = ..., corrupt: _Optional[int] = ..., bytes_in: _Optional[int] = ..., bytes_out: _Optional[int] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("tiers", "misses", "pinned", "queue_depth", "queue_dropped", "arenas", "write_errors", "requested", "events_published", "events_dropped", "data_port", "inline_bytes", "data_host")
    TIERS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DROPPED_FIELD_NUMBER: _ClassVar[int]
    ARENAS_FIELD_NUMBER: _ClassVar[int]
    WRITE_ERRORS_FIELD_NUMBER: _ClassVar[int]
    REQUESTED_FIELD_NUMBER: _ClassVar[int]
    EVENTS_PUBLISHED_FIELD_NUMBER: _ClassVar[int]
    EVENTS_DROPPED_FIELD_NUMBER: _ClassVar[int]
    DATA_PORT_FIELD_NUMBER: _ClassVar[int]
    INLINE_BYTES_FIELD_NUMBER: _ClassVar[int]
    DATA_HOST_FIELD_NUMBER: _ClassVar[int]
    tiers: _containers.RepeatedCompositeFieldContainer[TierStats]
    misses: int
    pinned: int
    queue_depth: int
    queue_dropped: int
    arenas: int
    write_errors: int
    requested: int
    events_published: int
    events_dropped: int
    data_port: int
    inline_bytes: int
    data_host: str
    def __init__(self, tiers: _Optional[_Iterable[_Union[TierStats, _Mapping]]] = ..., misses: _Optional[int] = ..., pinned: _Optional[int] = ..., queue_depth: _Optional[int] = ..., queue_dropped: _Optional[int] = ..., arenas: _Optional[int] = ..., write_errors: _Optional[int] = ..., requested: _Optional[int] = ..., events_published: _Optional[int] = ..., events_dropped: _Optional[int] = ..., data_port: _Optional[int] = ..., inline_bytes: _Optional[int] = ..., data_host: _Optional[str] = ...) -> None: ...

class RegisterArenaRequest(_message.Message):
    __slots__ = ("name", "size")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    name: str
    size: int
    def __init__(self, name: _Optional[str] = ..., size: _Optional[int] = ...) -> None: ...

class RegisterArenaResponse(_message.Message):
    __slots__ = ("arena_id", "index_name")
    ARENA_ID_FIELD_NUMBER: _ClassVar[int]
    INDEX_NAME_FIELD_NUMBER: _ClassVar[int]
    arena_id: int
    index_name: str
    def __init__(self, arena_id: _Optional[int] = ..., index_name: _Optional[str] = ...) -> None: ...

class UnregisterArenaRequest(_message.Message):
    __slots__ = ("arena_id",)
    ARENA_ID_FIELD_NUMBER: _ClassVar[int]
    arena_id: int
    def __init__(self, arena_id: _Optional[int] = ...) -> None: ...
