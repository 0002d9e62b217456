"""From one scrape to a snapshot's fields: every figure bounds-checked (a value an engine should
never report is left unknown and named), interval means from the counters' differences."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from extproc.fleet import snapshot_pb2 as spb
from extproc.fleet.snapshots import (
    MAX_BLOCK_SIZE,
    MAX_COUNTER,
    MAX_ID_LEN,
    MAX_KV_BLOCKS,
    MAX_KV_USAGE,
    MAX_LATENCY_S,
    MAX_LORA_SLOTS,
    MAX_MODEL_LEN,
    MAX_MODELS,
    MAX_QUEUE,
)
from extproc.publishers.engines import (
    ENGINE_METRICS,
    EngineLoad,
    GpuReading,
)
from extproc.publishers.prefill_rate import PrefillRate

LOAD_FIELDS = ("num_running", "num_waiting", "kv_cache_usage")  # any one of them makes a load signal


@dataclass(slots=True)
class _Previous:
    """What one instance's earlier scrapes left behind: readiness history and cumulative counters."""

    ready_seen: bool = False
    readiness: int | None = None  # the last published state, to log changes
    blind: bool = False  # and whether it was READY with the load unknown
    loaded_at: float | None = None  # time.monotonic() of the last READY snapshot with a load reading
    # and that snapshot: what it said of the engine itself (models, adapters, limits) outlives a failed
    # /metrics within the TTL
    last_read: spb.UpstreamSnapshot | None = None
    ttft: tuple[float, float] | None = None
    tpot: tuple[float, float] | None = None
    prefix: tuple[float, float] | None = None
    prefill: PrefillRate = field(default_factory=PrefillRate)


def _checked(name: str, value: float | None, high: float, rejected: list[tuple[str, str]]) -> float | None:
    """`value` if it is a finite number in [0, high]; otherwise None, with the reason recorded."""
    if value is None:
        return None
    if math.isnan(value):
        reason = "nan"
    elif math.isinf(value):
        reason = "infinite"
    elif value < 0:
        reason = "negative"
    elif value > high:
        reason = "too_large"
    else:
        return value
    rejected.append((name, reason))
    return None


def _names(values: list[str], name: str, rejected: list[tuple[str, str]]) -> list[str]:
    """Model or adapter names readers accept: non-empty, at most MAX_ID_LEN long, at most MAX_MODELS
    of them (more: the whole list is left out, so a reader falls back to its configured models)."""
    out = []
    for v in values:
        if not v or len(v) > MAX_ID_LEN:
            rejected.append((name, "bad_name"))
        else:
            out.append(v)
    if len(out) > MAX_MODELS:
        rejected.append((name, "too_many"))
        return []
    return out


