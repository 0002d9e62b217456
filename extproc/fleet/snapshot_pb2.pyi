from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Readiness(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    READINESS_UNSPECIFIED: _ClassVar[Readiness]
    WARMING_UP: _ClassVar[Readiness]
    READY: _ClassVar[Readiness]
    DRAINING: _ClassVar[Readiness]
    DOWN: _ClassVar[Readiness]
READINESS_UNSPECIFIED: Readiness
WARMING_UP: Readiness
READY: Readiness
DRAINING: Readiness
DOWN: Readiness

class UpstreamSnapshot(_message.Message):
    __slots__ = ("upstream_id", "cluster", "address", "engine", "models", "lora_adapters", "readiness", "capacity_weight", "max_lora", "max_num_seqs", "num_running", "num_waiting", "kv_cache_usage", "kv_blocks_total", "kv_blocks_free", "block_size", "max_model_len", "gpu_utilization", "gpu_memory_usage", "prefix_cache_hit_rate", "ttft_seconds", "tpot_seconds", "prefill_tokens_per_s", "prompt_tokens_total", "first_tokens_total", "ttft_seconds_total", "publisher_id", "sequence", "published_at_ms", "ttl_ms", "load_presence", "readiness_reason", "gpu_model")
    UPSTREAM_ID_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    LORA_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    READINESS_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    MAX_LORA_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_USAGE_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_FREE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    GPU_UTILIZATION_FIELD_NUMBER: _ClassVar[int]
    GPU_MEMORY_USAGE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    TTFT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TPOT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    TTFT_SECONDS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    PUBLISHER_ID_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    PUBLISHED_AT_MS_FIELD_NUMBER: _ClassVar[int]
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    LOAD_PRESENCE_FIELD_NUMBER: _ClassVar[int]
    READINESS_REASON_FIELD_NUMBER: _ClassVar[int]
    GPU_MODEL_FIELD_NUMBER: _ClassVar[int]
    upstream_id: str
    cluster: str
    address: str
    engine: str
    models: _containers.RepeatedScalarFieldContainer[str]
    lora_adapters: _containers.RepeatedScalarFieldContainer[str]
    readiness: Readiness
    capacity_weight: float
    max_lora: int
    max_num_seqs: int
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    kv_blocks_total: int
    kv_blocks_free: int
    block_size: int
    max_model_len: int
    gpu_utilization: float
    gpu_memory_usage: float
    prefix_cache_hit_rate: float
    ttft_seconds: float
    tpot_seconds: float
    prefill_tokens_per_s: float
    prompt_tokens_total: float
    first_tokens_total: float
    ttft_seconds_total: float
    publisher_id: str
    sequence: int
    published_at_ms: int
    ttl_ms: int
    load_presence: bool
    readiness_reason: str
    gpu_model: str
    def __init__(self, upstream_id: _Optional[str] = ..., cluster: _Optional[str] = ..., address: _Optional[str] = ..., engine: _Optional[str] = ..., models: _Optional[_Iterable[str]] = ..., lora_adapters: _Optional[_Iterable[str]] = ..., readiness: _Optional[_Union[Readiness, str]] = ..., capacity_weight: _Optional[float] = ..., max_lora: _Optional[int] = ..., max_num_seqs: _Optional[int] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., kv_cache_usage: _Optional[float] = ..., kv_blocks_total: _Optional[int] = ..., kv_blocks_free: _Optional[int] = ..., block_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., gpu_utilization: _Optional[float] = ..., gpu_memory_usage: _Optional[float] = ..., prefix_cache_hit_rate: _Optional[float] = ..., ttft_seconds: _Optional[float] = ..., tpot_seconds: _Optional[float] = ..., prefill_tokens_per_s: _Optional[float] = ..., prompt_tokens_total: _Optional[float] = ..., first_tokens_total: _Optional[float] = ..., ttft_seconds_total: _Optional[float] = ..., publisher_id: _Optional[str] = ..., sequence: _Optional[int] = ..., published_at_ms: _Optional[int] = ..., ttl_ms: _Optional[int] = ..., load_presence: _Optional[bool] = ..., readiness_reason: _Optional[str] = ..., gpu_model: _Optional[str] = ...) -> None: ...
