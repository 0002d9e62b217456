"""LoRA affinity, observed-latency exploration (UCB) and GPU utilisation: the plugins with fake fleet
state, the fleet view and snapshot fields they read, the publisher's adapter slots and DCGM reading, and
two discrete simulations (no network, virtual clock) that reproduce the targets of the issue:

- 10 adapters, 4 adapter slots per instance, 6 instances: >= 90 % of requests land where their adapter
  is in GPU memory, and no instance gets more than 2x its fair share;
- one instance slowed 3x mid-run: its share halves within 30 s; restored, it regains (80 % of) its
  share within 60 s.

The simulations are models (an engine here is an LRU of adapter slots, a batch and a service time),
not live engines; they live in the bench tooling (lab/extproc_lab/bench/lora_latency.py), whose
`python -m extproc_lab.bench.lora_latency` writes the figures in docs/benchmarks.md; here they run small
(LoRA: half the duration) and the targets are checked. The live slowdown check is tests/test_ucb_live.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from builders import NOW, chat_request, instance_state, serve_http

from extproc.fleet import ClusterSpec, FleetView, InstanceState, Load, Pool, RoutingMode, Upstream
from extproc.fleet import snapshot_pb2 as spb
from extproc.fleet.snapshots import validate
from extproc.openai import InferenceRequest
from extproc.publishers import InstanceSpec, Publisher, PublisherConfig
from extproc.publishers.config import instance_from_dict
from extproc.publishers.engines import EngineLoad, normalize, normalize_dcgm
from extproc.publishers.snapshot_fields import _fill_load, _Previous
from extproc.scheduling import build_filter, build_scorer
from extproc.scheduling.gpu import GpuUtilizationScorer
from extproc.scheduling.latency import LatencyUcbScorer
from extproc.scheduling.lora import LoraAffinityFilter, LoraAffinityScorer
from extproc.settings import ConfigError, RedisSettings
from extproc_lab.bench.lora_latency import ModelState, latency_profile, simulate_lora, simulate_slowdown, up
from extproc_lab.bench.lora_latency import ld as model_load
from extproc_lab.engines import SimEngine


# -- fakes -------------------------------------------------------------------------------------------------
class FakeState(ModelState):
    """The bench's FleetState over dicts, its clock starting at NOW (virtual seconds)."""

    def __init__(self, loads: dict[str, Load] | None = None, t: float = NOW) -> None:
        super().__init__(loads, t)


def ld(**kw: Any) -> Load:
    return model_load(**{"published_at": NOW, **kw})


def req(model: str) -> InferenceRequest:
    return replace(chat_request(), model=model)


def ids(upstreams: Sequence[Upstream]) -> list[str]:
    return [u.id for u in upstreams]


# -- lora-affinity filter ------------------------------------------------------------------------------
def test_filter_drops_instances_whose_slots_are_pinned_by_other_adapters() -> None:
    cands = [up("has-it"), up("full"), up("free"), up("no-slots"), up("no-load")]
    state = FakeState(
        {
            "has-it": ld(lora_adapters=frozenset({"a", "b"}), lora_slots=2, lora_slots_free=0),
            "full": ld(lora_adapters=frozenset({"c", "d"}), lora_slots=2, lora_slots_free=0),
            "free": ld(lora_adapters=frozenset({"c"}), lora_slots=2, lora_slots_free=1),
            "no-slots": ld(lora_adapters=frozenset({"e"})),  # slots not published: unknown, kept
        }
    )
    assert ids(LoraAffinityFilter().filter(req("a"), cands, state)) == [
        "has-it",
        "free",
        "no-slots",
        "no-load",
    ]


