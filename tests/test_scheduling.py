"""Unit tests for extproc.scheduling: the framework (profiles, registry) and the built-in plugins."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Sequence
from typing import Any

import pytest
from builders import AFFINITY_PROFILE, chat_request

from extproc.fleet import InFlight, Lease, SchedulingState, Upstream
from extproc.openai import InferenceRequest
from extproc.openai.parse import bodyless_request, parse_head
from extproc.scheduling import (
    Profile,
    build_filter,
    build_picker,
    build_scorer,
    framework,
    profile_from_config,
    register,
    registered,
)
from extproc.scheduling.bounded_load import BoundedLoadFilter
from extproc.scheduling.decode_speed import DecodeSpeedScorer
from extproc.scheduling.plugins import (
    KvCacheUsageScorer,
    LeastOutstandingScorer,
    MaxInflightFilter,
    MaxScorePicker,
    QueueDepthScorer,
    SaturationFilter,
    SessionAffinityScorer,
    WeightedRandomPicker,
)
from extproc.scheduling.predicted_ttft import PredictedTtftScorer
from extproc.scheduling.prefix import PrefixAffinityScorer
from extproc.scheduling.slo import SloTpotFilter, SloTtftFilter
from extproc.settings import DEFAULT_PROFILE


def ups(n: int, weight: float = 1.0, prefix: str = "u") -> list[Upstream]:
    return [
        Upstream(id=f"{prefix}{i}", cluster=f"{prefix}{i}", address=None, weight=weight) for i in range(n)
    ]


def up(uid: str, weight: float = 1.0) -> Upstream:
    return Upstream(id=uid, cluster=uid, address=None, weight=weight)


class State(SchedulingState):
    """Scheduling state without a fleet view (static pool), with the test's own handle on leases."""

    def __init__(self) -> None:
        super().__init__(InFlight(), None)

    def acquire(self, upstream: Upstream) -> Lease:
        return self.inflight.acquire(upstream)


def load(state: State, upstream: Upstream, n: int) -> list[Lease]:
    return [state.acquire(upstream) for _ in range(n)]


def req(session: str | None = None, user: str | None = None) -> InferenceRequest:
    headers = {":method": "POST", ":path": "/v1/chat/completions"}
    if session is not None:
        headers["x-session-id"] = session
    if user is not None:
        headers["x-user-id"] = user
    head = parse_head(headers, session_header="x-session-id", user_header="x-user-id", priority_header="x-p")
    return bodyless_request(head)


def direct_req(session: str | None = None, user: str | None = None) -> InferenceRequest:
    return chat_request(session=session, user=user, body_bytes=10)


def affinity_target(key: str, candidates: Sequence[Upstream]) -> Upstream:
    scores = SessionAffinityScorer().score(req(session=key), candidates, State())
    assert sorted(scores) == [0.0] * (len(candidates) - 1) + [1.0]
    return candidates[list(scores).index(1.0)]


class Exploding:
    """A scorer / picker that must not be called."""

    name = "exploding"

    def score(self, *args: Any) -> Sequence[float]:
        raise AssertionError("scorer called")

    def pick(self, *args: Any) -> Upstream:
        raise AssertionError("picker called")


@pytest.fixture
def isolated_registry(monkeypatch: pytest.MonkeyPatch) -> dict[str, dict[str, Any]]:
    copy: dict[str, dict[str, Any]] = {}
    for kind, registry in framework._REGISTRIES.items():
        copy[kind] = dict(registry.factories)
        monkeypatch.setattr(registry, "factories", copy[kind])
        monkeypatch.setattr(registry, "names_by_type", dict(registry.names_by_type))
    return copy


# --------------------------------------------------------------------------------------------------
# least-outstanding
# --------------------------------------------------------------------------------------------------


