"""The publisher's measured prefill throughput (publishers/prefill_rate.py), against counters whose
true rate is known, and against the simulated engine's own counters."""

from __future__ import annotations

import pytest

from extproc.publishers.prefill_rate import PrefillRate
from extproc_lab.engines.model import EngineModel
from extproc_lab.engines.profiles import A10G_LLAMA3_8B, H100_LLAMA3_8B


def test_no_estimate_before_a_delta_then_the_ratio_of_deltas() -> None:
    r = PrefillRate()
    assert r.update(1_000, 0, 1.0) is None  # the first scrape only sets the baseline
    assert r.update(1_000, 0, 1.0) is None  # nothing prefilled since
    assert r.update(3_000, 500, 2.0) == pytest.approx(1_500)  # (2000 - 500) tokens in 1 s


def test_an_upper_quantile_of_recent_samples_and_a_slowdown_is_followed() -> None:
    r = PrefillRate(window=10, quantile=0.8, span=1)
    tokens, seconds = 0.0, 0.0
    r.update(tokens, 0, seconds)
    for i in range(10):  # alone the GPU prefills 4k tokens/s; busy intervals look slower (overlap)
        tokens, seconds = tokens + (4_000 if i % 3 == 0 else 1_000), seconds + 1.0
        r.update(tokens, 0, seconds)
    assert r.estimate == pytest.approx(4_000)
    for _ in range(10):  # then the GPU slows to 1k tokens/s
        tokens, seconds = tokens + 1_000, seconds + 1.0
        r.update(tokens, 0, seconds)
    assert r.estimate == pytest.approx(1_000)


def test_hits_counted_a_scrape_before_their_prompt_do_not_make_a_spike() -> None:
    """An engine counts a request's cache hits when it is admitted and its prompt tokens at its first
    token, so the two can fall on either side of a scrape: one interval is debited hits whose prompt
    is not counted yet, the next is credited a prompt without them. A sample over one interval reads
    8x the true rate there (a GPU "8x faster" gets flooded); over three intervals the two cancel."""
    # The GPU prefills 2k uncached tokens/s. Per interval: (prompt tokens, cached tokens, seconds).
    intervals = [(2_000, 0, 1.0), (1_000, 7_000, 0.5), (8_000, 0, 0.5), (2_000, 0, 1.0)]
    for span, worst in ((1, 16_000), (3, 2_000)):
        r = PrefillRate(span=span, window=10, quantile=1.0)
        p = c = s = 0.0
        r.update(p, c, s)
        for dp, dc, ds in intervals:
            p, c, s = p + dp, c + dc, s + ds
            r.update(p, c, s)
        assert r.estimate == pytest.approx(worst)


@pytest.mark.parametrize("kw", [{"span": 0}, {"window": 0}])
def test_a_sample_needs_at_least_one_scrape(kw: dict[str, int]) -> None:
    with pytest.raises(ValueError, match="span"):
        PrefillRate(**kw)


def test_a_restart_keeps_the_estimate_and_restarts_the_deltas() -> None:
    r = PrefillRate()
    r.update(0, 0, 0.0)
    r.update(2_000, 0, 1.0)
    assert r.update(10, 0, 0.01) == pytest.approx(2_000)  # counters went backwards: no sample
    assert r.update(2_010, 0, 1.01) == pytest.approx(2_000)


def test_an_idle_figure_relaxes_towards_the_best_shown_and_no_further() -> None:
    r = PrefillRate(stale_after=2, window=4, quantile=0.5, span=1)
    tokens, seconds = 0.0, 0.0
    r.update(tokens, 0, seconds)
    for rate in (3_000, 3_000, 1_000, 1_000, 1_000, 1_000):  # a slowdown: 3k, then 1k tokens/s
        tokens, seconds = tokens + rate, seconds + 1.0
        r.update(tokens, 0, seconds)
    assert (r.estimate, r.best) == (1_000, 3_000)
    # No prefill since (the scheduler avoids it): every 2 idle scrapes the figure doubles, to 3k.
    assert [r.update(tokens, 0, seconds) for _ in range(6)] == [1_000, 2_000, 2_000, 3_000, 3_000, 3_000]
    # Still slow when tried: the first new sample says so (the old ones went with the relaxation).
    assert r.update(tokens + 1_000, 0, seconds + 1.0) == pytest.approx(1_000)