def test_filter_never_empties_and_leaves_base_models_alone() -> None:
    state = FakeState({"x": ld(lora_adapters=frozenset({"c", "d"}), lora_slots=2, lora_slots_free=0)})
    f = LoraAffinityFilter()
    assert ids(f.filter(req("c"), [up("x")], state)) == ["x"]  # learns c, d are adapters
    assert ids(f.filter(req("d-other"), [up("x")], state)) == ["x"]  # unknown model: untouched
    assert ids(f.filter(req("base"), [up("x")], state)) == ["x"]
    # A known adapter that no candidate can take: everyone is kept (it waits for a slot somewhere).
    state.loads["y"] = ld(lora_adapters=frozenset({"e", "f"}), lora_slots=2, lora_slots_free=0)
    assert ids(f.filter(req("e"), [up("x"), up("y")], state)) == ["y"]
    state.loads["y"] = ld(lora_adapters=frozenset({"c", "d"}), lora_slots=2, lora_slots_free=0)
    assert ids(f.filter(req("e"), [up("x"), up("y")], state)) == ["x", "y"]


def test_filter_configured_adapters_are_known_before_any_engine_lists_them() -> None:
    state = FakeState({"x": ld(lora_adapters=frozenset({"c", "d"}), lora_slots=2, lora_slots_free=0)})
    f = build_filter("lora-affinity", {"adapters": ["new"]})
    assert ids(f.filter(req("new"), [up("x"), up("y")], state)) == ["y"]


# -- lora-affinity scorer ------------------------------------------------------------------------------
def test_scorer_tiers_loaded_free_slot_swap() -> None:
    s = LoraAffinityScorer()
    state = FakeState(
        {
            "loaded": ld(lora_adapters=frozenset({"a"}), lora_slots=2, lora_slots_free=1),
            "free": ld(lora_adapters=frozenset({"b"}), lora_slots=2, lora_slots_free=1),
            "swap": ld(lora_slots=2, lora_slots_free=2),
            "unknown": ld(),
        }
    )
    cands = [up("loaded"), up("free"), up("swap"), up("unknown")]
    # "swap" lists nothing, but this process sent it two other adapters: its two slots hold them.
    s.score(req("a"), cands, state)  # learns that a and b are adapters
    s.on_pick(req("b"), up("swap"), state)
    state.t += 1
    state.loads["swap"] = replace(state.loads["swap"], lora_adapters=frozenset({"c"}), published_at=NOW + 1)
    assert s.score(req("a"), cands, state) == [1.0, 0.5, 0.1, 0.5]


def test_scorer_remembers_where_it_sent_an_adapter_until_memory_s() -> None:
    s = LoraAffinityScorer(memory_s=60.0, adapters=("a",))
    state = FakeState({"x": ld(lora_slots=4, lora_slots_free=4), "y": ld(lora_slots=4, lora_slots_free=4)})
    assert s.score(req("a"), [up("x"), up("y")], state) == [0.5, 0.5]
    s.on_pick(req("a"), up("x"), state)
    state.t += 30  # requests finished; vLLM no longer lists the adapter but it is still in GPU memory
    assert s.score(req("a"), [up("x"), up("y")], state) == [1.0, 0.5]
    state.t += 31
    assert s.score(req("a"), [up("x"), up("y")], state) == [0.5, 0.5]


def test_scorer_lru_is_bounded_by_the_published_slots() -> None:
    s = LoraAffinityScorer(adapters=("a", "b", "c"))
    state = FakeState({"x": ld(lora_slots=2, lora_slots_free=2)})
    for name in ("a", "b", "c"):  # c evicts a (least recently used), as the engine would
        s.on_pick(req(name), up("x"), state)
        state.t += 1
    assert s.score(req("a"), [up("x")], state) == [0.1]
    assert s.score(req("b"), [up("x")], state) == [1.0]
    assert s.score(req("c"), [up("x")], state) == [1.0]


def test_scorer_base_model_is_neutral() -> None:
    s = LoraAffinityScorer()
    state = FakeState({"x": ld(lora_adapters=frozenset({"a"}), lora_slots=1, lora_slots_free=0), "y": ld()})
    assert s.score(req("base"), [up("x"), up("y")], state) == [1.0, 1.0]


