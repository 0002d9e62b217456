"""Unit tests for the load-aware scheduling plugins: saturation filter, queue-depth and kv-cache-usage
scorers, the weighted-round-robin picker, and a profile combining them."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
from builders import NOW, chat_request, instance_state

from extproc.fleet import (
    ClusterSpec,
    FleetView,
    InFlight,
    InstanceState,
    Load,
    Pool,
    SchedulingState,
    Upstream,
)
from extproc.scheduling import Profile, build_filter, build_picker
from extproc.scheduling.plugins import (
    KvCacheUsageScorer,
    MaxScorePicker,
    QueueDepthScorer,
    SaturationFilter,
    WeightedRoundRobinPicker,
)

REQ = chat_request()


def up(uid: str, weight: float = 1.0) -> Upstream:
    return Upstream(id=uid, cluster=uid, address=None, weight=weight)


def ld(waiting: int = 0, kv: float = 0.0, running: int = 0) -> Load:
    return Load(
        num_running=running,
        num_waiting=waiting,
        kv_cache_usage=kv,
        published_at=NOW,
        instances=1,
        own_at_snapshot=0,
    )


class FakeState:
    """A FleetState with fixed answers."""

    def __init__(
        self,
        loads: dict[str, Load] | None = None,
        pending: dict[str, int] | None = None,
        counts: dict[str, int] | None = None,
    ) -> None:
        self.loads = loads or {}
        self.pendings = pending or {}
        self.counts = counts or {}

    def count(self, upstream_id: str) -> int:
        return self.counts.get(upstream_id, 0)

    def load(self, upstream_id: str) -> Load | None:
        return self.loads.get(upstream_id)

    def pending(self, upstream_id: str) -> int:
        return self.pendings.get(upstream_id, 0)

    def batch(
        self, upstream_id: str, published: bool = False, cap: bool = False, shared: bool = False
    ) -> tuple[float, float | None, float | None]:
        return 0.0, None, None  # no batch limit known


def ids(upstreams: Any) -> list[str]:
    return [u.id for u in upstreams]


# -- saturation ----------------------------------------------------------------------------------------
def test_saturation_drops_full_kv_and_long_queue() -> None:
    cands = [up("ok"), up("kv-full"), up("kv-edge"), up("queue"), up("queue-edge"), up("no-load")]
    state = FakeState(
        {
            "ok": ld(waiting=99, kv=0.89),
            "kv-full": ld(kv=0.95),
            "kv-edge": ld(kv=0.9),  # >= kv_cache_max: dropped
            "queue": ld(waiting=150),
            "queue-edge": ld(waiting=100),  # >= queue_max: dropped
        }
    )
    assert ids(SaturationFilter().filter(REQ, cands, state)) == ["ok", "no-load"]


def test_saturation_queue_is_per_weight() -> None:
    cands = [up("big", weight=4.0), up("small", weight=1.0)]
    state = FakeState({"big": ld(waiting=300), "small": ld(waiting=300)})
    assert ids(SaturationFilter().filter(REQ, cands, state)) == ["big"]


def test_saturation_custom_limits() -> None:
    f = SaturationFilter(kv_cache_max=0.5, queue_max=5)
    state = FakeState({"a": ld(kv=0.49, waiting=4), "b": ld(kv=0.5), "c": ld(waiting=5)})
    assert ids(f.filter(REQ, [up("a"), up("b"), up("c")], state)) == ["a"]


def test_saturation_all_saturated_keeps_all() -> None:
    cands = [up("a"), up("b")]
    state = FakeState({"a": ld(kv=0.99), "b": ld(waiting=1000)})
    assert ids(SaturationFilter().filter(REQ, cands, state)) == ["a", "b"]


def test_saturation_all_saturated_sheds_when_configured() -> None:
    cands = [up("a"), up("b")]
    state = FakeState({"a": ld(kv=0.99), "b": ld(waiting=1000)})
    assert list(SaturationFilter(keep_all_if_empty=False).filter(REQ, cands, state)) == []


def test_saturation_built_from_registry() -> None:
    f = build_filter("saturation", {"kv_cache_max": 0.8, "queue_max": 10, "keep_all_if_empty": False})
    state = FakeState({"a": ld(kv=0.85)})
    assert list(f.filter(REQ, [up("a")], state)) == []


# -- queue-depth ---------------------------------------------------------------------------------------
def test_queue_depth_waiting_plus_pending_per_weight() -> None:
    cands = [up("a"), up("b", weight=2.0), up("c"), up("d")]
    state = FakeState(
        loads={"a": ld(waiting=10), "b": ld(waiting=10), "c": ld(waiting=0)},
        pending={"a": 0, "b": 2, "c": 2, "d": 4},
    )
    # depths: a 10, b (10+2)/2 = 6, c 2, d (no load) 4 -> inverted min-max over [2, 10]
    scores = QueueDepthScorer().score(REQ, cands, state)
    assert scores == pytest.approx([0.0, 0.5, 1.0, 0.75])


def test_queue_depth_all_equal_is_all_one() -> None:
    cands = [up("a"), up("b"), up("c")]
    state = FakeState(loads={"a": ld(waiting=3), "b": ld(waiting=3)}, pending={"c": 3})
    assert QueueDepthScorer().score(REQ, cands, state) == [1.0, 1.0, 1.0]


def test_queue_depth_with_real_state_counts_growth_since_snapshot() -> None:
    pool = Pool(clusters=(ClusterSpec("a", ("m",)), ClusterSpec("b", ("m",))))
    inflight = InFlight()
    view = FleetView(pool, clock=lambda: NOW + 1, own_count=inflight.count)
    state = SchedulingState(inflight, view)
    b_leases = [inflight.acquire(up("b")) for _ in range(3)]  # before b's snapshot: in its figure
    for cluster, waiting in (("a", 2), ("b", 5)):
        view.apply(_inst(cluster, num_waiting=waiting))
    view.rebuild()
    cands = list(view.candidates("m") or ())
    assert ids(cands) == ["a", "b"]
    assert QueueDepthScorer().score(REQ, cands, state) == pytest.approx([1.0, 0.0])
    for _ in range(4):  # four sends to a since its snapshot: a is now deeper (6) than b (5)
        inflight.acquire(up("a"))
    assert QueueDepthScorer().score(REQ, cands, state) == pytest.approx([0.0, 1.0])
    for lease in b_leases:  # finishing requests counted before the snapshot does not go below zero
        lease.release()
    assert state.pending("b") == 0
    assert QueueDepthScorer().score(REQ, cands, state) == pytest.approx([0.0, 1.0])


# -- kv-cache-usage -------------------------------------------------------------------------------------
def test_kv_cache_usage_scores() -> None:
    cands = [up("a"), up("b"), up("c"), up("d")]
    state = FakeState({"a": ld(kv=0.0), "b": ld(kv=0.25), "c": ld(kv=1.0)})
    assert KvCacheUsageScorer().score(REQ, cands, state) == pytest.approx([1.0, 0.75, 0.0, 0.5])


# -- weighted-round-robin ------------------------------------------------------------------------------
def _longest_run(seq: list[str], who: str) -> int:
    best = run = 0
    for s in seq:
        run = run + 1 if s == who else 0
        best = max(best, run)
    return best


def test_wrr_three_to_one_is_exact_and_smooth() -> None:
    picker = WeightedRoundRobinPicker()
    cands = [up("heavy", 3.0), up("light", 1.0)]
    picks = [picker.pick(REQ, cands, [0.0, 0.0]).id for _ in range(8)]
    assert Counter(picks) == {"heavy": 6, "light": 2}
    assert _longest_run(picks, "heavy") <= 3
    assert _longest_run(picks, "light") == 1
    # Smooth: every window of four picks holds exactly one light pick.
    for i in range(0, 8, 4):
        assert picks[i : i + 4].count("light") == 1


def test_wrr_equal_weights_alternate() -> None:
    picker = WeightedRoundRobinPicker()
    cands = [up("a"), up("b")]
    picks = [picker.pick(REQ, cands, [1.0, 0.0]).id for _ in range(6)]
    assert picks in (["a", "b"] * 3, ["b", "a"] * 3)


def test_wrr_three_equal_cycle() -> None:
    picker = WeightedRoundRobinPicker()
    cands = [up("a"), up("b"), up("c")]
    picks = [picker.pick(REQ, cands, [0.0, 0.0, 0.0]).id for _ in range(9)]
    assert Counter(picks) == {"a": 3, "b": 3, "c": 3}
    for i in range(0, 9, 3):
        assert sorted(picks[i : i + 3]) == ["a", "b", "c"]


def test_wrr_ignores_scores() -> None:
    cands = [up("heavy", 3.0), up("light", 1.0)]
    p1, p2 = WeightedRoundRobinPicker(), WeightedRoundRobinPicker()
    a = [p1.pick(REQ, cands, [0.0, 100.0]).id for _ in range(8)]
    b = [p2.pick(REQ, cands, [100.0, 0.0]).id for _ in range(8)]
    assert a == b
    assert Counter(a) == {"heavy": 6, "light": 2}


def test_wrr_registered() -> None:
    picker = build_picker("weighted-round-robin")
    assert isinstance(picker, WeightedRoundRobinPicker)
    assert picker.pick(REQ, [up("only")], [0.0]).id == "only"


# -- a profile combining them --------------------------------------------------------------------------
def _profile() -> Profile:
    return Profile(
        name="load-aware",
        filters=(SaturationFilter(),),
        scorers=((QueueDepthScorer(), 1.0), (KvCacheUsageScorer(), 1.0)),
        picker=MaxScorePicker(seed=1),
    )


def test_profile_picks_least_loaded_fake_state() -> None:
    cands = [up("saturated"), up("busy"), up("light"), up("mid")]
    state = FakeState(
        {
            "saturated": ld(waiting=0, kv=0.95),  # emptiest queue but dropped by the filter
            "busy": ld(waiting=20, kv=0.6),
            "light": ld(waiting=1, kv=0.2),
            "mid": ld(waiting=5, kv=0.1),
        }
    )
    for _ in range(5):
        assert _profile().schedule(REQ, cands, state) == up("light")


def _inst(cluster: str, **kw: Any) -> InstanceState:
    return instance_state(f"{cluster}/0", cluster, None, **kw)


def test_profile_picks_least_loaded_real_view() -> None:
    pool = Pool(clusters=tuple(ClusterSpec(c, ("m",)) for c in ("a", "b", "c")))
    inflight = InFlight()
    view = FleetView(pool, clock=lambda: NOW + 1, own_count=inflight.count)
    view.apply(_inst("a", num_waiting=0, kv_cache_usage=0.97))
    view.apply(_inst("b", num_waiting=8, kv_cache_usage=0.5))
    view.apply(_inst("c", num_waiting=2, kv_cache_usage=0.3))
    view.rebuild()
    state = SchedulingState(inflight, view)
    cands = view.candidates("m") or ()
    assert ids(cands) == ["a", "b", "c"]
    assert _profile().schedule(REQ, cands, state) == up("c")
    # Eight requests sent to c since its snapshot make b (8 waiting, kv 0.5) the better choice.
    for _ in range(8):
        inflight.acquire(up("c"))
    assert _profile().schedule(REQ, cands, state) == up("b")


def test_profile_sheds_when_all_saturated_and_configured() -> None:
    profile = Profile(
        name="shed",
        filters=(SaturationFilter(keep_all_if_empty=False),),
        scorers=((QueueDepthScorer(), 1.0),),
        picker=MaxScorePicker(seed=0),
    )
    state = FakeState({"a": ld(kv=0.99), "b": ld(kv=0.95)})
    assert profile.schedule(REQ, [up("a"), up("b")], state) is None