class TestLeastOutstanding:
    def test_min_load_one_max_load_zero(self) -> None:
        state = State()
        cands = ups(4)
        for u, n in zip(cands, [3, 0, 5, 1], strict=True):
            load(state, u, n)
        scores = LeastOutstandingScorer().score(req(), cands, state)
        assert scores[1] == 1.0
        assert scores[2] == 0.0
        assert scores[0] == pytest.approx(0.4)
        assert scores[3] == pytest.approx(0.8)
        assert all(0.0 <= s <= 1.0 for s in scores)

    def test_all_equal_is_all_one(self) -> None:
        state = State()
        cands = ups(3)
        for u in cands:
            load(state, u, 2)
        assert list(LeastOutstandingScorer().score(req(), cands, state)) == [1.0, 1.0, 1.0]

    def test_idle_fleet_is_all_one(self) -> None:
        assert list(LeastOutstandingScorer().score(req(), ups(5), State())) == [1.0] * 5

    def test_capacity_weight_divides_load(self) -> None:
        state = State()
        big, small = up("big", 4.0), up("small", 1.0)
        load(state, big, 4)  # 1 per unit of capacity
        load(state, small, 2)  # 2 per unit of capacity
        scores = LeastOutstandingScorer().score(req(), [big, small], state)
        assert list(scores) == [1.0, 0.0]

    def test_weighted_equal_loads_tie(self) -> None:
        state = State()
        big, small = up("big", 2.0), up("small", 1.0)
        load(state, big, 4)
        load(state, small, 2)
        assert list(LeastOutstandingScorer().score(req(), [big, small], state)) == [1.0, 1.0]

    def test_fractional_score(self) -> None:
        state = State()
        a, b, c = up("a", 4.0), up("b", 1.0), up("c", 1.0)
        load(state, a, 4)  # 1.0
        load(state, b, 2)  # 2.0
        scores = LeastOutstandingScorer().score(req(), [a, b, c], state)
        assert list(scores) == pytest.approx([0.5, 0.0, 1.0])

    def test_released_leases_lower_load(self) -> None:
        state = State()
        a, b = ups(2)
        leases = load(state, a, 3)
        load(state, b, 1)
        assert list(LeastOutstandingScorer().score(req(), [a, b], state)) == [0.0, 1.0]
        for lease in leases:
            lease.release()
        assert list(LeastOutstandingScorer().score(req(), [a, b], state)) == [1.0, 0.0]


# --------------------------------------------------------------------------------------------------
# max-inflight
# --------------------------------------------------------------------------------------------------


class TestMaxInflight:
    def test_default_limit(self) -> None:
        assert MaxInflightFilter().limit == 256
        assert build_filter("max-inflight").limit == 256

    def test_respects_limit(self) -> None:
        state = State()
        a, b, c = ups(3)
        load(state, a, 2)
        load(state, b, 1)
        kept = MaxInflightFilter(limit=2).filter(req(), [a, b, c], state)
        assert [u.id for u in kept] == ["u1", "u2"]

    def test_limit_scaled_by_weight(self) -> None:
        state = State()
        heavy, light, lighter, idle_light = up("heavy", 2.0), up("light"), up("half", 0.5), up("idle", 0.5)
        load(state, heavy, 3)  # 3 < 2*2 -> kept
        load(state, light, 2)  # 2 < 2*1 -> dropped
        load(state, lighter, 1)  # 1 < 2*0.5 -> dropped
        kept = MaxInflightFilter(limit=2).filter(req(), [heavy, light, lighter, idle_light], state)
        assert [u.id for u in kept] == ["heavy", "idle"]
        load(state, heavy, 1)  # 4 < 4 -> dropped
        kept = MaxInflightFilter(limit=2).filter(req(), [heavy, light, lighter, idle_light], state)
        assert [u.id for u in kept] == ["idle"]

    def test_everyone_full(self) -> None:
        state = State()
        cands = ups(3)
        for u in cands:
            load(state, u, 1)
        assert list(MaxInflightFilter(limit=1).filter(req(), cands, state)) == []

    def test_limit_zero_drops_all(self) -> None:
        assert list(MaxInflightFilter(limit=0).filter(req(), ups(3), State())) == []


# --------------------------------------------------------------------------------------------------
# session-affinity
# --------------------------------------------------------------------------------------------------


