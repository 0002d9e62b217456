"""Calibration against the engines' own counters (scheduling/calibration.py), the bounded-load guard
(scheduling/bounded_load.py), and how both reach snapshots, the scorer, /metrics and the explain
header."""

from __future__ import annotations

import math
from typing import Any

import orjson
import pytest
from builders import NOW, instance_state

from extproc.config import config_from_dict
from extproc.fleet import FleetView, Upstream, decode
from extproc.fleet import snapshot_pb2 as spb
from extproc.lifecycle import RequestLifecycle
from extproc.openai.parse import parse_head
from extproc.scheduling.bounded_load import BoundedLoadFilter
from extproc.scheduling.calibration import MAX_RATIO, Calibration
from extproc.scheduling.explain import new_explanation
from extproc.scheduling.predicted_ttft import PredictedTtftScorer
from extproc.settings import ConfigError
from extproc.telemetry import Metrics

HEAD = parse_head(
    {":method": "POST", ":path": "/v1/chat/completions"},
    session_header="s",
    user_header="u",
    priority_header="p",
)


class Engine:
    """An engine's cumulative counters as a publisher copies them: it counts `scale` tokens per token
    of the service's count, and every request reaches its first token `ttft_s` after it was sent."""

    def __init__(self, scale: float, ttft_s: float = 0.5) -> None:
        self.scale, self.ttft_s = scale, ttft_s
        self.prompt = self.first = self.ttft = 0.0
        self.sent: list[tuple[float, float]] = []  # (when sent, service tokens)

    def send(self, cal: Calibration, uid: str, when: float, tokens: float, predicted: float) -> None:
        cal.sent(uid, when, tokens, predicted)
        self.sent.append((when, tokens))

    def counters(self, at: float) -> tuple[float, float, float]:
        """The counters at `at`: every request whose first token came by then is counted."""
        done = [(w, t) for w, t in self.sent if w + self.ttft_s <= at]
        self.sent = [(w, t) for w, t in self.sent if w + self.ttft_s > at]
        for _, t in done:
            self.prompt += t * self.scale
            self.first += 1
            self.ttft += self.ttft_s
        return self.prompt, self.first, self.ttft


def drive(
    cal: Calibration,
    engines: dict[str, Engine],
    seconds: float,
    *,
    start: float = 0.0,
    rate: float = 10.0,
    predicted: float = 0.5,
    tokens: Any = lambda i: 1000.0 + 37 * (i % 7),
) -> float:
    """`rate` requests/s to each engine, snapshots every 0.5 s; returns the time reached."""
    t, i, next_snap = start, 0, start + 0.5
    while t < start + seconds:
        t += 1.0 / rate
        for uid, e in engines.items():
            e.send(cal, uid, t, tokens(i), predicted)
        i += 1
        if t >= next_snap:
            for uid, e in engines.items():
                cal.observe(uid, e.counters(t), t, 1, 0)
            next_snap += 0.5
    return t


def test_the_ratio_is_learnt_per_engine_and_a_new_one_starts_from_the_pool() -> None:
    cal = Calibration()
    assert cal.ratio("a") == 1.0  # nothing known: the service's count stands
    drive(cal, {"a": Engine(0.57), "b": Engine(2.0)}, 60)
    assert cal.ratio("a") == pytest.approx(0.57, rel=0.08)
    assert cal.ratio("b") == pytest.approx(2.0, rel=0.08)
    pool = cal.ratio("new")  # no data of its own: the pool's ratio (engine tokens over ours)
    assert 0.57 < pool < 2.0


def test_with_the_engines_tokenizer_the_ratio_is_one() -> None:
    cal = Calibration()
    drive(cal, {"a": Engine(1.0), "b": Engine(1.0)}, 30)
    assert cal.ratio("a") == pytest.approx(1.0, abs=0.03)
    assert cal.ratio("b") == pytest.approx(1.0, abs=0.03)


def test_counters_that_go_back_start_a_new_baseline() -> None:
    """A restarted engine's counters start from 0 again: no negative interval is learnt from, and the
    ratio learnt before stands until new intervals refine it."""
    cal = Calibration()
    e = Engine(0.5)
    t = drive(cal, {"a": e}, 30)
    before = cal.ratio("a")
    e.prompt = e.first = e.ttft = 0.0  # the restart
    cal.observe("a", e.counters(t + 0.5), t + 0.5, 1, 0)
    assert cal.ratio("a") == before
    drive(cal, {"a": e}, 30, start=t + 0.5)
    assert cal.ratio("a") == pytest.approx(0.5, rel=0.08)


