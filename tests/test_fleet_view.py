"""Unit tests for extproc.fleet.view: FleetView and SchedulingState."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from builders import NOW, instance_state

from extproc.fleet import ClusterSpec, InFlight, InstanceState, Pool, RoutingMode, Upstream
from extproc.fleet import snapshot_pb2 as spb
from extproc.fleet.view import FleetView, Load, SchedulingState
from extproc.settings import FORGET_AFTER_S


class Clock:
    def __init__(self, t: float = NOW) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def inst(uid: str = "c1/10.0.0.1:8000", **kw: Any) -> InstanceState:
    fields: dict[str, Any] = {
        "cluster": "c1",
        "address": "10.0.0.1:8000",
        "models": frozenset({"m1"}),
        "publisher_id": "pub-1",
        **kw,
    }
    return instance_state(uid, **fields)


def cluster_pool() -> Pool:
    return Pool(
        clusters=(
            ClusterSpec("c1", ("m1",)),
            ClusterSpec("c2", ("m2", "shared")),
            ClusterSpec("c3", ("m3",)),
        )
    )


def endpoint_pool() -> Pool:
    return Pool(
        clusters=(
            ClusterSpec("c1", ("m1",), endpoints=("10.0.0.1:8000",)),
            ClusterSpec("c2", ("m2",), endpoints=("10.0.1.1:8000",)),
        ),
        mode=RoutingMode.ENDPOINT,
    )


# -- apply -------------------------------------------------------------------------------------------
def test_apply_same_publisher_sequence_rules() -> None:
    v = FleetView(cluster_pool(), clock=Clock())
    assert v.apply(inst(sequence=5, num_waiting=5))
    assert not v.apply(inst(sequence=5, num_waiting=99))  # equal: ignored
    assert not v.apply(inst(sequence=4, num_waiting=99, published_at=NOW + 1))  # lower: ignored
    assert v.instances()["c1/10.0.0.1:8000"].num_waiting == 5
    assert v.apply(inst(sequence=6, num_waiting=6, published_at=NOW - 1))  # higher wins even if older
    assert v.instances()["c1/10.0.0.1:8000"].num_waiting == 6


def test_apply_different_publisher_time_rules() -> None:
    v = FleetView(cluster_pool(), clock=Clock())
    assert v.apply(inst(publisher_id="a", sequence=100, published_at=NOW, num_waiting=1))
    assert not v.apply(inst(publisher_id="b", sequence=999, published_at=NOW - 0.5, num_waiting=2))
    assert v.instances()["c1/10.0.0.1:8000"].num_waiting == 1
    assert v.apply(inst(publisher_id="b", sequence=1, published_at=NOW + 0.5, num_waiting=3))
    held = v.instances()["c1/10.0.0.1:8000"]
    assert (held.publisher_id, held.num_waiting) == ("b", 3)


def test_apply_distinct_upstreams_independent() -> None:
    v = FleetView(cluster_pool(), clock=Clock())
    assert v.apply(inst("x", sequence=10))
    assert v.apply(inst("y", sequence=1))
    assert set(v.instances()) == {"x", "y"}


def test_dirty_set_by_apply_cleared_by_rebuild() -> None:
    v = FleetView(cluster_pool(), clock=Clock())
    assert not v.dirty
    v.apply(inst(sequence=1))
    assert v.dirty
    v.rebuild()
    assert not v.dirty
    assert not v.apply(inst(sequence=1))  # ignored: stays clean
    assert not v.dirty
    v.apply(inst(sequence=2))
    assert v.dirty


def test_known_clusters_from_pool() -> None:
    assert FleetView(cluster_pool()).known_clusters == frozenset({"c1", "c2", "c3"})


# -- rebuild: cluster mode ---------------------------------------------------------------------------
def test_cluster_mode_aggregates_instances() -> None:
    v = FleetView(cluster_pool(), clock=Clock(NOW + 1))
    v.apply(inst("c1/a", num_running=2, num_waiting=1, kv_cache_usage=0.3, weight=1.0, published_at=NOW))
    v.apply(
        inst("c1/b", num_running=3, num_waiting=4, kv_cache_usage=0.8, weight=2.0, published_at=NOW - 0.5)
    )
    v.apply(inst("c1/c", num_running=1, num_waiting=0, kv_cache_usage=0.1, weight=0.5, published_at=NOW))
    v.apply(inst("c2/a", cluster="c2", models=frozenset({"m2"}), num_waiting=7, kv_cache_usage=0.2))
    v.rebuild()
    assert v.load("c1") == Load(
        num_running=6,
        num_waiting=5,
        kv_cache_usage=0.8,
        published_at=NOW - 0.5,
        instances=3,
        own_at_snapshot=0,
    )
    assert v.load("c2") == Load(
        num_running=0, num_waiting=7, kv_cache_usage=0.2, published_at=NOW, instances=1, own_at_snapshot=0
    )
    assert v.load("c3") is None
    assert v.candidates("m1") == (Upstream(id="c1", cluster="c1", address=None, weight=3.5),)
    assert v.candidates("m2") == (Upstream(id="c2", cluster="c2", address=None, weight=1.0),)
    assert v.counts == {"fresh_ready": 4, "fresh_not_ready": 0, "stale": 0, "stale_ready": 0}


def test_cluster_prefill_rate_sums_instances_and_counts_unmeasured_ones_at_the_mean() -> None:
    v = FleetView(cluster_pool(), clock=Clock(NOW + 1))
    v.apply(inst("c1/a", prefill_tokens_per_s=3_000.0))
    v.apply(inst("c1/b", prefill_tokens_per_s=1_000.0))
    v.apply(inst("c1/c"))  # not measured yet: taken at the others' mean
    v.apply(inst("c2/a", cluster="c2", models=frozenset({"m2"})))
    v.rebuild()
    assert v.load("c1").prefill_tokens_per_s == pytest.approx(6_000)  # type: ignore[union-attr]
    assert v.load("c2").prefill_tokens_per_s is None  # type: ignore[union-attr]


def test_cluster_gpu_speed_sums_the_known_gpus_and_counts_unknown_ones_at_the_mean() -> None:
    v = FleetView(cluster_pool(), clock=Clock(NOW + 1))
    v.apply(inst("c1/a", gpu_model="NVIDIA H100 80GB HBM3"))
    v.apply(inst("c1/b", gpu_model="NVIDIA A10G"))
    v.apply(inst("c1/c", gpu_model="some future GPU"))  # not in the table: the others' mean
    v.apply(inst("c2/a", cluster="c2", models=frozenset({"m2"})))
    v.rebuild()
    assert v.load("c1").gpu_speed == pytest.approx((989 + 70) * 3 / 2)  # type: ignore[union-attr]
    assert v.load("c2").gpu_speed is None  # type: ignore[union-attr]


def test_loads_of_is_kept_per_candidates_tuple_until_the_view_is_rebuilt() -> None:
    v = FleetView(cluster_pool(), clock=Clock(NOW + 1))
    v.apply(inst("c1/a", num_running=1))
    v.rebuild()
    state = SchedulingState(InFlight(), v)
    candidates = v.candidates("m1")
    assert isinstance(candidates, tuple)
    first = state.loads_of(candidates)
    assert state.loads_of(candidates) is first  # the same answer, no lookups
    assert state.loads_of(list(candidates)) == first and state.loads_of(list(candidates)) is not first
    v.apply(inst("c1/a", num_running=5, sequence=2))
    v.rebuild()
    again = state.loads_of(candidates)  # the same tuple, new loads: looked up again
    assert again is not first and again[0] is not None and again[0].num_running == 5


def test_cluster_mode_per_model_candidates() -> None:
    v = FleetView(cluster_pool(), clock=Clock())
    v.apply(inst("c1/a", models=frozenset({"m1", "shared"})))
    v.apply(inst("c2/a", cluster="c2", models=frozenset({"m2", "shared"})))
    v.rebuild()
    assert [u.id for u in v.candidates("shared") or ()] == ["c1", "c2"]
    assert [u.id for u in v.candidates("m1") or ()] == ["c1"]
    assert [u.id for u in v.candidates("m2") or ()] == ["c2"]
    assert v.candidates("m3") is None
    assert v.serves("shared") and not v.serves("m3")


def test_empty_models_fall_back_to_static_pool() -> None:
    v = FleetView(cluster_pool(), clock=Clock())
    v.apply(inst("c2/a", cluster="c2", models=frozenset()))
    v.rebuild()
    assert [u.id for u in v.candidates("m2") or ()] == ["c2"]
    assert [u.id for u in v.candidates("shared") or ()] == ["c2"]
    assert v.candidates("m1") is None


def test_snapshot_models_override_static_pool() -> None:
    v = FleetView(cluster_pool(), clock=Clock())
    v.apply(inst("c1/a", cluster="c1", models=frozenset({"dynamic"})))
    v.rebuild()
    assert [u.id for u in v.candidates("dynamic") or ()] == ["c1"]
    assert v.candidates("m1") is None  # the static model is not claimed by the snapshot


# -- rebuild: endpoint mode --------------------------------------------------------------------------
def test_endpoint_mode_one_upstream_per_address() -> None:
    v = FleetView(endpoint_pool(), clock=Clock())
    v.apply(inst("c1/10.0.0.1:8000", address="10.0.0.1:8000", weight=2.0, num_waiting=3))
    v.apply(inst("c1/10.0.0.2:8000", address="10.0.0.2:8000", num_waiting=1, kv_cache_usage=0.5))
    v.apply(inst("c1/noaddr", address=None, num_waiting=50))
    v.rebuild()
    assert v.candidates("m1") == (
        Upstream(id="c1/10.0.0.1:8000", cluster="c1", address="10.0.0.1:8000", weight=2.0),
        Upstream(id="c1/10.0.0.2:8000", cluster="c1", address="10.0.0.2:8000", weight=1.0),
    )
    assert v.load("c1/10.0.0.2:8000") == Load(
        num_running=0, num_waiting=1, kv_cache_usage=0.5, published_at=NOW, instances=1, own_at_snapshot=0
    )
    assert v.load("c1") is None
    assert v.load("c1/noaddr") is None
    assert v.load("c1/None") is None


def test_endpoint_mode_only_addressless_instances() -> None:
    v = FleetView(endpoint_pool(), clock=Clock())
    v.apply(inst("c1/x", address=None))
    v.rebuild()
    # Fresh information about m1 exists, but nothing routable: () rather than None.
    assert v.candidates("m1") == ()


# -- readiness and candidates ------------------------------------------------------------------------
def test_candidates_none_without_information() -> None:
    v = FleetView(cluster_pool(), clock=Clock())
    v.rebuild()
    assert v.candidates("m1") is None
    assert v.counts == {"fresh_ready": 0, "fresh_not_ready": 0, "stale": 0, "stale_ready": 0}


@pytest.mark.parametrize("readiness", [spb.WARMING_UP, spb.DRAINING, spb.DOWN, spb.READINESS_UNSPECIFIED])
def test_candidates_empty_when_none_ready(readiness: int) -> None:
    v = FleetView(cluster_pool(), clock=Clock())
    v.apply(inst("c1/a", readiness=readiness))
    v.apply(inst("c2/a", cluster="c2", models=frozenset({"m2"})))
    v.rebuild()
    assert v.candidates("m1") == ()
    assert v.serves("m1")
    assert v.load("c1") is None
    assert [u.id for u in v.candidates("m2") or ()] == ["c2"]
    assert v.counts == {"fresh_ready": 1, "fresh_not_ready": 1, "stale": 0, "stale_ready": 0}


def test_not_ready_instance_excluded_from_aggregate() -> None:
    v = FleetView(cluster_pool(), clock=Clock())
    v.apply(inst("c1/a", num_waiting=2, weight=1.0))
    v.apply(inst("c1/b", num_waiting=100, weight=4.0, readiness=spb.DRAINING))
    v.rebuild()
    assert v.candidates("m1") == (Upstream(id="c1", cluster="c1", address=None, weight=1.0),)
    load = v.load("c1")
    assert load is not None and (load.num_waiting, load.instances) == (2, 1)


# -- expiry --------------------------------------------------------------------------------------------
def test_expiry_then_forget() -> None:
    clock = Clock(NOW)
    v = FleetView(cluster_pool(), clock=clock)
    v.apply(inst("c1/a", published_at=NOW, expires_at=NOW + 2.0))
    v.rebuild()
    assert v.counts == {"fresh_ready": 1, "fresh_not_ready": 0, "stale": 0, "stale_ready": 0}
    assert v.candidates("m1") is not None and len(v.candidates("m1") or ()) == 1

    clock.t = NOW + 1.99
    v.rebuild()
    assert len(v.candidates("m1") or ()) == 1

    clock.t = NOW + 2.0
    v.rebuild()
    assert v.counts == {"fresh_ready": 0, "fresh_not_ready": 0, "stale": 1, "stale_ready": 0}
    assert v.candidates("m1") is None
    assert v.load("c1") is None
    assert "c1/a" in v.instances()

    clock.t = NOW + 2.0 + FORGET_AFTER_S
    v.rebuild()
    assert "c1/a" in v.instances()  # not yet: strictly after FORGET_AFTER_S

    clock.t = NOW + 2.0 + FORGET_AFTER_S + 0.1
    v.rebuild()
    assert v.instances() == {}
    assert v.counts["stale"] == 1  # counted on the rebuild that forgets it
    v.rebuild()
    assert v.counts == {"fresh_ready": 0, "fresh_not_ready": 0, "stale": 0, "stale_ready": 0}


def test_one_stale_instance_leaves_the_fresh_one() -> None:
    clock = Clock(NOW + 5)
    v = FleetView(cluster_pool(), clock=clock)
    v.apply(inst("c1/old", published_at=NOW - 10, expires_at=NOW, num_waiting=40))
    v.apply(inst("c1/new", published_at=NOW + 4, expires_at=NOW + 7, num_waiting=1))
    v.rebuild()
    load = v.load("c1")
    assert load is not None and (load.num_waiting, load.instances, load.published_at) == (1, 1, NOW + 4)
    assert v.counts == {"fresh_ready": 1, "fresh_not_ready": 0, "stale": 1, "stale_ready": 0}


def test_forgotten_instance_accepts_older_sequence_again() -> None:
    clock = Clock(NOW)
    v = FleetView(cluster_pool(), clock=clock)
    v.apply(inst("c1/a", sequence=50, expires_at=NOW + 1))
    clock.t = NOW + 1 + FORGET_AFTER_S + 1
    v.rebuild()
    assert v.apply(inst("c1/a", sequence=1))


# -- own in-flight sampled at each snapshot ------------------------------------------------------------
def _leases(inflight: InFlight, upstream: Upstream, n: int) -> list[Any]:
    return [inflight.acquire(upstream) for _ in range(n)]


def test_own_count_sampled_when_snapshot_applied_cluster_mode() -> None:
    inflight = InFlight()
    v = FleetView(cluster_pool(), clock=Clock(), own_count=inflight.count)
    c1 = Upstream(id="c1", cluster="c1", address=None, weight=1.0)
    _leases(inflight, c1, 4)
    v.apply(inst("c1/a", sequence=1))
    _leases(inflight, c1, 3)  # sent after the snapshot arrived: not in its figures
    v.rebuild()
    load = v.load("c1")
    assert load is not None and load.own_at_snapshot == 4
    # An ignored (old) snapshot does not resample.
    assert not v.apply(inst("c1/a", sequence=1))
    v.rebuild()
    assert v.load("c1").own_at_snapshot == 4  # type: ignore[union-attr]
    # A newer one does: keyed by the schedulable upstream (the cluster), whichever instance sent it.
    v.apply(inst("c1/b", sequence=1))
    v.rebuild()
    assert v.load("c1").own_at_snapshot == 7  # type: ignore[union-attr]


def test_own_count_keyed_by_endpoint_in_endpoint_mode() -> None:
    seen: list[str] = []

    def own(uid: str) -> int:
        seen.append(uid)
        return {"c1/10.0.0.1:8000": 5, "c1/10.0.0.2:8000": 2}.get(uid, 0)

    v = FleetView(endpoint_pool(), clock=Clock(), own_count=own)
    v.apply(inst("c1/10.0.0.1:8000", address="10.0.0.1:8000"))
    v.apply(inst("c1/10.0.0.2:8000", address="10.0.0.2:8000"))
    v.rebuild()
    assert seen == ["c1/10.0.0.1:8000", "c1/10.0.0.2:8000"]
    assert v.load("c1/10.0.0.1:8000").own_at_snapshot == 5  # type: ignore[union-attr]
    assert v.load("c1/10.0.0.2:8000").own_at_snapshot == 2  # type: ignore[union-attr]


def test_default_own_count_is_zero() -> None:
    v = FleetView(cluster_pool(), clock=Clock())
    v.apply(inst("c1/a"))
    v.rebuild()
    assert v.load("c1").own_at_snapshot == 0  # type: ignore[union-attr]


# -- SchedulingState -----------------------------------------------------------------------------------
def test_scheduling_state_without_view() -> None:
    inflight = InFlight()
    st = SchedulingState(inflight, None)
    u = Upstream(id="c1", cluster="c1", address=None, weight=1.0)
    leases = _leases(inflight, u, 3)
    assert st.load("c1") is None
    assert st.count("c1") == 3
    assert st.pending("c1") == 3
    leases[0].release()
    assert st.pending("c1") == 2
    assert st.pending("elsewhere") == 0


def test_scheduling_state_pending_since_snapshot() -> None:
    inflight = InFlight()
    v = FleetView(cluster_pool(), clock=Clock(NOW + 1), own_count=inflight.count)
    st = SchedulingState(inflight, v)
    u = Upstream(id="c1", cluster="c1", address=None, weight=1.0)
    before = _leases(inflight, u, 10)
    assert st.pending("c1") == 10  # no snapshot yet: all own in-flight
    v.apply(inst("c1/a", published_at=NOW, expires_at=NOW + 3))
    v.rebuild()
    assert st.load("c1") == v.load("c1")
    assert st.pending("c1") == 0  # the engines' figures already include those ten
    after = _leases(inflight, u, 3)
    assert st.pending("c1") == 3
    assert st.count("c1") == 13
    for lease in before[:2]:
        lease.release()
    assert st.pending("c1") == 1  # growth since the snapshot: sent since minus finished since
    for lease in before[2:] + after:
        lease.release()
    assert st.count("c1") == 0
    assert st.pending("c1") == 0  # never negative


def test_scheduling_state_pending_back_to_own_when_snapshot_expires() -> None:
    inflight = InFlight()
    clock = Clock(NOW)
    v = FleetView(cluster_pool(), clock=clock, own_count=inflight.count)
    st = SchedulingState(inflight, v)
    u = Upstream(id="c1", cluster="c1", address=None, weight=1.0)
    _leases(inflight, u, 5)
    v.apply(inst("c1/a", published_at=NOW, expires_at=NOW + 2))
    v.rebuild()
    assert st.pending("c1") == 0
    clock.t = NOW + 2
    v.rebuild()
    assert st.load("c1") is None
    assert st.pending("c1") == 5


def test_replace_keeps_state_frozen() -> None:
    # InstanceState is immutable: the view holds what it was given.
    a = inst()
    with pytest.raises(AttributeError):
        a.num_waiting = 3  # type: ignore[misc]
    assert replace(a, num_waiting=3).num_waiting == 3


# -- unknown load is not idle ------------------------------------------------------------------------
def test_unknown_load_gets_the_fleet_median_and_is_marked() -> None:
    v = FleetView(cluster_pool(), clock=Clock())
    v.apply(inst("c1/a", num_running=4, num_waiting=6, kv_cache_usage=0.5))
    v.apply(
        inst(
            "c2/a", cluster="c2", models=frozenset({"m2"}), num_running=8, num_waiting=10, kv_cache_usage=0.9
        )
    )
    v.apply(
        inst("c3/a", cluster="c3", models=frozenset({"m3"}), num_running=None, num_waiting=None, weight=2.0)
    )
    v.rebuild()
    load = v.load("c3")
    assert load is not None
    # Median per unit of weight (running 6, waiting 8), scaled by the instance's weight 2.
    assert (load.num_running, load.num_waiting) == (12, 16)
    assert load.kv_cache_usage == 0.0  # reported as 0.0 here: a known figure, kept
    assert load.unknown == frozenset({"num_running", "num_waiting"})
    known = v.load("c1")
    assert known is not None and known.unknown == frozenset() and known.num_waiting == 6


def test_unknown_kv_usage_gets_the_median() -> None:
    v = FleetView(cluster_pool(), clock=Clock())
    v.apply(inst("c1/a", kv_cache_usage=0.2))
    v.apply(inst("c1/b", kv_cache_usage=0.6))
    v.apply(inst("c2/a", cluster="c2", models=frozenset({"m2"}), kv_cache_usage=None))
    v.rebuild()
    load = v.load("c2")
    assert load is not None and load.kv_cache_usage == pytest.approx(0.4)
    assert load.unknown == frozenset({"kv_cache_usage"})


def test_unknown_everywhere_is_the_same_for_everyone() -> None:
    v = FleetView(cluster_pool(), clock=Clock())
    v.apply(inst("c1/a", num_waiting=None))
    v.apply(inst("c2/a", cluster="c2", models=frozenset({"m2"}), num_waiting=None))
    v.rebuild()
    loads = [v.load("c1"), v.load("c2")]
    assert all(ld is not None and ld.num_waiting == 0 and "num_waiting" in ld.unknown for ld in loads)


def test_one_unknown_instance_in_a_cluster_marks_the_aggregate() -> None:
    v = FleetView(cluster_pool(), clock=Clock())
    v.apply(inst("c1/a", num_waiting=2))
    v.apply(inst("c1/b", num_waiting=None))
    v.rebuild()
    load = v.load("c1")
    assert load is not None and load.num_waiting == 4 and load.unknown == frozenset({"num_waiting"})


# -- stale-READY grace ---------------------------------------------------------------------------------
def test_late_ready_snapshots_are_candidates_when_a_neighbour_is_down() -> None:
    """The measured failure: one hung engine's fresh DOWN snapshot, the healthy ones slightly late."""
    clock = Clock(NOW + 3.5)  # the READY snapshots (published NOW, TTL 3 s) expired 0.5 s ago
    v = FleetView(endpoint_pool(), clock=clock)
    v.apply(inst("c1/10.0.0.1:8000", num_waiting=1))
    v.apply(inst("c1/10.0.0.2:8000", address="10.0.0.2:8000", num_waiting=3))
    v.apply(
        inst(
            "c1/10.0.0.3:8000",
            address="10.0.0.3:8000",
            readiness=spb.DOWN,
            published_at=NOW + 3.4,
            expires_at=NOW + 6.4,
        )
    )
    v.rebuild()
    assert v.counts == {"fresh_ready": 0, "fresh_not_ready": 1, "stale": 2, "stale_ready": 2}
    found = v.candidates("m1")
    assert found is not None and {u.address for u in found} == {"10.0.0.1:8000", "10.0.0.2:8000"}
    assert v.stale_ready_decisions == 1
    load = v.load("c1/10.0.0.2:8000")
    assert load is not None and load.stale and load.num_waiting == 3

    clock.t = NOW + 3.0 + 3.0  # a whole TTL past expiry: the grace is over, the DOWN one is the news
    v.rebuild()
    assert v.candidates("m1") == ()
    assert v.stale_ready_decisions == 1


