"""LoRA affinity, observed-latency exploration (UCB) and GPU utilisation: the plugins with fake fleet
state, the fleet view and snapshot fields they read, the publisher's adapter slots and DCGM reading, and
two discrete simulations (no network, virtual clock) that reproduce the targets of the issue:

- 10 adapters, 4 adapter slots per instance, 6 instances: >= 90 % of requests land where their adapter
  is in GPU memory, and no instance gets more than 2x its fair share;
- one instance slowed 3x mid-run: its share halves within 30 s; restored, it regains (80 % of) its
  share within 60 s.

The simulations are models (an engine here is an LRU of adapter slots, a batch and a service time),
not live engines. `python tests/test_lora_latency_gpu.py` prints the figures quoted in docs/tuning.md.
"""

from __future__ import annotations

import random
from collections import Counter, OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from builders import NOW, chat_request, instance_state

from extproc.fleet import ClusterSpec, FleetView, InstanceState, Load, Pool, RoutingMode, Upstream
from extproc.fleet import snapshot_pb2 as spb
from extproc.fleet.snapshots import validate
from extproc.lab.engines import SimEngine
from extproc.openai import InferenceRequest
from extproc.publishers.engines import EngineLoad, normalize, normalize_dcgm
from extproc.publishers.publisher import (
    InstanceSpec,
    Publisher,
    PublisherConfig,
    _fill_load,
    _Previous,
    instance_from_dict,
)
from extproc.scheduling import build_filter, build_scorer, profile_from_config
from extproc.scheduling.gpu import GpuUtilizationScorer
from extproc.scheduling.latency import LatencyUcbScorer
from extproc.scheduling.lora import LoraAffinityFilter, LoraAffinityScorer
from extproc.settings import ConfigError, RedisSettings


# -- fakes -------------------------------------------------------------------------------------------------
class FakeState:
    """A FleetState over dicts with a settable clock (virtual seconds)."""

    def __init__(self, loads: dict[str, Load] | None = None, t: float = NOW) -> None:
        self.loads: dict[str, Load] = loads or {}
        self.counts: Counter[str] = Counter()
        self.t = t

    def count(self, upstream_id: str) -> int:
        return self.counts[upstream_id]

    def load(self, upstream_id: str) -> Load | None:
        return self.loads.get(upstream_id)

    def pending(self, upstream_id: str) -> int:
        load = self.loads.get(upstream_id)
        own = self.counts[upstream_id]
        return own if load is None else max(0, own - load.own_at_snapshot)

    def now(self) -> float:
        return self.t


def ld(**kw: Any) -> Load:
    base: dict[str, Any] = {
        "num_running": 0,
        "num_waiting": 0,
        "kv_cache_usage": 0.0,
        "published_at": NOW,
        "instances": 1,
        "own_at_snapshot": 0,
    }
    base.update(kw)
    return Load(**base)


def up(uid: str) -> Upstream:
    return Upstream(id=uid, cluster=uid, address=None, weight=1.0)


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


