"""The live class-objectives bench (`python -m extproc_lab.bench.class_objectives_live`): a short run
through real Envoy + llm-extproc + redis-server + the publisher over simulated 8-sequence engines, and
Envoy's round robin. The figures are in docs/benchmarks.md; this checks the plumbing: every request
accounted for, nothing failing but a 429, the checks written."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest

from extproc_lab.bench.class_objectives_live import ROWS, LiveConfig, run_live, scaled_admission
from extproc_lab.bench.classes import CONFIGURED, OURS
from extproc_lab.bench.priorities import CLASSES


def test_the_service_gets_the_shipped_admission_with_its_waits_in_real_seconds() -> None:
    admission = scaled_admission({"enabled": True, "client_max_priority": "critical"}, 2.0)
    assert admission["enabled"] is True and admission["client_max_priority"] == "critical"
    assert admission["max_wait_s"] == pytest.approx(0.75)  # the defaults (1.5, 0.5, 0.25 s), halved
    assert admission["overload_after_s"] == pytest.approx(0.25)
    assert admission["overload_wait_s"] == pytest.approx(0.125)
    assert all("," not in row for row in ROWS)  # --rows is a comma-separated list


@pytest.mark.envoy
@pytest.mark.slow
@pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server")
async def test_a_short_live_run_accounts_for_every_request(tmp_path: Path) -> None:
    rows = (OURS, CONFIGURED, "round-robin")
    cfg = LiveConfig(count=40, loads=(0.5, 2.0), rows=rows, time_scale=4.0)
    result = await asyncio.wait_for(run_live(cfg, tmp_path, progress=lambda _: None), timeout=300)
    assert (tmp_path / "classes-live.json").exists() and (tmp_path / "classes-live.md").exists()
    assert result["skipped"] == {}
    for run in result["loads"].values():
        assert set(run["policies"]) == set(rows)
        for row in rows:
            p = run["policies"][row]
            assert p["requests"] == 40 and p["errors"] == 0, (row, p)
            classes = p["classes"]
            assert all(classes[k]["other_errors"] == 0 for k in CLASSES)
            assert classes["critical"]["shed"] == 0
        assert sum(run["policies"]["round-robin"]["classes"][k]["shed"] for k in CLASSES) == 0
        assert "observed_ttft" not in run["policies"]["round-robin"]
        for row in (OURS, CONFIGURED):
            # every request served is in the service's observed TTFT, near what its client measured
            for k, seen in run["policies"][row]["observed_ttft"].items():
                assert seen["service_count"] == seen["client_count"], (row, k, seen)
                if seen["client_count"]:  # Envoy's first byte, a loopback hop before the client's
                    assert 0.8 * seen["client_mean_ms"] <= seen["service_mean_ms"] <= seen["client_mean_ms"]
    assert set(result["checks"]) == {OURS, CONFIGURED}
