"""predicted-ttft: the default scorer. Decisions on small hand-made fleets, through the real
lifecycle and fleet view, with snapshots built as the publisher writes them."""

from __future__ import annotations

from collections import Counter
from typing import Any

import orjson
import pytest
from builders import NOW, instance_state

from extproc.config import config_from_dict
from extproc.fleet import FleetView, InFlight, SchedulingState, Upstream
from extproc.fleet import snapshot_pb2 as spb
from extproc.lifecycle import RequestLifecycle
from extproc.openai import Api, InferenceRequest
from extproc.openai.parse import parse_head
from extproc.scheduling.predicted_ttft import PredictedTtftScorer
from extproc.scheduling.ttft_predictor import BACKLOG_KEPT, ROOM_WAIT_FLOOR, TtftPredictor
from extproc.settings import ConfigError
from extproc.telemetry import Metrics
from extproc.tokenization import block_hashes

HEAD = parse_head(
    {":method": "POST", ":path": "/v1/chat/completions"},
    session_header="s",
    user_header="u",
    priority_header="p",
)
TENANTS = {name: f"Tenant {name} system prompt, words of its own. " * 120 for name in "ABCDEFGH"}  # ~1.4k tok


def config(names: list[str], **params: Any) -> Any:
    """One cluster per name serving "m"; the profile is predicted-ttft with `params`, seeded."""
    return config_from_dict(
        {
            "pool": {"clusters": [{"name": name, "models": ["m"]} for name in names]},
            "metrics_listen": None,
            "scheduling": {
                "profiles": {
                    "default": {
                        "scorers": [{"name": "predicted-ttft", "params": params}],
                        "picker": {"name": "max-score", "params": {"seed": 1}},
                    }
                }
            },
        }
    )


def lifecycle(n: int, view: FleetView | None = None, **params: Any) -> RequestLifecycle:
    names = [f"c{i}" for i in range(n)]
    return RequestLifecycle(config(names, **params), Metrics(["m"], names), view)


def body(system: str, q: int) -> bytes:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": f"question {q}"}]
    return orjson.dumps({"model": "m", "messages": messages, "max_tokens": 100})


def test_tenants_stick_while_load_is_even() -> None:
    lc = lifecycle(4)
    homes: dict[str, set[str]] = {t: set() for t in TENANTS}
    for q in range(6):
        for t, system in TENANTS.items():
            d = lc.route(HEAD, body(system, q))
            homes[t].add(d.upstream.cluster)
            lc.finish(d, "response_end")
    assert all(len(h) == 1 for h in homes.values()), homes
    # New prefixes were spread (emptiest cache first), not piled on one upstream.
    assert len({next(iter(h)) for h in homes.values()}) == 4


def test_a_prompt_shared_by_all_traffic_does_not_collapse_the_fleet() -> None:
    lc = lifecycle(4)
    held = [lc.route(HEAD, body(TENANTS["A"], q)) for q in range(60)]  # a burst, all in flight
    spread = Counter(d.upstream.cluster for d in held)
    assert len(spread) == 4 and max(spread.values()) <= 30, spread


def test_the_holder_wins_until_its_queue_costs_more_than_a_miss() -> None:
    lc = lifecycle(2, prefill_tokens_per_s=2000)
    first = lc.route(HEAD, body(TENANTS["A"], 0))
    lc.finish(first, "response_end")
    home = first.upstream.cluster
    # Fill the other upstream's cache with another tenant, so a copy there would evict it.
    other = lc.route(HEAD, body(TENANTS["B"], 0))
    assert other.upstream.cluster != home
    lc.finish(other, "response_end")
    again = lc.route(HEAD, body(TENANTS["A"], 1))
    assert again.upstream.cluster == home  # its prefix is there: ~1.4k tokens not to prefill


def snap(cluster: str, **kw: Any) -> Any:
    return instance_state(f"{cluster}/0", cluster, None, **kw)