def test_grace_never_shadows_fresh_ready_instances() -> None:
    clock = Clock(NOW + 3.5)
    v = FleetView(cluster_pool(), clock=clock)
    v.apply(inst("c1/late", num_waiting=0))  # expired 0.5 s ago
    v.apply(inst("c1/fresh", published_at=NOW + 3.0, expires_at=NOW + 6.0, num_waiting=9))
    v.rebuild()
    load = v.load("c1")
    assert load is not None and (load.instances, load.num_waiting, load.stale) == (1, 9, False)
    assert v.stale_ready_decisions == 0
    assert v.counts["stale_ready"] == 0


def test_grace_does_not_replace_the_all_stale_fallback() -> None:
    # No fresh snapshot for the model at all: None, so the router's weighted round robin decides.
    v = FleetView(cluster_pool(), clock=Clock(NOW + 3.5))
    v.apply(inst("c1/a"))
    v.rebuild()
    assert v.candidates("m1") is None


def test_grace_can_be_turned_off() -> None:
    v = FleetView(cluster_pool(), clock=Clock(NOW + 3.5), stale_ready_grace_ttls=0.0)
    v.apply(inst("c1/a"))
    v.apply(inst("c1/b", readiness=spb.DOWN, published_at=NOW + 3.0, expires_at=NOW + 6.0))
    v.rebuild()
    assert v.candidates("m1") == ()