async def _serve(handler: Any) -> tuple[web.AppRunner, int]:
    app = web.Application()
    app.router.add_get("/metrics", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, port


async def test_scrape_reads_dcgm_and_a_dead_exporter_only_leaves_gpu_unknown() -> None:
    engine = SimEngine("e", "m")
    engine_port = await engine.start("127.0.0.1", 0)

    async def dcgm(_: web.Request) -> web.Response:
        return web.Response(text=DCGM)

    runner, dcgm_port = await _serve(dcgm)
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
        assert down.load is not None and down.load.gpu_utilization is None
        assert ("gpu_utilization", "dcgm_error") in down.load.rejected
        assert pub.snapshot(dead, down.health, down.load, _Previous()).readiness == spb.READY
    finally:
        await runner.cleanup()
        await engine.stop()


# -- discrete simulation 1: LoRA affinity -----------------------------------------------------------------
# Recommended profile (docs/tuning.md): filter on slots, affinity first, load as the tie-breaker; the
# affinity's own bound (overload_ratio, overload_slack) is what keeps hot adapters from piling up.
LORA_PROFILE: dict[str, Any] = {
    "filters": ["lora-affinity"],
    "scorers": [{"name": "lora-affinity", "weight": 2.0}, {"name": "least-outstanding", "weight": 1.0}],
    "picker": {"name": "max-score", "params": {"seed": 1}},
}


@dataclass
class LoraEngine:
    """An engine model: `slots` adapters in GPU memory (LRU; an adapter with a running request cannot
    be evicted), a batch of `batch` concurrent requests, a swap-in cost, FIFO waiting that skips
    requests whose adapter cannot get a slot yet (as vLLM's scheduler does beyond max_loras)."""

    slots: int = 4
    batch: int = 16
    swap_s: float = 0.3
    gpu: OrderedDict[str, None] = field(default_factory=OrderedDict)
    running: list[tuple[float, str]] = field(default_factory=list)  # (ends at, adapter)
    waiting: deque[tuple[str, float]] = field(default_factory=deque)  # (adapter, service time)

    def _evictable(self) -> list[str]:
        busy = {a for _, a in self.running}
        return [a for a in self.gpu if a not in busy]

    def _can_start(self, adapter: str) -> bool:
        if len(self.running) >= self.batch:
            return False
        return adapter in self.gpu or len(self.gpu) < self.slots or bool(self._evictable())

    def _start(self, adapter: str, service: float, now: float) -> None:
        if adapter not in self.gpu:
            if len(self.gpu) >= self.slots:
                del self.gpu[self._evictable()[0]]
            self.gpu[adapter] = None
            service += self.swap_s
        self.gpu.move_to_end(adapter)
        self.running.append((now + service, adapter))

    def step(self, now: float) -> int:
        """Advance to `now`; returns how many requests finished."""
        before = len(self.running)
        self.running = [r for r in self.running if r[0] > now]
        finished = before - len(self.running)
        still: deque[tuple[str, float]] = deque()
        for adapter, service in self.waiting:
            if self._can_start(adapter):
                self._start(adapter, service, now)
            else:
                still.append((adapter, service))
        self.waiting = still
        return finished

    def listed(self) -> frozenset[str]:
        """What vLLM's lora_requests_info would list: adapters with running or waiting requests."""
        return frozenset({a for _, a in self.running} | {a for a, _ in self.waiting})


@dataclass
class LoraResult:
    requests: int
    landed_loaded: float  # share of requests routed where their adapter was in GPU memory
    max_share: float  # the busiest instance's requests over the fair share (1.0 = perfectly even)
    max_window_share: float  # the same over the worst 10 s window
    shares: dict[str, float]


def simulate_lora(
    profile: dict[str, Any] | None = None,
    *,
    instances: int = 6,
    adapters: int = 10,
    rate: float = 30.0,
    duration: float = 240.0,
    zipf: float = 1.0,
    seed: int = 1,
    publish_s: float = 1.0,
) -> LoraResult:
    """Poisson arrivals at `rate` req/s; adapter popularity ~ 1/rank^zipf; service 1-3 s, plus 0.3 s
    when the adapter must be swapped in. The router is the real profile; the fleet state is rebuilt
    from the engine models every `publish_s` (as snapshots), plus the router's own in-flight counts
    in between."""
    rng = random.Random(seed)
    prof = profile_from_config("lora", profile or LORA_PROFILE)
    ups = [up(f"u{i}") for i in range(instances)]
    engines = {u.id: LoraEngine() for u in ups}
    state = FakeState(t=0.0)
    names = [f"adapter-{k}" for k in range(adapters)]
    weights = [1.0 / (k + 1) ** zipf for k in range(adapters)]
    requests = {m: req(m) for m in names}
    dt, t = 0.02, 0.0
    next_arrival, next_publish = rng.expovariate(rate), 0.0
    landed = 0
    routed: list[tuple[float, str]] = []
    while t < duration:
        t += dt
        state.t = t
        for uid, e in engines.items():
            state.counts[uid] -= e.step(t)
        if t >= next_publish:
            next_publish += publish_s
            for uid, e in engines.items():
                listed = e.listed()
                state.loads[uid] = ld(
                    num_running=len(e.running),
                    num_waiting=len(e.waiting),
                    published_at=t,
                    own_at_snapshot=state.counts[uid],
                    lora_adapters=listed,
                    lora_slots=e.slots,
                    lora_slots_free=max(0, e.slots - len(listed)),
                )
        while next_arrival <= t:
            next_arrival += rng.expovariate(rate)
            model = rng.choices(names, weights=weights)[0]
            chosen = prof.schedule(requests[model], ups, state)
            assert chosen is not None
            engine = engines[chosen.id]
            landed += model in engine.gpu
            routed.append((t, chosen.id))
            state.counts[chosen.id] += 1
            engine.waiting.append((model, rng.uniform(1.0, 3.0)))
            engine.step(t)
    total = Counter(uid for _, uid in routed)
    fair = len(routed) / instances
    worst = 0.0
    for start in range(0, int(duration), 10):
        window = Counter(uid for at, uid in routed if start <= at < start + 10)
        if sum(window.values()) >= 10 * instances:
            worst = max(worst, max(window.values()) / (sum(window.values()) / instances))
    return LoraResult(
        requests=len(routed),
        landed_loaded=landed / len(routed),
        max_share=max(total.values()) / fair,
        max_window_share=worst,
        shares={uid: total[uid] / fair for uid in sorted(total)},
    )


def replace_scorer_params(profile: dict[str, Any], name: str, params: dict[str, Any]) -> dict[str, Any]:
    scorers = [{**s, "params": params} if s.get("name") == name else s for s in profile["scorers"]]
    return {**profile, "scorers": scorers}


@pytest.mark.parametrize("zipf", [0.0, 1.0])
def test_sim_lora_lands_where_loaded_and_stays_balanced(zipf: float) -> None:
    r = simulate_lora(zipf=zipf)
    assert r.requests > 6000
    assert r.landed_loaded >= 0.90
    assert r.max_share <= 2.0 and r.max_window_share <= 2.0


def test_sim_lora_without_affinity_lands_far_less_often() -> None:
    """The contrast: load balancing alone puts requests where their adapter is loaded much less often."""
    plain = {"scorers": ["least-outstanding"], "picker": {"name": "max-score", "params": {"seed": 1}}}
    assert simulate_lora(plain).landed_loaded < 0.75


# -- discrete simulation 2: one instance slowed 3x, then restored ----------------------------------------
def latency_profile(load_scorer: str) -> dict[str, Any]:
    return {
        "scorers": [{"name": "latency-ucb", "weight": 2.0}, {"name": load_scorer, "weight": 1.0}],
        "picker": {"name": "max-score", "params": {"seed": 1}},
    }


@dataclass
class SlowdownResult:
    baseline: float  # the slowed instance's share over the minute before the slowdown
    halved_after_s: float | None  # first 5 s window (ending that long after) with share <= baseline / 2
    slowed_share: float  # its share from 30 s after the slowdown to the restore
    regained_after_s: float | None  # first 5 s window after the restore with share >= 0.8 x baseline
    share_after: float  # its share from 60 s after the restore to the end


def simulate_slowdown(
    profile: dict[str, Any],
    *,
    instances: int = 6,
    rate: float = 30.0,
    slow_at: float = 120.0,
    restore_at: float = 240.0,
    end: float = 360.0,
    factor: float = 3.0,
    slow_decode: bool = True,
    seed: int = 1,
    publish_s: float = 1.0,
) -> SlowdownResult:
    """Engines without queueing (continuous batching with room): TTFT = 0.15 s x (1 + 0.03 x running)
    +-20 %, then 1-3 s of decode; instance u0 runs `factor` x slower (TTFT, and decode unless
    `slow_decode` is False) between `slow_at` and `restore_at`. Snapshots every `publish_s` carry each
    engine's running count and mean TTFT over the interval, as the publisher computes it."""
    rng = random.Random(seed)
    prof = profile_from_config("latency", profile)
    ups = [up(f"u{i}") for i in range(instances)]
    state = FakeState(t=0.0)
    running: dict[str, list[tuple[float, float]]] = {u.id: [] for u in ups}  # (ends at, ttft)
    first_tokens: dict[str, list[tuple[float, float]]] = {u.id: [] for u in ups}  # (at, ttft)
    request = req("m")
    dt, t = 0.02, 0.0
    next_arrival, next_publish = rng.expovariate(rate), publish_s
    routed: list[tuple[float, str]] = []
    while t < end:
        t += dt
        state.t = t
        for uid, rs in running.items():
            still = [r for r in rs if r[0] > t]
            state.counts[uid] -= len(rs) - len(still)
            running[uid] = still
        if t >= next_publish:
            next_publish += publish_s
            for uid in running:
                seen = [x for at, x in first_tokens[uid] if at <= t]
                first_tokens[uid] = [(at, x) for at, x in first_tokens[uid] if at > t]
                state.loads[uid] = ld(
                    num_running=len(running[uid]),
                    published_at=t,
                    own_at_snapshot=state.counts[uid],
                    ttft_s=sum(seen) / len(seen) if seen else None,
                )
        while next_arrival <= t:
            next_arrival += rng.expovariate(rate)
            chosen = prof.schedule(request, ups, state)
            assert chosen is not None
            slow = factor if chosen.id == "u0" and slow_at <= t < restore_at else 1.0
            ttft = slow * 0.15 * (1 + 0.03 * len(running[chosen.id])) * rng.uniform(0.8, 1.2)
            decode = (slow if slow_decode else 1.0) * rng.uniform(1.0, 3.0)
            running[chosen.id].append((t + ttft + decode, ttft))
            first_tokens[chosen.id].append((t + ttft, ttft))
            state.counts[chosen.id] += 1
            routed.append((t, chosen.id))

    def share(a: float, b: float) -> float:
        picks = [uid for at, uid in routed if a <= at < b]
        return sum(1 for uid in picks if uid == "u0") / max(1, len(picks))

    baseline = share(slow_at - 60, slow_at)
    halved = next((k for k in range(1, 121) if share(slow_at + k - 5, slow_at + k) <= baseline / 2), None)
    regained = next(
        (k for k in range(1, 121) if share(restore_at + k - 5, restore_at + k) >= 0.8 * baseline), None
    )
    return SlowdownResult(
        baseline=baseline,
        halved_after_s=None if halved is None else float(halved),
        slowed_share=share(slow_at + 30, restore_at),
        regained_after_s=None if regained is None else float(regained),
        share_after=share(restore_at + 60, end),
    )


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


if __name__ == "__main__":  # the figures in docs/tuning.md
    picker = {"name": "max-score", "params": {"seed": 1}}
    for z in (0.0, 1.0):
        print(f"lora zipf={z}:", simulate_lora(zipf=z))
    print(
        "lora, least-outstanding alone:", simulate_lora({"scorers": ["least-outstanding"], "picker": picker})
    )
    print("lora, 40 adapters:", simulate_lora(adapters=40))
    forgetful = replace_scorer_params(LORA_PROFILE, "lora-affinity", {"memory_s": 0.001})
    print("lora, published adapters only (no memory of own picks):", simulate_lora(forgetful))
    for seed in (2, 3):
        print(f"lora seed={seed}:", simulate_lora(seed=seed))
    for slow_decode in (True, False):
        for scorer in ("queue-depth", "least-outstanding"):
            with_ucb = simulate_slowdown(latency_profile(scorer), slow_decode=slow_decode)
            print(f"slowdown decode={slow_decode} latency-ucb+{scorer}:", with_ucb)
            alone = simulate_slowdown({"scorers": [scorer], "picker": picker}, slow_decode=slow_decode)
            print(f"slowdown decode={slow_decode} {scorer} alone:", alone)
            for seed in (2, 3, 4):
                again = simulate_slowdown(latency_profile(scorer), slow_decode=slow_decode, seed=seed)
                print(f"  seed={seed}: halved, regained after", again.halved_after_s, again.regained_after_s)
