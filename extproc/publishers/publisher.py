"""`llm-extproc publish`: scrape each engine's /metrics on an interval and publish normalised
snapshots to Redis (SET with TTL + PUBLISH), for any number of service replicas to follow.

Instances come from a config file or from Envoy's admin API (clusters that carry `llm-extproc`
filter metadata in envoy.yaml), so envoy.yaml can stay the single source of truth.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from extproc.fleet import snapshot_pb2 as spb
from extproc.fleet.pool import parse_endpoint
from extproc.fleet.redis_feed import redis_client
from extproc.publishers.engines import ENGINE_METRICS, EngineLoad, normalize
from extproc.settings import (
    DEFAULT_DISCOVERY_INTERVAL_S,
    DEFAULT_PUBLISH_INTERVAL_S,
    DEFAULT_SCRAPE_TIMEOUT_S,
    ENV_REDIS_PASSWORD,
    MAX_TTL_MS,
    MIN_TTL_MS,
    ConfigError,
    RedisSettings,
    check_keys,
    mapping,
    number,
    redis_settings,
    string_list,
)

log = logging.getLogger("extproc.publisher")

METADATA_NAMESPACE = "llm-extproc"


@dataclass(slots=True)
class InstanceSpec:
    cluster: str
    address: str
    engine: str = "vllm"
    models: tuple[str, ...] = ()
    capacity_weight: float = 1.0
    draining: bool = False
    metrics_path: str = "/metrics"
    health_path: str = "/health"

    @property
    def upstream_id(self) -> str:
        return f"{self.cluster}/{self.address}"

    def url(self, path: str) -> str:
        return f"http://{self.address}{path}"


@dataclass(slots=True)
class PublisherConfig:
    redis: RedisSettings
    instances: list[InstanceSpec] = field(default_factory=list)
    envoy_admin: str | None = None
    interval_s: float = DEFAULT_PUBLISH_INTERVAL_S
    ttl_s: float | None = None
    discovery_interval_s: float = DEFAULT_DISCOVERY_INTERVAL_S
    scrape_timeout_s: float = DEFAULT_SCRAPE_TIMEOUT_S
    publisher_id: str = field(default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}")

    @property
    def ttl_ms(self) -> int:
        return int((self.ttl_s if self.ttl_s is not None else max(3 * self.interval_s, 2.0)) * 1000)


@dataclass(slots=True)
class _Previous:
    ready_seen: bool = False
    ttft: tuple[float, float] | None = None
    tpot: tuple[float, float] | None = None
    prefix: tuple[float, float] | None = None


def instance_from_dict(raw: dict[str, Any]) -> InstanceSpec:
    if (
        not isinstance(raw, dict)
        or not isinstance(raw.get("cluster"), str)
        or not isinstance(raw.get("address"), str)
    ):
        raise ConfigError("publisher: each instance needs string 'cluster' and 'address' (ip:port)")
    check_keys(raw, InstanceSpec.__dataclass_fields__, f"publisher: instance {raw['address']}")
    try:
        parse_endpoint(raw["address"])
    except ValueError as exc:
        raise ConfigError(f"publisher: {exc}") from None
    engine = raw.get("engine", "vllm")
    if engine not in ENGINE_METRICS:
        raise ConfigError(f"publisher: unknown engine '{engine}' (known: {sorted(ENGINE_METRICS)})")
    models = string_list(raw.get("models", []), "publisher: 'models'")
    weight = number(raw.get("capacity_weight", 1.0), "publisher: 'capacity_weight'", positive=True)
    return InstanceSpec(
        cluster=raw["cluster"],
        address=raw["address"],
        engine=engine,
        models=tuple(models),
        capacity_weight=weight,
        draining=bool(raw.get("draining", False)),
        metrics_path=str(raw.get("metrics_path", "/metrics")),
        health_path=str(raw.get("health_path", "/health")),
    )


# Bounds of the publisher's timing settings (readers reject snapshots whose TTL is out of range:
# fail here, not silently there).
_TIMINGS = (
    ("interval_s", 0.01, 3600.0),
    ("ttl_s", MIN_TTL_MS / 1000, MAX_TTL_MS / 1000),
    ("discovery_interval_s", 0.1, 86400.0),
    ("scrape_timeout_s", 0.01, 600.0),
)


def load_publisher_config(path: str | None, **overrides: Any) -> PublisherConfig:
    raw: dict[str, Any] = {}
    if path:
        raw = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: top level must be a mapping")
    raw.update({k: v for k, v in overrides.items() if v is not None})
    redis_raw = dict(mapping(raw.pop("redis", None), "publisher: 'redis'"))
    for key in ("url", "pool", "key_prefix", "username", "password"):
        if f"redis_{key}" in raw:
            redis_raw[key] = raw.pop(f"redis_{key}")
    redis = redis_settings(redis_raw, "publisher: 'redis'", password_env=ENV_REDIS_PASSWORD)
    instances = [instance_from_dict(i) for i in raw.pop("instances", []) or []]
    check_keys(raw, set(PublisherConfig.__dataclass_fields__) - {"redis", "instances"}, "publisher")
    for key, low, high in _TIMINGS:
        if raw.get(key) is not None:
            raw[key] = number(raw[key], f"publisher: '{key}'", minimum=low, maximum=high)
    cfg = PublisherConfig(redis=redis, instances=instances, **raw)
    if not cfg.instances and not cfg.envoy_admin:
        raise ConfigError("publisher: give 'instances' or 'envoy_admin' (Envoy admin URL for discovery)")
    return cfg


class Publisher:
    def __init__(self, config: PublisherConfig) -> None:
        self.config = config
        self.instances: list[InstanceSpec] = list(config.instances)
        self.sequence = int(time.time() * 1000)  # increasing across restarts of this publisher id
        self._prev: dict[str, _Previous] = {}
        self.published = 0

    async def run(self, stop: asyncio.Event | None = None) -> None:
        stop = stop or asyncio.Event()
        client = redis_client(self.config.redis)
        timeout = aiohttp.ClientTimeout(total=self.config.scrape_timeout_s)
        loop = asyncio.get_running_loop()
        next_discovery = 0.0
        try:
            async with aiohttp.ClientSession(timeout=timeout) as session:
                while not stop.is_set():
                    started = loop.time()
                    if self.config.envoy_admin and started >= next_discovery:
                        with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError, ValueError):
                            self.instances = await discover_from_envoy(session, self.config.envoy_admin)
                        next_discovery = started + self.config.discovery_interval_s
                    await self.tick(session, client)
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(
                            stop.wait(), max(0.0, self.config.interval_s - (loop.time() - started))
                        )
        finally:
            await client.aclose()

    async def tick(self, session: aiohttp.ClientSession, client: Any) -> list[spb.UpstreamSnapshot]:
        snaps = await asyncio.gather(*(self.scrape(session, spec) for spec in self.instances))
        try:
            async with client.pipeline(transaction=False) as pipe:
                for snap in snaps:
                    data = snap.SerializeToString()
                    pipe.set(self.config.redis.key(snap.upstream_id), data, px=snap.ttl_ms)
                    pipe.publish(self.config.redis.channel, data)
                await pipe.execute()
            self.published += len(snaps)
        except Exception as exc:  # Redis down: keep scraping; the next tick retries
            log.warning("publish failed: %s", exc)
        return list(snaps)

    async def scrape(self, session: aiohttp.ClientSession, spec: InstanceSpec) -> spb.UpstreamSnapshot:
        prev = self._prev.setdefault(spec.upstream_id, _Previous())
        health: int | None = None
        load: EngineLoad | None = None
        try:
            async with session.get(spec.url(spec.health_path)) as r:
                health = r.status
                await r.read()
            async with session.get(spec.url(spec.metrics_path)) as r:
                if r.status == 200:
                    load = normalize(spec.engine, await r.text())
        except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
            log.debug("scrape %s failed: %s", spec.upstream_id, exc)
        return self.snapshot(spec, health, load, prev)

    def snapshot(
        self, spec: InstanceSpec, health: int | None, load: EngineLoad | None, prev: _Previous
    ) -> spb.UpstreamSnapshot:
        if health is None:
            readiness = spb.DOWN
        elif spec.draining:
            readiness = spb.DRAINING
        elif health == 200 and load is not None:
            readiness = spb.READY
        else:
            readiness = spb.DRAINING if prev.ready_seen and health != 200 else spb.WARMING_UP
        prev.ready_seen = prev.ready_seen or readiness == spb.READY
        self.sequence += 1
        snap = spb.UpstreamSnapshot(
            upstream_id=spec.upstream_id,
            cluster=spec.cluster,
            address=spec.address,
            engine=spec.engine,
            models=list(spec.models or (load.models if load else [])),
            readiness=readiness,
            capacity_weight=spec.capacity_weight,
            publisher_id=self.config.publisher_id,
            sequence=self.sequence,
            published_at_ms=int(time.time() * 1000),
            ttl_ms=self.config.ttl_ms,
        )
        if load is not None:
            _fill_load(snap, load, prev)
        return snap


def _fill_load(snap: spb.UpstreamSnapshot, load: EngineLoad, prev: _Previous) -> None:
    snap.num_running = _count(load.num_running)
    snap.num_waiting = _count(load.num_waiting)
    if load.kv_cache_usage is not None:
        snap.kv_cache_usage = max(0.0, load.kv_cache_usage)
    elif load.kv_blocks_total and load.kv_blocks_free is not None:
        snap.kv_cache_usage = 1.0 - load.kv_blocks_free / load.kv_blocks_total
    if load.kv_blocks_total:
        snap.kv_blocks_total = load.kv_blocks_total
        free = load.kv_blocks_free
        if free is None and load.kv_cache_usage is not None:
            free = round(load.kv_blocks_total * (1.0 - min(1.0, load.kv_cache_usage)))
        snap.kv_blocks_free = min(free or 0, load.kv_blocks_total)
    snap.block_size = _count(load.block_size)
    snap.max_model_len = _count(load.max_model_len)
    if load.gpu_utilization is not None:
        snap.gpu_utilization = load.gpu_utilization
    ttft, prev.ttft = _interval_mean(load.ttft_sum, load.ttft_count, prev.ttft)
    if ttft is not None:
        snap.ttft_seconds = ttft
    tpot, prev.tpot = _interval_mean(load.tpot_sum, load.tpot_count, prev.tpot)
    if tpot is not None:
        snap.tpot_seconds = tpot
    rate, prev.prefix = _interval_mean(load.prefix_cache_hits, load.prefix_cache_queries, prev.prefix)
    if rate is None:
        rate = load.prefix_cache_hit_rate
    if rate is not None:
        snap.prefix_cache_hit_rate = min(1.0, max(0.0, rate))


def _count(v: float | int | None) -> int:
    return max(0, min(int(v), 1_000_000)) if v is not None else 0


def _interval_mean(
    total: float | None, count: float | None, prev: tuple[float, float] | None
) -> tuple[float | None, tuple[float, float] | None]:
    """Mean over the last interval from cumulative (sum, count); None until two scrapes or no change."""
    if total is None or count is None:
        return None, prev
    now = (total, count)
    if prev is None or count < prev[1]:  # first scrape, or the engine restarted
        return None, now
    dc = count - prev[1]
    return ((total - prev[0]) / dc if dc > 0 else None), now


async def discover_from_envoy(session: aiohttp.ClientSession, admin: str) -> list[InstanceSpec]:
    """Instances of every Envoy cluster tagged with `llm-extproc` filter metadata, with current hosts."""
    async with session.get(f"{admin}/config_dump", params={"resource": "static_clusters"}) as r:
        dump = await r.json(content_type=None)
    async with session.get(f"{admin}/config_dump", params={"resource": "dynamic_active_clusters"}) as r:
        dynamic = await r.json(content_type=None) if r.status == 200 else {"configs": []}
    tagged: dict[str, dict[str, Any]] = {}
    for entry in dump.get("configs", []) + dynamic.get("configs", []):
        cluster = entry.get("cluster", {})
        meta = cluster.get("metadata", {}).get("filter_metadata", {}).get(METADATA_NAMESPACE)
        if isinstance(meta, dict) and isinstance(cluster.get("name"), str):
            tagged[cluster["name"]] = meta
    async with session.get(f"{admin}/clusters", params={"format": "json"}) as r:
        status = await r.json(content_type=None)
    out: list[InstanceSpec] = []
    for cs in status.get("cluster_statuses", []):
        meta = tagged.get(cs.get("name"))
        if meta is None:
            continue
        for host in cs.get("host_statuses", []):
            sock = host.get("address", {}).get("socket_address", {})
            if "address" not in sock or "port_value" not in sock:
                continue
            eds = host.get("health_status", {}).get("eds_health_status")
            try:
                out.append(
                    instance_from_dict(
                        {
                            **{
                                k: meta[k]
                                for k in (
                                    "engine",
                                    "models",
                                    "capacity_weight",
                                    "metrics_path",
                                    "health_path",
                                )
                                if k in meta
                            },
                            "cluster": cs["name"],
                            "address": f"{sock['address']}:{sock['port_value']}",
                            "draining": eds == "DRAINING",
                        }
                    )
                )
            except ValueError as exc:
                log.warning("envoy discovery: skipping a host of %s: %s", cs.get("name"), exc)
    return out