def test_scorer_bounded_affinity_spills_an_overloaded_holder() -> None:
    s = LoraAffinityScorer(overload_ratio=2.0, overload_slack=4.0)
    state = FakeState(
        {
            "hot": ld(num_running=30, lora_adapters=frozenset({"a"}), lora_slots=4, lora_slots_free=3),
            "idle": ld(num_running=2, lora_slots=4, lora_slots_free=4),
        }
    )
    assert s.score(req("a"), [up("hot"), up("idle")], state) == [0.0, 0.5]
    state.loads["hot"] = replace(state.loads["hot"], num_running=8)  # <= 2 x 2 + 4
    assert s.score(req("a"), [up("hot"), up("idle")], state) == [1.0, 0.5]


def test_scorer_restart_forgets_the_lru() -> None:
    s = LoraAffinityScorer(adapters=("a",))
    state = FakeState({"x": ld(lora_slots=4, lora_slots_free=4)})
    s.on_pick(req("a"), up("x"), state)
    assert s.score(req("a"), [up("x")], state) == [1.0]
    state.loads["x"] = ld(lora_slots=4, lora_slots_free=4, epoch=1)
    assert s.score(req("a"), [up("x")], state) == [0.5]


@pytest.mark.parametrize(
    "params",
    [{"free_slot_score": 1.5}, {"swap_score": -0.1}, {"memory_s": 0}, {"overload_ratio": 0.5}, {"x": 1}],
)
def test_scorer_bad_params(params: dict[str, Any]) -> None:
    with pytest.raises(ConfigError, match="lora-affinity"):
        build_scorer("lora-affinity", params)


# -- latency-ucb ---------------------------------------------------------------------------------------
def test_ucb_unobserved_candidates_are_equal() -> None:
    s = LatencyUcbScorer()
    assert s.score(req("m"), [up("a"), up("b")], FakeState()) == [1.0, 1.0]


def test_ucb_prefers_the_faster_upstream_from_snapshot_means() -> None:
    s = LatencyUcbScorer(c=0.0)
    state = FakeState({"fast": ld(ttft_s=0.1), "slow": ld(ttft_s=0.3), "none": ld()})
    scores = s.score(req("m"), [up("fast"), up("slow"), up("none")], state)
    assert scores[0] == 1.0 and scores[2] == 1.0  # never observed: optimistic
    assert scores[1] == pytest.approx(0.105 / 0.305)


def test_ucb_reads_each_snapshot_once_weighted_by_the_picks_it_covers() -> None:
    s = LatencyUcbScorer()
    state = FakeState({"a": ld(ttft_s=0.2)})
    for _ in range(3):
        s.score(req("m"), [up("a")], state)
    assert s._arms["a"].latency_weight.value == 1.0
    for _ in range(4):
        s.on_pick(req("m"), up("a"), state)
    state.loads["a"] = ld(ttft_s=0.4, published_at=NOW + 1)
    s.score(req("m"), [up("a")], state)
    assert s._arms["a"].latency() == pytest.approx((0.2 + 4 * 0.4) / 5)


def test_ucb_observe_hook_and_tpot_tokens() -> None:
    s = LatencyUcbScorer(c=0.0, tpot_tokens=100)
    state = FakeState()
    s.observe("a", 0.1, 0.01, now=NOW)  # 0.1 + 100 x 0.01 = 1.1 s
    s.observe("b", 0.5, 0.001, now=NOW)  # 0.6 s
    s.observe("b", float("nan"), 0.001, now=NOW)  # ignored
    s.observe("b", 0.1, None, now=NOW)  # no TPOT while tpot_tokens is set: ignored
    scores = s.score(req("m"), [up("a"), up("b")], state)
    assert scores == [pytest.approx(0.605 / 1.105), 1.0]


def test_ucb_bonus_grows_for_an_avoided_upstream() -> None:
    """Exploration: with equal latencies, the upstream that got no picks scores higher, and the gap
    between a slow upstream and a fast one narrows as the slow one goes unpicked."""
    s = LatencyUcbScorer(c=0.3, half_life_s=10.0)
    state = FakeState({"fast": ld(ttft_s=0.1), "slow": ld(ttft_s=0.3)})
    cands = [up("fast"), up("slow")]
    s.score(req("m"), cands, state)
    for _ in range(50):
        s.on_pick(req("m"), up("fast"), state)
    s.on_pick(req("m"), up("slow"), state)
    before = s.score(req("m"), cands, state)[1]
    state.t += 30  # nobody picks; the slow one's single pick decays towards nothing
    after = s.score(req("m"), cands, state)[1]
    assert before < after <= 1.0


