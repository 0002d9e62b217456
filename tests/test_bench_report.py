"""Benchmark report: statistics on hand-computed inputs, the table, JSON round trip and plots."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from extproc_lab.bench.report import (
    Report,
    RequestRecord,
    Slo,
    format_table,
    imbalance,
    in_flight,
    percentile,
    plot,
    read_json,
    summarize,
    write_json,
)


def rec(
    ttft: float | None = 0.1,
    e2e: float = 1.0,
    *,
    served_by: str | None = "a",
    status: int = 200,
    error: str | None = None,
    arrival: float = 0.0,
    prompt: int | None = 100,
    completion: int | None = 10,
    cached: int | None = 0,
) -> RequestRecord:
    return RequestRecord("t", served_by, status, error, arrival, ttft, e2e, prompt, completion, cached)


def test_percentile_nearest_rank() -> None:
    values = [float(v) for v in range(10, 0, -1)]  # 1..10, unsorted
    assert percentile(values, 50) == 5.0  # ceil(0.5 * 10) = 5th smallest
    assert percentile(values, 90) == 9.0  # ceil(9.0) = 9th (not 10th: no float drift)
    assert percentile(values, 99) == 10.0  # ceil(9.9) = 10th
    assert percentile(values, 0) == 1.0
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0  # ceil(1.5) = 2nd
    assert percentile(range(1, 101), 99) == 99
    assert percentile([], 50) is None


def test_tpot_formula() -> None:
    assert rec(0.2, 2.2, completion=11).tpot_s == pytest.approx(0.2)  # 2.0 s over 10 later tokens
    assert rec(0.2, 2.2, completion=1).tpot_s == pytest.approx(2.0)  # max(1, 0)
    assert rec(None, 2.2).tpot_s is None
    r = rec(0.5, 1.5, completion=None)
    r.inter_token_s = [0.25] * 4  # 5 tokens seen
    assert r.tpot_s == pytest.approx(0.25)


def test_imbalance() -> None:
    assert imbalance([10, 20, 30]) == pytest.approx(1.0)
    assert imbalance([5, 5]) == 0.0
    assert imbalance([]) is None


def test_summarize_known_inputs() -> None:
    slo = Slo(ttft_s=0.5, tpot_s=0.05)
    records = [
        # ttft, e2e, completion -> tpot = (e2e - ttft) / (completion - 1)
        rec(0.1, 1.0, served_by="a", completion=10, prompt=100, cached=50),  # tpot 0.1: misses TPOT
        rec(0.2, 0.65, served_by="a", completion=10, prompt=100, cached=100),  # tpot 0.05: good
        rec(0.3, 0.75, served_by="b", completion=10, prompt=200, cached=0),  # tpot 0.05: good
        rec(0.6, 1.05, served_by="b", completion=10, prompt=100, cached=None),  # ttft misses; no cache info
        rec(None, 0.01, served_by="c", status=503, error="HTTP 503", prompt=None, completion=None),
        rec(None, 5.0, served_by=None, status=0, error="TimeoutError", prompt=None, completion=None),
        rec(None, 0.02, served_by="c", status=429, error=None, prompt=None, completion=None),
    ]
    r = summarize("p", records, 2.0, slo, instances=["a", "b", "c", "d"])
    assert (r.requests, r.ok, r.errors, r.good) == (7, 4, 3, 2)
    assert r.throughput_rps == pytest.approx(2.0)
    assert r.goodput_rps == pytest.approx(1.0)
    assert r.output_tokens_per_s == pytest.approx(20.0)
    assert (r.ttft_p50_ms, r.ttft_p90_ms, r.ttft_p99_ms) == pytest.approx((200.0, 600.0, 600.0))
    assert (r.tpot_p50_ms, r.tpot_p99_ms) == pytest.approx((50.0, 100.0))
    assert (r.e2e_p50_ms, r.e2e_p90_ms) == pytest.approx((750.0, 1050.0))
    assert r.prefix_cache_hit_rate == pytest.approx(150 / 400)  # the cache-less record is left out
    assert r.cached_tokens == 150 and r.prompt_tokens == 500 and r.completion_tokens == 40
    assert r.split == {"a": 2, "b": 2, "c": 2, "d": 0}
    assert r.imbalance == pytest.approx((2 - 0) / 1.5)
    assert r.errors_by_kind == {"HTTP 503": 1, "TimeoutError": 1, "HTTP 429": 1}
    assert r.slo == slo


def test_summarize_split_imbalance_and_defaults() -> None:
    records = [rec(served_by="a")] * 10 + [rec(served_by="b")] * 20 + [rec(served_by="c")] * 30
    r = summarize("p", records, 10.0)
    assert r.imbalance == pytest.approx(1.0)
    assert r.slo == Slo(1.0, 0.1)
    empty = summarize("none", [], 0.0)
    assert empty.ttft_p50_ms is None and empty.prefix_cache_hit_rate is None and empty.imbalance is None
    assert empty.throughput_rps == 0.0


def test_record_usage_and_errors() -> None:
    r = RequestRecord(tag="x", served_by="e1", status=200, error=None, arrival_s=3.0, ttft_s=0.1, e2e_s=0.5)
    assert (r.tag, r.served_by, r.arrival_s, r.ok, r.prompt_tokens) == ("x", "e1", 3.0, True, None)
    r.apply_usage(
        {"prompt_tokens": 40, "completion_tokens": 5, "prompt_tokens_details": {"cached_tokens": 16}}
    )
    assert (r.prompt_tokens, r.completion_tokens, r.cached_tokens) == (40, 5, 16)
    r.apply_usage({"prompt_tokens": 40, "completion_tokens": 5})
    assert r.cached_tokens is None
    failed = RequestRecord(
        tag="x", served_by=None, status=0, error="ClientError", arrival_s=0, ttft_s=None, e2e_s=1.0
    )
    assert not failed.ok and failed.error_kind == "ClientError"


def reports() -> list[Report]:
    fast = [rec(0.1, 0.5, served_by="a", cached=60), rec(0.2, 0.6, served_by="b", cached=40)]
    slow = [
        rec(1.5, 3.0, served_by="a"),
        rec(0.4, 9.0, served_by="a"),
        rec(None, 0.1, status=503, error="HTTP 503", served_by=None),
    ]
    return [summarize("prefix-aware", fast, 1.0), summarize("round-robin", slow, 1.0)]


def test_table_contains_numbers_and_slo() -> None:
    table = format_table(reports())
    lines = table.splitlines()
    assert "TTFT <= 1000 ms, TPOT <= 100 ms" in lines[0]
    assert "nearest-rank" in table
    row = next(line for line in lines if line.startswith("prefix-aware"))
    for text in ("2/2", "100.0", "200.0", "50.0%", "a:1 b:1", "0.00"):
        assert text in row
    row = next(line for line in lines if line.startswith("round-robin"))
    for text in ("2/3", "1500.0", "HTTP 503:1", "a:2"):
        assert text in row


def test_table_lists_each_slo_when_they_differ() -> None:
    a = summarize("a", [rec()], 1.0, Slo(0.5, 0.05))
    b = summarize("b", [rec()], 1.0)
    table = format_table([a, b])
    assert "(a): TTFT <= 500 ms, TPOT <= 50 ms" in table and "(b): TTFT <= 1000 ms" in table


def test_json_round_trip(tmp_path: Path) -> None:
    rs = reports()
    path = write_json(tmp_path / "out" / "run.json", rs, {"workload": {"name": "bursty", "rate": 4.0}})
    doc = json.loads(path.read_text())
    assert doc["reports"][0]["slo"] == {"ttft_s": 1.0, "tpot_s": 0.1}
    back, meta = read_json(path)
    assert back == rs
    assert meta == {"workload": {"name": "bursty", "rate": 4.0}}


def test_in_flight_counts() -> None:
    points = in_flight([rec(arrival=0.0, e2e=2.0), rec(arrival=1.0, e2e=2.0), rec(arrival=2.0, e2e=1.0)])
    times, counts = points["a"]
    assert list(zip(times, counts, strict=True)) == [(0, 0), (0, 1), (1, 2), (2, 1), (2, 2), (3, 1), (3, 0)]


def test_plot_writes_pngs(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    by_policy = {
        "prefix-aware": [rec(0.1 + i / 100, 1.0, served_by="ab"[i % 2], arrival=i / 10) for i in range(40)],
        "random": [rec(0.2 + i / 50, 2.0, served_by="abc"[i % 3], arrival=i / 10) for i in range(40)],
        "all-failed": [rec(None, 0.1, status=503, error="HTTP 503", served_by=None)],
    }
    paths = plot(tmp_path / "plots" / "run", by_policy, slo=Slo())
    assert [p.name for p in paths] == ["run-ttft-cdf.png", "run-in-flight.png"]
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert p.stat().st_size > 5000


def test_plot_without_matplotlib_names_the_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")] + ["matplotlib"]:
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(ImportError, match="pip install matplotlib"):
        plot(tmp_path / "x", {"p": [rec()]})
