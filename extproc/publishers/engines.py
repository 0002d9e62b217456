"""Per-engine metric names, as data, and normalisation of a Prometheus /metrics scrape.

Each engine (vLLM, SGLang, llama.cpp server, TGI, TensorRT-LLM behind Triton or its own trtllm-serve,
and our simulator, which speaks vLLM's names) publishes load under different names and units. The
table below maps them onto one `EngineLoad`; adding an engine is adding a row, not a branch in code.
docs/engines.md is the reader's version of the table, with sources.
"""

from __future__ import annotations

import functools
import io
import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, fields

from prometheus_client.parser import text_fd_to_metric_families, text_string_to_metric_families

from extproc.fleet.snapshots import MAX_KV_BLOCKS


@dataclass(slots=True)
class EngineLoad:
    """One scrape, normalised. None means the engine does not publish that signal, or published a
    value that cannot be used; `rejected` then says which field and why (for the publisher's metrics).
    """

    num_running: float | None = None
    num_waiting: float | None = None
    kv_cache_usage: float | None = None  # fraction 0..1
    kv_blocks_total: int | None = None
    kv_blocks_free: int | None = None
    kv_tokens_total: int | None = None  # KV capacity in tokens, where the engine says it that way
    block_size: int | None = None  # tokens per KV block
    max_model_len: int | None = None
    gpu_utilization: float | None = None  # fraction 0..1
    gpu_memory_usage: float | None = None  # fraction 0..1 (from an NVIDIA DCGM exporter, see normalize_dcgm)
    gpu_model: str | None = None  # the GPU's name (DCGM's modelName label), a prefill-speed prior
    max_lora: int | None = None  # LoRA adapter slots in GPU memory
    max_num_seqs: int | None = None  # the most requests the engine runs at once
    # Cumulative counters; the publisher turns deltas between scrapes into rates and means.
    prefix_cache_hits: float | None = None
    prefix_cache_queries: float | None = None
    prefix_cache_hit_rate: float | None = None  # when the engine reports a rate directly (0..1)
    ttft_sum: float | None = None
    ttft_count: float | None = None
    tpot_sum: float | None = None
    tpot_count: float | None = None
    prompt_tokens: float | None = None  # prompt tokens processed (cached ones too where the table says)
    prefill_seconds: float | None = None  # summed per-request prefill time
    preemptions: float | None = None  # requests preempted (a prefill-rate sample over one is void)
    models: list[str] = field(default_factory=list)  # from the engine's own series only
    lora_adapters: list[str] = field(default_factory=list)  # running or waiting, newest report
    rejected: list[tuple[str, str]] = field(default_factory=list)  # (field, reason) per unusable value

    def has_load_signal(self) -> bool:
        """Whether anything says how busy the engine is; without it, it must not look idle."""
        return self.num_running is not None or self.num_waiting is not None or self.kv_cache_usage is not None


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
    kv_tokens_total: Candidates = ()  # capacity in tokens; gives kv_blocks_total when that is absent
    block_size: Candidates = ()
    max_model_len: Candidates = ()
    gpu_utilization: Candidates = ()
    max_lora: Candidates = ()  # LoRA adapter slots in GPU memory
    max_num_seqs: Candidates = ()  # the most requests the engine runs at once
    prefix_cache_hits: Candidates = ()
    prefix_cache_queries: Candidates = ()
    prefix_cache_hit_rate: Candidates = ()
    ttft: Candidates = ()  # histogram, seconds -> ttft_sum / ttft_count
    tpot: Candidates = ()  # histogram, seconds -> tpot_sum / tpot_count
    # Measured prefill throughput (publishers/prefill_rate.py): a prompt-token counter and a counter of
    # prefill seconds (a histogram's `_sum` sample reads as one); `prompt_tokens_cached`: the prompt
    # counter includes prefix-cache hits, which are subtracted (prefix_cache_hits).
    prompt_tokens: Candidates = ()
    prefill_seconds: Candidates = ()
    prompt_tokens_cached: bool = True
    preemptions: Candidates = ()  # a counter; intervals with preemptions give no prefill-rate sample
    model_labels: tuple[str, ...] = ()  # labels naming the served model, first present wins
    lora_info: tuple[str, ...] = ()  # info gauges listing LoRA adapters (vLLM's lora_requests_info)
    metrics_path: str = "/metrics"  # where the engine serves Prometheus text by default


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
# - lora_requests_info: a gauge whose value is the wall-clock time of its last update and whose labels
#   running_lora_adapters / waiting_lora_adapters are comma-separated adapter names, plus max_lora
#   (vLLM docs/design/metrics.md "LoRA Metrics"; the Gateway API Inference Extension's model-server
#   protocol, docs/proposals/003-model-server-protocol, reads it the same way). Newest series wins.
#   max_lora ("the maximum number of adapters that can be loaded to GPU memory to serve a batch", same
#   protocol document) is read as the adapter slots (the largest over the series: it is configuration).
# - prompt_tokens_total counts every prompt token, cached ones included (prefix_cache_hits_total is
#   subtracted for the prefill rate); request_prefill_time_seconds is the per-request time from first
#   scheduled to first token (V1 "PREFILL phase", docs/design/metrics.md), its `_sum` read as a counter.
# - num_preemptions ("Cumulative number of preemption from the engine", a counter): a request preempted
#   before its first token keeps its first scheduling time and has its hits counted again, so the
#   prefill rate takes no sample over an interval where it moved.
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
    prompt_tokens=_m("vllm:prompt_tokens_total"),
    prefill_seconds=_m("vllm:request_prefill_time_seconds_sum"),
    preemptions=_m("vllm:num_preemptions_total"),
    model_labels=("model_name",),
    lora_info=("vllm:lora_requests_info",),
    max_lora=_m("vllm:lora_requests_info", label="max_lora"),
)