def _fill_load(snap: spb.UpstreamSnapshot, load: EngineLoad, prev: _Previous) -> list[tuple[str, str]]:
    """Copy `load` into `snap` within the bounds readers accept, leaving out (unknown) what is not;
    returns every (field, reason) left out, the engine-side rejections included. This is the last
    gate before protobuf, whose own range errors (a uint64 overflow) must never be reached."""
    rejected = list(load.rejected)
    running = _checked("num_running", load.num_running, MAX_QUEUE, rejected)
    if running is not None:
        snap.num_running = int(running)
    waiting = _checked("num_waiting", load.num_waiting, MAX_QUEUE, rejected)
    if waiting is not None:
        snap.num_waiting = int(waiting)
    usage = _checked("kv_cache_usage", load.kv_cache_usage, MAX_KV_USAGE, rejected)
    total = _checked("kv_blocks_total", load.kv_blocks_total, MAX_KV_BLOCKS, rejected)
    free = _checked("kv_blocks_free", load.kv_blocks_free, MAX_KV_BLOCKS, rejected)
    if free is not None and total is not None and free > total:
        rejected.append(("kv_blocks_free", "above_total"))
        free = None
    if usage is None and total and free is not None:
        usage = 1.0 - free / total
    if usage is not None:
        snap.kv_cache_usage = usage
    if total:
        if free is None and usage is not None:
            free = round(total * (1.0 - min(1.0, usage)))
        snap.kv_blocks_total = int(total)
        snap.kv_blocks_free = int(min(free or 0, total))
    block_size = _checked("block_size", load.block_size, MAX_BLOCK_SIZE, rejected)
    if block_size is not None:
        snap.block_size = int(block_size)
    max_len = _checked("max_model_len", load.max_model_len, MAX_MODEL_LEN, rejected)
    if max_len is not None:
        snap.max_model_len = int(max_len)
    gpu = _checked("gpu_utilization", load.gpu_utilization, MAX_KV_USAGE, rejected)
    if gpu is not None:
        snap.gpu_utilization = min(gpu, 1.0)  # readers take 0..1 (a sampled percent may read 100+)
    memory = _checked("gpu_memory_usage", load.gpu_memory_usage, MAX_KV_USAGE, rejected)
    if memory is not None:
        snap.gpu_memory_usage = min(memory, 1.0)
    slots = _checked("max_lora", load.max_lora, MAX_LORA_SLOTS, rejected)
    if slots is not None:
        snap.max_lora = int(slots)
    seqs = _checked("max_num_seqs", load.max_num_seqs, MAX_QUEUE, rejected)
    if seqs:
        snap.max_num_seqs = int(seqs)
    ttft, prev.ttft = _interval_mean(load.ttft_sum, load.ttft_count, prev.ttft)
    ttft = _checked("ttft", ttft, MAX_LATENCY_S, rejected)
    if ttft is not None:
        snap.ttft_seconds = ttft
    tpot, prev.tpot = _interval_mean(load.tpot_sum, load.tpot_count, prev.tpot)
    tpot = _checked("tpot", tpot, MAX_LATENCY_S, rejected)
    if tpot is not None:
        snap.tpot_seconds = tpot
    rate, prev.prefix = _interval_mean(load.prefix_cache_hits, load.prefix_cache_queries, prev.prefix)
    if rate is None:
        rate = load.prefix_cache_hit_rate
    if rate is not None and math.isfinite(rate):
        snap.prefix_cache_hit_rate = min(1.0, max(0.0, rate))
    # A prompt counter that includes cache hits is usable only with the hits to subtract.
    row = ENGINE_METRICS.get(snap.engine)
    if row is not None:
        cached = load.prefix_cache_hits if row.prompt_tokens_cached else 0.0
        if cached is not None:
            prev.prefill.update(load.prompt_tokens, cached, load.prefill_seconds, load.preemptions)
    if prev.prefill.estimate is not None:  # the last figure stands while nothing new is measured
        snap.prefill_tokens_per_s = prev.prefill.estimate
    # The counters readers calibrate against (scheduling/calibration.py): every prompt token, cached
    # ones included (vLLM's prompt counter; SGLang's, which the table reads as prefix-cache queries),
    # and the TTFT histogram's count and sum, as cumulative values.
    prompt = load.prompt_tokens if row is not None and row.prompt_tokens_cached else None
    if prompt is None:
        prompt = load.prefix_cache_queries
    prompt = _checked("prompt_tokens_total", prompt, MAX_COUNTER, rejected)
    first = _checked("first_tokens_total", load.ttft_count, MAX_COUNTER, rejected)
    ttft_total = _checked("ttft_seconds_total", load.ttft_sum, MAX_COUNTER, rejected)
    if first is not None and ttft_total is not None:
        snap.first_tokens_total, snap.ttft_seconds_total = first, ttft_total
        if prompt is not None:
            snap.prompt_tokens_total = prompt
    return rejected


def _apply_gpu(load: EngineLoad, reading: GpuReading) -> None:
    """DCGM's figures replace the engine's own (Triton's nv_gpu_utilization): the operator chose them."""
    if reading.utilization is not None:
        load.gpu_utilization = reading.utilization
    if reading.memory_usage is not None:
        load.gpu_memory_usage = reading.memory_usage
    if reading.model is not None:
        load.gpu_model = reading.model
    load.rejected.extend(reading.rejected)


def _interval_mean(
    total: float | None, count: float | None, prev: tuple[float, float] | None
) -> tuple[float | None, tuple[float, float] | None]:
    """Mean over the last interval from cumulative (sum, count); None until two scrapes or no change."""
    if total is None or count is None:
        return None, prev
    now = (total, count)
    if prev is None or count < prev[1]:  # first scrape, or the engine restarted
        return None, now
    dc = count - prev[1]
    return ((total - prev[0]) / dc if dc > 0 else None), now