def test_ucb_restart_forgets_observations() -> None:
    s = LatencyUcbScorer(c=0.0)
    state = FakeState({"a": ld(ttft_s=1.0), "b": ld(ttft_s=0.1)})
    assert s.score(req("m"), [up("a"), up("b")], state)[0] < 0.2
    state.loads["a"] = ld(epoch=1)
    assert s.score(req("m"), [up("a"), up("b")], state) == [1.0, 1.0]


@pytest.mark.parametrize("params", [{"c": -1}, {"half_life_s": 0}, {"floor_s": 0}, {"tpot_tokens": -1}])
def test_ucb_bad_params(params: dict[str, Any]) -> None:
    with pytest.raises(ConfigError, match="latency-ucb"):
        build_scorer("latency-ucb", params)


# -- gpu-utilization -----------------------------------------------------------------------------------
def test_gpu_penalty_above_the_threshold_and_unknown_is_neutral() -> None:
    state = FakeState(
        {
            "low": ld(gpu_utilization=0.5),
            "edge": ld(gpu_utilization=0.85),
            "high": ld(gpu_utilization=0.925),
            "full": ld(gpu_utilization=1.0),
            "unknown": ld(),
        }
    )
    cands = [up("low"), up("edge"), up("high"), up("full"), up("unknown"), up("no-load")]
    scores = GpuUtilizationScorer().score(req("m"), cands, state)
    assert scores == [1.0, 1.0, pytest.approx(0.5), 0.0, 1.0, 1.0]


@pytest.mark.parametrize("threshold", [1.0, -0.1])
def test_gpu_bad_threshold(threshold: float) -> None:
    with pytest.raises(ConfigError, match="gpu-utilization"):
        build_scorer("gpu-utilization", {"threshold": threshold})


# -- what the plugins read: snapshots and the fleet view ------------------------------------------------
def test_snapshot_carries_adapter_slots_and_gpu_figures() -> None:
    msg = spb.UpstreamSnapshot(
        upstream_id="c1/10.0.0.1:8000",
        cluster="c1",
        readiness=spb.READY,
        max_lora=4,
        gpu_utilization=0.9,
        gpu_memory_usage=0.7,
        published_at_ms=int(NOW * 1000),
        ttl_ms=3000,
    )
    st = validate(msg, frozenset({"c1"}), now=NOW)
    assert (st.max_lora, st.gpu_utilization, st.gpu_memory_usage) == (4, 0.9, 0.7)
    msg.gpu_utilization = 1.7  # out of range: unknown, not a rejection of the snapshot
    msg.ClearField("max_lora")
    st = validate(msg, frozenset({"c1"}), now=NOW)
    assert (st.max_lora, st.gpu_utilization) == (None, None)


def _inst(uid: str, cluster: str = "c1", address: str | None = None, **kw: Any) -> InstanceState:
    return instance_state(uid, cluster, address, **kw)


def test_view_aggregates_adapters_slots_gpu_and_latency_per_upstream() -> None:
    pool = Pool(clusters=(ClusterSpec(name="c1", models=("m",)), ClusterSpec(name="c2", models=("m",))))
    view = FleetView(pool, clock=lambda: NOW + 1)
    view.apply(
        _inst(
            "c1/a", lora_adapters=frozenset({"x"}), max_lora=2, gpu_utilization=0.5, ttft_s=0.1, tpot_s=0.02
        )
    )
    view.apply(
        _inst(
            "c1/b",
            lora_adapters=frozenset({"y", "z"}),
            max_lora=2,
            gpu_utilization=0.9,
            gpu_memory_usage=0.8,
            ttft_s=0.3,
        )
    )
    view.apply(_inst("c2/a", cluster="c2"))
    view.rebuild()
    c1 = view.load("c1")
    assert c1 is not None
    assert c1.lora_adapters == frozenset({"x", "y", "z"})
    assert (c1.lora_slots, c1.lora_slots_free) == (4, 1)  # one free on a, none on b
    assert (c1.gpu_utilization, c1.gpu_memory_usage) == (0.9, 0.8)
    assert c1.ttft_s == pytest.approx(0.2) and c1.tpot_s == pytest.approx(0.02)
    c2 = view.load("c2")
    assert c2 is not None
    assert (c2.lora_adapters, c2.lora_slots, c2.gpu_utilization, c2.ttft_s) == (frozenset(), 0, None, None)


