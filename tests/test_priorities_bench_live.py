"""The live priorities bench (`python -m extproc_lab.bench.priorities_live`): a short run through real
Envoy + llm-extproc + redis-server + the publisher over simulated engines, and Envoy's round robin,
reported with the discrete-event bench's per-class statistics and checks. The figures are in
docs/benchmarks.md; this checks the plumbing: every request's class and objective reach the service
(the headers), every request is accounted for, and nothing fails but a 429."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from builders import serve_http

from extproc_lab.bench.loadgen import open_loop
from extproc_lab.bench.priorities import CLASSES, ENGINE_PRIORITY_ROW, TPOT_OBJECTIVE_ROW
from extproc_lab.bench.priorities_live import LiveConfig, run_live, service_admission
from extproc_lab.bench.report import Slo


async def test_open_loop_sends_each_requests_own_headers() -> None:
    seen: list[dict[str, str]] = []

    async def handle(request: web.Request) -> web.Response:
        seen.append({k.lower(): v for k, v in request.headers.items() if k.lower().startswith("x-")})
        return web.json_response({"choices": [{"message": {"content": "hi"}}]})

    runner, port = await serve_http("POST", "/v1/chat/completions", handle)
    try:
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        body: dict[str, Any] = {"model": "m", "messages": []}
        requests = [(0.0, body, "a"), (0.01, body, "b")]
        headers = [{"x-llm-priority": "critical"}, {"x-llm-priority": "sheddable", "x-user-id": "t"}]
        records, _ = await open_loop(url, requests, headers=headers)
        assert all(r.ok for r in records)
        assert sorted(seen, key=len) == headers
        with pytest.raises(ValueError, match="1 header sets for 2 requests"):
            await open_loop(url, requests, headers=headers[:1])
    finally:
        await runner.cleanup()


def test_the_service_gets_the_bench_admission_in_real_seconds() -> None:
    admission = service_admission(2.0)
    assert admission["enabled"] is True
    assert admission["max_predicted_wait_s"] == pytest.approx(0.075)
    assert admission["max_wait_s"] == pytest.approx(0.75)
    assert admission["overload_after_s"] == pytest.approx(0.25)  # the defaults (0.5 s, 0.25 s), halved
    assert admission["overload_wait_s"] == pytest.approx(0.125)
    assert "max_tpot_s" not in admission
    assert service_admission(2.0, 0.1)["max_tpot_s"] == pytest.approx(0.05)


@pytest.mark.envoy
@pytest.mark.slow
@pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server")
async def test_a_short_live_run_accounts_for_every_request(tmp_path: Path) -> None:
    # The engine-priority row: the service writes each class's number into the bodies, and its
    # engines take them (engines left on FCFS would answer 400, counted in errors).
    rows = ("llm-extproc", TPOT_OBJECTIVE_ROW, ENGINE_PRIORITY_ROW, "round-robin")
    # An objective no engine meets once it reports (1 ms of virtual time a token): requests that
    # carry it are shed as soon as the engines' figures arrive, which shows the header got through.
    cfg = LiveConfig(count=60, loads=(0.5, 1.2), rows=rows, time_scale=4.0, slo=Slo(1.0, 0.001))
    result = await asyncio.wait_for(run_live(cfg, tmp_path, progress=lambda _: None), timeout=300)
    assert (tmp_path / "priorities-live.json").exists() and (tmp_path / "priorities-live.md").exists()
    assert result["skipped"] == {}
    for run in result["loads"].values():
        assert set(run["policies"]) == set(rows)
        for row in rows:
            p = run["policies"][row]
            assert p["requests"] == 60 and p["errors"] == 0
            classes = p["classes"]
            assert sum(classes[k]["requests"] for k in CLASSES) == 60
            assert all(classes[k]["other_errors"] == 0 for k in CLASSES)
        assert sum(run["policies"]["round-robin"]["classes"][k]["shed"] for k in CLASSES) == 0
    shed = sum(
        run["policies"][TPOT_OBJECTIVE_ROW]["classes"][k]["shed"]
        for run in result["loads"].values()
        for k in CLASSES
    )
    assert shed > 0  # the objective reached the service
    assert {"checks", "checks_tpot_objective", "checks_engine_priority"} <= set(result)


def test_every_row_name_can_be_given_to_rows() -> None:
    """`--rows` is a comma-separated list: a row name with a comma in it could never be chosen."""
    from extproc_lab.bench.priorities_live import ROWS

    assert all("," not in row for row in ROWS)
