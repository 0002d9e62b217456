"""Unit tests for extproc.fleet.snapshots: decoding and validating one UpstreamSnapshot."""

from __future__ import annotations

import math
from typing import Any

import pytest

from extproc.fleet import snapshot_pb2 as spb
from extproc.fleet.snapshots import (
    MAX_ID_LEN,
    MAX_MODELS,
    MAX_SNAPSHOT_BYTES,
    InstanceState,
    SnapshotRejected,
    decode,
    validate,
)

NOW = 1_700_000_000.0
CLUSTERS = frozenset({"gpu-a", "gpu-b"})


def msg(**overrides: Any) -> spb.UpstreamSnapshot:
    """A valid snapshot published one second before NOW, with `overrides` applied."""
    fields: dict[str, Any] = {
        "upstream_id": "gpu-a/10.0.0.5:8000",
        "cluster": "gpu-a",
        "address": "10.0.0.5:8000",
        "engine": "vllm",
        "models": ["llama", "qwen"],
        "lora_adapters": ["sql-lora"],
        "readiness": spb.READY,
        "capacity_weight": 2.5,
        "num_running": 7,
        "num_waiting": 3,
        "kv_cache_usage": 0.42,
        "kv_blocks_total": 1000,
        "kv_blocks_free": 580,
        "block_size": 16,
        "max_model_len": 8192,
        "publisher_id": "pub-1",
        "sequence": 41,
        "published_at_ms": int((NOW - 1.0) * 1000),
        "ttl_ms": 3000,
    }
    fields.update(overrides)
    return spb.UpstreamSnapshot(**fields)


def raw(**overrides: Any) -> bytes:
    return msg(**overrides).SerializeToString()


def rejected(m: spb.UpstreamSnapshot | bytes) -> str:
    with pytest.raises(SnapshotRejected) as info:
        if isinstance(m, bytes):
            decode(m, CLUSTERS, now=NOW)
        else:
            validate(m, CLUSTERS, now=NOW)
    assert str(info.value).startswith(info.value.reason)
    return info.value.reason


# -- accepted ----------------------------------------------------------------------------------------
def test_valid_snapshot_round_trips_field_by_field() -> None:
    m = msg(prefix_cache_hit_rate=0.25, ttft_seconds=0.12, tpot_seconds=0.02)
    st = decode(m.SerializeToString(), CLUSTERS, now=NOW)
    assert isinstance(st, InstanceState)
    assert st.upstream_id == "gpu-a/10.0.0.5:8000"
    assert st.cluster == "gpu-a"
    assert st.address == "10.0.0.5:8000"
    assert st.engine == "vllm"
    assert st.models == frozenset({"llama", "qwen"})
    assert st.lora_adapters == frozenset({"sql-lora"})
    assert st.readiness == spb.READY
    assert st.weight == 2.5
    assert st.num_running == 7
    assert st.num_waiting == 3
    assert st.kv_cache_usage == pytest.approx(0.42)
    assert st.kv_blocks_total == 1000
    assert st.kv_blocks_free == 580
    assert st.block_size == 16
    assert st.max_model_len == 8192
    assert st.prefix_cache_hit_rate == pytest.approx(0.25)
    assert st.ttft_s == pytest.approx(0.12)
    assert st.tpot_s == pytest.approx(0.02)
    assert st.publisher_id == "pub-1"
    assert st.sequence == 41
    assert st.published_at == pytest.approx(NOW - 1.0)
    assert st.expires_at == pytest.approx(NOW - 1.0 + 3.0)


def test_optional_fields_absent_are_none() -> None:
    st = validate(msg(address=""), CLUSTERS, now=NOW)
    assert st.address is None
    assert st.prefix_cache_hit_rate is None
    assert st.ttft_s is None
    assert st.tpot_s is None


def test_optional_fields_present_but_zero_are_zero_not_none() -> None:
    st = validate(msg(prefix_cache_hit_rate=0.0, ttft_seconds=0.0), CLUSTERS, now=NOW)
    assert st.prefix_cache_hit_rate == 0.0
    assert st.ttft_s == 0.0


def test_capacity_weight_zero_means_one() -> None:
    assert validate(msg(capacity_weight=0.0), CLUSTERS, now=NOW).weight == 1.0
    assert validate(msg(capacity_weight=1000.0), CLUSTERS, now=NOW).weight == 1000.0


def test_kv_usage_slightly_above_one_is_clamped() -> None:
    st = validate(msg(kv_cache_usage=1.2), CLUSTERS, now=NOW)
    assert st.kv_cache_usage == 1.0
    assert validate(msg(kv_cache_usage=1.5), CLUSTERS, now=NOW).kv_cache_usage == 1.0


