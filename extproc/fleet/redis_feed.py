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
import random
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeAlias

import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool

from extproc.fleet.snapshots import SnapshotRejected, decode
from extproc.fleet.view import FleetView
from extproc.settings import (
    EXPIRY_TICK_S,
    REBUILD_EVERY_S,
    REDIS_CONNECT_TIMEOUT_S,
    REDIS_SOCKET_TIMEOUT_S,
    RedisSettings,
    RedisTopology,
    redis_topology,
)
from extproc.telemetry import Metrics
from extproc.telemetry.supervision import supervised

log = logging.getLogger("extproc.fleet")


RedisClient: TypeAlias = aioredis.Redis | RedisCluster
"""What `redis_client` returns: one server or a Sentinel-followed master (`Redis`), or a `RedisCluster`.
Both offer what the service and the publisher use (GET/SET/MGET/SCAN/PUBLISH, pipelines, pubsub,
aclose), except that a Cluster's pipelines refuse PUBLISH: use `write_and_publish`."""


def _client_kwargs(settings: RedisSettings, topology: RedisTopology) -> dict[str, Any]:
    kwargs: dict[str, Any] = {
        "socket_timeout": REDIS_SOCKET_TIMEOUT_S,
        "socket_connect_timeout": REDIS_CONNECT_TIMEOUT_S,
    }
    username = settings.username or topology.username
    password = settings.password or topology.password
    if username:
        kwargs["username"] = username
    if password:
        kwargs["password"] = password
    if topology.kind == "standalone":
        if settings.tls_ca_file:
            kwargs["ssl_ca_certs"] = settings.tls_ca_file
    elif topology.tls:
        kwargs["ssl"] = True
        if settings.tls_ca_file:
            kwargs["ssl_ca_certs"] = settings.tls_ca_file
    return kwargs


class _SentinelPool(SentinelConnectionPool):
    """Closes the Sentinel connections with the master's: a client made per reconnect leaks none."""

    async def disconnect(self, inuse_connections: bool = True) -> None:
        await super().disconnect(inuse_connections)
        for sentinel in self.sentinel_manager.sentinels:
            with contextlib.suppress(Exception):
                await sentinel.aclose()


def _sentinel_master(settings: RedisSettings, topology: RedisTopology) -> aioredis.Redis:
    kwargs = _client_kwargs(settings, topology)
    own: dict[str, Any] = {k: kwargs[k] for k in ("socket_timeout", "socket_connect_timeout")}
    if settings.sentinel_username:
        own["username"] = settings.sentinel_username
    if settings.sentinel_password:
        own["password"] = settings.sentinel_password
    if topology.tls if settings.sentinel_tls is None else settings.sentinel_tls:
        own["ssl"] = True
        if settings.tls_ca_file:
            own["ssl_ca_certs"] = settings.tls_ca_file
    sentinel = Sentinel(list(topology.nodes), sentinel_kwargs=own)
    assert topology.master_name is not None  # redis_topology checked it
    # Every new connection asks the Sentinels for the current master, so a failover is followed by
    # reconnecting; check_connection PINGs first, so a demoted master is not kept.
    client: aioredis.Redis = sentinel.master_for(
        topology.master_name,
        connection_pool_class=_SentinelPool,
        db=topology.db,
        check_connection=True,
        **kwargs,
    )
    return client


class _FleetCluster(RedisCluster):
    """A RedisCluster whose `pubsub()` works like the other topologies' (redis-py's ClusterPubSub
    fails to SUBSCRIBE before the slot map is loaded): a plain connection to a live node, which
    classic PUBLISH reaches from anywhere in the cluster."""

    fleet_settings: RedisSettings

    def pubsub(self, *_args: Any, **kwargs: Any) -> aioredis.client.PubSub:  # type: ignore[override]
        return redis_pubsub_client(self.fleet_settings).pubsub(**kwargs)


def redis_client(settings: RedisSettings) -> RedisClient:
    """A client for the fleet's Redis in its topology (one server, Sentinel or Cluster); the socket
    timeouts keep a hung Redis from pinning a task. For SUBSCRIBE use `redis_pubsub_client`."""
    topology = redis_topology(settings)
    kwargs = _client_kwargs(settings, topology)
    if topology.kind == "sentinel":
        return _sentinel_master(settings, topology)
    if topology.kind == "cluster":
        nodes = [ClusterNode(host, port) for host, port in topology.nodes]
        cluster = _FleetCluster(startup_nodes=nodes, **kwargs)
        cluster.fleet_settings = settings
        return cluster
    return aioredis.from_url(settings.url, **kwargs)


