"""gRPC health services with the endpoint picker's meanings, fed by the state behind /healthz and
/readyz (app._Probes), so a kubelet gRPC probe, Envoy's health check and the HTTP probes agree.

Names (Gateway API Inference Extension, docs/proposals/004-endpoint-picker-protocol "Health
Checking", the reference picker's cmd/epp/runner/health.go, and its manifests' probes):

- `liveness`: the process answers and its event loop turns. Never depends on the pool or phase
  (a liveness tied to them restarts pods that are only waiting).
- `readiness`: serving (not starting, not shutting down) and the loop turns.
- `inference-extension` (what the upstream manifests' gRPC probes ask for), the ext_proc service
  name (what Envoy's health check asks for) and "": ready *and* able to pick: every discovered
  cluster has its first endpoint list, and the pool has at least one endpoint.

On SIGTERM `enter_graceful_shutdown` turns every name NOT_SERVING and later updates are ignored.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable

from grpc_health.v1 import health, health_pb2

LIVENESS = "liveness"
READINESS = "readiness"
INFERENCE_EXTENSION = "inference-extension"
UPDATE_EVERY_S = 0.5

Check = Callable[[], tuple[bool, str]]


class HealthStates:
    """Keeps the health servicer's statuses equal to the probes' answers (checked every 0.5 s and
    on demand, e.g. right after discovery changes the pool)."""

    def __init__(
        self,
        servicer: health.aio.HealthServicer,
        live: Check,
        ready: Check,
        can_pick: Callable[[], bool],
        pick_names: Iterable[str],
    ) -> None:
        self.servicer = servicer
        self.live = live
        self.ready = ready
        self.can_pick = can_pick
        self.pick_names = (INFERENCE_EXTENSION, *pick_names)
        self._current: dict[str, bool] = {}

    def wanted(self) -> dict[str, bool]:
        live = self.live()[0]
        ready = live and self.ready()[0]
        picking = ready and self.can_pick()
        return {LIVENESS: live, READINESS: ready, **dict.fromkeys(self.pick_names, picking)}

    async def update(self) -> None:
        for name, ok in self.wanted().items():
            if self._current.get(name) is not ok:
                self._current[name] = ok
                status = (
                    health_pb2.HealthCheckResponse.SERVING
                    if ok
                    else health_pb2.HealthCheckResponse.NOT_SERVING
                )
                await self.servicer.set(name, status)

    async def run_forever(self, every_s: float = UPDATE_EVERY_S) -> None:
        while True:
            await self.update()
            await asyncio.sleep(every_s)