def test_capacity_comes_from_snapshots_and_a_restart_resets_the_model() -> None:
    clock = {"t": NOW + 1}
    cfg = config_from_dict({"pool": {"clusters": [{"name": "c0", "models": ["m"]}]}, "metrics_listen": None})
    view = FleetView(cfg.pool, clock=lambda: clock["t"])
    lc = RequestLifecycle(cfg, Metrics(["m"], ["c0"]), view)
    view.own_count = lc.inflight.count
    view.apply(snap("c0", kv_blocks_total=200, block_size=16, sequence=1))
    view.rebuild()
    scorer = lc.config.profile.scorers[0][0]
    assert isinstance(scorer, PredictedTtftScorer)
    d = lc.route(HEAD, body(TENANTS["A"], 0))
    lc.finish(d, "response_end")
    model = scorer.predictor._models["c0"]
    assert model.cache.capacity_blocks == 200 * 16 // scorer.block_tokens  # 50 index blocks
    assert model.cache.used_blocks > 0
    # The engine goes through WARMING_UP (a restart): what the model learned is gone.
    view.apply(snap("c0", kv_blocks_total=200, block_size=16, sequence=2, readiness=spb.WARMING_UP))
    view.apply(snap("c0", kv_blocks_total=200, block_size=16, sequence=3))
    view.rebuild()
    assert view.load("c0") is not None and view.load("c0").epoch == 2  # type: ignore[union-attr]
    lc.route(HEAD, body(TENANTS["B"], 0))
    assert (
        scorer.predictor._models["c0"].cache.matched(scorer.predictor.predict(_req(TENANTS["A"])).hashes) == 0
    )


def _req(system: str) -> InferenceRequest:
    text = f"{system}\nquestion 0"
    return InferenceRequest(Api.CHAT, "m", False, None, text, None, None, None, 0, len(text))


class _OneEngine:
    """One upstream "a" with five ~1.4k-token prompts sent at t = 100 (~7 s of prefill at the
    configured 1000 tokens/s), and a clock the test moves."""

    def __init__(self) -> None:
        self.scorer = PredictedTtftScorer(prefill_tokens_per_s=1000)
        self.clock = {"t": 100.0}
        clock = self.clock

        class State(SchedulingState):
            def now(self) -> float:
                return clock["t"]

        cfg = config_from_dict(
            {"pool": {"clusters": [{"name": "a", "models": ["m"]}]}, "metrics_listen": None}
        )
        self.view = FleetView(cfg.pool, clock=lambda: clock["t"])
        self.state = State(InFlight(), self.view)
        self.a = Upstream("a", "a", None, 1.0)
        for q in range(5):
            r = _req(TENANTS["ABCDE"[q]])
            self.scorer.score(r, [self.a], self.state)
            self.scorer.on_pick(r, self.a, self.state)
        self.model = self.scorer.predictor._models["a"]

    def snapshot(self, **fields: Any) -> None:
        """The engine's snapshot, then a decision that reads it."""
        self.view.apply(instance_state("a/0", "a", None, **fields))
        self.view.rebuild()
        self.scorer.score(_req(TENANTS["F"]), [self.a], self.state)


def test_snapshots_reporting_an_empty_queue_drain_a_stale_backlog() -> None:
    e = _OneEngine()
    model, clock = e.model, e.clock
    queued = model.busy_until
    assert queued - clock["t"] > 5
    # One second later the engine says nothing waits. Its prompts may still be in prefill (running),
    # so a share of what was queued before the snapshot is kept, not all of it.
    clock["t"] = 101.0
    e.snapshot(num_waiting=0, published_at=100.9, expires_at=110.0, sequence=9)
    assert model.busy_until == pytest.approx(100.9 + BACKLOG_KEPT * (queued - 100.9))
    # Every further snapshot with none waiting cuts it again: it drains faster than in real time.
    for n in range(1, 25):
        clock["t"] = 101.0 + n * 0.5
        e.snapshot(num_waiting=0, published_at=clock["t"] - 0.1, expires_at=200.0, sequence=9 + n)
        if n == 2:
            assert 0.5 < model.busy_until - clock["t"] < queued - clock["t"] - 1.0
    assert model.busy_until - clock["t"] < 0.05


