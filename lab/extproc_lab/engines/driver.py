"""Runs an `EngineModel` in (scaled) real time behind the simulated HTTP server.

One task steps the model: it sleeps each step's duration (divided by `time_scale`), then hands the
step's events to the requests waiting on them. Requests submit, then consume their own event queue;
a request whose client goes away is aborted, releasing its KV blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

from extproc.publishers.kv_events import KvEvent
from extproc_lab.engines.model import EngineModel, FinishedEvent, FirstTokenEvent, TokenEvent

Event = FirstTokenEvent | TokenEvent | FinishedEvent


class ModelDriver:
    def __init__(self, model: EngineModel, time_scale: float = 1.0) -> None:
        if time_scale <= 0:
            raise ValueError("time_scale must be positive")
        self.model = model
        self.time_scale = time_scale
        self._queues: dict[str, asyncio.Queue[Event]] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._t0 = 0.0
        self._next_id = 0
        # Told each step's KV-cache events (the model must be built with kv_events=True).
        self.on_kv_events: Callable[[list[KvEvent]], None] | None = None

    def now(self) -> float:
        """Virtual seconds since start."""
        return (asyncio.get_running_loop().time() - self._t0) * self.time_scale

    def start(self) -> None:
        self._t0 = asyncio.get_running_loop().time()
        self._task = asyncio.create_task(self._run(), name="sim-engine-steps")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        while True:
            result = self.model.step(self.now())
            if result is None:
                self._wake.clear()
                await self._wake.wait()
                continue
            await asyncio.sleep(result.duration / self.time_scale)
            if self.on_kv_events is not None:
                kv_events = self.model.drain_kv_events()
                if kv_events:
                    self.on_kv_events(kv_events)
            for group in (result.first_tokens, result.tokens, result.finished):
                for ev in group:
                    q = self._queues.get(ev.request_id)
                    if q is not None:
                        q.put_nowait(ev)

    async def generate(
        self, prompt_tokens: list[int], max_tokens: int, priority: int = 0
    ) -> AsyncIterator[Event]:
        """Submit one request and yield its events until it finishes. Raises ValueError for prompts
        the engine refuses (too long for its context)."""
        self._next_id += 1
        rid = f"r{self._next_id}"
        queue: asyncio.Queue[Event] = asyncio.Queue()
        self.model.submit(rid, prompt_tokens, max_tokens, self.now(), priority)
        self._queues[rid] = queue
        self._wake.set()
        finished = False
        try:
            while True:
                ev = await queue.get()
                yield ev
                if isinstance(ev, FinishedEvent):
                    finished = True
                    return
        finally:
            self._queues.pop(rid, None)
            if not finished:
                self.model.abort(rid, self.now())