def test_a_changed_set_of_instances_starts_a_new_baseline() -> None:
    """A cluster's counters are summed over its instances: one joining adds its whole history at once,
    which is not one interval's work."""
    cal = Calibration()
    t = drive(cal, {"a": Engine(1.0)}, 20)
    before = cal.ratio("a")
    cal.observe("a", (1e9, 10.0 + 1e6, 5e5), t + 0.5, 2, 0)  # a second instance, and its history
    assert cal.ratio("a") == before


def test_engines_without_counters_leave_the_count_alone() -> None:
    cal = Calibration()
    cal.sent("a", 1.0, 1000.0, 0.2)
    cal.observe("a", None, 2.0, 1, 0)
    cal.observe("a", None, 3.0, 1, 0)
    assert cal.ratio("a") == 1.0
    assert cal.error_s("a") == 0.0


def test_without_a_prompt_counter_only_the_ttft_error_is_learnt() -> None:
    cal = Calibration()
    t = 0.0
    first = ttft = 0.0
    for step in range(40):
        t = step * 0.5
        for k in range(5):
            cal.sent("a", t + k * 0.1, 1000.0, 0.2)
        first += 5
        ttft += 5 * 1.2  # first tokens come 1.2 s after they were sent: 1 s later than predicted
        cal.observe("a", (None, first, ttft), t + 1.2, 1, 0)
    assert cal.ratio("a") == 1.0
    assert cal.error_s("a") == pytest.approx(1.0, abs=0.1)
    figures = dict(cal.figures())["a"]
    assert figures.relative_error == pytest.approx(5.0, rel=0.15)  # 1 s late on a 0.2 s promise


def test_the_ttft_error_compares_the_promise_with_what_the_engine_delivered() -> None:
    cal = Calibration()
    drive(cal, {"slow": Engine(1.0, ttft_s=2.0), "true": Engine(1.0, ttft_s=0.5)}, 40, predicted=0.5)
    assert cal.error_s("slow") == pytest.approx(1.5, abs=0.15)
    assert cal.error_s("true") == pytest.approx(0.0, abs=0.05)


def test_absurd_counters_are_clamped_not_trusted() -> None:
    cal = Calibration()
    drive(cal, {"a": Engine(1e6)}, 30)
    assert cal.ratio("a") == MAX_RATIO


# -- snapshots --------------------------------------------------------------------------------------


def _snapshot(**fields: Any) -> bytes:
    msg = spb.UpstreamSnapshot(
        upstream_id="gpu-a/10.0.0.1:8000",
        cluster="gpu-a",
        engine="vllm",
        readiness=spb.READY,
        published_at_ms=int(NOW * 1000),
        ttl_ms=3000,
        **fields,
    )
    return msg.SerializeToString()


def test_snapshots_carry_the_counters_and_bad_ones_are_dropped_not_fatal() -> None:
    known = frozenset({"gpu-a"})
    ok = decode(
        _snapshot(prompt_tokens_total=1e6, first_tokens_total=500, ttft_seconds_total=42.5), known, now=NOW
    )
    assert ok.counters == (1e6, 500.0, 42.5)
    no_prompt = decode(_snapshot(first_tokens_total=500, ttft_seconds_total=42.5), known, now=NOW)
    assert no_prompt.counters == (None, 500.0, 42.5)
    assert decode(_snapshot(prompt_tokens_total=1e6), known, now=NOW).counters is None
    bad = decode(
        _snapshot(prompt_tokens_total=math.nan, first_tokens_total=-1, ttft_seconds_total=1.0), known, now=NOW
    )
    assert bad.counters is None and bad.ready  # the snapshot itself stands


def test_a_clusters_counters_are_summed_over_its_instances() -> None:
    cfg = config_from_dict({"pool": {"clusters": [{"name": "c", "models": ["m"]}]}, "metrics_listen": None})
    view = FleetView(cfg.pool, clock=lambda: NOW + 1)
    view.apply(instance_state("c/1", "c", None, counters=(100.0, 2.0, 1.0)))
    view.apply(instance_state("c/2", "c", None, counters=(50.0, 1.0, 0.5)))
    view.rebuild()
    assert view.load("c").counters == (150.0, 3.0, 1.5)  # type: ignore[union-attr]
    view.apply(instance_state("c/2", "c", None, counters=(None, 1.0, 0.5), sequence=2))
    view.rebuild()
    assert view.load("c").counters == (None, 3.0, 1.5)  # type: ignore[union-attr]


# -- the scorer ---------------------------------------------------------------------------------------


def _lifecycle(names: list[str], filters: list[Any] | None = None) -> tuple[RequestLifecycle, FleetView]:
    cfg = config_from_dict(
        {
            "pool": {"clusters": [{"name": n, "models": ["m"]} for n in names]},
            "metrics_listen": None,
            "explain": {"header": "always"},
            "scheduling": {
                "profiles": {
                    "default": {
                        "filters": filters or [],
                        "scorers": ["predicted-ttft"],
                        "picker": {"name": "max-score", "params": {"seed": 1}},
                    }
                }
            },
        }
    )
    clock = {"t": NOW}
    view = FleetView(cfg.pool, clock=lambda: clock["t"])
    lc = RequestLifecycle(cfg, Metrics(["m"], names), view)
    view.own_count = lc.inflight.count
    return lc, view