def test_a_measured_prefill_rate_rereads_the_seconds_queued_at_the_configured_one() -> None:
    """Before its first measurement an engine's queue is in seconds at `prefill_tokens_per_s`; an
    H100 measured at ~13x that has the same work queued, done 13x sooner."""
    e = _OneEngine()
    model, clock = e.model, e.clock
    queued = model.busy_until - clock["t"]
    assert queued > 5
    # one request waiting: no cut for an empty queue, only the rate moves
    e.snapshot(num_waiting=1, prefill_tokens_per_s=1100.0, published_at=100.0, sequence=2)
    assert model.busy_until - clock["t"] == pytest.approx(queued)  # within the tolerance: as it was
    e.snapshot(num_waiting=1, prefill_tokens_per_s=10_000.0, published_at=100.0, sequence=3)
    assert model.busy_until - clock["t"] == pytest.approx(queued / 10, rel=0.01)
    assert model.rate == pytest.approx(10_000.0)


def _mixed_fleet(
    measured: dict[str, float], gpus: dict[str, str] | None = None, **params: Any
) -> tuple[RequestLifecycle, FleetView]:
    cfg = config(["fast", "slow", "new"], **params)
    view = FleetView(cfg.pool, clock=lambda: NOW + 1)
    lc = RequestLifecycle(cfg, Metrics(["m"], ["fast", "slow", "new"]), view)
    view.own_count = lc.inflight.count
    for name in ("fast", "slow", "new"):
        view.apply(
            snap(
                name,
                kv_blocks_total=100_000,
                block_size=16,
                prefill_tokens_per_s=measured.get(name),
                gpu_model=(gpus or {}).get(name, ""),
            )
        )
    view.rebuild()
    return lc, view


def _rates(lc: RequestLifecycle, view: FleetView, names: tuple[str, ...]) -> dict[str, float]:
    scorer = lc.config.profile.scorers[0][0]
    assert isinstance(scorer, PredictedTtftScorer)
    return scorer.predictor._rates([Upstream(n, n, None, 1.0) for n in names], [view.load(n) for n in names])


def test_measured_prefill_rates_split_work_by_gpu_speed() -> None:
    """Equal weights, but one engine prefills 10x faster: it gets most of a stream of distinct
    prompts, the slow one some (its queue is short while the fast one's grows), and an engine
    not measured yet counts as the fastest measured one, so it gets the traffic that measures it.
    Measured figures replace the configured guess (2000, the default)."""
    lc, view = _mixed_fleet({"fast": 30_000.0, "slow": 3_000.0})
    assert _rates(lc, view, ("fast", "slow", "new")) == {"fast": 30_000.0, "slow": 3_000.0, "new": 30_000.0}
    picks = Counter(lc.route(HEAD, body(_distinct(q), q)).upstream.id for q in range(60))
    assert picks["fast"] + picks["new"] > 4 * picks["slow"] > 0
    assert abs(picks["fast"] - picks["new"]) <= 0.25 * (picks["fast"] + picks["new"])


def test_rates_follow_new_snapshots() -> None:
    lc, view = _mixed_fleet({"fast": 30_000.0, "slow": 3_000.0})
    names = ("fast", "slow", "new")
    assert _rates(lc, view, names)["slow"] == 3_000.0
    view.apply(
        snap("slow", kv_blocks_total=100_000, block_size=16, prefill_tokens_per_s=30_000.0, sequence=2)
    )
    view.rebuild()  # new Load objects: the cached rates are not reused
    assert _rates(lc, view, names) == dict.fromkeys(names, 30_000.0)  # one GPU type now


