"""Unit tests for extproc.publishers.publisher: readiness, snapshot fields, load normalisation into the
snapshot, configuration, and one publish tick against a simulated engine and a fake Redis client."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from extproc.fleet import snapshot_pb2 as spb
from extproc.fleet.snapshots import decode
from extproc.publishers import InstanceSpec, Publisher, PublisherConfig, load_publisher_config
from extproc.publishers.config import instance_from_dict
from extproc.publishers.engines import EngineLoad
from extproc.publishers.snapshot_fields import _fill_load, _Previous
from extproc.settings import DEFAULT_PUBLISH_INTERVAL_S, ConfigError, RedisSettings
from extproc_lab.engines import SimEngine
from extproc_lab.engines.profiles import A10G_LLAMA3_8B

SPEC = InstanceSpec(cluster="gpu-a", address="10.0.0.5:8000", models=("llama",), capacity_weight=2.0)


def publisher(**kw: Any) -> Publisher:
    cfg = PublisherConfig(redis=RedisSettings(pool="p"), instances=[SPEC], publisher_id="pub-1", **kw)
    return Publisher(cfg)


def load(**kw: Any) -> EngineLoad:
    base: dict[str, Any] = {
        "num_running": 2,
        "num_waiting": 1,
        "kv_cache_usage": 0.3,
        "models": ["from-load"],
    }
    base.update(kw)
    return EngineLoad(**base)


# -- readiness -----------------------------------------------------------------------------------------
def test_health_none_is_down() -> None:
    p = publisher()
    assert p.snapshot(SPEC, None, load(), _Previous()).readiness == spb.DOWN
    prev = _Previous(ready_seen=True)
    assert p.snapshot(SPEC, None, None, prev).readiness == spb.DOWN


def test_spec_draining_is_draining() -> None:
    p = publisher()
    spec = InstanceSpec(cluster="gpu-a", address="10.0.0.5:8000", draining=True)
    assert p.snapshot(spec, 200, load(), _Previous()).readiness == spb.DRAINING


def test_health_200_with_load_is_ready() -> None:
    prev = _Previous()
    snap = publisher().snapshot(SPEC, 200, load(), prev)
    assert snap.readiness == spb.READY
    assert prev.ready_seen


def test_not_ready_before_first_ready_is_warming_up() -> None:
    p = publisher()
    prev = _Previous()
    assert p.snapshot(SPEC, 503, None, prev).readiness == spb.WARMING_UP
    assert p.snapshot(SPEC, 503, load(), prev).readiness == spb.WARMING_UP
    assert not prev.ready_seen


def test_not_200_after_ready_is_draining() -> None:
    p = publisher()
    prev = _Previous()
    assert p.snapshot(SPEC, 200, load(), prev).readiness == spb.READY
    assert p.snapshot(SPEC, 503, load(), prev).readiness == spb.DRAINING
    assert p.snapshot(SPEC, 500, None, prev).readiness == spb.DRAINING
    assert p.snapshot(SPEC, 200, load(), prev).readiness == spb.READY


def test_health_200_without_metrics_is_not_ready() -> None:
    p = publisher()
    assert p.snapshot(SPEC, 200, None, _Previous()).readiness == spb.WARMING_UP
    prev = _Previous(ready_seen=True)
    assert p.snapshot(SPEC, 200, None, prev).readiness != spb.READY


def test_no_load_signal_is_warming_up_with_a_reason() -> None:
    # Empty /metrics, a wrong engine kind, or every load value rejected: READY would read as idle.
    p = publisher()
    for ld in (EngineLoad(), EngineLoad(num_running=float("nan")), EngineLoad(kv_blocks_total=100)):
        snap = p.snapshot(SPEC, 200, ld, _Previous())
        assert snap.readiness == spb.WARMING_UP
        assert snap.readiness_reason == "no_load_signal"
    prev = _Previous(ready_seen=True)
    assert p.snapshot(SPEC, 200, EngineLoad(), prev).readiness == spb.WARMING_UP


def test_partial_load_is_ready_with_the_rest_unknown() -> None:
    snap = publisher().snapshot(SPEC, 200, EngineLoad(num_running=3.0), _Previous())
    assert snap.readiness == spb.READY and snap.readiness_reason == ""
    st = decode(snap.SerializeToString(), frozenset({"gpu-a"}))
    assert (st.num_running, st.num_waiting, st.kv_cache_usage) == (3, None, None)


def test_readiness_reasons() -> None:
    p = publisher()
    assert p.snapshot(SPEC, None, None, _Previous(), detail="timeout").readiness_reason == "timeout"
    assert p.snapshot(SPEC, None, None, _Previous()).readiness_reason == "unreachable"
    assert p.snapshot(SPEC, 503, load(), _Previous()).readiness_reason == "health_status_503"
    assert p.snapshot(SPEC, 200, None, _Previous(), detail="bad_metrics").readiness_reason == "bad_metrics"


def test_rejected_values_are_counted_per_instance() -> None:
    p = publisher()
    ld = load(num_waiting=float("inf"), kv_blocks_total=10**20, rejected=[("block_size", "fractional")])
    snap = p.snapshot(SPEC, 200, ld, _Previous())
    assert snap.readiness == spb.READY  # running and KV usage are still known
    assert not snap.HasField("num_waiting") and snap.kv_blocks_total == 0
    uid = SPEC.upstream_id
    for field, reason in (
        ("num_waiting", "infinite"),
        ("kv_blocks_total", "too_large"),
        ("block_size", "fractional"),
    ):
        value = p.metrics.value(
            "llm_extproc_publisher_rejected_values_total", upstream=uid, field=field, reason=reason
        )
        assert value == 1.0, (field, reason)


def test_models_and_adapters_readers_would_reject_are_left_out() -> None:
    p = publisher()
    bare = InstanceSpec(cluster="gpu-a", address="10.0.0.5:8000")
    snap = p.snapshot(bare, 200, load(models=["ok", "x" * 300], lora_adapters=["a", ""]), _Previous())
    assert list(snap.models) == ["ok"] and list(snap.lora_adapters) == ["a"]
    many = [f"m{i}" for i in range(300)]
    snap = p.snapshot(bare, 200, load(models=many, lora_adapters=many), _Previous())
    assert list(snap.models) == [] and list(snap.lora_adapters) == []  # readers fall back to config
    st = decode(snap.SerializeToString(), frozenset({"gpu-a"}))
    assert st.ready


def test_lora_adapters_published() -> None:
    snap = publisher().snapshot(SPEC, 200, load(lora_adapters=["sql", "chat"]), _Previous())
    st = decode(snap.SerializeToString(), frozenset({"gpu-a"}))
    assert st.lora_adapters == frozenset({"sql", "chat"})


# -- snapshot fields -----------------------------------------------------------------------------------
def test_snapshot_identity_and_publication_fields() -> None:
    p = publisher(interval_s=1.0)
    before = int(time.time() * 1000)
    snap = p.snapshot(SPEC, 200, load(), _Previous())
    after = int(time.time() * 1000)
    assert snap.upstream_id == "gpu-a/10.0.0.5:8000"
    assert snap.cluster == "gpu-a"
    assert snap.address == "10.0.0.5:8000"
    assert snap.engine == "vllm"
    assert snap.capacity_weight == 2.0
    assert snap.publisher_id == "pub-1"
    assert before <= snap.published_at_ms <= after
    assert snap.ttl_ms == 3000
    assert snap.num_running == 2 and snap.num_waiting == 1
    assert snap.kv_cache_usage == pytest.approx(0.3)


def test_sequence_strictly_increasing() -> None:
    p = publisher()
    seqs = [p.snapshot(SPEC, 200, load(), _Previous()).sequence for _ in range(5)]
    assert seqs == list(range(seqs[0], seqs[0] + 5))
    assert seqs[0] > int(time.time() * 1000) - 60_000  # seeded from the clock: survives restarts


@pytest.mark.parametrize(
    ("interval", "ttl", "want"), [(1.0, None, 3000), (0.5, None, 2000), (0.1, None, 2000), (1.0, 7.5, 7500)]
)
def test_ttl_ms(interval: float, ttl: float | None, want: int) -> None:
    p = publisher(interval_s=interval, ttl_s=ttl)
    assert p.config.ttl_ms == want
    assert p.snapshot(SPEC, 200, load(), _Previous()).ttl_ms == want


def test_models_from_spec_else_from_load() -> None:
    p = publisher()
    assert list(p.snapshot(SPEC, 200, load(), _Previous()).models) == ["llama"]
    bare = InstanceSpec(cluster="gpu-a", address="10.0.0.5:8000")
    assert list(p.snapshot(bare, 200, load(models=["a", "b"]), _Previous()).models) == ["a", "b"]
    assert list(p.snapshot(bare, None, None, _Previous()).models) == []


def test_no_load_leaves_load_fields_unset() -> None:
    snap = publisher().snapshot(SPEC, 503, None, _Previous())
    assert (snap.num_running, snap.num_waiting, snap.kv_cache_usage, snap.kv_blocks_total) == (0, 0, 0.0, 0)
    assert not snap.HasField("ttft_seconds")


def test_snapshot_passes_service_validation() -> None:
    snap = publisher().snapshot(SPEC, 200, load(kv_blocks_total=100), _Previous())
    st = decode(snap.SerializeToString(), frozenset({"gpu-a"}))
    assert st.ready and st.weight == 2.0 and st.models == frozenset({"llama"})
    assert (st.kv_blocks_total, st.kv_blocks_free) == (100, 70)


# -- _fill_load ----------------------------------------------------------------------------------------
def fill(ld: EngineLoad, prev: _Previous | None = None, engine: str = "") -> spb.UpstreamSnapshot:
    snap = spb.UpstreamSnapshot(engine=engine)
    _fill_load(snap, ld, prev or _Previous())
    return snap


def test_kv_usage_from_blocks_when_fraction_missing() -> None:
    snap = fill(EngineLoad(kv_blocks_total=200, kv_blocks_free=50))
    assert snap.kv_cache_usage == pytest.approx(0.75)
    assert (snap.kv_blocks_total, snap.kv_blocks_free) == (200, 50)


def test_kv_blocks_free_estimated_from_usage() -> None:
    snap = fill(EngineLoad(kv_cache_usage=0.3, kv_blocks_total=1000))
    assert snap.kv_blocks_free == 700
    snap = fill(EngineLoad(kv_cache_usage=1.2, kv_blocks_total=1000))
    assert snap.kv_blocks_free == 0
    assert snap.kv_cache_usage == pytest.approx(1.2)  # not clamped here; readers clamp


def test_kv_blocks_free_above_total_is_rejected_then_estimated_from_usage() -> None:
    snap = spb.UpstreamSnapshot()
    rejected = _fill_load(
        snap, EngineLoad(kv_cache_usage=0.1, kv_blocks_total=100, kv_blocks_free=150), _Previous()
    )
    assert rejected == [("kv_blocks_free", "above_total")]
    assert (snap.kv_blocks_total, snap.kv_blocks_free) == (100, 90)


def test_no_blocks_total_leaves_blocks_unset() -> None:
    snap = fill(EngineLoad(kv_cache_usage=0.4, kv_blocks_free=10))
    assert (snap.kv_blocks_total, snap.kv_blocks_free) == (0, 0)
    assert snap.kv_cache_usage == pytest.approx(0.4)


def test_counts_out_of_range_are_left_unknown_not_clamped() -> None:
    snap = spb.UpstreamSnapshot()
    ld = EngineLoad(num_running=2_000_000.0, num_waiting=-3.0, block_size=16, max_model_len=3.7)
    rejected = _fill_load(snap, ld, _Previous())
    assert rejected == [("num_running", "too_large"), ("num_waiting", "negative")]
    assert not snap.HasField("num_running") and not snap.HasField("num_waiting")
    assert (snap.block_size, snap.max_model_len) == (16, 3)
    snap = fill(EngineLoad())
    assert not snap.HasField("num_running") and not snap.HasField("num_waiting")
    assert not snap.HasField("kv_cache_usage")
    assert (snap.block_size, snap.max_model_len) == (0, 0)


def test_zero_load_is_present_not_absent() -> None:
    snap = fill(EngineLoad(num_running=0.0, num_waiting=0.0, kv_cache_usage=0.0))
    assert snap.HasField("num_running") and snap.HasField("num_waiting") and snap.HasField("kv_cache_usage")


@pytest.mark.parametrize(
    ("kw", "field", "reason"),
    [
        ({"kv_cache_usage": -0.2}, "kv_cache_usage", "negative"),
        ({"kv_cache_usage": 1.6}, "kv_cache_usage", "too_large"),
        ({"kv_cache_usage": float("nan")}, "kv_cache_usage", "nan"),
        ({"num_running": float("inf")}, "num_running", "infinite"),
        ({"kv_blocks_total": 10**20}, "kv_blocks_total", "too_large"),  # uint64 overflow before
        ({"kv_blocks_free": 10**20, "kv_blocks_total": 10}, "kv_blocks_free", "too_large"),
        ({"block_size": 1 << 40}, "block_size", "too_large"),
        ({"max_model_len": 1 << 40}, "max_model_len", "too_large"),
        ({"gpu_utilization": 50.0}, "gpu_utilization", "too_large"),
    ],
)
def test_out_of_range_values_are_rejected_with_a_reason(kw: dict[str, Any], field: str, reason: str) -> None:
    snap = spb.UpstreamSnapshot()
    assert (field, reason) in _fill_load(snap, EngineLoad(**kw), _Previous())
    assert not snap.HasField(field) if field in ("kv_cache_usage", "num_running", "gpu_utilization") else True
    snap.SerializeToString()  # whatever was kept fits the schema


def test_absurd_latency_mean_is_rejected() -> None:
    prev = _Previous()
    fill(EngineLoad(ttft_sum=0.0, ttft_count=1), prev)
    snap = spb.UpstreamSnapshot()
    assert ("ttft", "too_large") in _fill_load(snap, EngineLoad(ttft_sum=1e9, ttft_count=2), prev)
    assert not snap.HasField("ttft_seconds")


def test_gpu_utilization_copied_when_present() -> None:
    assert fill(EngineLoad(gpu_utilization=0.66)).gpu_utilization == pytest.approx(0.66)
    assert not fill(EngineLoad()).HasField("gpu_utilization")


def test_ttft_tpot_interval_means() -> None:
    prev = _Previous()
    s1 = fill(EngineLoad(ttft_sum=10.0, ttft_count=5, tpot_sum=1.0, tpot_count=100), prev)
    assert not s1.HasField("ttft_seconds") and not s1.HasField("tpot_seconds")  # first scrape
    s2 = fill(EngineLoad(ttft_sum=13.0, ttft_count=8, tpot_sum=3.0, tpot_count=300), prev)
    assert s2.ttft_seconds == pytest.approx(1.0)
    assert s2.tpot_seconds == pytest.approx(0.01)
    s3 = fill(EngineLoad(ttft_sum=13.0, ttft_count=8, tpot_sum=3.0, tpot_count=300), prev)
    assert not s3.HasField("ttft_seconds")  # no new requests in the interval
    # Engine restart: counters go backwards. No mean from that scrape; the next one counts again.
    s4 = fill(EngineLoad(ttft_sum=0.5, ttft_count=1, tpot_sum=0.1, tpot_count=10), prev)
    assert not s4.HasField("ttft_seconds") and not s4.HasField("tpot_seconds")
    s5 = fill(EngineLoad(ttft_sum=2.5, ttft_count=3, tpot_sum=0.4, tpot_count=20), prev)
    assert s5.ttft_seconds == pytest.approx(1.0)
    assert s5.tpot_seconds == pytest.approx(0.03)


def test_missing_histogram_keeps_previous_counters() -> None:
    prev = _Previous()
    fill(EngineLoad(ttft_sum=1.0, ttft_count=1), prev)
    fill(EngineLoad(), prev)  # a scrape without the histogram
    assert prev.ttft == (1.0, 1)
    assert fill(EngineLoad(ttft_sum=3.0, ttft_count=3), prev).ttft_seconds == pytest.approx(1.0)


def test_prefix_hit_rate_interval_and_fallback() -> None:
    prev = _Previous()
    s1 = fill(EngineLoad(prefix_cache_hits=100, prefix_cache_queries=400), prev)
    assert not s1.HasField("prefix_cache_hit_rate")
    s2 = fill(EngineLoad(prefix_cache_hits=400, prefix_cache_queries=800), prev)
    assert s2.prefix_cache_hit_rate == pytest.approx(0.75)
    s3 = fill(EngineLoad(prefix_cache_hits=0, prefix_cache_queries=0), prev)  # restart
    assert not s3.HasField("prefix_cache_hit_rate")
    # An engine that reports a rate directly, used when no interval rate exists.
    s4 = fill(EngineLoad(prefix_cache_hit_rate=0.4), _Previous())
    assert s4.prefix_cache_hit_rate == pytest.approx(0.4)
    s5 = fill(EngineLoad(prefix_cache_hit_rate=1.7), _Previous())
    assert s5.prefix_cache_hit_rate == 1.0


def test_prefill_rate_from_vllm_counters_subtracts_cache_hits() -> None:
    prev = _Previous()
    first = EngineLoad(prompt_tokens=10_000, prefix_cache_hits=4_000, prefill_seconds=2.0)
    assert not fill(first, prev, "vllm").HasField("prefill_tokens_per_s")  # one scrape: no delta
    # 9k prompt tokens of which 3k cached, in 3 s of prefill: 2k uncached tokens per second.
    later = EngineLoad(prompt_tokens=19_000, prefix_cache_hits=7_000, prefill_seconds=5.0)
    assert fill(later, prev, "vllm").prefill_tokens_per_s == pytest.approx(2_000)
    # Without the hit counter vLLM's prompt counter says nothing about uncached work: no new figure.
    blind = EngineLoad(prompt_tokens=40_000, prefill_seconds=6.0)
    assert fill(blind, prev, "vllm").prefill_tokens_per_s == pytest.approx(2_000)
    # An interval with a preemption is no sample (its prefill seconds count time back in the queue).
    fill(
        EngineLoad(prompt_tokens=19_000, prefix_cache_hits=7_000, prefill_seconds=5.0, preemptions=0),
        prev,
        "vllm",
    )
    slow = EngineLoad(prompt_tokens=20_000, prefix_cache_hits=7_900, prefill_seconds=9.0, preemptions=2)
    assert fill(slow, prev, "vllm").prefill_tokens_per_s == pytest.approx(2_000)
    assert list(prev.prefill._samples) == [pytest.approx(2_000)]  # the 25 tokens/s interval not taken


def test_prefill_rate_from_llamacpp_counters_has_no_hits_to_subtract() -> None:
    prev = _Previous()
    fill(EngineLoad(prompt_tokens=1_000, prefill_seconds=1.0), prev, "llamacpp")
    snap = fill(EngineLoad(prompt_tokens=1_600, prefill_seconds=2.0), prev, "llamacpp")
    assert snap.prefill_tokens_per_s == pytest.approx(600)
    assert not fill(EngineLoad(prompt_tokens=1, prefill_seconds=1.0), _Previous()).HasField(
        "prefill_tokens_per_s"
    )  # an unknown engine kind: no table row says what its counters mean


def test_the_counters_readers_calibrate_against_are_copied_as_they_are() -> None:
    """vLLM's prompt counter (cached tokens included) and the TTFT histogram's count and sum, as
    cumulative values; SGLang's prompt counter is the one its table reads as prefix-cache queries;
    llama.cpp's leaves cached tokens out: only the TTFT pair; without the pair, nothing."""
    load = EngineLoad(prompt_tokens=19_000, prefix_cache_hits=7_000, ttft_sum=12.5, ttft_count=40)
    snap = fill(load, _Previous(), "vllm")
    assert (snap.prompt_tokens_total, snap.first_tokens_total, snap.ttft_seconds_total) == (19_000, 40, 12.5)
    sglang = fill(EngineLoad(prefix_cache_queries=8_000, ttft_sum=1.0, ttft_count=4), _Previous(), "sglang")
    assert (sglang.prompt_tokens_total, sglang.first_tokens_total) == (8_000, 4)
    llama = fill(EngineLoad(prompt_tokens=500, ttft_sum=1.0, ttft_count=4), _Previous(), "llamacpp")
    assert not llama.HasField("prompt_tokens_total") and llama.first_tokens_total == 4
    blind = fill(EngineLoad(prompt_tokens=500), _Previous(), "vllm")
    assert not blind.HasField("prompt_tokens_total") and not blind.HasField("first_tokens_total")
    bad = spb.UpstreamSnapshot()
    assert ("first_tokens_total", "nan") in _fill_load(
        bad, EngineLoad(ttft_sum=1.0, ttft_count=float("nan")), _Previous()
    )
    assert not bad.HasField("ttft_seconds_total")