def _body(system: str, q: int) -> bytes:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": f"question {q}"}]
    return orjson.dumps({"model": "m", "messages": messages, "max_tokens": 50})


def test_the_cache_model_holds_the_engines_kv_in_the_services_tokens() -> None:
    """An engine that counts half as many tokens as the service holds twice as many of the service's
    tokens in the same KV blocks."""
    lc, view = _lifecycle(["c0"])
    scorer = lc.config.profile.scorers[0][0]
    assert isinstance(scorer, PredictedTtftScorer)
    e = Engine(0.5)
    drive(scorer.calibration, {"c0": e}, 30)
    prompt, first, ttft = e.counters(NOW)
    view.apply(
        instance_state(
            "c0/0", "c0", None, kv_blocks_total=1000, block_size=16, counters=(prompt, first, ttft)
        )
    )
    view.rebuild()
    lc.finish(lc.route(HEAD, _body("system prompt " * 50, 0)), "response_end")
    ratio = scorer.calibration.ratio("c0")
    assert ratio == pytest.approx(0.5, rel=0.1)
    assert (
        scorer.predictor._models["c0"].cache.capacity_blocks == int(1000 * 16 / ratio) // scorer.block_tokens
    )


def test_metrics_and_the_explain_header_show_the_calibration() -> None:
    lc, _view = _lifecycle(["c0", "c1"])
    scorer = lc.config.profile.scorers[0][0]
    assert isinstance(scorer, PredictedTtftScorer)
    drive(scorer.calibration, {"c0": Engine(0.5)}, 30)
    explanation = new_explanation("m")
    profile = lc.config.profile
    chosen = profile.schedule(
        lc.prepare(HEAD, _body("a prompt " * 30, 1)),
        [Upstream("c0", "c0", None, 1.0), Upstream("c1", "c1", None, 1.0)],
        lc.state,
        explain=explanation,
    )
    assert chosen is not None
    ratio = scorer.calibration.ratio("c0")
    assert ratio == pytest.approx(0.5, rel=0.1)
    header = explanation.header_value()
    figures = explanation.figures(chosen.id)
    assert figures["token_ratio"] == scorer.calibration.ratio(chosen.id)
    assert f"token_ratio={figures['token_ratio']:.4g}" in header
    sample = lc.metrics.registry.get_sample_value(
        "llm_extproc_calibration_token_ratio", {"profile": "default", "upstream": "c0"}
    )
    assert sample == ratio
    error = lc.metrics.registry.get_sample_value(
        "llm_extproc_calibration_ttft_error_seconds", {"profile": "default", "upstream": "c0"}
    )
    assert error == pytest.approx(0.0, abs=0.05)  # Engine's first tokens came as promised


# -- the bounded-load guard ---------------------------------------------------------------------------


def _loaded(loads: dict[str, int], rates: dict[str, float] | None = None) -> tuple[Any, list[Upstream]]:
    names = list(loads)
    lc, view = _lifecycle(names)
    for n, waiting in loads.items():
        view.apply(
            instance_state(
                f"{n}/0",
                n,
                None,
                num_running=0,
                num_waiting=waiting,
                prefill_tokens_per_s=(rates or {}).get(n),
            )
        )
    view.rebuild()
    return lc, [Upstream(n, n, None, 1.0) for n in names]


def test_the_guard_takes_out_an_engine_past_twice_its_share() -> None:
    lc, ups = _loaded({"a": 30, "b": 2, "c": 1, "d": 0})
    guard = BoundedLoadFilter()
    req = lc.prepare(HEAD, _body("x", 0))
    kept = guard.filter(req, ups, lc.state)
    # 34 in flight (+1) over 4 engines: a share is ~8.75, the bound 2 x that + 1 = 18.5
    assert [u.id for u in kept] == ["b", "c", "d"]
    assert dict((uid, v) for name, uid, v in guard.report() if name == "bounded_load_dropped") == {"a": 1.0}


def test_an_engine_over_its_share_with_no_queue_keeps_its_place() -> None:
    """A prefix holder running many cheap cached requests, its engine taking new work at once (no
    request waiting): over twice its share of what is in flight, but not queueing, so it stays a
    candidate; the same load with requests waiting there is cut off."""
    names = ["a", "b", "c", "d"]
    lc, view = _lifecycle(names)
    view.apply(instance_state("a/0", "a", None, num_running=30, num_waiting=0))
    for n in names[1:]:
        view.apply(instance_state(f"{n}/0", n, None, num_running=1, num_waiting=0))
    view.rebuild()
    ups = [Upstream(n, n, None, 1.0) for n in names]
    req = lc.prepare(HEAD, _body("x", 0))
    assert BoundedLoadFilter().filter(req, ups, lc.state) == ups
    view.apply(instance_state("a/0", "a", None, num_running=25, num_waiting=5, sequence=2))
    view.rebuild()
    assert [u.id for u in BoundedLoadFilter().filter(req, ups, lc.state)] == ["b", "c", "d"]