# SGLang (--enable-metrics). Source: python/sglang/srt/metrics/collector.py (later
# python/sglang/srt/observability/metrics_collector.py) and
# https://docs.sglang.io/references/production_metrics.html
# Labels: model_name (plain `name` before ~v0.4), engine_type, tp_rank, pp_rank, dp_rank; with DP
# attention each rank reports its own series and the node total is their sum (sglang PR #7597).
# - token_usage is the KV pool's used fraction (0..1); cache_hit_rate a 0..1 rate.
# - page_size / num_pages gauges (v0.5.11+) replaced labels of sglang:cache_config_info.
# - max_total_num_tokens: gauge "Maximum total number of tokens in the KV cache pool" (SchedulerMetrics-
#   Collector in python/sglang/srt/metrics/collector.py; plain `name` label in the v0.3 docs). Used only
#   when no page count is published: blocks = tokens / page size (a page of 1 token when no page size).
#   A max_total_num_tokens label of cache_config_info was not found in SGLang's sources: not read.
# - prefix hits/queries: cached_tokens_total over prompt_tokens_total (both counted per finished
#   request), a token-weighted hit rate like vLLM's.
# - time_per_output_token_seconds was renamed inter_token_latency_seconds.
# - lora_pool_slots_total: "Total number of LoRA adapter slots available (max_loras_per_batch)", a gauge
#   created only with --enable-lora (SchedulerMetricsCollector in python/sglang/srt/metrics/collector.py);
#   read as the adapter slots (max over dp ranks: each rank has its own pool). SGLang publishes no
#   adapter names (lora_pool_slots_used is a count), so lora_adapters stays empty.
# - max_running_requests: gauge "Maximum running requests" in the v0.3 docs' example (the server's
#   --max-running-requests); read as the batch limit where published (max over series).
# Not offered: kv_blocks_free, gpu_utilization, LoRA adapter names.
_SGLANG = EngineMetrics(
    num_running=_m("sglang:num_running_reqs"),
    num_waiting=_m("sglang:num_queue_reqs"),
    kv_cache_usage=_m("sglang:token_usage"),
    kv_blocks_total=_m("sglang:num_pages") + _m("sglang:cache_config_info", label="num_pages"),
    kv_tokens_total=_m("sglang:max_total_num_tokens"),
    block_size=_m("sglang:page_size") + _m("sglang:cache_config_info", label="page_size"),
    max_model_len=_m("sglang:context_len"),
    prefix_cache_hits=_m("sglang:cached_tokens_total"),
    prefix_cache_queries=_m("sglang:prompt_tokens_total"),
    prefix_cache_hit_rate=_m("sglang:cache_hit_rate"),
    ttft=_m("sglang:time_to_first_token_seconds"),
    tpot=_m("sglang:inter_token_latency_seconds", "sglang:time_per_output_token_seconds"),
    max_lora=_m("sglang:lora_pool_slots_total"),
    max_num_seqs=_m("sglang:max_running_requests"),
    model_labels=("model_name", "name"),
)