class TestSessionAffinity:
    def test_same_session_same_upstream(self) -> None:
        cands = ups(8)
        scorer = SessionAffinityScorer()
        state = State()
        first = list(scorer.score(req(session="conv-42"), cands, state))
        assert first.count(1.0) == 1
        assert first.count(0.0) == 7
        for _ in range(50):
            assert list(scorer.score(req(session="conv-42"), cands, state)) == first
        # A fresh scorer instance (another replica) agrees.
        assert list(SessionAffinityScorer().score(direct_req(session="conv-42"), cands, state)) == first

    def test_independent_of_candidate_order(self) -> None:
        cands = ups(8)
        rng = random.Random(3)
        for i in range(30):
            key = f"s{i}"
            target = affinity_target(key, cands)
            shuffled = cands[:]
            rng.shuffle(shuffled)
            assert affinity_target(key, shuffled) == target

    def test_sessions_spread(self) -> None:
        cands = ups(8)
        counts = Counter(affinity_target(f"session-{i}", cands).id for i in range(200))
        assert len(counts) >= 7
        assert max(counts.values()) <= 60
        assert sum(counts.values()) == 200

    def test_no_session_or_user_is_all_zero(self) -> None:
        scores = SessionAffinityScorer().score(req(), ups(4), State())
        assert list(scores) == [0.0] * 4
        scores = SessionAffinityScorer().score(direct_req(session="", user=""), ups(4), State())
        assert list(scores) == [0.0] * 4

    def test_user_is_fallback_key(self) -> None:
        cands = ups(8)
        scorer = SessionAffinityScorer()
        by_user = list(scorer.score(req(user="alice"), cands, State()))
        assert by_user.count(1.0) == 1
        assert list(scorer.score(req(session="alice"), cands, State())) == by_user

    def test_session_takes_precedence_over_user(self) -> None:
        cands = ups(8)
        scorer = SessionAffinityScorer()
        # find a session and a user that hash to different upstreams
        user_pick = list(scorer.score(req(user="alice"), cands, State()))
        session = next(
            f"s{i}"
            for i in range(100)
            if list(scorer.score(req(session=f"s{i}"), cands, State())) != user_pick
        )
        both = list(scorer.score(req(session=session, user="alice"), cands, State()))
        assert both == list(scorer.score(req(session=session), cands, State()))
        assert both != user_pick

    def test_stable_when_unrelated_upstream_removed(self) -> None:
        cands = ups(8)
        removed = cands[3]
        rest = [u for u in cands if u != removed]
        before = {f"k{i}": affinity_target(f"k{i}", cands) for i in range(300)}
        after = {k: affinity_target(k, rest) for k in before}
        moved = [k for k in before if before[k] != after[k]]
        # Only the sessions that lived on the removed upstream move; everyone else stays put.
        assert all(before[k] == removed for k in moved)
        assert all(after[k] == before[k] for k in before if before[k] != removed)
        assert len(moved) == sum(1 for u in before.values() if u == removed)
        assert len(moved) < 0.25 * len(before)

    def test_stable_when_upstream_added(self) -> None:
        cands = ups(7)
        grown = [*cands, up("new")]
        before = {f"k{i}": affinity_target(f"k{i}", cands) for i in range(300)}
        after = {k: affinity_target(k, grown) for k in before}
        for k in before:
            assert after[k] in (before[k], grown[-1])
        assert sum(1 for k in before if after[k] != before[k]) < 0.25 * len(before)

    def test_single_candidate(self) -> None:
        assert list(SessionAffinityScorer().score(req(session="s"), ups(1), State())) == [1.0]


# --------------------------------------------------------------------------------------------------
# pickers
# --------------------------------------------------------------------------------------------------


