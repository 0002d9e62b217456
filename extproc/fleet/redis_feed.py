"""Follow the fleet's snapshots in Redis: load every key at start, then the pub/sub channel, with a
periodic resync and a resync after every reconnect. Runs as a background task; the request path
never waits on it, and a Redis outage only ages the view until snapshots go stale.

Every snapshot is decoded and applied on its own, keyed by its upstream id: a rejected, DOWN or
deleted snapshot only ever concerns its own instance, never another one's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from extproc.fleet.snapshots import SnapshotRejected, decode
from extproc.fleet.view import FleetView
from extproc.settings import (
    EXPIRY_TICK_S,
    REBUILD_EVERY_S,
    REDIS_CONNECT_TIMEOUT_S,
    REDIS_SOCKET_TIMEOUT_S,
    RedisSettings,
)
from extproc.telemetry import Metrics

log = logging.getLogger("extproc.fleet")


def redis_client(settings: RedisSettings) -> aioredis.Redis:
    """A client for the fleet's Redis; the socket timeouts keep a hung Redis from pinning a task."""
    kwargs: dict[str, object] = {
        "socket_timeout": REDIS_SOCKET_TIMEOUT_S,
        "socket_connect_timeout": REDIS_CONNECT_TIMEOUT_S,
    }
    if settings.username:
        kwargs["username"] = settings.username
    if settings.password:
        kwargs["password"] = settings.password
    if settings.tls_ca_file:
        kwargs["ssl_ca_certs"] = settings.tls_ca_file
    return aioredis.from_url(settings.url, **kwargs)


class RedisFeed:
    def __init__(self, settings: RedisSettings, view: FleetView, metrics: Metrics) -> None:
        self.settings = settings
        self.view = view
        self.metrics = metrics
        self._tasks: list[asyncio.Task[None]] = []
        self._exported: set[str] = set()
        self._stale_ready_seen = 0  # view.stale_ready_decisions already added to the counter
        self.connected = asyncio.Event()

    def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._follow(), name="fleet-redis"),
            asyncio.create_task(self._maintain(), name="fleet-rebuild"),
        ]

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t

    # -- ingestion ---------------------------------------------------------------------------------
    def ingest(self, data: bytes) -> None:
        try:
            state = decode(data, self.view.known_clusters)
        except SnapshotRejected as exc:
            self.metrics.snapshots.labels(outcome="rejected", reason=exc.reason).inc()
            return
        outcome = "accepted" if self.view.apply(state) else "outdated"
        self.metrics.snapshots.labels(outcome=outcome, reason="").inc()

    async def resync(self, client: aioredis.Redis) -> int:
        """Read every snapshot key of the pool (SCAN + MGET in batches)."""
        n = 0
        batch: list[bytes] = []
        async for key in client.scan_iter(match=f"{self.settings.prefix}:snap:*", count=500):
            batch.append(key)
            if len(batch) >= 500:
                n += await self._load(client, batch)
                batch = []
        if batch:
            n += await self._load(client, batch)
        return n

    async def _load(self, client: aioredis.Redis, keys: list[bytes]) -> int:
        values = await client.mget(keys)
        for i, v in enumerate(values):
            if isinstance(v, bytes):
                self.ingest(v)
            if i % 100 == 99:
                await asyncio.sleep(0)  # let requests in: decoding 500 snapshots takes ~10 ms
        return len(values)

    async def _follow(self) -> None:
        backoff = 0.2
        first = True
        while True:
            client = redis_client(self.settings)
            pubsub = client.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(self.settings.channel)
                # Subscribe first, then load: nothing published in between is lost.
                n = await self.resync(client)
                self.metrics.redis_connected.set(1)
                if not first:
                    self.metrics.redis_reconnects.inc()
                first = False
                self.connected.set()
                log.info("fleet feed: following %s (%d snapshots loaded)", self.settings.channel, n)
                backoff = 0.2
                await self._listen(client, pubsub)
            except asyncio.CancelledError:
                raise
            except (RedisError, OSError) as exc:
                if self.connected.is_set():
                    log.warning("fleet feed: Redis connection lost (%s); retrying", exc)
                self.connected.clear()
                self.metrics.redis_connected.set(0)
            finally:
                with contextlib.suppress(Exception):
                    await pubsub.aclose()
                with contextlib.suppress(Exception):
                    await client.aclose()
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 5.0)

    async def _listen(self, client: aioredis.Redis, pubsub: aioredis.client.PubSub) -> None:
        loop = asyncio.get_running_loop()
        next_resync = loop.time() + self.settings.resync_interval_s
        while True:
            timeout = max(0.0, next_resync - loop.time())
            msg = await pubsub.get_message(timeout=min(timeout, 1.0))
            if msg is not None and msg.get("type") == "message":
                data = msg.get("data")
                if isinstance(data, bytes):
                    self.ingest(data)
                else:
                    self.metrics.snapshots.labels(outcome="rejected", reason="undecodable").inc()
            if loop.time() >= next_resync:
                await self.resync(client)
                next_resync = loop.time() + self.settings.resync_interval_s

    # -- derived tables ----------------------------------------------------------------------------
    async def _maintain(self) -> None:
        loop = asyncio.get_running_loop()
        last = 0.0
        while True:
            await asyncio.sleep(REBUILD_EVERY_S)
            now = loop.time()
            if self.view.dirty or now - last >= EXPIRY_TICK_S:
                self.view.rebuild()
                last = now
                self._export()

    def _export(self) -> None:
        now = self.view.clock()
        for state, n in self.view.counts.items():
            self.metrics.fleet_instances.labels(state=state).set(n)
        # The view counts on the request path with a plain int; the counter catches up here.
        decisions = self.view.stale_ready_decisions
        if decisions > self._stale_ready_seen:
            self.metrics.stale_ready.inc(decisions - self._stale_ready_seen)
        self._stale_ready_seen = decisions
        ages = self.metrics.snapshot_age
        held = self.view.instances()
        for uid, inst in held.items():
            ages.labels(upstream=uid).set(max(0.0, now - inst.published_at))
        for uid in self._exported - held.keys():  # forget series of instances the view dropped
            ages.remove(uid)
        self._exported = set(held)
