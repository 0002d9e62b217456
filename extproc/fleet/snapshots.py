"""Decoding and validating upstream snapshots read from Redis.

Redis is shared infrastructure: anything in it may be stale, truncated, written by an old publisher
or hostile. Every snapshot is checked before it can influence routing; a bad one is rejected with a
reason (counted in metrics) and never raises past this module.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from google.protobuf.message import DecodeError

from extproc.fleet import snapshot_pb2 as spb
from extproc.fleet.gpus import MAX_GPU_NAME
from extproc.fleet.pool import parse_endpoint
from extproc.settings import MAX_TTL_MS, MIN_TTL_MS

READY = spb.READY
Readiness = spb.Readiness

MAX_SNAPSHOT_BYTES = 64 * 1024
MAX_ID_LEN = 256
MAX_MODELS = 256
MAX_QUEUE = 1_000_000
MAX_WEIGHT = 1000.0
MAX_FUTURE_SKEW_S = 30.0
# Bounds shared with the publishers (which reject a value out of range before writing it, so one bad
# field never costs the whole snapshot here). A KV "block" can be one token (SGLang's default page),
# so a billion blocks is far beyond any engine; a context of 2^30 tokens likewise.
MAX_KV_USAGE = 1.5  # engines round above 1.0 briefly; readers clamp to 1.0
MAX_KV_BLOCKS = 1_000_000_000
MAX_BLOCK_SIZE = 1 << 20
MAX_MODEL_LEN = 1 << 30
MAX_LATENCY_S = 3600.0
MAX_PREFILL_TOKENS_PER_S = 1e8  # far above any GPU (an H100 prefills ~3e4 tokens/s of an 8B model)
MAX_COUNTER = 1e18  # a cumulative engine counter (tokens, requests, seconds): finite and below this
MAX_LORA_SLOTS = 4096  # adapters one engine holds in GPU memory at once (vLLM's default max_loras is 1)


class SnapshotRejected(ValueError):
    """A snapshot that must not be used. `reason` is a short, fixed metric label."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


@dataclass(slots=True, frozen=True)
class InstanceState:
    """A validated snapshot: what the scheduler may read about one instance.

    num_running, num_waiting and kv_cache_usage are None when the engine did not report them (or the
    publisher rejected the value): unknown load, which FleetView must never read as idle.
    """

    upstream_id: str
    cluster: str
    address: str | None
    engine: str
    models: frozenset[str]
    lora_adapters: frozenset[str]
    readiness: int
    weight: float
    num_running: int | None
    num_waiting: int | None
    kv_cache_usage: float | None
    kv_blocks_total: int
    kv_blocks_free: int
    block_size: int
    max_model_len: int
    prefix_cache_hit_rate: float | None
    ttft_s: float | None
    tpot_s: float | None
    publisher_id: str
    sequence: int
    published_at: float  # unix seconds
    expires_at: float  # unix seconds
    # Optional signals (None: not published). max_lora: LoRA adapter slots in GPU memory;
    # gpu_utilization / gpu_memory_usage: 0..1, the busiest / fullest of the instance's GPUs.
    max_lora: int | None = None
    max_num_seqs: int | None = None  # the most requests it runs at once (configured or the engine's)
    gpu_utilization: float | None = None
    gpu_memory_usage: float | None = None
    prefill_tokens_per_s: float | None = None  # measured (publishers/prefill_rate.py); None: not yet
    gpu_model: str | None = None  # e.g. "NVIDIA H100 80GB HBM3" (fleet/gpus.py); None: not said
    # The engine's cumulative counters (prompt tokens at first token, or None when not published;
    # first tokens; TTFT seconds summed), or None without the TTFT pair (scheduling/calibration.py).
    counters: tuple[float | None, float, float] | None = None

    @property
    def ready(self) -> bool:
        return self.readiness == READY

    def fresh(self, now: float) -> bool:
        return now < self.expires_at


def decode(data: bytes, known_clusters: frozenset[str], *, now: float | None = None) -> InstanceState:
    """Parse and validate one serialized UpstreamSnapshot; raises SnapshotRejected."""
    if len(data) > MAX_SNAPSHOT_BYTES:
        raise SnapshotRejected("too_large", f"{len(data)} bytes")
    msg = spb.UpstreamSnapshot()
    try:
        msg.ParseFromString(data)
    except (DecodeError, ValueError, RuntimeError) as exc:
        raise SnapshotRejected("undecodable", type(exc).__name__) from None
    return validate(msg, known_clusters, now=now)