def test_view_endpoint_mode_keeps_each_instance_apart() -> None:
    pool = Pool(
        clusters=(ClusterSpec(name="c1", models=("m",), endpoints=("10.0.0.1:8000", "10.0.0.2:8000")),),
        mode=RoutingMode.ENDPOINT,
    )
    view = FleetView(pool, clock=lambda: NOW + 1)
    view.apply(_inst("c1/1", address="10.0.0.1:8000", lora_adapters=frozenset({"x"}), max_lora=1))
    view.apply(_inst("c1/2", address="10.0.0.2:8000", max_lora=1))
    view.rebuild()
    one, two = view.load("c1/10.0.0.1:8000"), view.load("c1/10.0.0.2:8000")
    assert one is not None and two is not None
    assert (one.lora_slots, one.lora_slots_free, two.lora_slots_free) == (1, 0, 1)


# -- publisher: adapter slots and DCGM -------------------------------------------------------------------
def test_vllm_and_sglang_adapter_slots() -> None:
    vllm = (
        "vllm:num_requests_running 1\n"
        'vllm:lora_requests_info{max_lora="4",running_lora_adapters="a",waiting_lora_adapters=""} 1.8e9\n'
    )
    assert normalize("vllm", vllm).max_lora == 4
    sglang = (
        'sglang:num_running_reqs{model_name="m"} 1\n'
        'sglang:lora_pool_slots_total{model_name="m",dp_rank="0"} 8\n'
        'sglang:lora_pool_slots_total{model_name="m",dp_rank="1"} 8\n'
    )
    assert normalize("sglang", sglang).max_lora == 8
    assert normalize("vllm", "vllm:num_requests_running 1\n").max_lora is None


DCGM = """\
# HELP DCGM_FI_DEV_GPU_UTIL GPU utilization (in %).
# TYPE DCGM_FI_DEV_GPU_UTIL gauge
DCGM_FI_DEV_GPU_UTIL{gpu="0",UUID="GPU-aaa",device="nvidia0",modelName="NVIDIA H100",Hostname="n1"} 97
DCGM_FI_DEV_GPU_UTIL{gpu="1",UUID="GPU-bbb",device="nvidia1",modelName="NVIDIA H100",Hostname="n1"} 20
# HELP DCGM_FI_DEV_FB_FREE Framebuffer memory free (in MiB).
# TYPE DCGM_FI_DEV_FB_FREE gauge
DCGM_FI_DEV_FB_FREE{gpu="0",UUID="GPU-aaa",device="nvidia0",modelName="NVIDIA H100",Hostname="n1"} 8000
DCGM_FI_DEV_FB_FREE{gpu="1",UUID="GPU-bbb",device="nvidia1",modelName="NVIDIA H100",Hostname="n1"} 60000
# HELP DCGM_FI_DEV_FB_USED Framebuffer memory used (in MiB).
# TYPE DCGM_FI_DEV_FB_USED gauge
DCGM_FI_DEV_FB_USED{gpu="0",UUID="GPU-aaa",device="nvidia0",modelName="NVIDIA H100",Hostname="n1"} 72000
DCGM_FI_DEV_FB_USED{gpu="1",UUID="GPU-bbb",device="nvidia1",modelName="NVIDIA H100",Hostname="n1"} 20000
"""