class TestMaxScorePicker:
    def test_highest_wins(self) -> None:
        cands = ups(4)
        picker = MaxScorePicker(seed=0)
        for _ in range(50):
            assert picker.pick(req(), cands, [0.1, 0.9, 0.5, 0.89]).id == "u1"

    def test_ties_broken_randomly(self) -> None:
        cands = ups(3)
        picker = MaxScorePicker(seed=1234)
        picked = Counter(picker.pick(req(), cands, [1.0, 0.2, 1.0]).id for _ in range(400))
        assert set(picked) == {"u0", "u2"}
        assert min(picked.values()) > 100

    def test_near_ties_count_as_ties(self) -> None:
        cands = ups(2)
        picker = MaxScorePicker(seed=5)
        picked = {picker.pick(req(), cands, [0.3, 0.3 + 1e-12]).id for _ in range(100)}
        assert picked == {"u0", "u1"}

    def test_seed_is_reproducible(self) -> None:
        cands = ups(5)
        scores = [1.0] * 5
        a = [MaxScorePicker(seed=99).pick(req(), cands, scores).id for _ in range(1)]
        p1, p2 = MaxScorePicker(seed=99), MaxScorePicker(seed=99)
        seq1 = [p1.pick(req(), cands, scores).id for _ in range(50)]
        seq2 = [p2.pick(req(), cands, scores).id for _ in range(50)]
        assert seq1 == seq2
        assert seq1[0] == a[0]
        assert len(set(seq1)) > 1

    def test_built_with_seed_param(self) -> None:
        picker = build_picker("max-score", {"seed": 7})
        assert isinstance(picker, MaxScorePicker)
        assert picker.seed == 7


class TestWeightedRandomPicker:
    def test_zero_scores_uniform(self) -> None:
        cands = ups(3)
        picker = WeightedRandomPicker(seed=42)
        counts = Counter(picker.pick(req(), cands, [0.0, 0.0, 0.0]).id for _ in range(3000))
        assert set(counts) == {"u0", "u1", "u2"}
        for n in counts.values():
            assert 800 <= n <= 1200

    def test_never_picks_zero_score_when_others_positive(self) -> None:
        cands = ups(4)
        picker = WeightedRandomPicker(seed=7)
        counts = Counter(picker.pick(req(), cands, [0.0, 1.0, 0.0, 2.0]).id for _ in range(3000))
        assert set(counts) == {"u1", "u3"}
        # roughly proportional to score (1:2)
        assert 1.5 < counts["u3"] / counts["u1"] < 2.6

    def test_single_positive_always_wins(self) -> None:
        cands = ups(5)
        picker = WeightedRandomPicker(seed=0)
        assert {picker.pick(req(), cands, [0, 0, 0.01, 0, 0]).id for _ in range(200)} == {"u2"}

    def test_seed_is_reproducible(self) -> None:
        cands = ups(4)
        scores = [0.25, 0.25, 0.25, 0.25]
        p1, p2 = WeightedRandomPicker(seed=3), WeightedRandomPicker(seed=3)
        assert [p1.pick(req(), cands, scores).id for _ in range(40)] == [
            p2.pick(req(), cands, scores).id for _ in range(40)
        ]


# --------------------------------------------------------------------------------------------------
# Profile.schedule
# --------------------------------------------------------------------------------------------------