def test_expires_at_is_published_plus_ttl() -> None:
    st = validate(msg(published_at_ms=int(NOW * 1000), ttl_ms=100), CLUSTERS, now=NOW)
    assert st.expires_at == pytest.approx(NOW + 0.1)
    st = validate(msg(published_at_ms=int(NOW * 1000), ttl_ms=3_600_000), CLUSTERS, now=NOW)
    assert st.expires_at == pytest.approx(NOW + 3600.0)


def test_fresh_and_ready() -> None:
    st = validate(msg(published_at_ms=int(NOW * 1000), ttl_ms=2000), CLUSTERS, now=NOW)
    assert st.ready
    assert st.fresh(NOW)
    assert st.fresh(NOW + 1.999)
    assert not st.fresh(NOW + 2.0)
    assert not st.fresh(NOW + 10.0)
    for readiness in (spb.READINESS_UNSPECIFIED, spb.WARMING_UP, spb.DRAINING, spb.DOWN):
        assert not validate(msg(readiness=readiness), CLUSTERS, now=NOW).ready


def test_bracketed_ipv6_address_accepted() -> None:
    st = validate(msg(address="[::1]:8000"), CLUSTERS, now=NOW)
    assert st.address == "[::1]:8000"


def test_optional_out_of_range_become_none() -> None:
    st = validate(msg(prefix_cache_hit_rate=2.0, ttft_seconds=-1.0, tpot_seconds=math.nan), CLUSTERS, now=NOW)
    assert st.prefix_cache_hit_rate is None
    assert st.ttft_s is None
    assert st.tpot_s is None
    st = validate(
        msg(prefix_cache_hit_rate=-0.1, ttft_seconds=3600.0, tpot_seconds=math.inf), CLUSTERS, now=NOW
    )
    assert (st.prefix_cache_hit_rate, st.ttft_s, st.tpot_s) == (None, None, None)


def test_gpu_model_is_kept_when_it_is_a_short_printable_name() -> None:
    assert validate(msg(), CLUSTERS, now=NOW).gpu_model is None
    assert validate(msg(gpu_model="NVIDIA A10G"), CLUSTERS, now=NOW).gpu_model == "NVIDIA A10G"
    for bad in ("x" * 65, "H100\n", "\x00"):  # dropped, not a reason to reject the snapshot
        assert validate(msg(gpu_model=bad), CLUSTERS, now=NOW).gpu_model is None


def test_prefill_rate_is_kept_only_when_a_reader_can_divide_by_it() -> None:
    assert validate(msg(), CLUSTERS, now=NOW).prefill_tokens_per_s is None  # not measured yet
    assert validate(msg(prefill_tokens_per_s=2_500.0), CLUSTERS, now=NOW).prefill_tokens_per_s == 2_500.0
    for bad in (0.0, -1.0, math.nan, math.inf, 1e9):
        assert validate(msg(prefill_tokens_per_s=bad), CLUSTERS, now=NOW).prefill_tokens_per_s is None


def test_timestamp_within_skew_accepted() -> None:
    st = validate(msg(published_at_ms=int((NOW + 29.0) * 1000)), CLUSTERS, now=NOW)
    assert st.published_at == pytest.approx(NOW + 29.0)


def test_long_engine_and_publisher_id_are_truncated() -> None:
    st = validate(msg(engine="e" * 100, publisher_id="p" * 1000), CLUSTERS, now=NOW)
    assert st.engine == "e" * 32
    assert st.publisher_id == "p" * MAX_ID_LEN


# -- rejected ----------------------------------------------------------------------------------------
def test_too_large() -> None:
    assert rejected(b"\x00" * (MAX_SNAPSHOT_BYTES + 1)) == "too_large"


def test_undecodable_garbage() -> None:
    assert rejected(b"\xff\xff\xff\xff") == "undecodable"


def test_undecodable_truncated() -> None:
    data = raw()
    # The upstream_id string comes first: cut inside it.
    assert rejected(data[:6]) == "undecodable"


def test_undecodable_bad_utf8() -> None:
    assert rejected(b"\x0a\x02\xff\xfe") == "undecodable"


@pytest.mark.parametrize("uid", ["", "x" * (MAX_ID_LEN + 1), "gpu-a/\x00", "a\nb"])
def test_bad_id(uid: str) -> None:
    assert rejected(msg(upstream_id=uid)) == "bad_id"


def test_id_at_max_length_accepted() -> None:
    assert validate(msg(upstream_id="x" * MAX_ID_LEN), CLUSTERS, now=NOW).upstream_id == "x" * MAX_ID_LEN


@pytest.mark.parametrize("cluster", ["", "gpu-z", "GPU-A"])
def test_unknown_cluster(cluster: str) -> None:
    assert rejected(msg(cluster=cluster)) == "unknown_cluster"


@pytest.mark.parametrize(
    "address", ["vllm-0.local:8000", "10.0.0.5", "10.0.0.5:", "10.0.0.5:0", "10.0.0.5:70000", "::1:8000"]
)
def test_bad_address(address: str) -> None:
    assert rejected(msg(address=address)) == "bad_address"