def test_the_guard_never_empties_the_choice_and_leaves_an_even_fleet_alone() -> None:
    lc, ups = _loaded({"a": 5, "b": 5, "c": 5})
    req = lc.prepare(HEAD, _body("x", 0))
    assert BoundedLoadFilter().filter(req, ups, lc.state) == ups
    assert BoundedLoadFilter(factor=1.0, slack=0.0).filter(req, ups, lc.state)  # the least loaded stays


def test_the_guard_shares_work_by_measured_capacity() -> None:
    """An H100 beside A10Gs (14x the prefill rate) may hold far more than an even split."""
    lc, ups = _loaded(
        {"h100": 40, "a10g-1": 2, "a10g-2": 2}, {"h100": 30_000, "a10g-1": 2_100, "a10g-2": 2_000}
    )
    req = lc.prepare(HEAD, _body("x", 0))
    assert [u.id for u in BoundedLoadFilter().filter(req, ups, lc.state)] == ["h100", "a10g-1", "a10g-2"]
    lc, ups = _loaded({"h100": 40, "a10g-1": 2, "a10g-2": 2})  # not measured: alike
    assert [u.id for u in BoundedLoadFilter().filter(req, ups, lc.state)] == ["a10g-1", "a10g-2"]


@pytest.mark.parametrize("guarded", [True, False])
def test_whatever_the_scorers_believe_no_engine_gets_past_its_bound(guarded: bool) -> None:
    """A scorer sure of one engine (session affinity: every request of one session): without the
    guard every request of a burst goes there; with it, none is sent one while it holds more than twice
    its share of what is in flight (+1 of slack), and the rest go to the next best."""
    names = ["c0", "c1", "c2", "c3"]
    cfg = config_from_dict(
        {
            "pool": {"clusters": [{"name": n, "models": ["m"]} for n in names]},
            "metrics_listen": None,
            "scheduling": {
                "profiles": {
                    "default": {
                        "filters": ["bounded-load"] if guarded else [],
                        "scorers": ["session-affinity"],
                        "picker": {"name": "max-score", "params": {"seed": 1}},
                    }
                }
            },
        }
    )
    lc = RequestLifecycle(cfg, Metrics(["m"], names), None)
    head = parse_head(
        {":method": "POST", ":path": "/v1/chat/completions", "s": "one-session"},
        session_header="s",
        user_header="u",
        priority_header="p",
    )
    held = [lc.route(head, _body("hot tenant", q)) for q in range(40)]  # all in flight
    counts: dict[str, int] = {}
    for d in held:
        counts[d.upstream.id] = counts.get(d.upstream.id, 0) + 1
    if guarded:
        assert max(counts.values()) <= 2 * 40 / 4 + 1 + 1, counts  # the bound, then the one it took
        assert len(counts) >= 2
    else:
        assert max(counts.values()) == 40, counts


@pytest.mark.parametrize("params", [{"factor": 0.5}, {"slack": -1}])
def test_bad_guard_parameters_are_config_errors(params: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        _lifecycle(["a"], filters=[{"name": "bounded-load", "params": params}])


def test_sends_are_matched_by_window_without_a_scan() -> None:
    """The window sums (bisection over running sums) agree with a plain scan, across the dropping of
    old sends and the compaction of the lists."""
    from extproc.scheduling.calibration import MAX_SENT, _Sent

    sent = _Sent()
    kept: list[tuple[float, float, float]] = []
    for i in range(3 * MAX_SENT):
        when, tokens, predicted = i * 0.01, float(100 + i % 37), 0.1 + (i % 11) / 100
        sent.add(when, tokens, predicted)
        kept.append((when, tokens, predicted))
        kept = kept[-MAX_SENT:]
        if i % 997 == 0 or i == 3 * MAX_SENT - 1:
            for lo, hi in ((when - 5.0, when - 1.0), (when - 200.0, when), (when + 1, when + 2)):
                inside = [(t, p) for w, t, p in kept if lo < w <= hi]
                n, tok, pred = sent.window(lo, hi)
                assert n == len(inside)
                assert tok == pytest.approx(sum(t for t, _ in inside))
                assert pred == pytest.approx(sum(p for _, p in inside))
    assert len(sent.times) <= 2 * MAX_SENT + 1  # compacted, not grown without bound