# -- configuration -------------------------------------------------------------------------------------
def write(tmp_path: Path, doc: Any) -> str:
    path = tmp_path / "publisher.yaml"
    path.write_text(yaml.safe_dump(doc))
    return str(path)


@pytest.fixture(autouse=True)
def _no_env_password(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LLM_EXTPROC_REDIS_PASSWORD", raising=False)


def test_load_config_file(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        {
            "redis": {"url": "redis://r:6379/1", "pool": "prod"},
            "interval_s": 0.5,
            "ttl_s": 4.0,
            "publisher_id": "p-9",
            "instances": [
                {"cluster": "gpu-a", "address": "10.0.0.1:8000", "engine": "sglang", "models": ["x"]},
                {
                    "cluster": "gpu-b",
                    "address": "[::1]:9000",
                    "capacity_weight": 3,
                    "draining": True,
                    "gpu": "NVIDIA A10G",
                },
            ],
        },
    )
    cfg = load_publisher_config(path)
    assert cfg.redis.url == "redis://r:6379/1"
    assert cfg.redis.pool == "prod"
    assert cfg.redis.password is None
    assert cfg.redis.key("gpu-a/10.0.0.1:8000") == "llm-extproc:prod:snap:gpu-a/10.0.0.1:8000"
    assert (cfg.interval_s, cfg.ttl_s, cfg.ttl_ms, cfg.publisher_id) == (0.5, 4.0, 4000, "p-9")
    assert cfg.envoy_admin is None
    a, b = cfg.instances
    assert (a.cluster, a.address, a.engine, a.models, a.capacity_weight) == (
        "gpu-a",
        "10.0.0.1:8000",
        "sglang",
        ("x",),
        1.0,
    )
    assert (b.address, b.capacity_weight, b.draining, b.engine) == ("[::1]:9000", 3.0, True, "vllm")
    assert (a.gpu, b.gpu) == ("", "NVIDIA A10G")


def test_load_config_overrides(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLM_EXTPROC_REDIS_PASSWORD", "s3cret")
    path = write(
        tmp_path, {"redis": {"url": "redis://file:6379/0", "pool": "file"}, "envoy_admin": "http://e"}
    )
    cfg = load_publisher_config(path, redis_url="redis://cli:6379/2", redis_pool="cli", interval_s=None)
    assert (cfg.redis.url, cfg.redis.pool, cfg.redis.password) == ("redis://cli:6379/2", "cli", "s3cret")
    assert cfg.envoy_admin == "http://e"
    assert cfg.interval_s == DEFAULT_PUBLISH_INTERVAL_S  # a None override is ignored


def test_load_config_without_file() -> None:
    cfg = load_publisher_config(None, envoy_admin="http://127.0.0.1:9901", redis_pool="x")
    assert cfg.instances == []
    assert cfg.redis.pool == "x"
    assert cfg.redis.url == "redis://127.0.0.1:6379/0"
    assert cfg.publisher_id  # host-pid by default


@pytest.mark.parametrize(
    ("doc", "match"),
    [
        ({"envoy_admin": "http://e", "colour": "red"}, "unknown keys"),
        ({"instances": [{"cluster": "c", "address": "10.0.0.1:80", "engine": "ollama"}]}, "unknown engine"),
        ({"instances": [{"cluster": "c", "address": "host.local:80"}]}, "ip:port"),
        ({"instances": [{"cluster": "c", "address": "10.0.0.1"}]}, "ip:port"),
        (
            {"instances": [{"cluster": "c", "address": "10.0.0.1:80", "capacity_weight": 0}]},
            "capacity_weight",
        ),
        (
            {"instances": [{"cluster": "c", "address": "10.0.0.1:80", "capacity_weight": -1}]},
            "capacity_weight",
        ),
        (
            {"instances": [{"cluster": "c", "address": "10.0.0.1:80", "capacity_weight": True}]},
            "capacity_weight",
        ),
        ({"instances": [{"cluster": "c", "address": "10.0.0.1:80", "models": "x"}]}, "models"),
        ({"instances": [{"cluster": "c", "address": "10.0.0.1:80", "draining": "no"}]}, "draining"),
        ({"instances": [{"cluster": "c", "address": "10.0.0.1:80", "health_path": 5}]}, "health_path"),
        ({"instances": [{"cluster": "c", "address": "10.0.0.1:80", "gpu": 100}]}, "'gpu'"),
        ({"instances": [{"cluster": "c", "address": "10.0.0.1:80", "gpu": "x" * 65}]}, "'gpu'"),
        ({"instances": [{"address": "10.0.0.1:80"}]}, "cluster"),
        ({"instances": []}, "instances"),
        ({"redis": {"pool": "p"}}, "envoy_admin"),
        ({"envoy_admin": "http://e", "interval_s": 0}, "interval_s"),
        ({"envoy_admin": "http://e", "redis": "redis://x"}, "redis"),
    ],
)
def test_load_config_errors(tmp_path: Path, doc: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        load_publisher_config(write(tmp_path, doc))


def test_scrape_timeout_must_be_below_the_interval(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="scrape_timeout_s"):
        load_publisher_config(
            write(tmp_path, {"envoy_admin": "http://e", "interval_s": 0.5, "scrape_timeout_s": 0.5})
        )
    with pytest.raises(ValueError, match="scrape_timeout_s"):
        Publisher(PublisherConfig(redis=RedisSettings(), interval_s=1.0, scrape_timeout_s=3.0))
    cfg = load_publisher_config(
        write(tmp_path, {"envoy_admin": "http://e", "interval_s": 1, "scrape_timeout_s": 0.3})
    )
    assert cfg.scrape_deadline_s == 0.3


@pytest.mark.parametrize(("interval", "want"), [(0.5, 0.4), (1.0, 0.8), (5.0, 2.0), (0.2, 0.16)])
def test_scrape_deadline_derived_from_the_interval(interval: float, want: float) -> None:
    cfg = load_publisher_config(None, envoy_admin="http://e", interval_s=interval)
    assert cfg.scrape_deadline_s == pytest.approx(want)
    assert cfg.scrape_deadline_s < cfg.interval_s


def test_metrics_listen_is_validated(tmp_path: Path) -> None:
    cfg = load_publisher_config(None, envoy_admin="http://e", metrics_listen="127.0.0.1:9103")
    assert cfg.metrics_listen == "127.0.0.1:9103"
    assert load_publisher_config(None, envoy_admin="http://e").metrics_listen is None  # off by default
    with pytest.raises(ValueError, match="metrics_listen"):
        load_publisher_config(None, envoy_admin="http://e", metrics_listen="9103")


def test_trtllm_serve_metrics_path_default() -> None:
    spec = instance_from_dict({"cluster": "c", "address": "10.0.0.1:8000", "engine": "trtllm-serve"})
    assert spec.metrics_path == "/prometheus/metrics"
    assert InstanceSpec("c", "10.0.0.1:8000", "trtllm-serve").metrics_path == "/prometheus/metrics"
    assert InstanceSpec("c", "10.0.0.1:8000").metrics_path == "/metrics"
    unset = {"cluster": "c", "address": "10.0.0.1:8000", "engine": "trtllm-serve", "metrics_path": None}
    assert instance_from_dict(unset).metrics_path == "/prometheus/metrics"  # null: the engine's own
    with pytest.raises(ValueError, match="metrics_path"):
        instance_from_dict({**unset, "metrics_path": 3})


def test_load_config_top_level_not_mapping(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="mapping"):
        load_publisher_config(write(tmp_path, ["a", "b"]))


def test_load_config_unknown_redis_key_is_value_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        load_publisher_config(write(tmp_path, {"envoy_admin": "http://e", "redis": {"hots": "x"}}))


def test_load_config_non_numeric_interval_is_value_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        load_publisher_config(write(tmp_path, {"envoy_admin": "http://e", "interval_s": "fast"}))


@pytest.mark.parametrize("ttl", [0.05, -1.0, 7200.0])
def test_load_config_ttl_outside_reader_limits_rejected(tmp_path: Path, ttl: float) -> None:
    with pytest.raises(ValueError):
        load_publisher_config(write(tmp_path, {"envoy_admin": "http://e", "ttl_s": ttl}))


def test_instance_from_dict_defaults() -> None:
    spec = instance_from_dict({"cluster": "gpu-a", "address": "10.0.0.5:8000"})
    assert spec == InstanceSpec(
        cluster="gpu-a",
        address="10.0.0.5:8000",
        engine="vllm",
        models=(),
        capacity_weight=1.0,
        draining=False,
        metrics_path="/metrics",
        health_path="/health",
    )
    assert spec.upstream_id == "gpu-a/10.0.0.5:8000"
    assert spec.url(spec.metrics_path) == "http://10.0.0.5:8000/metrics"


def test_instance_from_dict_all_fields() -> None:
    spec = instance_from_dict(
        {
            "cluster": "c",
            "address": "10.0.0.1:30000",
            "engine": "trtllm",
            "models": ["a"],
            "capacity_weight": 2,
            "draining": True,
            "metrics_path": "/m",
            "health_path": "/v2/health/ready",
        }
    )
    assert spec.capacity_weight == 2.0 and isinstance(spec.capacity_weight, float)
    assert (spec.engine, spec.models, spec.draining) == ("trtllm", ("a",), True)
    assert spec.url(spec.health_path) == "http://10.0.0.1:30000/v2/health/ready"


# -- one tick: simulated engine -> fake Redis ----------------------------------------------------------
class FakePipeline:
    def __init__(self, owner: FakeRedis, transaction: bool) -> None:
        self.owner = owner
        self.transaction = transaction
        self.queued: list[tuple[Any, ...]] = []

    async def __aenter__(self) -> FakePipeline:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None

    def set(self, key: str, data: bytes, px: int | None = None) -> FakePipeline:
        self.queued.append(("set", key, data, px))
        return self

    def publish(self, channel: str, data: bytes) -> FakePipeline:
        self.queued.append(("publish", channel, data))
        return self

    async def execute(self) -> list[Any]:
        if self.owner.fail:
            raise ConnectionError("redis down")
        self.owner.executed.append(list(self.queued))
        return [True] * len(self.queued)


class FakeRedis:
    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.pipelines: list[FakePipeline] = []
        self.executed: list[list[tuple[Any, ...]]] = []
        self.closed = False

    async def aclose(self) -> None:
        self.closed = True

    def written(self) -> list[spb.UpstreamSnapshot]:
        """Every snapshot SET so far, in write order."""
        return [spb.UpstreamSnapshot.FromString(ops[0][2]) for ops in self.executed]

    def pipeline(self, transaction: bool = True) -> FakePipeline:
        pipe = FakePipeline(self, transaction)
        self.pipelines.append(pipe)
        return pipe


async def test_tick_publishes_scraped_snapshot() -> None:
    engine = SimEngine("e", "m")
    port = await engine.start("127.0.0.1", 0)
    try:
        addr = f"127.0.0.1:{port}"
        cfg = PublisherConfig(
            redis=RedisSettings(pool="pool1"),
            instances=[InstanceSpec(cluster="c1", address=addr)],
            publisher_id="pub-t",
            ttl_s=5.0,
        )
        pub = Publisher(cfg)
        redis = FakeRedis()
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
            snaps = await pub.tick(session, redis)
        assert len(snaps) == 1
        assert pub.published == 1
        assert [p.transaction for p in redis.pipelines] == [False]
        assert len(redis.executed) == 1
        (op_set, op_pub) = redis.executed[0]
        assert op_set[0] == "set"
        assert op_set[1] == f"llm-extproc:pool1:snap:c1/{addr}"
        assert op_set[3] == 5000 == snaps[0].ttl_ms
        assert op_pub[:2] == ("publish", "llm-extproc:pool1:events")
        assert op_pub[2] == op_set[2]
        st = decode(op_pub[2], frozenset({"c1"}))
        assert st.ready
        assert st.upstream_id == f"c1/{addr}"
        assert st.address == addr
        assert st.models == frozenset({"m"})
        assert st.publisher_id == "pub-t"
        assert (st.num_running, st.num_waiting, st.kv_cache_usage) == (0, 0, 0.0)
        assert (st.kv_blocks_total, st.kv_blocks_free, st.block_size) == (4096, 4096, 16)

        # The engine reports "loading": the next tick publishes DRAINING (it was ready before).
        engine.ready = False
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
            snaps2 = await pub.tick(session, redis)
        assert snaps2[0].readiness == spb.DRAINING
        assert snaps2[0].sequence > snaps[0].sequence
        assert pub.published == 2
    finally:
        await engine.stop()


async def test_tick_publishes_the_engines_measured_prefill_rate() -> None:
    """A model-driven simulated A10G (vLLM's metric names, run 20x faster than real time): after a
    few prompts between two scrapes, the snapshot carries a prefill rate near the GPU's own (in
    real seconds, so 20x)."""
    engine = SimEngine("e", "m", profile=A10G_LLAMA3_8B, time_scale=20.0)
    port = await engine.start("127.0.0.1", 0)
    try:
        addr = f"127.0.0.1:{port}"
        cfg = PublisherConfig(
            redis=RedisSettings(pool="pool1"),
            instances=[InstanceSpec(cluster="c1", address=addr, engine="sim")],
            publisher_id="pub-t",
        )
        pub = Publisher(cfg)
        redis = FakeRedis()
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
            first = await pub.tick(session, redis)
            assert not first[0].HasField("prefill_tokens_per_s")  # nothing measured yet
            for i in range(3):  # distinct ~1.5k-token prompts, one at a time
                text = f"prompt {i} " + "words of a long prompt " * 300
                body = {"model": "m", "prompt": text, "max_tokens": 1}
                async with session.post(f"http://{addr}/v1/completions", json=body) as r:
                    assert r.status == 200, await r.text()
            second = await pub.tick(session, redis)
        rate = decode(redis.executed[-1][1][2], frozenset({"c1"})).prefill_tokens_per_s
        assert rate == second[0].prefill_tokens_per_s
        true_rate = 20.0 / A10G_LLAMA3_8B.prefill_s_per_token  # ~2.4k tokens/s, 20x faster
        assert rate is not None and 0.3 * true_rate < rate <= true_rate
    finally:
        await engine.stop()


async def test_tick_unreachable_engine_is_down_and_redis_failure_is_swallowed() -> None:
    engine = SimEngine("e", "m")
    port = await engine.start("127.0.0.1", 0)
    await engine.stop()  # the port is now closed: connection refused
    cfg = PublisherConfig(
        redis=RedisSettings(),
        instances=[InstanceSpec(cluster="c1", address=f"127.0.0.1:{port}")],
        publisher_id="pub-t",
    )
    pub = Publisher(cfg)
    redis = FakeRedis(fail=True)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
        snaps = await pub.tick(session, redis)
    assert [s.readiness for s in snaps] == [spb.DOWN]
    assert pub.published == 0
    assert redis.executed == []


# -- one instance never delays or kills another ------------------------------------------------------
async def _hung_server() -> tuple[asyncio.Server, str]:
    """Accepts TCP connections and never answers (an engine stuck in a GPU hang)."""
    server = await asyncio.get_running_loop().create_server(asyncio.Protocol, "127.0.0.1", 0)
    return server, f"127.0.0.1:{server.sockets[0].getsockname()[1]}"


async def test_tick_writes_each_instance_when_its_own_scrape_ends() -> None:
    engine = SimEngine("e", "m")
    port = await engine.start("127.0.0.1", 0)
    hung, hung_addr = await _hung_server()
    try:
        healthy = InstanceSpec(cluster="c1", address=f"127.0.0.1:{port}", engine="sim")
        stuck = InstanceSpec(cluster="c1", address=hung_addr, engine="sim")
        pub = Publisher(
            PublisherConfig(
                redis=RedisSettings(), instances=[stuck, healthy], interval_s=3.0, scrape_timeout_s=1.0
            )
        )
        redis = FakeRedis()
        async with aiohttp.ClientSession() as session:
            await pub.tick(session, redis)
        first, second = redis.written()
        # Order, not timing: the healthy snapshot was written before the stuck scrape's deadline ended.
        assert (first.upstream_id, first.readiness) == (healthy.upstream_id, spb.READY)
        assert (second.upstream_id, second.readiness) == (stuck.upstream_id, spb.DOWN)
        assert second.readiness_reason == "timeout"
        assert first.published_at_ms <= second.published_at_ms
        value = pub.metrics.value
        assert (
            value("llm_extproc_publisher_scrapes_total", upstream=stuck.upstream_id, outcome="timeout") == 1
        )
        assert value("llm_extproc_publisher_scrapes_total", upstream=healthy.upstream_id, outcome="ok") == 1
    finally:
        hung.close()
        await engine.stop()


async def test_an_instance_whose_scrape_raises_costs_only_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    from extproc.publishers import scrape as module

    real = module.normalize

    def fragile(engine: str, text: str, *, deadline: float | None = None) -> EngineLoad:
        if engine == "vllm":
            raise RuntimeError("a bug in the code reading this engine")
        return real(engine, text, deadline=deadline)

    monkeypatch.setattr(module, "normalize", fragile)
    engine = SimEngine("e", "m")
    port = await engine.start("127.0.0.1", 0)
    try:
        ok = InstanceSpec(cluster="c1", address=f"127.0.0.1:{port}", engine="sim")
        bad = InstanceSpec(cluster="c2", address=f"127.0.0.1:{port}", engine="vllm")
        pub = Publisher(PublisherConfig(redis=RedisSettings(), instances=[bad, ok]))
        redis = FakeRedis()
        async with aiohttp.ClientSession() as session:
            snaps = await pub.tick(session, redis)
            assert [s.upstream_id for s in snaps] == [ok.upstream_id]
            assert pub.metrics.value(
                "llm_extproc_publisher_scrapes_total", upstream=bad.upstream_id, outcome="error"
            )
            await pub.tick(session, redis)  # and again: the instance is retried every tick
        assert [s.upstream_id for s in redis.written()] == [ok.upstream_id] * 2
    finally:
        await engine.stop()


async def test_run_follows_the_instance_list_and_serves_metrics(monkeypatch: pytest.MonkeyPatch) -> None:
    from extproc.publishers import publisher as module

    redis = FakeRedis()
    monkeypatch.setattr(module, "redis_client", lambda _settings: redis)
    engines = [SimEngine(f"e{i}", "m") for i in range(2)]
    ports = [await e.start("127.0.0.1", 0) for e in engines]
    specs = [InstanceSpec(cluster="c1", address=f"127.0.0.1:{p}", engine="sim") for p in ports]
    pub = Publisher(
        PublisherConfig(
            redis=RedisSettings(), instances=specs[:1], interval_s=0.1, metrics_listen="127.0.0.1:0"
        )
    )
    stop = asyncio.Event()
    task = asyncio.create_task(pub.run(stop))

    async def until(predicate: Any) -> bool:
        for _ in range(200):
            if predicate():
                return True
            await asyncio.sleep(0.05)
        return bool(predicate())

    def published(uid: str) -> int:
        return sum(1 for s in redis.written() if s.upstream_id == uid)

    try:
        assert await until(lambda: published(specs[0].upstream_id) >= 2)
        pub.instances.append(specs[1])  # a new instance: its own task starts within one interval
        assert await until(lambda: published(specs[1].upstream_id) >= 2)
        assert pub.metrics.value("llm_extproc_publisher_instances") == 2
        assert pub.metrics_port
        async with (
            aiohttp.ClientSession() as session,
            session.get(f"http://127.0.0.1:{pub.metrics_port}/metrics") as r,
        ):
            text = await r.text()
        assert (
            f'llm_extproc_publisher_scrapes_total{{outcome="ok",upstream="{specs[1].upstream_id}"}}' in text
        )
        assert "llm_extproc_publisher_publish_lag_seconds_bucket" in text
        pub.instances.remove(specs[0])  # gone from discovery: its task stops, its series go
        assert await until(lambda: pub.metrics.value("llm_extproc_publisher_instances") == 1)
        assert not pub.metrics.value(
            "llm_extproc_publisher_scrapes_total", upstream=specs[0].upstream_id, outcome="ok"
        )
        before = published(specs[0].upstream_id)
        await asyncio.sleep(0.3)
        assert published(specs[0].upstream_id) == before
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
        for e in engines:
            await e.stop()
    assert redis.closed


# -- the batch limit (max_num_seqs) ---------------------------------------------------------------------
def test_max_num_seqs_from_the_config_wins_over_the_engines_figure_and_reaches_the_service() -> None:
    from dataclasses import replace

    from extproc.fleet import ClusterSpec, FleetView, Pool
    from extproc.fleet.snapshots import validate
    from extproc.publishers.engines import normalize

    p = publisher()
    assert not p.snapshot(SPEC, 200, load(), _Previous()).HasField("max_num_seqs")  # not known
    engine = normalize(
        "sglang", 'sglang:num_running_reqs{name="m"} 3\nsglang:max_running_requests{name="m"} 48\n'
    )
    assert engine.max_num_seqs == 48
    assert p.snapshot(SPEC, 200, engine, _Previous()).max_num_seqs == 48  # the engine's own figure
    spec = replace(SPEC, max_num_seqs=8)
    snap = p.snapshot(spec, 200, engine, _Previous())
    assert snap.max_num_seqs == 8  # the configured one
    snap.published_at_ms = int(time.time() * 1000)
    state = validate(snap, frozenset({"gpu-a"}), now=time.time())
    assert state.max_num_seqs == 8
    twin = validate(replace_address(snap, "10.0.0.6:8000"), frozenset({"gpu-a"}), now=time.time())
    view = FleetView(Pool(clusters=(ClusterSpec("gpu-a", ("llama",)),)))
    view.apply(state)
    view.apply(twin)
    view.rebuild()
    upstream = view.load("gpu-a")
    assert upstream is not None and upstream.max_num_seqs == 16  # summed over the instances
    assert view.batches.limit("gpu-a") == 16  # the batch limit before any queue showed it
    view.apply(
        validate(
            replace_address(snap, "10.0.0.7:8000", keep_seqs=False), frozenset({"gpu-a"}), now=time.time()
        )
    )
    view.rebuild()
    assert view.load("gpu-a").max_num_seqs is None  # type: ignore[union-attr]  # not every instance says
    snap.max_num_seqs = 2_000_000  # beyond any engine: not used (the publisher never writes it)
    assert validate(snap, frozenset({"gpu-a"}), now=time.time()).max_num_seqs is None
    rejected = _fill_load(spb.UpstreamSnapshot(), replace(engine, max_num_seqs=10**7), _Previous())
    assert ("max_num_seqs", "too_large") in rejected


def replace_address(snap: spb.UpstreamSnapshot, address: str, keep_seqs: bool = True) -> spb.UpstreamSnapshot:
    other = spb.UpstreamSnapshot()
    other.CopyFrom(snap)
    other.address, other.upstream_id = address, f"gpu-a/{address}"
    if not keep_seqs:
        other.ClearField("max_num_seqs")
    return other


@pytest.mark.parametrize("bad", [0, -1, 2.5, "8", True, 10**7])
def test_a_bad_max_num_seqs_is_a_config_error_naming_the_key(bad: Any) -> None:
    with pytest.raises(ConfigError, match="max_num_seqs"):
        instance_from_dict({"cluster": "c", "address": "10.0.0.7:8000", "max_num_seqs": bad})
    assert (
        instance_from_dict({"cluster": "c", "address": "10.0.0.7:8000", "max_num_seqs": 256}).max_num_seqs
        == 256
    )


def test_a_failed_metrics_scrape_after_a_good_reading_stays_ready_with_load_unknown() -> None:
    p = publisher()
    prev = _Previous()
    assert p.snapshot(SPEC, 200, load(), prev).readiness == spb.READY
    snap = p.snapshot(SPEC, 200, None, prev, detail="timeout")
    assert (snap.readiness, snap.readiness_reason) == (spb.READY, "timeout")
    st = decode(snap.SerializeToString(), frozenset({"gpu-a"}))
    assert (st.num_running, st.num_waiting, st.kv_cache_usage) == (None, None, None)
    # What the engine said of itself is kept: models (from its own series here), adapters, limits.
    bare = InstanceSpec(cluster="gpu-a", address="10.0.0.6:8000")
    known = _Previous()
    p.snapshot(bare, 200, load(lora_adapters=["ad"], max_num_seqs=64, max_lora=2, max_model_len=8192), known)
    kept = p.snapshot(bare, 200, None, known, detail="timeout")
    assert (list(kept.models), list(kept.lora_adapters)) == (["from-load"], ["ad"])
    assert (kept.max_num_seqs, kept.max_lora, kept.max_model_len) == (64, 2, 8192)
    assert not kept.HasField("num_running") and kept.kv_blocks_total == 0
    # Once the last reading is older than the TTL, the instance is out of rotation as before.
    assert prev.loaded_at is not None
    prev.loaded_at -= p.config.ttl_ms / 1000 + 0.1
    snap = p.snapshot(SPEC, 200, None, prev, detail="timeout")
    assert (snap.readiness, snap.readiness_reason) == (spb.WARMING_UP, "timeout")
    # Never read before, an answering /health is not enough; an unhealthy one never is.
    assert p.snapshot(SPEC, 200, None, _Previous(), detail="timeout").readiness == spb.WARMING_UP
    fresh = _Previous()
    p.snapshot(SPEC, 200, load(), fresh)
    assert p.snapshot(SPEC, 503, None, fresh, detail="timeout").readiness == spb.DRAINING


def test_readiness_changes_are_logged_once_load_unknown_included(caplog: pytest.LogCaptureFixture) -> None:
    p = publisher()
    prev = p._prev.setdefault(SPEC.upstream_id, _Previous())
    caplog.set_level(logging.INFO, logger="extproc.publisher")
    for health, ld, detail in [
        (200, load(), ""),
        (200, load(), ""),
        (200, None, "timeout"),
        (200, None, "timeout"),
        (200, load(), ""),
    ]:
        p._log_change(SPEC, p.snapshot(SPEC, health, ld, prev, detail=detail))
    lines = [(r.levelno, r.getMessage().split(": ", 1)[1]) for r in caplog.records]
    assert lines == [
        (logging.INFO, "NEW -> READY"),
        (logging.WARNING, "READY -> READY, load unknown (timeout)"),
        (logging.INFO, "READY, load unknown -> READY"),
    ]