def validate(
    msg: spb.UpstreamSnapshot, known_clusters: frozenset[str], *, now: float | None = None
) -> InstanceState:
    now = time.time() if now is None else now
    uid = msg.upstream_id
    if not uid or len(uid) > MAX_ID_LEN or not uid.isprintable():
        raise SnapshotRejected("bad_id")
    if msg.cluster not in known_clusters:
        # The service must never name a cluster Envoy does not have (503 NC).
        raise SnapshotRejected("unknown_cluster", msg.cluster[:64])
    address = msg.address or None
    if address is not None:
        try:
            parse_endpoint(address)
        except ValueError:
            raise SnapshotRejected("bad_address", address[:64]) from None
    if len(msg.models) > MAX_MODELS or any(not m or len(m) > MAX_ID_LEN for m in msg.models):
        raise SnapshotRejected("bad_models")
    if len(msg.lora_adapters) > MAX_MODELS or any(len(m) > MAX_ID_LEN for m in msg.lora_adapters):
        raise SnapshotRejected("bad_models")
    if msg.readiness not in Readiness.values():
        raise SnapshotRejected("bad_readiness")
    running, waiting = _load_field(msg, "num_running"), _load_field(msg, "num_waiting")
    if (running or 0) > MAX_QUEUE or (waiting or 0) > MAX_QUEUE:
        raise SnapshotRejected("bad_load", "queue out of range")
    kv = _load_field(msg, "kv_cache_usage")
    if kv is not None and (not math.isfinite(kv) or kv < 0.0 or kv > MAX_KV_USAGE):
        raise SnapshotRejected("bad_load", "kv_cache_usage out of range")
    if msg.kv_blocks_total > MAX_KV_BLOCKS:
        raise SnapshotRejected("bad_load", "kv_blocks_total out of range")
    if msg.kv_blocks_free > msg.kv_blocks_total:
        raise SnapshotRejected("bad_load", "kv_blocks_free > kv_blocks_total")
    weight = msg.capacity_weight or 1.0
    if not math.isfinite(weight) or weight <= 0.0 or weight > MAX_WEIGHT:
        raise SnapshotRejected("bad_weight")
    if not MIN_TTL_MS <= msg.ttl_ms <= MAX_TTL_MS:
        raise SnapshotRejected("bad_ttl")
    published = msg.published_at_ms / 1000.0
    if published > now + MAX_FUTURE_SKEW_S or published <= 0:
        raise SnapshotRejected("bad_timestamp")
    return InstanceState(
        upstream_id=uid,
        cluster=msg.cluster,
        address=address,
        engine=msg.engine[:32],
        models=frozenset(msg.models),
        lora_adapters=frozenset(msg.lora_adapters),
        readiness=msg.readiness,
        weight=weight,
        num_running=None if running is None else int(running),
        num_waiting=None if waiting is None else int(waiting),
        kv_cache_usage=None if kv is None else min(kv, 1.0),
        kv_blocks_total=msg.kv_blocks_total,
        kv_blocks_free=msg.kv_blocks_free,
        block_size=msg.block_size,
        max_model_len=msg.max_model_len,
        prefix_cache_hit_rate=_fraction(msg, "prefix_cache_hit_rate"),
        ttft_s=_seconds(msg, "ttft_seconds"),
        tpot_s=_seconds(msg, "tpot_seconds"),
        publisher_id=msg.publisher_id[:MAX_ID_LEN],
        sequence=msg.sequence,
        published_at=published,
        expires_at=published + msg.ttl_ms / 1000.0,
        max_lora=msg.max_lora if msg.HasField("max_lora") and msg.max_lora <= MAX_LORA_SLOTS else None,
        max_num_seqs=_max_num_seqs(msg),
        gpu_utilization=_fraction(msg, "gpu_utilization"),
        gpu_memory_usage=_fraction(msg, "gpu_memory_usage"),
        prefill_tokens_per_s=_prefill_rate(msg),
        gpu_model=_gpu_model(msg.gpu_model),
        counters=_counters(msg),
    )


def _max_num_seqs(msg: spb.UpstreamSnapshot) -> int | None:
    """The published batch limit, or None (absent, 0, or beyond any engine's: not used)."""
    if not msg.HasField("max_num_seqs") or not 0 < msg.max_num_seqs <= MAX_QUEUE:
        return None
    return msg.max_num_seqs


def _counters(msg: spb.UpstreamSnapshot) -> tuple[float | None, float, float] | None:
    """(prompt tokens or None, first tokens, TTFT seconds), each finite and in [0, MAX_COUNTER]; None
    without the TTFT pair. A missing or bad counter is not a reason to reject the snapshot, only to
    learn less from it."""
    out: list[float | None] = []
    for name in ("prompt_tokens_total", "first_tokens_total", "ttft_seconds_total"):
        v = getattr(msg, name) if msg.HasField(name) else None
        out.append(v if v is not None and math.isfinite(v) and 0.0 <= v <= MAX_COUNTER else None)
    prompt, first, ttft = out
    if first is None or ttft is None:
        return None
    return prompt, first, ttft


def _gpu_model(name: str) -> str | None:
    """An informational name: a bad one is dropped, not a reason to reject the snapshot."""
    return name if name and len(name) <= MAX_GPU_NAME and name.isprintable() else None


def _load_field(msg: spb.UpstreamSnapshot, name: str) -> float | None:
    """A load field's value, or None when unknown. Writers that set `load_presence` leave a field
    unset when the engine did not report it; older writers could not say, so unset means 0 there."""
    if msg.load_presence and not msg.HasField(name):
        return None
    return float(getattr(msg, name))


def _fraction(msg: spb.UpstreamSnapshot, name: str) -> float | None:
    if not msg.HasField(name):
        return None
    v = getattr(msg, name)
    return v if math.isfinite(v) and 0.0 <= v <= 1.0 else None


def _prefill_rate(msg: spb.UpstreamSnapshot) -> float | None:
    """A measured prefill rate readers can divide by: positive and finite, or None (not known)."""
    if not msg.HasField("prefill_tokens_per_s"):
        return None
    v = msg.prefill_tokens_per_s
    return v if math.isfinite(v) and 0.0 < v <= MAX_PREFILL_TOKENS_PER_S else None


def _seconds(msg: spb.UpstreamSnapshot, name: str) -> float | None:
    if not msg.HasField(name):
        return None
    v = getattr(msg, name)
    return v if math.isfinite(v) and 0.0 <= v < MAX_LATENCY_S else None