def test_forgotten_endpoints_leave_no_state_behind() -> None:
    """Endpoints that come and go (pods replaced): once the last instance behind an upstream key is
    forgotten, what the view kept per key goes too (own count at snapshot, epoch, smoothed TPOT) and
    the departure hooks hear of it, so state tracks the endpoints there are, not every one seen."""
    clock = Clock(NOW)
    v = FleetView(endpoint_pool(), clock=clock)
    departed: list[tuple[str, ...]] = []
    v.on_departure(departed.append)
    v.apply(inst("c1/10.0.0.1:8000", tpot_s=0.02, num_running=2))
    v.rebuild()
    v.smoothed_tpot("c1/10.0.0.1:8000", 5.0)
    baseline = (len(v._own_at_apply), len(v._epochs), sum(len(s._seen) for s in v._tpot.values()))
    for i in range(50):  # pods that come, serve, flap readiness once and go
        uid = f"c1/10.9.0.{i}:8000"
        v.apply(inst(uid, address=f"10.9.0.{i}:8000", tpot_s=0.03, num_running=1, expires_at=NOW + 1))
        v.apply(inst(uid, address=f"10.9.0.{i}:8000", sequence=2, readiness=spb.DOWN, expires_at=NOW + 1))
        v.apply(
            inst(uid, address=f"10.9.0.{i}:8000", sequence=3, tpot_s=0.03, num_running=1, expires_at=NOW + 1)
        )
    v.rebuild()
    grown = (len(v._own_at_apply), len(v._epochs), sum(len(s._seen) for s in v._tpot.values()))
    assert all(g > b for g, b in zip(grown, baseline, strict=True)), (grown, baseline)
    v.apply(
        inst(
            "c1/10.0.0.1:8000",
            sequence=9,
            published_at=NOW + FORGET_AFTER_S + 5,
            expires_at=NOW + FORGET_AFTER_S + 10,
            tpot_s=0.02,
            num_running=2,
        )
    )
    clock.t = NOW + 1 + FORGET_AFTER_S + 1
    v.rebuild()
    assert set(v.instances()) == {"c1/10.0.0.1:8000"}
    assert (len(v._own_at_apply), len(v._epochs), sum(len(s._seen) for s in v._tpot.values())) == baseline
    assert sorted(uid for batch in departed for uid in batch) == sorted(
        f"c1/10.9.0.{i}:8000" for i in range(50)
    )
    assert v.upstream_keys() == {"c1/10.0.0.1:8000"}
