"""The slowdown target live (issue 11): real Envoy + llm-extproc + redis-server + publisher over four
simulated engines, one slowed 3x mid-run and then restored; `latency-ucb` (with `least-outstanding`)
moves traffic away and back, while Envoy's round robin, in the same run, does not react (the contrast
that shows the check can fail). A shorter run than `python -m extproc_lab.bench.ucb_live`, whose
figures are in docs/benchmarks.md."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from extproc_lab.bench.ucb_live import Timeline, run

pytestmark = [
    pytest.mark.envoy,
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server"),
]

UCB = "latency-ucb+least-outstanding"
RR = "envoy-round-robin"


def test_slowed_engine_loses_share_and_regains_it(tmp_path: Path) -> None:
    # 65 s after the restore: latency-ucb takes ~45 s to give the engine its quarter back here, and the
    # share is then judged over the last 35 s (~420 requests; a 20 s window read 0.17-0.19 against a
    # 0.175 bound, before and after 2026-12-01, and failed CI once).
    tl = Timeline(warmup_s=5.0, slow_at=30.0, restore_at=75.0, end=140.0)
    results = {r.policy: r for r in run([UCB, RR], timeline=tl, rate=12.0, workdir=tmp_path)}
    ucb, rr = results[UCB], results[RR]
    assert ucb.errors == 0 and rr.errors == 0
    assert ucb.requests > 1000
    assert 0.1 < ucb.baseline < 0.45  # about a quarter before the slowdown
    # Slowed: the share halves within 30 s (the target) and stays well down.
    assert ucb.halved_after_s is not None and ucb.halved_after_s <= 30, ucb.windows
    assert ucb.slowed_share <= 0.6 * ucb.baseline, ucb.windows
    # Restored: back within the 60 s that follow (the target), and it keeps its share.
    assert ucb.regained_after_s is not None and ucb.regained_after_s <= 60, ucb.windows
    assert ucb.share_after >= 0.7 * ucb.baseline, ucb.windows
    # The contrast: round robin keeps sending the slowed engine its quarter.
    assert rr.slowed_share >= 0.8 * rr.baseline, rr.windows