class _FirstReachableConnection(aioredis.Connection):
    """Connects to the first of several nodes that answers, starting after the one used last, so a
    subscriber whose node died moves on to a live one on its next connect."""

    def __init__(self, *, nodes: tuple[tuple[str, int], ...], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._nodes = nodes
        self._next = random.randrange(len(nodes))

    async def _connect(self) -> None:
        error: BaseException | None = None
        for _ in range(len(self._nodes)):
            self.host, self.port = self._nodes[self._next]
            self._next = (self._next + 1) % len(self._nodes)
            try:
                await super()._connect()
                return
            except (OSError, TimeoutError) as exc:
                error = exc
        assert error is not None
        raise error


class _FirstReachableSSLConnection(_FirstReachableConnection, aioredis.SSLConnection):
    pass


def redis_pubsub_client(settings: RedisSettings) -> aioredis.Redis:
    """A client whose `.pubsub()` follows the fleet's channels in every topology.

    One server and Sentinel: the same client as `redis_client` (Sentinel: the current master).
    Cluster: classic PUBLISH reaches every node of a cluster, so a plain connection to any live
    node can SUBSCRIBE; this one tries the seed nodes in turn (list several in the URL)."""
    topology = redis_topology(settings)
    if topology.kind == "sentinel":
        return _sentinel_master(settings, topology)
    if topology.kind == "cluster":
        kwargs = _client_kwargs(settings, topology)
        if kwargs.pop("ssl", False):
            kwargs["connection_class"] = _FirstReachableSSLConnection
        else:
            kwargs["connection_class"] = _FirstReachableConnection
        host, port = topology.nodes[0]
        pool = aioredis.ConnectionPool(host=host, port=port, nodes=topology.nodes, **kwargs)
        return aioredis.Redis.from_pool(pool)
    return aioredis.from_url(settings.url, **_client_kwargs(settings, topology))


def is_cluster(client: RedisClient) -> bool:
    return isinstance(client, RedisCluster)


async def write_and_publish(
    client: RedisClient,
    messages: Sequence[tuple[str, bytes | str]],
    snapshot: tuple[str, bytes, int] | None = None,
) -> list[int] | None:
    """SET `snapshot` (key, value, TTL ms) if given, then PUBLISH each (channel, message).

    One pipelined round trip on one server or Sentinel's master; returns each PUBLISH's receiver
    count. A Cluster's pipelines refuse PUBLISH, so there the SET goes first and the PUBLISHes follow
    concurrently (classic PUBLISH reaches subscribers on every node); returns None, because a
    cluster node counts only its own subscribers."""
    if isinstance(client, RedisCluster):
        if snapshot is not None:
            await client.set(snapshot[0], snapshot[1], px=snapshot[2])
        await asyncio.gather(*(client.publish(channel, data) for channel, data in messages))
        return None
    async with client.pipeline(transaction=False) as pipe:
        if snapshot is not None:
            pipe.set(snapshot[0], snapshot[1], px=snapshot[2])
        for channel, data in messages:
            pipe.publish(channel, data)
        results = await pipe.execute()
    return [int(r) for r in results[1 if snapshot is not None else 0 :]]


FOLLOW_BACKOFF_S = (0.1, 1.0)
"""Reconnect delays of a followed channel: doubling from the first to the second. Capped at 1 s (a
retry a second costs Redis nothing): after a restart, a Sentinel failover or a Cluster master's
replacement each follower is subscribed again about a second after Redis is back."""


async def follow_channel(
    settings: RedisSettings,
    channel: str,
    on_message: Callable[[Any], object],
    *,
    on_subscribed: Callable[[RedisClient], Awaitable[object]] | None = None,
    on_poll: Callable[[RedisClient], Awaitable[object]] | None = None,
    poll_s: float = 1.0,
    on_lost: Callable[[Exception], None] | None = None,
    connected: asyncio.Event | None = None,
    running: Callable[[], bool] = lambda: True,
) -> None:
    """Follow `channel` until cancelled (or `running()` turns false between connections).

    Subscribe first, then `on_subscribed(client)` loads what was written before, so nothing
    published in between is lost; then every message's data goes to `on_message`, and `on_poll(client)`
    runs after each wait of at most `poll_s`. Any failure (`on_lost` hears of it; `connected` is
    cleared) closes both connections, waits `FOLLOW_BACKOFF_S`, and starts over."""
    delay = FOLLOW_BACKOFF_S[0]
    while running():
        client = redis_client(settings)
        subscriber = redis_pubsub_client(settings)
        pubsub = subscriber.pubsub(ignore_subscribe_messages=True)
        try:
            await pubsub.subscribe(channel)
            if on_subscribed is not None:
                await on_subscribed(client)
            if connected is not None:
                connected.set()
            delay = FOLLOW_BACKOFF_S[0]
            while True:
                msg = await pubsub.get_message(timeout=poll_s)
                if msg is not None and msg.get("type") == "message":
                    on_message(msg.get("data"))
                if on_poll is not None:
                    await on_poll(client)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if on_lost is not None:
                on_lost(exc)
        finally:
            if connected is not None:
                connected.clear()
            for closing in (pubsub, subscriber, client):
                with contextlib.suppress(Exception):
                    await closing.aclose()
        await asyncio.sleep(delay)
        delay = min(delay * 2, FOLLOW_BACKOFF_S[1])


async def cancel_until_done(tasks: Sequence[asyncio.Task[None]]) -> None:
    """Cancel `tasks` and wait until every one has ended, cancelling again while any is left: a
    cancellation that arrives while redis-py connects or reads can be lost (seen with redis-py 8.1:
    a relay task stayed "cancelling" in a new read, and the service's shutdown waited forever)."""
    pending = {t for t in tasks if not t.done()}
    while pending:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=0.5)
    for task in tasks:
        if not task.cancelled():
            with contextlib.suppress(Exception):
                task.exception()