# llama.cpp server (llama-server --metrics). Source: tools/server/README.md (GET /metrics) and the
# metrics handler in tools/server/server.cpp / server-context.cpp; no labels, one model per server.
# - kv_cache_usage_ratio (0..1) was removed with kv_cache_tokens in llama.cpp PR #13660 (May 2025);
#   current builds publish no KV signal (PR #24010 proposes new ones).
# - prompt_tokens_total / prompt_seconds_total: prompt tokens the server evaluated and the time it
#   took (cached prompt tokens are not evaluated, so not counted): the prefill rate directly.
# Not offered: KV blocks, block size, max_model_len, gpu_utilization, prefix cache, TTFT, TPOT.
_LLAMACPP = EngineMetrics(
    num_running=_m("llamacpp:requests_processing"),
    num_waiting=_m("llamacpp:requests_deferred"),
    kv_cache_usage=_m("llamacpp:kv_cache_usage_ratio"),
    prompt_tokens=_m("llamacpp:prompt_tokens_total"),
    prefill_seconds=_m("llamacpp:prompt_seconds_total"),
    prompt_tokens_cached=False,
)

# Hugging Face TGI. Source: https://huggingface.co/docs/text-generation-inference/reference/metrics
# (docs/source/reference/metrics.md); emitted by the Rust metrics-exporter-prometheus, no model label.
# - tgi_batch_current_size is the running batch; tgi_queue_size the waiting queue.
# - tgi_request_mean_time_per_token_duration is each request's inference time / generated tokens,
#   so it includes prefill: TPOT-like, not ITL.
# Not offered: any KV signal, max_model_len, gpu_utilization, prefix cache, TTFT, LoRA adapters or
# slots (TGI loads the adapters named in LORA_ADAPTERS at launch, docs/source/conceptual/lora.md, and
# no metric lists them).
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

# TensorRT-LLM's own OpenAI server (`trtllm-serve`), GET /prometheus/metrics, every name prefixed
# `trtllm_`. Sources: NVIDIA/TensorRT-LLM examples/serve/prometheus_metrics.py (the endpoint, the prefix,
# trtllm_kv_cache_utilization, trtllm_time_to_first_token_seconds) and tensorrt_llm/metrics/collector.py
# (MetricsCollector: time_to_first_token_seconds / time_per_output_token_seconds histograms, labels
# model_name and engine_type); the running / waiting / block gauges (trtllm_num_requests_running,
# trtllm_num_requests_waiting, trtllm_kv_cache_max_blocks, trtllm_kv_cache_tokens_per_block) as the
# Gateway API Inference Extension's model-server protocol (docs/proposals/003-model-server-protocol)
# and llm-d-router's built-in engine configs list them for "trtllm-serve". Not checked against a live
# server here (docs/engines.md says so).
# - kv_cache_utilization is read as a 0..1 fraction (as every other engine's); publishers reject
#   values above 1.5 rather than guess a percent.
# Not offered: kv_blocks_free, max_model_len, gpu_utilization, prefix cache counters
# (trtllm_kv_cache_hit_rate exists, but its unit and window are not documented: not read).
_TRTLLM_SERVE = EngineMetrics(
    num_running=_m("trtllm_num_requests_running"),
    num_waiting=_m("trtllm_num_requests_waiting"),
    kv_cache_usage=_m("trtllm_kv_cache_utilization"),
    kv_blocks_total=_m("trtllm_kv_cache_max_blocks"),
    block_size=_m("trtllm_kv_cache_tokens_per_block"),
    ttft=_m("trtllm_time_to_first_token_seconds"),
    tpot=_m("trtllm_time_per_output_token_seconds"),
    model_labels=("model_name",),
    metrics_path="/prometheus/metrics",
)

ENGINE_METRICS: dict[str, EngineMetrics] = {
    "vllm": _VLLM,
    "sglang": _SGLANG,
    "llamacpp": _LLAMACPP,
    "tgi": _TGI,
    "trtllm": _TRTLLM,
    "trtllm-serve": _TRTLLM_SERVE,
    "sim": _VLLM,  # extproc_lab.engines speaks exactly vLLM's names
}

# Generic rules, not per engine: fractions and sizes take the max over series, counts the sum.
_MAX_FIELDS = frozenset(
    {
        "kv_cache_usage",
        "gpu_utilization",
        "prefix_cache_hit_rate",
        "block_size",
        "max_model_len",
        "max_lora",
        "max_num_seqs",
    }
)
_INT_FIELDS = frozenset(
    {
        "kv_blocks_total",
        "kv_blocks_free",
        "kv_tokens_total",
        "block_size",
        "max_model_len",
        "max_lora",
        "max_num_seqs",
    }
)
_HISTOGRAMS = ("ttft", "tpot")
_NOT_SCALARS = {*_HISTOGRAMS, "model_labels", "lora_info", "metrics_path", "prompt_tokens_cached"}
_SCALARS = tuple(f.name for f in fields(EngineMetrics) if f.name not in _NOT_SCALARS)
_LORA_LABELS = ("running_lora_adapters", "waiting_lora_adapters")