def test_identical_engines_measured_with_noise_share_their_upper_quartile() -> None:
    """Alike engines read apart by load (a busy one's prefills share steps with its decodes: it reads
    low, never high) get one figure, the group's upper quartile: the busy one is not taken for a
    slower GPU, which would count its queue twice."""
    lc, view = _mixed_fleet({"fast": 2_400.0, "slow": 1_700.0, "new": 2_000.0}, prefill_tokens_per_s=1_500)
    assert _rates(lc, view, ("fast", "slow", "new")) == dict.fromkeys(("fast", "slow", "new"), 2_400.0)
    # With no tolerance each figure counts: the noise would tell them apart.
    lc, view = _mixed_fleet({"fast": 2_400.0, "slow": 1_700.0, "new": 2_000.0}, rate_tolerance=1.0)
    assert _rates(lc, view, ("fast", "slow", "new")) == pytest.approx(
        {"fast": 2_400.0, "slow": 1_700.0, "new": 2_000.0}
    )


H100, A10G = "NVIDIA H100 80GB HBM3", "NVIDIA A10G"


def test_before_any_measurement_the_gpus_nominal_speeds_order_the_engines() -> None:
    """A mixed fleet's first seconds: nothing measured, but the snapshots name the GPUs. The H100s
    get ~14x the A10G's rate (989 / 70 dense TFLOPS), an unknown GPU counts as the fastest."""
    lc, view = _mixed_fleet({}, {"fast": H100, "slow": A10G})
    rates = _rates(lc, view, ("fast", "slow", "new"))
    assert rates == pytest.approx({"fast": 2_000 * 989 / 70, "slow": 2_000.0, "new": 2_000 * 989 / 70})
    picks = Counter(lc.route(HEAD, body(_distinct(q), q)).upstream.id for q in range(60))
    assert picks["fast"] + picks["new"] > 6 * picks["slow"]
    # One GPU type: the prior changes nothing.
    lc, view = _mixed_fleet({}, {"fast": H100, "slow": H100, "new": H100})
    assert _rates(lc, view, ("fast", "slow", "new")) == dict.fromkeys(("fast", "slow", "new"), 2_000.0)
    # Off: every unmeasured engine alike, as before.
    lc, view = _mixed_fleet({}, {"fast": H100, "slow": A10G}, gpu_prior=False)
    assert _rates(lc, view, ("fast", "slow", "new")) == dict.fromkeys(("fast", "slow", "new"), 2_000.0)


def test_an_unmeasured_gpu_is_scaled_to_the_measured_ones() -> None:
    """The slow A10G is measured first (3k tokens/s); the new H100 is not: its nominal speed times the
    A10G's measured-per-nominal ratio. Measured figures win over nominal ones."""
    lc, view = _mixed_fleet({"slow": 3_000.0, "fast": 3_100.0}, {"slow": A10G, "new": H100, "fast": H100})
    rates = _rates(lc, view, ("fast", "slow", "new"))
    assert rates["slow"] == rates["fast"] == 3_100.0  # measured alike: one group, whatever the names
    assert rates["new"] == pytest.approx(3_100 * 989 / 70)  # the median ratio over both is the A10G's


def test_measured_rates_can_be_switched_off() -> None:
    lc, _ = _mixed_fleet({"fast": 20_000.0, "slow": 2_000.0}, measured_rate=False, prefill_tokens_per_s=3_000)
    picks = Counter(lc.route(HEAD, body(_distinct(q), q)).upstream.id for q in range(60))
    assert max(picks.values()) - min(picks.values()) <= 3  # all three alike: an even split


def test_large_pools_predict_the_holders_and_a_sample_of_the_rest() -> None:
    """Past `max_evaluated` candidates only the prefix's holders and a random sample of the others are
    predicted (the rest score 0), and a tenant still finds its one home among 40 engines."""
    lc = lifecycle(40, max_evaluated=6)
    homes: dict[str, set[str]] = {t: set() for t in "ABCD"}
    for q in range(5):
        for t in "ABCD":
            d = lc.route(HEAD, body(TENANTS[t], q), explain=True)
            assert d.explanation is not None and d.upstream is not None
            scores = dict(zip(d.explanation.scored_ids, d.explanation.raw[0], strict=True))
            assert len(scores) == 40 and sum(1 for v in scores.values() if v > 0) == 6, scores
            if homes[t]:  # the holder is always among those predicted
                assert scores[next(iter(homes[t]))] > 0
            homes[t].add(d.upstream.cluster)
            lc.finish(d, "response_end")
    assert all(len(h) == 1 for h in homes.values()), homes
    assert len({next(iter(h)) for h in homes.values()}) > 1


