"""Per-engine metric names, as data, and normalisation of a Prometheus /metrics scrape.

Each engine (vLLM, SGLang, llama.cpp server, TGI, TensorRT-LLM behind Triton, and our simulator,
which speaks vLLM's names) publishes load under different names and units. The table below maps
them onto one `EngineLoad`; adding an engine is adding a row, not a branch in code.
docs/engines.md is the reader's version of the table, with sources.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, fields

from prometheus_client.parser import text_string_to_metric_families


@dataclass(slots=True)
class EngineLoad:
    """One scrape, normalised. None means the engine does not publish that signal."""

    num_running: float | None = None
    num_waiting: float | None = None
    kv_cache_usage: float | None = None  # fraction 0..1
    kv_blocks_total: int | None = None
    kv_blocks_free: int | None = None
    block_size: int | None = None  # tokens per KV block
    max_model_len: int | None = None
    gpu_utilization: float | None = None  # fraction 0..1
    # Cumulative counters; the publisher turns deltas between scrapes into rates and means.
    prefix_cache_hits: float | None = None
    prefix_cache_queries: float | None = None
    prefix_cache_hit_rate: float | None = None  # when the engine reports a rate directly (0..1)
    ttft_sum: float | None = None
    ttft_count: float | None = None
    tpot_sum: float | None = None
    tpot_count: float | None = None
    models: list[str] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Metric:
    """One place a value can be read from: a sample name, as the parser yields it.

    Counters are named with their `_total` suffix (the parser adds it even when the engine does
    not); histograms by their base name (`_sum`/`_count` are appended). `where` keeps only the
    series whose labels match; `label` reads the value from a label (info-style gauges such as
    vLLM's cache_config_info) instead of the sample value; `scale` converts units (percent or
    milliseconds), and for a histogram applies to `_sum` only.
    """

    name: str
    where: tuple[tuple[str, str], ...] = ()
    label: str | None = None
    scale: float = 1.0


Candidates = tuple[Metric, ...]  # newest name first; the first one present in a scrape wins


def _m(*names: str, where: Mapping[str, str] | None = None, label: str | None = None) -> Candidates:
    """Candidates sharing one filter/label, newest first (keeps the table below readable)."""
    filt = tuple(sorted((where or {}).items()))
    return tuple(Metric(name, filt, label) for name in names)


@dataclass(frozen=True, slots=True)
class EngineMetrics:
    """Which metrics feed which `EngineLoad` field for one engine kind. Empty: not offered."""

    num_running: Candidates = ()
    num_waiting: Candidates = ()
    kv_cache_usage: Candidates = ()
    kv_blocks_total: Candidates = ()
    kv_blocks_free: Candidates = ()
    block_size: Candidates = ()
    max_model_len: Candidates = ()
    gpu_utilization: Candidates = ()
    prefix_cache_hits: Candidates = ()
    prefix_cache_queries: Candidates = ()
    prefix_cache_hit_rate: Candidates = ()
    ttft: Candidates = ()  # histogram, seconds -> ttft_sum / ttft_count
    tpot: Candidates = ()  # histogram, seconds -> tpot_sum / tpot_count
    model_labels: tuple[str, ...] = ()  # labels naming the served model, first present wins


# vLLM. Source: vllm/v1/metrics/loggers.py (PrometheusStatLogger) and
# https://docs.vllm.ai/en/stable/usage/metrics/ ; V0 names: https://docs.vllm.ai/en/v0.5.3/serving/metrics.html
# Labels: model_name, engine (one series per data-parallel engine, summed here).
# - gpu_cache_usage_perc: deprecated for kv_cache_usage_perc in 0.9, removed in 0.12 (both 0..1).
# - gpu_prefix_cache_{hits,queries}_total: early V1 names, deprecated in 0.9 for
#   prefix_cache_{hits,queries}_total (token counts); gpu_prefix_cache_hit_rate is the V0 gauge.
# - time_per_output_token_seconds: renamed inter_token_latency_seconds in 0.11 (vllm PR #23919/#24015);
#   request_time_per_output_token_seconds (per-request mean) is not read.
# - cache_config_info is a gauge fixed at 1 whose labels are CacheConfig's fields as strings
#   (vllm PR #3100); num_gpu_blocks reads "None" until the engine has profiled memory.
# Not offered: kv_blocks_free (usage x total is the caller's estimate), max_model_len, gpu_utilization.
_VLLM = EngineMetrics(
    num_running=_m("vllm:num_requests_running"),
    num_waiting=_m("vllm:num_requests_waiting"),
    kv_cache_usage=_m("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    kv_blocks_total=_m("vllm:cache_config_info", label="num_gpu_blocks"),
    block_size=_m("vllm:cache_config_info", label="block_size"),
    prefix_cache_hits=_m("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total"),
    prefix_cache_queries=_m("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total"),
    prefix_cache_hit_rate=_m("vllm:gpu_prefix_cache_hit_rate"),
    ttft=_m("vllm:time_to_first_token_seconds"),
    tpot=_m("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"),
    model_labels=("model_name",),
)

# SGLang (--enable-metrics). Source: python/sglang/srt/metrics/collector.py (later
# python/sglang/srt/observability/metrics_collector.py) and
# https://docs.sglang.io/references/production_metrics.html
# Labels: model_name (plain `name` before ~v0.4), engine_type, tp_rank, pp_rank, dp_rank; with DP
# attention each rank reports its own series and the node total is their sum (sglang PR #7597).
# - token_usage is the KV pool's used fraction (0..1); cache_hit_rate a 0..1 rate.
# - page_size / num_pages gauges (v0.5.11+) replaced labels of sglang:cache_config_info.
# - prefix hits/queries: cached_tokens_total over prompt_tokens_total (both counted per finished
#   request), a token-weighted hit rate like vLLM's.
# - time_per_output_token_seconds was renamed inter_token_latency_seconds.
# Not offered: kv_blocks_free, gpu_utilization.
_SGLANG = EngineMetrics(
    num_running=_m("sglang:num_running_reqs"),
    num_waiting=_m("sglang:num_queue_reqs"),
    kv_cache_usage=_m("sglang:token_usage"),
    kv_blocks_total=_m("sglang:num_pages") + _m("sglang:cache_config_info", label="num_pages"),
    block_size=_m("sglang:page_size") + _m("sglang:cache_config_info", label="page_size"),
    max_model_len=_m("sglang:context_len"),
    prefix_cache_hits=_m("sglang:cached_tokens_total"),
    prefix_cache_queries=_m("sglang:prompt_tokens_total"),
    prefix_cache_hit_rate=_m("sglang:cache_hit_rate"),
    ttft=_m("sglang:time_to_first_token_seconds"),
    tpot=_m("sglang:inter_token_latency_seconds", "sglang:time_per_output_token_seconds"),
    model_labels=("model_name", "name"),
)

# llama.cpp server (llama-server --metrics). Source: tools/server/README.md (GET /metrics) and the
# metrics handler in tools/server/server.cpp / server-context.cpp; no labels, one model per server.
# - kv_cache_usage_ratio (0..1) was removed with kv_cache_tokens in llama.cpp PR #13660 (May 2025);
#   current builds publish no KV signal (PR #24010 proposes new ones).
# Not offered: KV blocks, block size, max_model_len, gpu_utilization, prefix cache, TTFT, TPOT.
_LLAMACPP = EngineMetrics(
    num_running=_m("llamacpp:requests_processing"),
    num_waiting=_m("llamacpp:requests_deferred"),
    kv_cache_usage=_m("llamacpp:kv_cache_usage_ratio"),
)

# Hugging Face TGI. Source: https://huggingface.co/docs/text-generation-inference/reference/metrics
# (docs/source/reference/metrics.md); emitted by the Rust metrics-exporter-prometheus, no model label.
# - tgi_batch_current_size is the running batch; tgi_queue_size the waiting queue.
# - tgi_request_mean_time_per_token_duration is each request's inference time / generated tokens,
#   so it includes prefill: TPOT-like, not ITL.
# Not offered: any KV signal, max_model_len, gpu_utilization, prefix cache, TTFT.
_TGI = EngineMetrics(
    num_running=_m("tgi_batch_current_size"),
    num_waiting=_m("tgi_queue_size"),
    tpot=_m("tgi_request_mean_time_per_token_duration"),
)

# TensorRT-LLM behind Triton (metrics port 8002). Source: the backend's custom metrics reporter,
# triton_backend/inflight_batcher_llm/src/custom_metrics_reporter/custom_metrics_reporter.cc in
# NVIDIA/TensorRT-LLM (formerly triton-inference-server/tensorrtllm_backend), and Triton's
# docs/user_guide/metrics.md. All nv_trt_llm_* families are gauges labelled model/version plus a
# type label; request_type="waiting" and kv_cache_block_type="fraction" are the newer additions
# (Gateway API Inference Extension's model-server protocol reads them); without "fraction" the
# usage is derived from the max/free blocks (see normalize).
# - running is request_type="active" (requests admitted to the in-flight batcher).
# - nv_gpu_utilization is per GPU (0..1), max taken; it covers every GPU Triton sees.
# - TTFT: nv_inference_first_response_histogram_ms, only with
#   --metrics-config histogram_latencies=true and only for the model named "tensorrt_llm" (the
#   name in the backend's model repository; an ensemble would count each request twice); ms -> s.
# Not offered: max_model_len, prefix cache counters, TPOT.
_TRTLLM = EngineMetrics(
    num_running=_m("nv_trt_llm_request_metrics", where={"request_type": "active"}),
    num_waiting=_m("nv_trt_llm_request_metrics", where={"request_type": "waiting"}),
    kv_cache_usage=_m("nv_trt_llm_kv_cache_block_metrics", where={"kv_cache_block_type": "fraction"}),
    kv_blocks_total=_m("nv_trt_llm_kv_cache_block_metrics", where={"kv_cache_block_type": "max"}),
    kv_blocks_free=_m("nv_trt_llm_kv_cache_block_metrics", where={"kv_cache_block_type": "free"}),
    block_size=_m("nv_trt_llm_kv_cache_block_metrics", where={"kv_cache_block_type": "tokens_per"}),
    gpu_utilization=_m("nv_gpu_utilization"),
    ttft=(Metric("nv_inference_first_response_histogram_ms", (("model", "tensorrt_llm"),), scale=0.001),),
)

ENGINE_METRICS: dict[str, EngineMetrics] = {
    "vllm": _VLLM,
    "sglang": _SGLANG,
    "llamacpp": _LLAMACPP,
    "tgi": _TGI,
    "trtllm": _TRTLLM,
    "sim": _VLLM,  # extproc.lab.engines speaks exactly vLLM's names
}

# Generic rules, not per engine: fractions and sizes take the max over series, counts the sum.
_MAX_FIELDS = frozenset(
    {"kv_cache_usage", "gpu_utilization", "prefix_cache_hit_rate", "block_size", "max_model_len"}
)
_INT_FIELDS = frozenset({"kv_blocks_total", "kv_blocks_free", "block_size", "max_model_len"})
_HISTOGRAMS = ("ttft", "tpot")
_SCALARS = tuple(f.name for f in fields(EngineMetrics) if f.name not in {*_HISTOGRAMS, "model_labels"})

Series = list[tuple[dict[str, str], float]]


def normalize(engine: str, exposition: str) -> EngineLoad:
    """Map one /metrics scrape of `engine` onto an EngineLoad.

    Series matching one candidate are summed (counts) or maxed (fractions, sizes). A NaN, infinite
    or negative value, or a label that is not a number, makes that field None rather than a guess.
    Nothing is clamped: a kv usage above 1.0 is returned as read and the caller validates it.
    Raises ValueError for an unknown engine or text that is not Prometheus exposition.
    """
    spec = ENGINE_METRICS.get(engine)
    if spec is None:
        raise ValueError(f"unknown engine {engine!r}; known: {', '.join(sorted(ENGINE_METRICS))}")
    index = _index(exposition)
    load = EngineLoad()
    for name in _SCALARS:
        value = _scalar(index, getattr(spec, name), max if name in _MAX_FIELDS else sum)
        setattr(load, name, _whole(value) if name in _INT_FIELDS else value)
    for name in _HISTOGRAMS:
        total, count = _histogram(index, getattr(spec, name))
        setattr(load, f"{name}_sum", total)
        setattr(load, f"{name}_count", count)
    # Engines that publish blocks but no fraction (older Triton backends): used / total is exact.
    if load.kv_cache_usage is None and load.kv_blocks_total and load.kv_blocks_free is not None:
        load.kv_cache_usage = (load.kv_blocks_total - load.kv_blocks_free) / load.kv_blocks_total
    load.models = _models(index, spec.model_labels)
    return load


def _index(exposition: str) -> dict[str, Series]:
    """Sample name -> [(labels, value)]; every parser failure becomes a short ValueError."""
    index: dict[str, Series] = {}
    try:
        for family in text_string_to_metric_families(exposition):
            for sample in family.samples:
                index.setdefault(sample.name, []).append((sample.labels, float(sample.value)))
    except Exception as exc:  # the parser raises ValueError, IndexError, TypeError... keep one type
        detail = str(exc).splitlines()[0][:80] if str(exc) else type(exc).__name__
        raise ValueError(f"malformed Prometheus exposition: {detail}") from exc
    return index


def _matching(index: Mapping[str, Series], metric: Metric, suffix: str = "") -> Series | None:
    """The series of `metric` passing its label filter, or None when the name is absent."""
    found = [
        (labels, value) for labels, value in index.get(metric.name + suffix, ()) if _passes(labels, metric)
    ]
    return found or None


def _passes(labels: Mapping[str, str], metric: Metric) -> bool:
    return all(labels.get(key) == want for key, want in metric.where)


def _number(raw: float | str | None, scale: float) -> float | None:
    """A finite, non-negative number, or None: load signals are never negative."""
    if raw is None:
        return None
    try:
        value = float(raw) * scale
    except ValueError:  # a label such as num_gpu_blocks="None"
        return None
    return value if math.isfinite(value) and value >= 0 else None


def _values(series: Series, metric: Metric, scale: float) -> list[float] | None:
    """Numbers of every series, or None if any one is unusable (a partial sum would mislead)."""
    out = []
    for labels, value in series:
        number = _number(labels.get(metric.label) if metric.label else value, scale)
        if number is None:
            return None
        out.append(number)
    return out


def _scalar(
    index: Mapping[str, Series], candidates: Candidates, agg: Callable[[Iterable[float]], float]
) -> float | None:
    """The first candidate present in the scrape, aggregated over its series."""
    for metric in candidates:
        series = _matching(index, metric)
        if series is not None:
            values = _values(series, metric, metric.scale)
            return None if values is None else float(agg(values))
    return None


def _whole(value: float | None) -> int | None:
    """Block counts and sizes: a fractional value is not a count, so it is missing."""
    return int(value) if value is not None and value.is_integer() else None


def _histogram(index: Mapping[str, Series], candidates: Candidates) -> tuple[float | None, float | None]:
    """(_sum, _count) of the first histogram present, summed over series; both or neither."""
    for metric in candidates:
        counts = _matching(index, metric, "_count")
        if counts is None:
            continue
        sums = _matching(index, metric, "_sum") or []
        count_values, sum_values = _values(counts, metric, 1.0), _values(sums, metric, metric.scale)
        if not sums or count_values is None or sum_values is None:
            return None, None
        return sum(sum_values), float(sum(count_values))
    return None, None


def _models(index: Mapping[str, Series], model_labels: tuple[str, ...]) -> list[str]:
    """Served model names from any series carrying a model label, de-duplicated and sorted."""
    names: set[str] = set()
    for series in index.values():
        for labels, _ in series:
            name = next((labels[key] for key in model_labels if labels.get(key)), None)
            if name:
                names.add(name)
    return sorted(names)