Series = list[tuple[dict[str, str], float]]


def normalize(engine: str, exposition: str, *, deadline: float | None = None) -> EngineLoad:
    """Map one /metrics scrape of `engine` onto an EngineLoad.

    Series matching one candidate are summed (counts) or maxed (fractions, sizes). A NaN, infinite
    or negative value, a label that is not a number, or a fractional block count makes that field
    None rather than a guess, and is listed in `rejected` with its reason. Nothing is clamped: a kv
    usage above 1.0 is returned as read and the caller validates ranges. Models and LoRA adapters
    come only from series of this engine's own table, never from an unrelated series' labels.
    Raises ValueError for an unknown engine or text that is not Prometheus exposition, and
    ParseTimeout once `deadline` (a time.monotonic() value) has passed while parsing.
    """
    spec = ENGINE_METRICS.get(engine)
    if spec is None:
        raise ValueError(f"unknown engine {engine!r}; known: {', '.join(sorted(ENGINE_METRICS))}")
    index = _index(exposition, deadline)
    load = EngineLoad()
    for name in _SCALARS:
        value, reason = _scalar(index, getattr(spec, name), max if name in _MAX_FIELDS else sum)
        if name in _INT_FIELDS and value is not None and not value.is_integer():
            value, reason = None, "fractional"  # a block count or size that is not whole is no count
        if reason is not None:
            load.rejected.append((name, reason))
        setattr(load, name, int(value) if name in _INT_FIELDS and value is not None else value)
    for name in _HISTOGRAMS:
        total, count, reason = _histogram(index, getattr(spec, name))
        if reason is not None:
            load.rejected.append((name, reason))
        setattr(load, f"{name}_sum", total)
        setattr(load, f"{name}_count", count)
    # Capacity given in tokens (SGLang's max_total_num_tokens) when no block count is: a block of
    # `block_size` tokens, or of one token when the engine gives no size (the product stays exact).
    if load.kv_blocks_total is None and load.kv_tokens_total is not None:
        if load.block_size is None:
            load.block_size = 1
        load.kv_blocks_total = load.kv_tokens_total // load.block_size if load.block_size else None
    # Engines that publish blocks but no fraction (older Triton backends): used / total is exact, if
    # both counts are sane (an absurd total would make any engine look full or empty).
    total, free = load.kv_blocks_total, load.kv_blocks_free
    if load.kv_cache_usage is None and total and free is not None and free <= total <= MAX_KV_BLOCKS:
        load.kv_cache_usage = (total - free) / total
    own = _own_samples(engine)
    load.models = _models(index, own, spec.model_labels)
    load.lora_adapters = _lora_adapters(index, spec.lora_info)
    return load


@functools.cache
def _own_samples(engine: str) -> frozenset[str]:
    """Sample names of one engine's table: the only series whose labels may name its models."""
    spec = ENGINE_METRICS[engine]
    names: set[str] = set()
    for name in _SCALARS:
        names.update(m.name for m in getattr(spec, name))
    for name in _HISTOGRAMS:
        for m in getattr(spec, name):
            names.update(m.name + suffix for suffix in ("_sum", "_count", "_bucket"))
    return frozenset(names)


class ParseTimeout(TimeoutError):
    """Parsing a scrape ran past its deadline (the publisher drops that scrape)."""


# Longest exposition line parsed under a deadline. The text parser is quadratic in a line's label
# count, so one huge line can run far past the deadline, which is only checked between lines; real
# lines are under 1 KB (a LoRA info line listing adapters, a few KB).
MAX_LINE_CHARS = 64 * 1024


class _Lines(io.StringIO):
    """The exposition's lines, for the parser, checking the clock before each one: a page the scrape
    deadline cannot afford stops costing CPU there, not when the whole page is parsed (one family of
    many samples is only yielded at its end, so checking per family is not enough). A line longer
    than MAX_LINE_CHARS is refused, so no single line can run far past the deadline."""

    def __init__(self, text: str, deadline: float) -> None:
        super().__init__(text)
        self._deadline = deadline
        self._count = 0

    def __next__(self) -> str:  # type: ignore[override]  # typeshed: _IOBase says bytes
        if time.monotonic() > self._deadline:
            raise ParseTimeout(f"parse deadline passed after {self._count} lines")
        line = super().__next__()
        self._count += 1
        if len(line) > MAX_LINE_CHARS:
            raise ValueError(f"line {self._count} is longer than {MAX_LINE_CHARS} characters")
        return line