def test_dcgm_all_gpus_busiest_and_fullest() -> None:
    r = normalize_dcgm(DCGM)
    assert r.utilization == pytest.approx(0.97)
    assert r.memory_usage == pytest.approx(0.9)
    assert r.gpus == 2 and r.rejected == []
    assert r.model == "NVIDIA H100"


@pytest.mark.parametrize(
    ("name", "tflops"),
    [
        ("NVIDIA H100 80GB HBM3", 989.0),
        ("NVIDIA H100 PCIe", 756.0),
        ("NVIDIA H100 NVL", 835.0),
        ("NVIDIA H200", 989.0),
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("NVIDIA A10G", 70.0),
        ("NVIDIA A10", 125.0),
        ("NVIDIA L40S", 362.0),
        ("NVIDIA L40", 181.0),
        ("NVIDIA L4", 121.0),
        ("Tesla T4", 65.0),
        ("h100", 989.0),  # an operator's short name
        ("AMD Instinct MI300X", 1307.0),
        ("NVIDIA GeForce GTX 1080", None),
        ("", None),
        (None, None),
    ],
)
def test_gpu_names_map_to_nominal_prefill_speeds(name: str | None, tflops: float | None) -> None:
    from extproc.fleet.gpus import gpu_speed

    assert gpu_speed(name) == tflops


@pytest.mark.parametrize("select", [["1"], ["GPU-bbb"]])
def test_dcgm_selects_the_instance_gpus_by_index_or_uuid(select: list[str]) -> None:
    r = normalize_dcgm(DCGM, select)
    assert r.utilization == pytest.approx(0.2)
    assert r.memory_usage == pytest.approx(0.25)


def test_dcgm_mig_fallback_bad_values_and_missing_gpus() -> None:
    mig = 'DCGM_FI_PROF_GR_ENGINE_ACTIVE{gpu="0",UUID="GPU-aaa",GPU_I_ID="1"} 0.4\n'
    assert normalize_dcgm(mig).utilization == pytest.approx(0.4)
    bad = 'DCGM_FI_DEV_GPU_UTIL{gpu="0"} NaN\nDCGM_FI_DEV_FB_USED{gpu="0"} 10\n'
    r = normalize_dcgm(bad)
    assert (r.utilization, r.memory_usage) == (None, None)
    assert ("gpu_utilization", "nan") in r.rejected and ("gpu_memory_usage", "unusable") in r.rejected
    assert normalize_dcgm(DCGM, ["7"]).gpus == 0
    with pytest.raises(ValueError, match="malformed"):
        normalize_dcgm("<html>\n{{ nope")


def test_fill_load_copies_slots_and_gpu_figures_within_bounds() -> None:
    snap = spb.UpstreamSnapshot()
    rejected = _fill_load(
        snap,
        EngineLoad(num_running=1, max_lora=4, gpu_utilization=1.02, gpu_memory_usage=0.7),
        _Previous(),
    )
    assert rejected == []
    assert (snap.max_lora, snap.gpu_utilization, snap.gpu_memory_usage) == (4, 1.0, pytest.approx(0.7))
    snap = spb.UpstreamSnapshot()
    rejected = _fill_load(snap, EngineLoad(num_running=1, max_lora=10**6), _Previous())
    assert not snap.HasField("max_lora") and rejected == [("max_lora", "too_large")]


def test_dcgm_settings() -> None:
    spec = instance_from_dict(
        {
            "cluster": "c",
            "address": "10.0.0.7:8000",
            "dcgm_url": "http://{host}:9400/metrics",
            "dcgm_gpus": [0, "1"],
        }
    )
    assert spec.dcgm() == "http://10.0.0.7:9400/metrics" and spec.dcgm_gpus == ("0", "1")
    assert instance_from_dict({"cluster": "c", "address": "10.0.0.7:8000"}).dcgm() == ""
    for bad in ({"dcgm_url": "10.0.0.7:9400"}, {"dcgm_gpus": "0"}, {"dcgm_gpus": [True]}):
        with pytest.raises(ConfigError, match="dcgm"):
            instance_from_dict({"cluster": "c", "address": "10.0.0.7:8000", **bad})