class TestProfile:
    def test_filters_removing_everyone_gives_none(self) -> None:
        state = State()
        cands = ups(3)
        for u in cands:
            load(state, u, 2)
        profile = Profile(
            name="p",
            filters=(MaxInflightFilter(limit=2),),
            scorers=((Exploding(), 1.0),),  # type: ignore[arg-type]
            picker=Exploding(),  # type: ignore[arg-type]
        )
        assert profile.schedule(req(), cands, state) is None

    def test_filters_apply_in_order_and_narrow(self) -> None:
        state = State()
        a, b, c = ups(3)
        load(state, a, 5)
        load(state, b, 3)
        profile = Profile(
            name="p",
            filters=(MaxInflightFilter(limit=5), MaxInflightFilter(limit=4)),
            scorers=(),
            picker=MaxScorePicker(seed=0),
        )
        picked = {profile.schedule(req(), [a, b, c], state).id for _ in range(50)}  # type: ignore[union-attr]
        assert picked == {"u1", "u2"}

    def test_single_candidate_short_circuits(self) -> None:
        only = up("only")
        profile = Profile(
            name="p",
            filters=(),
            scorers=((Exploding(), 1.0),),  # type: ignore[arg-type]
            picker=Exploding(),  # type: ignore[arg-type]
        )
        assert profile.schedule(req(), [only], State()) is only

    def test_single_survivor_of_filters_short_circuits(self) -> None:
        state = State()
        a, b = ups(2)
        load(state, a, 1)
        profile = Profile(
            name="p",
            filters=(MaxInflightFilter(limit=1),),
            scorers=((Exploding(), 1.0),),  # type: ignore[arg-type]
            picker=Exploding(),  # type: ignore[arg-type]
        )
        assert profile.schedule(req(), [a, b], state) is b

    def test_least_outstanding_picks_idle(self) -> None:
        state = State()
        cands = ups(4)
        for u, n in zip(cands, [2, 1, 0, 3], strict=True):
            load(state, u, n)
        profile = profile_from_config("default", DEFAULT_PROFILE)
        assert profile.schedule(req(), cands, state) == cands[2]

    def test_spreads_as_leases_accumulate(self) -> None:
        state = State()
        cands = ups(4)
        profile = profile_from_config("default", DEFAULT_PROFILE)
        for _ in range(40):
            u = profile.schedule(req(), cands, state)
            assert u is not None
            state.acquire(u)
        assert [state.count(u.id) for u in cands] == [10, 10, 10, 10]

    def _affinity_setup(self) -> tuple[list[Upstream], Upstream, Upstream, InFlight, str]:
        cands = ups(2)
        session = "sticky-session"
        home = affinity_target(session, cands)
        other = next(u for u in cands if u != home)
        state = State()
        load(state, home, 3)  # home is busier: least-outstanding prefers `other`
        return cands, home, other, state, session

    def test_weights_combine_affinity_beats_load(self) -> None:
        cands, home, _, state, session = self._affinity_setup()
        profile = profile_from_config(
            "p",
            {
                "scorers": [
                    {"name": "least-outstanding", "weight": 1},
                    {"name": "session-affinity", "weight": 2},
                ],
                "picker": "max-score",
            },
        )
        for _ in range(20):
            assert profile.schedule(req(session=session), cands, state) == home

    def test_weights_combine_load_beats_weak_affinity(self) -> None:
        cands, _, other, state, session = self._affinity_setup()
        profile = profile_from_config(
            "p",
            {
                "scorers": [
                    {"name": "least-outstanding", "weight": 1},
                    {"name": "session-affinity", "weight": 0.5},
                ]
            },
        )
        for _ in range(20):
            assert profile.schedule(req(session=session), cands, state) == other

    def test_zero_weight_scorer_is_ignored(self) -> None:
        cands, _, other, state, session = self._affinity_setup()
        profile = profile_from_config(
            "p",
            {"scorers": [{"name": "least-outstanding"}, {"name": "session-affinity", "weight": 0.0}]},
        )
        assert profile.schedule(req(session=session), cands, state) == other

    def test_no_scorers_picks_randomly_among_all(self) -> None:
        profile = profile_from_config("p", {"picker": {"name": "max-score", "params": {"seed": 11}}})
        cands = ups(3)
        picked = Counter(profile.schedule(req(), cands, State()).id for _ in range(300))  # type: ignore[union-attr]
        assert set(picked) == {"u0", "u1", "u2"}

    def test_empty_candidates_without_filters_is_none(self) -> None:
        profile = profile_from_config("default", DEFAULT_PROFILE)
        assert profile.schedule(req(), [], State()) is None


# --------------------------------------------------------------------------------------------------
# profile_from_config, build, register
# --------------------------------------------------------------------------------------------------