def _index(exposition: str, deadline: float | None = None) -> dict[str, Series]:
    """Sample name -> [(labels, value)]; every parser failure becomes a short ValueError, and passing
    `deadline` (time.monotonic()) a ParseTimeout."""
    index: dict[str, Series] = {}
    try:
        if deadline is None:
            families = text_string_to_metric_families(exposition)
        else:
            families = text_fd_to_metric_families(_Lines(exposition, deadline))
        for family in families:
            for sample in family.samples:
                index.setdefault(sample.name, []).append((sample.labels, float(sample.value)))
    except ParseTimeout:
        raise
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


def _number(raw: float | str | None, scale: float) -> tuple[float | None, str | None]:
    """A finite, non-negative number, or (None, reason): load signals are never negative."""
    if raw is None:
        return None, "missing_label"
    try:
        value = float(raw) * scale
    except ValueError:  # a label such as num_gpu_blocks="None"
        return None, "not_a_number"
    if math.isnan(value):
        return None, "nan"
    if math.isinf(value):
        return None, "infinite"
    if value < 0:
        return None, "negative"
    return value, None


def _values(series: Series, metric: Metric, scale: float) -> tuple[list[float] | None, str | None]:
    """Numbers of every series, or (None, reason) if any one is unusable (a partial sum would mislead)."""
    out = []
    for labels, value in series:
        number, reason = _number(labels.get(metric.label) if metric.label else value, scale)
        if number is None:
            return None, reason
        out.append(number)
    return out, None


def _scalar(
    index: Mapping[str, Series], candidates: Candidates, agg: Callable[[Iterable[float]], float]
) -> tuple[float | None, str | None]:
    """The first candidate present in the scrape, aggregated over its series, or (None, reason)."""
    for metric in candidates:
        series = _matching(index, metric)
        if series is not None:
            values, reason = _values(series, metric, metric.scale)
            return (None, reason) if values is None else (float(agg(values)), None)
    return None, None


def _histogram(
    index: Mapping[str, Series], candidates: Candidates
) -> tuple[float | None, float | None, str | None]:
    """(_sum, _count) of the first histogram present, summed over series; both or neither."""
    for metric in candidates:
        counts = _matching(index, metric, "_count")
        if counts is None:
            continue
        sums = _matching(index, metric, "_sum")
        if sums is None:
            return None, None, "missing_sum"
        count_values, count_reason = _values(counts, metric, 1.0)
        sum_values, sum_reason = _values(sums, metric, metric.scale)
        if count_values is None or sum_values is None:
            return None, None, count_reason or sum_reason
        return sum(sum_values), float(sum(count_values)), None
    return None, None, None


def _models(index: Mapping[str, Series], own: frozenset[str], model_labels: tuple[str, ...]) -> list[str]:
    """Served model names from the engine's own series carrying a model label, de-duplicated, sorted."""
    names: set[str] = set()
    for sample in own & index.keys():
        for labels, _ in index[sample]:
            name = next((labels[key] for key in model_labels if labels.get(key)), None)
            if name:
                names.add(name)
    return sorted(names)


def _lora_adapters(index: Mapping[str, Series], info_names: tuple[str, ...]) -> list[str]:
    """Adapters running or waiting in the newest series of a LoRA info gauge (its value is the time it
    was written, so a stale series from an earlier engine state loses), de-duplicated and sorted."""
    for name in info_names:
        series = [(labels, value) for labels, value in index.get(name, ()) if math.isfinite(value)]
        if not series:
            continue
        labels, _ = max(series, key=lambda s: s[1])
        adapters = {a.strip() for key in _LORA_LABELS for a in labels.get(key, "").split(",")}
        adapters.discard("")
        return sorted(adapters)
    return []