async def test_scrape_reads_dcgm_and_a_dead_exporter_only_leaves_gpu_unknown() -> None:
    engine = SimEngine("e", "m")
    engine_port = await engine.start("127.0.0.1", 0)

    async def dcgm(_: web.Request) -> web.Response:
        return web.Response(text=DCGM)

    runner, dcgm_port = await serve_http("GET", "/metrics", dcgm)
    try:
        good = InstanceSpec(
            cluster="c1",
            address=f"127.0.0.1:{engine_port}",
            dcgm_url=f"http://{{host}}:{dcgm_port}/metrics",
            dcgm_gpus=("1",),
        )
        dead = replace(good, dcgm_url="http://127.0.0.1:9/metrics")
        pub = Publisher(PublisherConfig(redis=RedisSettings(pool="p"), instances=[good], publisher_id="t"))
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
            ok = await pub.scrape(session, good)
            down = await pub.scrape(session, dead)
        assert ok.load is not None and ok.load.gpu_utilization == pytest.approx(0.2)
        assert ok.load.gpu_memory_usage == pytest.approx(0.25)
        snap = pub.snapshot(good, ok.health, ok.load, _Previous())
        assert snap.readiness == spb.READY and snap.gpu_utilization == pytest.approx(0.2)
        assert snap.gpu_model == "NVIDIA H100"  # DCGM's modelName: the prefill-speed prior
        named = pub.snapshot(replace(good, gpu="NVIDIA L4"), ok.health, ok.load, _Previous())
        assert named.gpu_model == "NVIDIA L4"  # the operator's name wins
        assert down.load is not None and down.load.gpu_utilization is None
        assert ("gpu_utilization", "dcgm_error") in down.load.rejected
        assert pub.snapshot(dead, down.health, down.load, _Previous()).readiness == spb.READY
    finally:
        await runner.cleanup()
        await engine.stop()


# -- discrete simulation 1: LoRA affinity -----------------------------------------------------------------
# Recommended profile (docs/tuning.md, LORA_PROFILE): filter on slots, affinity first, load as the
# tie-breaker; the affinity's own bound (overload_ratio, overload_slack) keeps hot adapters from piling up.
@pytest.mark.parametrize("zipf", [0.0, 1.0])
def test_sim_lora_lands_where_loaded_and_stays_balanced(zipf: float) -> None:
    r = simulate_lora(zipf=zipf, duration=120.0)
    assert r.requests > 3000
    assert r.landed_loaded >= 0.90
    assert r.max_share <= 2.0 and r.max_window_share <= 2.0


def test_sim_lora_without_affinity_lands_far_less_often() -> None:
    """The contrast: load balancing alone puts requests where their adapter is loaded much less often."""
    plain = {"scorers": ["least-outstanding"], "picker": {"name": "max-score", "params": {"seed": 1}}}
    assert simulate_lora(plain, duration=120.0).landed_loaded < 0.75


# -- discrete simulation 2: one instance slowed 3x, then restored ----------------------------------------
@pytest.mark.parametrize("load_scorer", ["queue-depth", "least-outstanding"])
@pytest.mark.parametrize("slow_decode", [True, False])
def test_sim_slowed_instance_loses_share_fast_and_regains_it(load_scorer: str, slow_decode: bool) -> None:
    r = simulate_slowdown(latency_profile(load_scorer), slow_decode=slow_decode)
    assert 0.12 < r.baseline < 0.22  # ~1/6 before
    assert r.halved_after_s is not None and r.halved_after_s <= 30
    assert r.slowed_share <= r.baseline / 2
    assert r.regained_after_s is not None and r.regained_after_s <= 60
    assert r.share_after >= 0.8 * r.baseline


def test_sim_without_latency_ucb_queue_depth_does_not_react() -> None:
    """The contrast: engines with room in their batch report no queue, so queue-depth alone keeps
    sending the slowed instance its full share."""
    plain = {"scorers": ["queue-depth"], "picker": {"name": "max-score", "params": {"seed": 1}}}
    r = simulate_slowdown(plain)
    assert r.slowed_share > 0.75 * r.baseline