class RedisFeed:
    def __init__(self, settings: RedisSettings, view: FleetView, metrics: Metrics) -> None:
        self.settings = settings
        self.view = view
        self.metrics = metrics
        self._tasks: list[asyncio.Task[None]] = []
        self._exported: set[str] = set()
        # upstream -> the source and child of its llm_extproc_batch_limit series (one at a time)
        self._limit_series: dict[str, tuple[str, Any]] = {}
        self._stale_ready_seen = 0  # view.stale_ready_decisions already added to the counter
        self.connected = asyncio.Event()

    def start(self) -> None:
        self._tasks = [
            asyncio.create_task(supervised("fleet-redis", self._follow), name="fleet-redis"),
            asyncio.create_task(supervised("fleet-rebuild", self._maintain), name="fleet-rebuild"),
        ]

    async def stop(self) -> None:
        await cancel_until_done(self._tasks)

    # -- ingestion ---------------------------------------------------------------------------------
    def ingest(self, data: bytes) -> None:
        try:
            state = decode(data, self.view.known_clusters)
        except SnapshotRejected as exc:
            self.metrics.snapshots.labels(outcome="rejected", reason=exc.reason).inc()
            return
        outcome = "accepted" if self.view.apply(state) else "outdated"
        self.metrics.snapshots.labels(outcome=outcome, reason="").inc()

    async def resync(self, client: RedisClient) -> int:
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

    async def _load(self, client: RedisClient, keys: list[bytes]) -> int:
        values = await client.mget(keys)
        for i, v in enumerate(values):
            if isinstance(v, bytes):
                self.ingest(v)
            if i % 100 == 99:
                await asyncio.sleep(0)  # let requests in: a fleet's snapshots in one go would hold the loop
        return len(values)

    async def _follow(self) -> None:
        loop = asyncio.get_running_loop()
        next_resync = 0.0
        reconnecting = False

        async def subscribed(client: RedisClient) -> None:
            nonlocal next_resync, reconnecting
            n = await self.resync(client)
            next_resync = loop.time() + self.settings.resync_interval_s
            self.metrics.redis_connected.set(1)
            if reconnecting:
                self.metrics.redis_reconnects.inc()
            reconnecting = True
            log.info("fleet feed: following %s (%d snapshots loaded)", self.settings.channel, n)

        async def poll(client: RedisClient) -> None:
            nonlocal next_resync
            if loop.time() >= next_resync:
                await self.resync(client)
                next_resync = loop.time() + self.settings.resync_interval_s

        def lost(exc: Exception) -> None:
            if self.connected.is_set():
                log.warning("fleet feed: Redis connection lost (%s); retrying", exc)
            self.metrics.redis_connected.set(0)

        await follow_channel(
            self.settings,
            self.settings.channel,
            self._message,
            on_subscribed=subscribed,
            on_poll=poll,
            poll_s=min(1.0, self.settings.resync_interval_s),
            on_lost=lost,
            connected=self.connected,
        )

    def _message(self, data: Any) -> None:
        if isinstance(data, bytes):
            self.ingest(data)
        else:
            self.metrics.snapshots.labels(outcome="rejected", reason="undecodable").inc()

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
        # Per upstream (an instance, or a cluster in cluster mode): one series, labelled by its source.
        limits, series = self.metrics.batch_limit, self._limit_series
        upstreams = self.view.loads_by_id()
        for uid in upstreams:
            limit, source = self.view.batches.source(uid)
            held_series = series.get(uid)
            if held_series is None or held_series[0] != source:
                if held_series is not None:
                    limits.remove(uid, held_series[0])
                held_series = series[uid] = (source, limits.labels(uid, source))
            held_series[1].set(limit or 0.0)
        for uid in series.keys() - upstreams.keys():
            limits.remove(uid, series.pop(uid)[0])