# -- NVIDIA DCGM exporter (GPU utilisation and memory, per instance) ------------------------------------
# dcgm-exporter serves one series per GPU of its node (default :9400/metrics), labelled gpu (the index),
# UUID, pci_bus_id, device, modelName and Hostname (plus pod / namespace / container with Kubernetes pod
# mapping, GPU_I_ID / GPU_I_PROFILE for MIG instances). Sources: NVIDIA/dcgm-exporter
# etc/default-counters.csv and etc/dcp-metrics-included.csv (names, types, help texts) and
# https://docs.nvidia.com/datacenter/dcgm/latest/reference/dcgm-exporter-metrics.html
# - DCGM_FI_DEV_GPU_UTIL: gauge, "GPU utilization (in %)", 0..100: scaled to 0..1.
# - DCGM_FI_PROF_GR_ENGINE_ACTIVE: gauge, "Ratio of time the graphics engine is active" (0..1; a DCP
#   metric, in dcp-metrics-included.csv, and the one reported for MIG instances): used only without
#   DCGM_FI_DEV_GPU_UTIL.
# - DCGM_FI_DEV_FB_USED / DCGM_FI_DEV_FB_FREE: gauges, "Framebuffer memory used / free (in MiB)";
#   usage = used / (used + free) per GPU. Engines that preallocate their KV cache (vLLM, SGLang, TGI)
#   sit near their configured fraction whatever the load: published for operators, not scored.
# An instance's GPUs are chosen by `gpu` index or `UUID` (publisher config `dcgm_gpus`; all the
# exporter's GPUs when empty); the busiest GPU's utilisation and the fullest GPU's memory count.
DCGM_UTILIZATION: Candidates = (
    Metric("DCGM_FI_DEV_GPU_UTIL", scale=0.01),
    Metric("DCGM_FI_PROF_GR_ENGINE_ACTIVE"),
)
DCGM_FB_USED = "DCGM_FI_DEV_FB_USED"
DCGM_FB_FREE = "DCGM_FI_DEV_FB_FREE"
DCGM_GPU_LABELS = ("gpu", "UUID")


@dataclass(slots=True)
class GpuReading:
    """One DCGM scrape, reduced to one instance's GPUs. None: not published (or unusable)."""

    utilization: float | None = None  # 0..1, the busiest selected GPU
    memory_usage: float | None = None  # 0..1, the fullest selected GPU
    gpus: int = 0  # GPUs matched by the selection
    model: str | None = None  # the selected GPUs' modelName (the first one's)
    rejected: list[tuple[str, str]] = field(default_factory=list)


def normalize_dcgm(exposition: str, gpus: Iterable[str] = (), *, deadline: float | None = None) -> GpuReading:
    """Read GPU utilisation and memory use of the GPUs in `gpus` (indices or UUIDs; every GPU when
    empty) from a dcgm-exporter scrape. A value that is not a finite, non-negative number leaves its
    field None, with the reason in `rejected`, as in `normalize`. Raises ValueError for text that is
    not Prometheus exposition, and ParseTimeout once `deadline` (time.monotonic()) has passed."""
    wanted = frozenset(gpus)
    index = _index(exposition, deadline)

    def selected(name: str) -> Series:
        series = index.get(name, [])
        if not wanted:
            return series
        return [(lb, v) for lb, v in series if any(lb.get(k) in wanted for k in DCGM_GPU_LABELS)]

    reading = GpuReading()
    for name in (*(m.name for m in DCGM_UTILIZATION), DCGM_FB_USED):
        model = next((lb["modelName"] for lb, _ in selected(name) if lb.get("modelName")), None)
        if model is not None:
            reading.model = model
            break
    for metric in DCGM_UTILIZATION:
        series = selected(metric.name)
        if not series:
            continue
        values, reason = _values(series, metric, metric.scale)
        if values is None:
            reading.rejected.append(("gpu_utilization", reason or "unusable"))
        else:
            reading.utilization = max(values)
        reading.gpus = len(series)
        break
    free = {_gpu_key(lb): v for lb, v in selected(DCGM_FB_FREE)}
    usages: list[float] = []
    for labels, used in selected(DCGM_FB_USED):
        reading.gpus = max(reading.gpus, 1)
        total = used + free.get(_gpu_key(labels), math.nan)
        if not math.isfinite(total) or used < 0 or total <= 0 or used > total:
            reading.rejected.append(("gpu_memory_usage", "unusable"))
            usages = []
            break
        usages.append(used / total)
    if usages:
        reading.memory_usage = max(usages)
    return reading


def _gpu_key(labels: Mapping[str, str]) -> tuple[str, str, str]:
    """One GPU (or MIG instance) of the exporter: its UUID, index and MIG instance id."""
    return labels.get("UUID", ""), labels.get("gpu", ""), labels.get("GPU_I_ID", "")
