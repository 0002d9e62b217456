"""Several simulated engines served from a private event loop on a daemon thread.

Lets synchronous code (tests, the demo's orchestration) start engines, change their speed and read
their counters while its own event loop drives load.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Sequence
from typing import Any

from extproc_lab.engines.profiles import GpuProfile
from extproc_lab.engines.server import SimEngine


class EngineGroup:
    def __init__(
        self,
        delays_s: Sequence[float],
        model: str,
        *,
        max_batch: int = 0,
        profiles: Sequence[GpuProfile | None] | None = None,
        time_scale: float = 1.0,
        lora_slots: int = 0,
        lora_load_s: float = 0.3,
        scheduling_policy: str = "fcfs",
        token_scales: Sequence[float] = (1.0,),
    ) -> None:
        """One engine per entry of `delays_s` (fixed-cost engines), or, with `profiles`, one model-driven
        engine per profile (None entries stay fixed-cost). `lora_slots` > 0: the fixed-cost engines
        serve LoRA adapters (server.LoraSlots). `scheduling_policy`: vLLM's (fcfs, priority).
        `token_scales` (cycled): each model-driven engine's tokens per built-in token (tokens.Recount)."""
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="sim-engines", daemon=True)
        self._thread.start()
        kinds = list(profiles) if profiles is not None else [None] * len(delays_s)
        delays = list(delays_s) or [0.005]
        self.engines = [
            SimEngine(
                f"engine-{i}",
                model,
                delays[i % len(delays)],
                max_batch=max_batch,
                profile=p,
                time_scale=time_scale,
                lora_slots=lora_slots,
                lora_load_s=lora_load_s,
                scheduling_policy=scheduling_policy,
                token_scale=token_scales[i % len(token_scales)],
            )
            for i, p in enumerate(kinds)
        ]
        self.ports = [self._call(e.start("127.0.0.1", 0)) for e in self.engines]

    def _call(self, coro: Coroutine[Any, Any, Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(10)

    def address(self, i: int) -> str:
        return f"127.0.0.1:{self.ports[i]}"

    def by_name(self, name: str) -> SimEngine:
        return next(e for e in self.engines if e.name == name)

    def reset(self) -> None:
        for e in self.engines:
            e.stats.requests = e.stats.completed = e.stats.disconnected = e.stats.max_active = 0
            e.stats.hung_requests = 0
            e.hung = False
            e.metrics_delay_s = 0.0
            e.stats.routing_headers.clear()
            e.stats.priorities.clear()

    def close(self) -> None:
        for e in self.engines:
            self._call(e.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)
