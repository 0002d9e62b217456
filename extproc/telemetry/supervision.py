"""Long-lived background loops that log and go on instead of dying silently.

A loop that raises is logged and started again after a backoff (0.1 s doubling to 10 s); one that
has failed FAILING_AFTER times in a row, none of its runs lasting HEALTHY_RUN_S, is reported by
`failing()`, which the service's readiness reads (/readyz, gRPC health): a replica whose fleet view
can no longer be kept fresh leaves the pool instead of routing on a frozen view. A run that lasts
HEALTHY_RUN_S clears the count. Cancelling the task (a stop) ends the loop as before.

The registry is per process: each loop is in it while its task runs, so a stopped service leaves
nothing behind.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

log = logging.getLogger("extproc.supervision")

BACKOFF_S = (0.1, 10.0)
FAILING_AFTER = 5
HEALTHY_RUN_S = 30.0


@dataclass(slots=True)
class LoopState:
    name: str
    failures: int = 0  # in a row, without a run of HEALTHY_RUN_S
    total_failures: int = 0
    last_error: str = ""
    run_started: float = 0.0  # monotonic start of the current (or last) run

    def is_failing(self) -> bool:
        recovered = time.monotonic() - self.run_started >= HEALTHY_RUN_S
        return self.failures >= FAILING_AFTER and not recovered


_running: dict[int, LoopState] = {}


def loops() -> list[LoopState]:
    """The supervised loops running in this process now."""
    return list(_running.values())


def failing() -> list[str]:
    """Why readiness should fail: each loop that keeps failing, with its last error."""
    return [
        f"background loop {s.name} failed {s.failures} times in a row ({s.last_error})"
        for s in _running.values()
        if s.is_failing()
    ]


async def supervised(name: str, run: Callable[[], Awaitable[None]]) -> None:
    """Await `run()` until it returns or the task is cancelled; start it again when it raises."""
    state = LoopState(name)
    key = id(state)
    _running[key] = state
    delay = BACKOFF_S[0]
    try:
        while True:
            state.run_started = started = time.monotonic()
            try:
                await run()
                return
            except Exception as exc:  # any failure of a loop is logged and survived
                if time.monotonic() - started >= HEALTHY_RUN_S:
                    state.failures, delay = 0, BACKOFF_S[0]
                state.failures += 1
                state.total_failures += 1
                state.last_error = f"{type(exc).__name__}: {exc}"[:200]
                log.error(
                    "background loop %s failed (%d in a row), starting it again in %.1fs",
                    name,
                    state.failures,
                    delay,
                    exc_info=state.failures <= 3 or state.failures % 100 == 0,
                )
            await asyncio.sleep(delay)
            delay = min(delay * 2, BACKOFF_S[1])
    finally:
        del _running[key]