def test_a_preemption_voids_the_samples_it_spans() -> None:
    """A request preempted before its first token keeps its first scheduling time and has its cached
    blocks counted as hits again: the interval reads far below the GPU's rate. Where the engine
    counts preemptions, no sample is taken over one, and the next span begins after it."""
    r = PrefillRate(window=4, quantile=1.0, span=1)
    r.update(0, 0, 0.0, 0)
    assert r.update(2_000, 0, 1.0, 0) == pytest.approx(2_000)
    # 1k prompt tokens, 900 of them counted as hits (again), over 4 s of prefill time: 25 tokens/s.
    assert r.update(3_000, 900, 5.0, 1) == pytest.approx(2_000)
    assert r.update(5_000, 900, 6.0, 1) == pytest.approx(2_000)  # after it: a sample again
    assert list(r._samples) == [2_000, 2_000]
    # A preemption counter that goes backwards (a restart) restarts the deltas, not the estimate.
    assert r.update(7_000, 900, 7.0, 0) == pytest.approx(2_000)
    assert r.update(9_000, 900, 8.0, 0) == pytest.approx(2_000) and len(r._samples) == 3
    # Without the counter the same interval is a sample (quantile 0: the lowest, to show it).
    blind = PrefillRate(window=4, quantile=0.0, span=1)
    blind.update(0, 0, 0.0)
    blind.update(2_000, 0, 1.0)
    assert blind.update(3_000, 900, 5.0) == pytest.approx(25)


def test_intervals_of_cache_hits_are_no_samples() -> None:
    """Hits counted ahead of their prompts (or a window of hits only) say nothing about the speed:
    they are not zeros in the window that pull its quantile down to the one slow sample left."""
    r = PrefillRate(window=10, quantile=0.5, span=1)
    r.update(0, 0, 0.0)
    r.update(2_000, 0, 1.0)
    for i in range(2, 8):  # hits only, or more hits than prompt tokens
        r.update(2_000 + 10 * i, 100 * i, float(i))
    assert list(r._samples) == [2_000]
    assert r.estimate == pytest.approx(2_000)


def test_windows_of_cache_hits_only_keep_the_last_figure() -> None:
    r = PrefillRate(window=2, quantile=0.9, span=1)
    r.update(0, 0, 0.0)
    r.update(1_000, 0, 1.0)
    assert r.update(1_500, 500, 1.5) == r.update(2_000, 1_000, 2.0) == pytest.approx(1_000)


def test_missing_counters_and_a_window_of_only_cached_tokens_change_nothing() -> None:
    r = PrefillRate()
    r.update(0, 0, 0.0)
    r.update(1_000, 0, 0.5)
    assert r.update(None, 0, 0.6) == pytest.approx(2_000)
    assert r.update(1_000, 0, None) == pytest.approx(2_000)
    assert r.update(1_000, 0, 0.5) == pytest.approx(2_000)  # no prefill ended: no sample


@pytest.mark.parametrize("profile", [A10G_LLAMA3_8B, H100_LLAMA3_8B], ids=["a10g", "h100"])
def test_simulated_engine_counters_give_its_compute_rate_within_a_factor(profile) -> None:  # type: ignore[no-untyped-def]
    """One prompt at a time: the measured rate is the GPU's prefill rate less the steps' fixed
    costs; the figure errs low, never high."""
    engine = EngineModel(profile)
    rate = PrefillRate()
    rate.update(engine.prompt_tokens_total, engine.prefix_cache_hits, engine.prefill_time_sum)
    now = 0.0
    for i in range(8):
        engine.submit(f"r{i}", [(i * 7919 + k) % 30_000 + 1 for k in range(2_000)], 1, now)
        while (step := engine.step(now)) is not None:
            now = step.ended_at
        rate.update(engine.prompt_tokens_total, engine.prefix_cache_hits, engine.prefill_time_sum)
    true_rate = 1 / profile.prefill_s_per_token
    assert rate.estimate is not None
    assert 0.5 * true_rate < rate.estimate <= true_rate