class TestProfileFromConfig:
    def test_string_entries(self) -> None:
        profile = profile_from_config(
            "strings",
            {
                "filters": ["max-inflight"],
                "scorers": ["least-outstanding", "session-affinity"],
                "picker": "weighted-random",
            },
        )
        assert profile.name == "strings"
        assert len(profile.filters) == 1
        assert isinstance(profile.filters[0], MaxInflightFilter)
        assert profile.filters[0].limit == 256
        assert [(type(s), w) for s, w in profile.scorers] == [
            (LeastOutstandingScorer, 1.0),
            (SessionAffinityScorer, 1.0),
        ]
        assert isinstance(profile.picker, WeightedRandomPicker)

    def test_dict_entries_with_weight_and_params(self) -> None:
        profile = profile_from_config(
            "dicts",
            {
                "filters": [{"name": "max-inflight", "params": {"limit": 3}}],
                "scorers": [
                    {"name": "least-outstanding", "weight": 2},
                    {"name": "session-affinity", "weight": 0.25, "params": None},
                ],
                "picker": {"name": "weighted-random", "params": {"seed": 5}},
            },
        )
        assert profile.filters[0].limit == 3  # type: ignore[attr-defined]
        weights = [w for _, w in profile.scorers]
        assert weights == [2.0, 0.25]
        assert all(isinstance(w, float) for w in weights)
        assert isinstance(profile.picker, WeightedRandomPicker)
        assert profile.picker.seed == 5

    def test_defaults(self) -> None:
        profile = profile_from_config("empty", {})
        assert profile.filters == ()
        assert profile.scorers == ()
        assert isinstance(profile.picker, MaxScorePicker)
        profile = profile_from_config("nulls", {"filters": None, "scorers": None})
        assert profile.filters == ()
        assert profile.scorers == ()

    def test_default_profile(self) -> None:
        profile = profile_from_config("default", DEFAULT_PROFILE)
        # decode-speed without an objective of its own: only for requests that carry one
        assert [(type(s), w) for s, w in profile.scorers] == [
            (PredictedTtftScorer, 1.0),
            (DecodeSpeedScorer, 0.6),
        ]
        assert profile.scorers[1][0].tpot_objective_s is None  # type: ignore[attr-defined]
        # no-ops for requests without objectives
        # the guard first (docs/tuning.md, "The floor"), then no-ops for requests without objectives
        assert [type(f) for f in profile.filters] == [BoundedLoadFilter, SloTtftFilter, SloTpotFilter]

    def test_affinity_profile(self) -> None:
        profile = profile_from_config("v1", AFFINITY_PROFILE)
        assert [(type(s), w) for s, w in profile.scorers] == [
            (PrefixAffinityScorer, 3.0),
            (QueueDepthScorer, 1.0),
            (KvCacheUsageScorer, 0.5),
            (LeastOutstandingScorer, 0.5),
        ]
        assert [type(f) for f in profile.filters] == [SaturationFilter]
        assert isinstance(profile.picker, MaxScorePicker)

    @pytest.mark.parametrize("weight", [-1, -0.001, True, "1", None, [1]])
    def test_bad_weight(self, weight: Any) -> None:
        with pytest.raises(ValueError, match="weight must be a number"):
            profile_from_config("p", {"scorers": [{"name": "least-outstanding", "weight": weight}]})

    def test_zero_weight_allowed(self) -> None:
        profile = profile_from_config("p", {"scorers": [{"name": "least-outstanding", "weight": 0}]})
        assert profile.scorers[0][1] == 0.0

    @pytest.mark.parametrize(
        ("section", "entry", "known"),
        [
            ("scorers", "no-such-scorer", ["least-outstanding", "session-affinity"]),
            ("filters", "no-such-filter", ["max-inflight"]),
            ("picker", "no-such-picker", ["max-score", "weighted-random"]),
        ],
    )
    def test_unknown_plugin_names_known(self, section: str, entry: str, known: list[str]) -> None:
        raw: dict[str, Any] = {section: entry if section == "picker" else [entry]}
        with pytest.raises(ValueError) as info:
            profile_from_config("p", raw)
        msg = str(info.value)
        assert entry in msg
        for name in known:
            assert name in msg

    def test_unknown_plugin_in_dict_entry(self) -> None:
        with pytest.raises(ValueError, match="least-outstanding"):
            profile_from_config("p", {"scorers": [{"name": "least-outstandin", "weight": 1}]})

    @pytest.mark.parametrize(
        "raw",
        [
            {"filters": [{"name": "max-inflight", "params": {"bogus": 1}}]},
            {"scorers": [{"name": "least-outstanding", "params": {"seed": 1}}]},
            {"picker": {"name": "max-score", "params": {"limit": 3}}},
        ],
    )
    def test_bad_params(self, raw: dict[str, Any]) -> None:
        with pytest.raises(ValueError, match="bad parameters"):
            profile_from_config("p", raw)

    @pytest.mark.parametrize("params", [[1], "limit=3", 5])
    def test_params_not_mapping(self, params: Any) -> None:
        with pytest.raises(ValueError, match="'params' must be a mapping"):
            profile_from_config("p", {"filters": [{"name": "max-inflight", "params": params}]})

    @pytest.mark.parametrize("entry", [5, None, {"weight": 1}, {"name": 3}, ["least-outstanding"]])
    def test_bad_entry(self, entry: Any) -> None:
        with pytest.raises(ValueError, match="plugin entry"):
            profile_from_config("p", {"scorers": [entry]})

    @pytest.mark.parametrize("raw", [None, [], "least-outstanding"])
    def test_profile_not_mapping(self, raw: Any) -> None:
        with pytest.raises(ValueError, match="must be a mapping"):
            profile_from_config("p", raw)