def test_bad_models_too_many() -> None:
    assert rejected(msg(models=[f"m{i}" for i in range(MAX_MODELS + 1)])) == "bad_models"


def test_bad_models_empty_name() -> None:
    assert rejected(msg(models=["llama", ""])) == "bad_models"


def test_bad_models_long_name_and_too_many_adapters() -> None:
    assert rejected(msg(models=["x" * (MAX_ID_LEN + 1)])) == "bad_models"
    assert rejected(msg(lora_adapters=[f"l{i}" for i in range(MAX_MODELS + 1)])) == "bad_models"


def test_bad_readiness_via_field() -> None:
    m = msg()
    m.readiness = 99  # proto3 enums are open: the field holds undefined numbers
    assert rejected(m) == "bad_readiness"


def test_bad_readiness_via_wire() -> None:
    # field 7 (readiness), varint 99, appended to a valid message: the last value wins.
    assert rejected(raw() + b"\x38\x63") == "bad_readiness"


@pytest.mark.parametrize(
    "overrides",
    [
        {"num_waiting": 1_000_001},
        {"num_running": 1_000_001},
        {"kv_cache_usage": math.nan},
        {"kv_cache_usage": math.inf},
        {"kv_cache_usage": -0.01},
        {"kv_cache_usage": 1.51},
        {"kv_blocks_total": 100, "kv_blocks_free": 101},
        {"kv_blocks_total": 1_000_000_001},
        {"kv_cache_usage": 2.0, "load_presence": True},
    ],
)
def test_bad_load(overrides: dict[str, Any]) -> None:
    assert rejected(msg(**overrides)) == "bad_load"


# -- unknown load ----------------------------------------------------------------------------------------
def test_load_absent_with_presence_is_unknown_not_zero() -> None:
    m = msg(load_presence=True)
    for name in ("num_running", "num_waiting", "kv_cache_usage"):
        m.ClearField(name)
    st = decode(m.SerializeToString(), CLUSTERS, now=NOW)
    assert (st.num_running, st.num_waiting, st.kv_cache_usage) == (None, None, None)


def test_load_present_zero_with_presence_is_zero() -> None:
    m = msg(load_presence=True, num_running=0, num_waiting=0, kv_cache_usage=0.0)
    st = decode(m.SerializeToString(), CLUSTERS, now=NOW)
    assert (st.num_running, st.num_waiting, st.kv_cache_usage) == (0, 0, 0.0)


def test_legacy_writer_absent_load_is_zero() -> None:
    # A publisher from before load_presence wrote a plain proto3 0 as nothing at all.
    m = msg()
    for name in ("num_running", "num_waiting", "kv_cache_usage"):
        m.ClearField(name)
    st = decode(m.SerializeToString(), CLUSTERS, now=NOW)
    assert (st.num_running, st.num_waiting, st.kv_cache_usage) == (0, 0, 0.0)


def test_optional_load_fields_keep_the_old_wire_encoding() -> None:
    # `optional` changed presence tracking only: a value is encoded exactly as before (field 10 varint,
    # 11 varint, 12 fixed64), so old readers and writers interoperate. The bytes are spelled out here.
    m = spb.UpstreamSnapshot(num_running=7, num_waiting=3, kv_cache_usage=0.5)
    assert m.SerializeToString() == bytes.fromhex("5007580361000000000000e03f")
    # Zero is now written when set (presence); an old reader parses it as the same 0.
    assert spb.UpstreamSnapshot(num_running=0).SerializeToString() == b"\x50\x00"
    assert spb.UpstreamSnapshot.FromString(b"\x50\x00").HasField("num_running")


def test_queue_at_limit_accepted() -> None:
    st = validate(msg(num_waiting=1_000_000, num_running=1_000_000), CLUSTERS, now=NOW)
    assert st.num_waiting == 1_000_000


@pytest.mark.parametrize("weight", [-1.0, math.nan, math.inf, 1000.5])
def test_bad_weight(weight: float) -> None:
    assert rejected(msg(capacity_weight=weight)) == "bad_weight"


@pytest.mark.parametrize("ttl", [0, 99, 3_600_001])
def test_bad_ttl(ttl: int) -> None:
    assert rejected(msg(ttl_ms=ttl)) == "bad_ttl"


@pytest.mark.parametrize("published_ms", [0, -5, int((NOW + 31.0) * 1000), int((NOW + 86400) * 1000)])
def test_bad_timestamp(published_ms: int) -> None:
    assert rejected(msg(published_at_ms=published_ms)) == "bad_timestamp"


def test_decode_uses_wall_clock_by_default() -> None:
    # Published "now" by the test's NOW, which is in the past: valid with the real clock too.
    st = decode(raw(), CLUSTERS)
    assert st.upstream_id == "gpu-a/10.0.0.5:8000"


def test_rejection_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="unknown_cluster: gpu-z"):
        validate(msg(cluster="gpu-z"), CLUSTERS, now=NOW)