def test_a_prefix_held_everywhere_leaves_room_for_idle_engines_in_the_sample() -> None:
    """Holders take at most half of the predicted places: a burst of one prompt spreads over a large
    pool instead of queueing on the engines that hold it."""
    lc = lifecycle(40, max_evaluated=6)
    held = [lc.route(HEAD, body(TENANTS["A"], q)) for q in range(80)]  # all in flight
    spread = Counter(d.upstream.cluster for d in held if d.upstream is not None)
    assert len(spread) >= 20 and max(spread.values()) <= 8, spread


def test_pre_selection_can_be_switched_off() -> None:
    lc = lifecycle(40, max_evaluated=0)
    d = lc.route(HEAD, body(TENANTS["A"], 0), explain=True)
    assert d.explanation is not None
    assert all(v > 0 for v in d.explanation.raw[0])


def _distinct(q: int) -> str:
    """A ~1.4k-token prompt sharing no leading block with any other."""
    return f"Request {q} asks its own thing. " + TENANTS["ABCDEFGH"[q % 8]]


@pytest.mark.parametrize(
    "params",
    [
        {"prefill_tokens_per_s": 0},
        {"block_tokens": -1},
        {"evict_weight": -1},
        {"copy_discount": 2},
        {"copy_demand": -1},
        {"demand_window_s": 0},
        {"rate_tolerance": 0.5},
        {"max_evaluated": 1},
        {"max_evaluated": -2},
    ],
)
def test_bad_parameters_are_config_errors(params: dict[str, Any]) -> None:
    with pytest.raises(ConfigError, match="predicted-ttft"):
        lifecycle(2, **params)


class _CountsOnly:
    """A fleet without snapshots: each upstream's own in-flight count is all there is."""

    def __init__(self, counts: dict[str, int]) -> None:
        self.counts = counts

    def count(self, upstream_id: str) -> int:
        return self.counts[upstream_id]

    def load(self, upstream_id: str) -> None:
        return None

    def loads_of(self, upstreams: Any) -> list[None]:
        return [None] * len(upstreams)

    def pending(self, upstream_id: str) -> int:
        return 0

    def batch(
        self, upstream_id: str, published: bool = False, cap: bool = False, shared: bool = False
    ) -> tuple[float, float | None, float | None]:
        return 0.0, None, None  # no batch limit known

    def kv_blocks(self, upstream_id: str) -> None:
        return None

    def kv_holders(self, block: bytes) -> list[str]:
        return []

    def now(self) -> float:
        return NOW


