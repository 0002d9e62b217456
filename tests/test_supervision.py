"""Background loops under supervision (telemetry/supervision.py): a failure is logged and the loop
started again; one that keeps failing is reported for readiness; cancelling ends it."""

from __future__ import annotations

import asyncio

import pytest

from extproc.telemetry import supervision
from extproc.telemetry.supervision import supervised


@pytest.fixture(autouse=True)
def fast(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(supervision, "BACKOFF_S", (0.001, 0.002))


async def test_a_loop_that_raises_is_started_again_and_reported_while_it_keeps_failing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    runs = 0
    release = asyncio.Event()

    async def loop() -> None:
        nonlocal runs
        runs += 1
        if runs <= supervision.FAILING_AFTER:
            raise ValueError(f"bad record {runs}")
        await release.wait()

    task = asyncio.create_task(supervised("t", loop))
    for _ in range(200):
        await asyncio.sleep(0.005)
        if runs > supervision.FAILING_AFTER:
            break
    assert runs == supervision.FAILING_AFTER + 1  # failed 5 times, running the 6th
    assert supervision.failing() == [
        f"background loop t failed {supervision.FAILING_AFTER} times in a row (ValueError: bad record 5)"
    ]
    assert "background loop t failed" in caplog.text
    release.set()
    await task  # returning ends it: nothing left in the registry
    assert not supervision.loops() and not supervision.failing()


async def test_a_loop_that_recovers_stops_failing_readiness(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(supervision, "HEALTHY_RUN_S", 0.05)
    runs = 0

    async def loop() -> None:
        nonlocal runs
        runs += 1
        if runs <= supervision.FAILING_AFTER:
            raise RuntimeError("x")
        await asyncio.sleep(3600)

    task = asyncio.create_task(supervised("t", loop))
    while runs <= supervision.FAILING_AFTER:
        await asyncio.sleep(0.001)
    assert supervision.failing()
    await asyncio.sleep(0.1)  # the running attempt has lasted HEALTHY_RUN_S
    assert not supervision.failing()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not supervision.loops()


async def test_failures_are_counted_per_loop_in_the_services_metrics() -> None:
    from extproc.telemetry import Metrics

    metrics = Metrics(["m"], ["a"])
    runs = 0

    async def loop() -> None:
        nonlocal runs
        runs += 1
        if runs <= 2:
            raise RuntimeError("x")
        await asyncio.sleep(3600)

    task = asyncio.create_task(supervised("fleet-rebuild", loop))
    while runs <= 2:
        await asyncio.sleep(0.001)
    sample = metrics.registry.get_sample_value
    assert sample("llm_extproc_background_loop_failures_total", {"loop": "fleet-rebuild"}) == 2
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
