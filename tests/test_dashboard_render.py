"""The PromQL subset that redraws the Grafana dashboard for docs/operations.md: every panel's query is
understood, and the results match what Prometheus would compute on the same samples."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from extproc_lab.bench.dashboard import DASHBOARD, Evaluator, Scrape, parse_metrics, render

ROOT = Path(__file__).resolve().parents[1]


def scrapes() -> list[Scrape]:
    """Four scrapes 2 s apart: a counter growing by 4/s (routed) and 1/s (rejected), a histogram whose
    observations all fall in (0.001, 0.005], and two gauges."""
    out = []
    for i in range(4):
        text = f"""
# TYPE llm_extproc_requests_total counter
llm_extproc_requests_total{{outcome="routed",cluster="a"}} {8 * i}
llm_extproc_requests_total{{outcome="rejected",cluster=""}} {2 * i}
# TYPE llm_extproc_decision_seconds histogram
llm_extproc_decision_seconds_bucket{{le="0.001"}} 0
llm_extproc_decision_seconds_bucket{{le="0.005"}} {10 * i}
llm_extproc_decision_seconds_bucket{{le="+Inf"}} {10 * i}
llm_extproc_decision_seconds_count {10 * i}
llm_extproc_decision_seconds_sum {0.02 * i}
# TYPE llm_extproc_inflight_requests gauge
llm_extproc_inflight_requests{{cluster="a"}} {i}
llm_extproc_inflight_requests{{cluster="b"}} 7
"""
        out.append(Scrape(100.0 + 2 * i, parse_metrics(text, {"job": "llm-extproc"})))
    return out


def last(series: dict, key: tuple = ()) -> float:
    return series[key][-1][1]


def test_rate_sum_by_and_job_variable() -> None:
    ev = Evaluator(scrapes(), {"job": "llm-extproc|llm-extproc-epp"})
    by_outcome = ev.evaluate('sum by (outcome) (rate(llm_extproc_requests_total{job=~"$job"}[1m]))')
    assert last(by_outcome, (("outcome", "routed"),)) == pytest.approx(4.0)
    assert last(by_outcome, (("outcome", "rejected"),)) == pytest.approx(1.0)
    routed = ev.evaluate('sum by (cluster) (rate(llm_extproc_requests_total{outcome="routed"}[1m]))')
    assert list(routed) == [(("cluster", "a"),)]
    other = Evaluator(scrapes(), {"job": "someone-else"})
    assert other.evaluate('sum(rate(llm_extproc_requests_total{job=~"$job"}[1m]))') == {}


def test_histogram_quantile_interpolates_inside_the_bucket() -> None:
    ev = Evaluator(scrapes(), {})
    expr = "histogram_quantile({q}, sum by (le) (rate(llm_extproc_decision_seconds_bucket[1m])))"
    assert last(ev.evaluate(expr.format(q=0.5))) == pytest.approx(0.003)
    assert last(ev.evaluate(expr.format(q=0.99))) == pytest.approx(0.001 + 0.004 * 0.99)


def test_gauges_aggregates_ratio_and_time() -> None:
    ev = Evaluator(scrapes(), {})
    assert last(ev.evaluate("sum(llm_extproc_inflight_requests)")) == 10
    assert last(ev.evaluate("min(llm_extproc_inflight_requests)")) == 3
    assert last(ev.evaluate("max by (cluster) (llm_extproc_inflight_requests)"), (("cluster", "b"),)) == 7
    ratio = ev.evaluate(
        'sum by (job) (rate(llm_extproc_requests_total{outcome="rejected"}[1m])) / '
        'sum by (job) (rate(llm_extproc_requests_total{outcome="routed"}[1m]))'
    )
    assert last(ratio, (("job", "llm-extproc"),)) == pytest.approx(0.25)
    ago = ev.evaluate("time() - max(llm_extproc_inflight_requests)")
    assert last(ago) == pytest.approx(106.0 - 7)


def test_every_panel_of_the_shipped_dashboard_is_understood_and_drawn(tmp_path: Path) -> None:
    doc = json.loads(DASHBOARD.read_text())
    assert DASHBOARD == ROOT / "deploy" / "monitoring" / "grafana-dashboard.json"
    ev = Evaluator(scrapes(), {"job": "llm-extproc"})
    for panel in doc["panels"]:
        for target in panel["targets"]:
            ev.evaluate(target["expr"])  # raises on a query shape the redraw does not support
    out = tmp_path / "d.png"
    render(scrapes(), out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_committed_picture_exists_and_is_embedded() -> None:
    image = ROOT / "docs" / "images" / "dashboard.png"
    assert image.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    ops = (ROOT / "docs" / "operations.md").read_text()
    assert "](images/dashboard.png)" in ops
    assert "python -m extproc_lab.bench.dashboard --out docs/images/dashboard.png" in ops
