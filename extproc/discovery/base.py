"""The seam between endpoint sources and the pool: a source reports a cluster's full endpoint list
whenever it changes; `PoolUpdater` applies it (the pool swaps its indices whole) and counts it."""

from __future__ import annotations

import logging
from typing import Protocol

from extproc.fleet import Pool
from extproc.telemetry import Metrics

log = logging.getLogger("extproc.discovery")


class EndpointSource(Protocol):
    """Something that knows a pool cluster's endpoints and tells `PoolUpdater` as they change."""

    cluster: str

    @property
    def synced(self) -> bool:
        """The first complete list has been applied (until then the cluster may be empty)."""
        ...

    def start(self) -> None: ...

    async def stop(self) -> None: ...


class PoolUpdater:
    """Applies reported endpoint lists to the pool (event loop only)."""

    __slots__ = ("metrics", "pool")

    def __init__(self, pool: Pool, metrics: Metrics | None = None) -> None:
        self.pool = pool
        self.metrics = metrics

    def __call__(self, cluster: str, endpoints: tuple[str, ...]) -> None:
        try:
            changed = self.pool.set_endpoints(cluster, endpoints)
        except ValueError as exc:  # an address Envoy could not route to (not ip:port): skip it all
            log.warning("discovery: ignoring an update of cluster %s: %s", cluster, exc)
            return
        if self.metrics is not None:
            self.metrics.discovered_endpoints.labels(cluster=cluster).set(len(endpoints))
        if changed:
            log.info(
                "discovery: cluster %s now has %d endpoints: %s",
                cluster,
                len(endpoints),
                ", ".join(endpoints[:16]),
            )