def test_a_copy_is_discounted_only_for_a_prefix_that_later_requests_share() -> None:
    """With `copy_demand`, copying a busy holder's prefix to an idle engine is discounted only when
    recent requests matched the same held prefix: a tenant's system prompt, not a conversation whose
    every turn matches one block deeper than the last."""
    busy, idle = Upstream("busy", "busy", None, 1.0), Upstream("idle", "idle", None, 1.0)
    state: Any = _CountsOnly({"busy": 6, "idle": 0})

    def req(ids: list[int]) -> InferenceRequest:
        return InferenceRequest(Api.CHAT, "m", False, 4, "", ids, None, None, 0, 0)

    def copy_cost(scorer: PredictedTtftScorer, ids: list[int]) -> float:
        """Scores a request, places it at the busy holder, and returns what the score charged the
        idle engine beyond its own TTFT (its placement costs: a copy's here)."""
        request = req(ids)
        predicted = scorer._placed_costs(request, (busy, idle), state)
        own = scorer.predictor._last.facts[idle.id].own
        scorer.on_pick(request, busy, state)
        return predicted[1] - own

    system = list(range(10_000, 10_000 + 64 * 20))  # 20 blocks, then each request's own question
    conversation = list(range(50_000, 50_000 + 64 * 20))
    for scorer in (PredictedTtftScorer(copy_demand=3), PredictedTtftScorer(copy_demand=0)):
        demanded = scorer.copy_demand > 0
        scorer.on_pick(req([*system, 1]), busy, state)
        scorer.on_pick(req(conversation), busy, state)
        costs = []
        for q in range(2, 7):  # five more questions for the tenant, all placed at its home
            ids = system + [q] * 70
            costs.append(copy_cost(scorer, ids))
        turns = []
        for turn in range(4):  # each turn: the whole history, plus two new blocks
            conversation = conversation + [turn] * 128
            turns.append(copy_cost(scorer, conversation))
        if demanded:
            # The first copy of the tenant's prompt is not discounted: nothing matched it before.
            assert costs[0] > costs[1] > costs[2] > costs[3] == costs[4]  # from three matches: in full
            assert min(turns) > costs[-1]  # every turn matches a block no earlier turn ended on
        else:  # without it, all alike: full discount, whoever shares the prefix
            assert costs[0] == costs[-1] and max(turns) <= costs[-1] + 1e-9


def test_replicas_count_each_others_demand_for_a_prefix() -> None:
    """A pick record carries how much of the prompt was held somewhere, so every replica counts the
    same demand for the prefix (copy_demand), not 1/N of it; records from older replicas (7 fields)
    still place their blocks."""
    busy = Upstream("busy", "busy", None, 1.0)
    state: Any = _CountsOnly({"busy": 6})
    a, b = PredictedTtftScorer(), PredictedTtftScorer()
    a.predictor._outbox.take()  # replica sync on: picks are recorded for the others
    system = list(range(10_000, 10_000 + 64 * 20))
    for q in range(4):
        request = InferenceRequest(Api.CHAT, "m", False, 4, "", [*system, q, q], None, None, 0, 0)
        a._placed_costs(request, (busy,), state)
        a.on_pick(request, busy, state)
    records = a.predictor._outbox.take()
    assert [r[-1] for r in records] == [0, 20, 20, 20]  # the first found nothing held
    end = block_hashes(system, 64)[-1]
    b.apply_updates("a", records)
    assert b.predictor.demand_at(end, NOW) == a.predictor.demand_at(end, NOW) == 3.0
    old = PredictedTtftScorer()
    old.apply_updates("a", [r[:7] for r in records])
    assert (
        old.predictor.demand_at(end, NOW) == 0.0
        and old.predictor._models["busy"].cache.matched(block_hashes(system, 64)) == 20
    )
    # A held length that is not one (past the prompt, not an integer) counts nothing; the pick stands.
    odd = PredictedTtftScorer()
    odd.apply_updates("a", [[*r[:7], bad] for r, bad in zip(records, (21, "x", -1, 2.0), strict=True)])
    assert (
        not odd.predictor._demand
        and odd.predictor._models["busy"].cache.matched(block_hashes(system, 64)) == 20
    )


def test_ranking_depth_probes_few_blocks_and_is_exact_for_a_prefix_cache() -> None:
    """A large pool's holders are ranked by `_leading` (doubling, then bisection): exact whenever the
    held blocks are a prefix, as an engine's prefix cache keeps them, in O(log n) probes."""
    from extproc.scheduling.ttft_predictor import _leading

    for n in range(40):
        hashes = [bytes([i]) for i in range(n)]
        for k in range(n + 1):
            probes: list[bytes] = []
            held = set(hashes[:k])

            def has(h: bytes, held: set[bytes] = held, probes: list[bytes] = probes) -> bool:
                probes.append(h)
                return h in held

            assert _leading(hashes, has) == k, (n, k)
            assert len(probes) <= 2 * max(1, n).bit_length() + 1, (n, k, len(probes))
    # A hole the probes skip is not seen (ranking only: kept candidates are matched exactly).
    hashes = [bytes([i]) for i in range(8)]
    assert _leading(hashes, {*hashes[:2], *hashes[3:]}.__contains__) == 8