class TestRegistry:
    def test_registered_lists_builtins_sorted(self) -> None:
        assert registered("filter") == [
            "bounded-load",
            "lora-affinity",
            "max-inflight",
            "saturation",
            "slo-tpot",
            "slo-ttft",
        ]
        assert registered("scorer") == [
            "decode-speed",
            "gpu-utilization",
            "kv-cache-usage",
            "latency-ucb",
            "least-outstanding",
            "lora-affinity",
            "predicted-ttft",
            "prefix-affinity",
            "queue-depth",
            "session-affinity",
        ]
        assert registered("picker") == ["max-score", "weighted-random", "weighted-round-robin"]

    def test_build_unknown_kind_or_name(self) -> None:
        with pytest.raises(
            ValueError, match=r"unknown scorer 'nope' \(known: decode-speed, gpu-utilization, kv-cache-usage"
        ):
            build_scorer("nope")

    def test_register_duplicate_rejected(self, isolated_registry: dict[str, dict[str, Any]]) -> None:
        original = isolated_registry["scorer"]["least-outstanding"]
        with pytest.raises(ValueError, match="registered twice"):
            register("scorer", "least-outstanding")(lambda: None)
        assert isolated_registry["scorer"]["least-outstanding"] is original

    def test_register_unknown_kind_rejected(self, isolated_registry: dict[str, dict[str, Any]]) -> None:
        with pytest.raises(ValueError, match="unknown plugin kind 'ranker'"):
            register("ranker", "x")
        assert "ranker" not in isolated_registry

    def test_register_new_plugin_usable_in_profile(
        self, isolated_registry: dict[str, dict[str, Any]]
    ) -> None:
        class Prefer:
            name = "prefer"

            def __init__(self, target: str = "u0") -> None:
                self.target = target

            def score(
                self, request: InferenceRequest, candidates: Sequence[Upstream], state: Any
            ) -> list[float]:
                return [1.0 if u.id == self.target else 0.0 for u in candidates]

        factory = register("scorer", "test-prefer")(Prefer)
        assert factory is Prefer
        assert "test-prefer" in registered("scorer")
        profile = profile_from_config("p", {"scorers": [{"name": "test-prefer", "params": {"target": "u2"}}]})
        assert profile.schedule(req(), ups(4), State()) == up("u2")
        # same name, other kind is fine
        register("filter", "test-prefer")(Prefer)
        with pytest.raises(ValueError, match="registered twice"):
            register("scorer", "test-prefer")(Prefer)

    def test_isolated_registry_is_undone(self) -> None:
        assert "test-prefer" not in registered("scorer")
        assert "test-prefer" not in registered("filter")
