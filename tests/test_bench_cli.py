"""The benchmark commands end to end, scaled down: they run, compare policies, and write their files."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from extproc_lab.bench.report import read_json
from extproc_lab.bench.scenarios import run_live_bench

pytestmark = pytest.mark.envoy


async def test_live_bench_fresh_fleet_per_policy(tmp_path: Path) -> None:
    reports = await run_live_bench(
        workload="shared-prefix",
        policies=["llm-extproc", "envoy-round-robin"],
        profiles=["a10g-llama3-8b", "a10g-llama3-8b"],
        rate=8.0,
        count=16,
        warmup=2,
        time_scale=20.0,
        params={"tenants": 4},
        out_dir=tmp_path,
    )
    assert [r.name for r in reports] == ["llm-extproc", "envoy-round-robin"]
    for r in reports:
        assert r.requests == 16 and r.errors == 0, r.errors_by_kind
        assert r.prompt_tokens and r.prompt_tokens > 16 * 1000  # usage came back through every router
    saved, meta = read_json(tmp_path / "live-shared-prefix.json")
    assert [r.name for r in saved] == ["llm-extproc", "envoy-round-robin"]
    assert meta["params"]["tenants"] == 4
    assert (tmp_path / "live-shared-prefix-ttft-cdf.png").stat().st_size > 1000


def test_simulate_cli(tmp_path: Path) -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "extproc.cli",
            "simulate",
            "--workload",
            "multi-turn",
            "--engines",
            "3",
            "--rate",
            "4",
            "--count",
            "40",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    doc = json.loads((tmp_path / "multi-turn.json").read_text())
    names = [r["name"] for r in doc["reports"]]
    assert names == ["llm-extproc", "round-robin", "least-request", "exact-ttft", "clairvoyant-affinity"]
    assert all(r["ok"] == 40 for r in doc["reports"])
    assert "clairvoyant-affinity" in out.stdout


@pytest.mark.parametrize(
    "argv",
    [
        ["bench", "--target", "no-url-here"],
        ["bench", "--target", "a=ftp://x"],
        ["bench"],
        ["bench", "--local", "--param", "tenants"],
        ["simulate", "--profiles", "no-such-gpu", "--count", "5"],
        ["simulate", "--policies", "telepathy", "--count", "5", "--engines", "1"],
    ],
)
def test_bad_arguments_are_clear_errors(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    from extproc.cli import main

    assert main(argv) == 2
    assert "llm-extproc: error:" in capsys.readouterr().err