class _Turning(_CountsOnly):
    """_CountsOnly whose engines' batches turn over at known rates (first tokens a second)."""

    def __init__(self, counts: dict[str, int], turnover: dict[str, float | None]) -> None:
        super().__init__(counts)
        self.turnover = turnover

    def batch(
        self, upstream_id: str, published: bool = False, cap: bool = False, shared: bool = False
    ) -> tuple[float, float | None, float | None]:
        return 0.0, None, self.turnover[upstream_id]


def test_a_full_cache_costs_the_request_its_wait_for_room_and_the_rest_is_a_placement_cost() -> None:
    """Where the KV not pinned cannot hold the prompt, the request's own predicted TTFT (the prepared
    figure admission and slo-ttft read) carries the wait for running requests to free the blocks,
    shorter where the batch turns over faster; the score still charges `room_penalty_s` in all (the
    rest as crowding, a cost to the engine's other requests), so placement is as with a flat penalty."""
    fast, slow = Upstream("fast", "fast", None, 1.0), Upstream("slow", "slow", None, 1.0)
    counts = {"fast": 3, "slow": 3}
    timed: Any = _Turning(counts, {"fast": 20.0, "slow": 0.5})
    unknown: Any = _Turning(counts, {"fast": None, "slow": None})
    scorer = PredictedTtftScorer(default_kv_tokens=64 * 40, room_penalty_s=1.0)

    def req(ids: list[int]) -> InferenceRequest:
        return InferenceRequest(Api.CHAT, "m", False, 4, "", ids, None, None, 0, 0)

    for u in (fast, slow):  # three running requests pin 33 of the 40 blocks on each
        for t in range(3):
            running = req(list(range(1_000 * (t + 1), 1_000 * (t + 1) + 64 * 10)))
            scorer._placed_costs(running, (u,), timed)
            scorer.on_pick(running, u, timed)
    request = req(list(range(90_000, 90_000 + 64 * 20)))
    costs = scorer._placed_costs(request, (fast, slow), timed)
    facts = dict(scorer.predictor._last.facts)
    flat_costs = scorer._placed_costs(request, (fast, slow), unknown)
    flat = scorer.predictor._last.facts
    assert facts["fast"].own < facts["slow"].own == flat["slow"].own  # 0.5/s: the whole penalty
    assert facts["fast"].own + facts["fast"].crowding == pytest.approx(flat["fast"].own)
    assert facts["fast"].crowding >= 0.5 and flat["fast"].crowding == 0.0
    assert costs == pytest.approx(flat_costs)  # the same placement
    request.prepared = {}
    scorer.prepare(request, (fast, slow), timed)
    assert request.prepared["predicted-ttft"]["fast"] == pytest.approx(facts["fast"].own)


def test_the_kv_room_wait_is_the_time_to_free_the_blocks_a_request_lacks() -> None:
    """8 running requests pin 400 blocks, 50 each: a request lacking 100 blocks waits for 2 of them
    to finish, 0.5 s at 4 first tokens a second; within ROOM_WAIT_FLOOR-1x room_penalty_s, and the
    whole penalty while the turnover is unknown or nothing runs."""
    predictor = TtftPredictor(room_penalty_s=1.0)
    state: Any = _Turning({}, {"u": 4.0, "fast": 400.0, "slow": 0.5, "new": None})
    assert predictor._room_wait("u", 100, 8, 400, state) == pytest.approx(0.5)
    assert predictor._room_wait("slow", 100, 8, 400, state) == 1.0  # 4 s: at most the penalty
    assert predictor._room_wait("fast", 100, 8, 400, state) == pytest.approx(ROOM_WAIT_FLOOR)
    assert predictor._room_wait("new", 100, 8, 400, state) == 1.0
    assert predictor._room_wait("u", 100, 0, 0, state) == 1.0
