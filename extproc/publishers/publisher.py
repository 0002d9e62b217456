"""`llm-extproc publish`: scrape each engine's /metrics and publish normalised snapshots to Redis
(SET with TTL + PUBLISH), for any number of service replicas to follow.

Every instance has its own task, schedule and deadline: it is scraped and its snapshot written as soon
as that scrape ends, stamped when written. One engine that hangs, answers garbage or crashes the code
that reads it costs only its own snapshot (published DOWN, WARMING_UP or with fields left unknown) and
a counter; the others keep arriving fresh. Instances come from a config file or from Envoy's admin API
(clusters that carry `llm-extproc` filter metadata in envoy.yaml), so envoy.yaml can stay the single
source of truth; tasks start and stop as that set changes.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import os
import socket
import time
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import yaml

from extproc.fleet import snapshot_pb2 as spb
from extproc.fleet.gpus import MAX_GPU_NAME
from extproc.fleet.pool import parse_endpoint
from extproc.fleet.redis_feed import redis_client, write_and_publish
from extproc.fleet.snapshots import (
    MAX_BLOCK_SIZE,
    MAX_COUNTER,
    MAX_ID_LEN,
    MAX_KV_BLOCKS,
    MAX_KV_USAGE,
    MAX_LATENCY_S,
    MAX_LORA_SLOTS,
    MAX_MODEL_LEN,
    MAX_MODELS,
    MAX_QUEUE,
)
from extproc.publishers.engines import (
    ENGINE_METRICS,
    EngineLoad,
    GpuReading,
    ParseTimeout,
    normalize,
    normalize_dcgm,
)
from extproc.publishers.kv_events import KvEventsRelay, KvEventsSpec, kv_events_spec
from extproc.publishers.metrics import MetricsEndpoint, PublisherMetrics
from extproc.publishers.prefill_rate import PrefillRate
from extproc.settings import (
    DEFAULT_DISCOVERY_INTERVAL_S,
    DEFAULT_PUBLISH_INTERVAL_S,
    DEFAULT_SCRAPE_TIMEOUT_S,
    DISCOVERY_TIMEOUT_S,
    ENV_REDIS_PASSWORD,
    MAX_HEALTH_BYTES,
    MAX_METRICS_BYTES,
    MAX_TTL_MS,
    MIN_TTL_MS,
    PUBLISH_WRITE_TIMEOUT_S,
    SCRAPE_TIMEOUT_SHARE,
    ConfigError,
    RedisSettings,
    check_keys,
    listen_address,
    mapping,
    number,
    redis_settings,
    string_list,
)

log = logging.getLogger("extproc.publisher")

METADATA_NAMESPACE = "llm-extproc"
LOAD_FIELDS = ("num_running", "num_waiting", "kv_cache_usage")  # any one of them makes a load signal

# Largest /metrics (or DCGM) page read, by default. A vLLM page is ~100-300 KB; parsing 2 MiB of
# vLLM-like exposition takes ~0.6-1 s of one core here, which the scrape deadline still cuts short.
# 16 MiB (~6 s of parsing) let one engine's page outlast the snapshots' TTL. Configurable up to
# MAX_METRICS_BYTES (`max_metrics_bytes`); a page above the cap is a failed scrape, read no further.
DEFAULT_MAX_METRICS_BYTES = 2 * 1024 * 1024
MIN_METRICS_BYTES = 4096
# Threads that parse scrapes. Parsing runs off the event loop so the loop keeps scraping and writing
# the other instances on schedule; a few threads so one slow page does not queue every other parse
# behind it (they still share the GIL with the loop: the byte cap and the deadline bound them).
PARSE_WORKERS = 4
_T = TypeVar("_T")


@dataclass(slots=True)
class InstanceSpec:
    cluster: str
    address: str
    engine: str = "vllm"
    models: tuple[str, ...] = ()
    capacity_weight: float = 1.0
    draining: bool = False
    metrics_path: str = ""  # "" means the engine's own default (e.g. /prometheus/metrics for trtllm-serve)
    health_path: str = "/health"
    # An NVIDIA DCGM exporter that sees this instance's GPUs (e.g. "http://{host}:9400/metrics";
    # {host} is the instance's IP), and which of its GPUs are this instance's (`gpu` indices or UUIDs;
    # empty: all of them). "" : no GPU figures beyond what the engine itself publishes.
    dcgm_url: str = ""
    dcgm_gpus: tuple[str, ...] = ()
    # The GPU's name, e.g. "NVIDIA H100 80GB HBM3" or "A10G" (published as gpu_model: the service's
    # prefill-speed prior until the rate is measured, fleet/gpus.py). "": DCGM's modelName, if any.
    gpu: str = ""
    # The engine's KV-cache events (vLLM/SGLang ZMQ PUB): subscribed, mapped to the service's prefix
    # index blocks and published to Redis (publishers/kv_events.py). None: no events.
    kv_events: KvEventsSpec | None = None

    def __post_init__(self) -> None:
        if not self.metrics_path:
            row = ENGINE_METRICS.get(self.engine)
            self.metrics_path = row.metrics_path if row is not None else "/metrics"

    @property
    def upstream_id(self) -> str:
        return f"{self.cluster}/{self.address}"

    def url(self, path: str) -> str:
        return f"http://{self.address}{path}"

    def dcgm(self) -> str:
        """The DCGM exporter's URL with {host} filled in ("" when none is configured)."""
        host = self.address.rpartition(":")[0]
        return self.dcgm_url.replace("{host}", host)


@dataclass(slots=True)
class PublisherConfig:
    redis: RedisSettings
    instances: list[InstanceSpec] = field(default_factory=list)
    envoy_admin: str | None = None
    interval_s: float = DEFAULT_PUBLISH_INTERVAL_S
    ttl_s: float | None = None
    discovery_interval_s: float = DEFAULT_DISCOVERY_INTERVAL_S
    scrape_timeout_s: float | None = None  # None: derived from the interval (scrape_deadline_s)
    metrics_listen: str | None = None  # host:port for the publisher's own /metrics; None: off
    max_metrics_bytes: int = DEFAULT_MAX_METRICS_BYTES  # larger /metrics pages are failed scrapes
    publisher_id: str = field(default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}")

    @property
    def ttl_ms(self) -> int:
        return int((self.ttl_s if self.ttl_s is not None else max(3 * self.interval_s, 2.0)) * 1000)

    @property
    def scrape_deadline_s(self) -> float:
        """One instance's whole scrape (health + metrics + parsing) must end within this: inside one
        interval."""
        if self.scrape_timeout_s is not None:
            return self.scrape_timeout_s
        return min(DEFAULT_SCRAPE_TIMEOUT_S, SCRAPE_TIMEOUT_SHARE * self.interval_s)

    def check(self) -> None:
        """A scrape that may outlast the interval would make every snapshot of that instance late; a
        page cap beyond MAX_METRICS_BYTES would let one engine's page cost seconds of parsing."""
        cap = self.max_metrics_bytes
        if (
            isinstance(cap, bool)
            or not isinstance(cap, int)
            or not MIN_METRICS_BYTES <= cap <= MAX_METRICS_BYTES
        ):
            raise ConfigError(
                f"publisher: 'max_metrics_bytes' must be an integer number of bytes from "
                f"{MIN_METRICS_BYTES} to {MAX_METRICS_BYTES}, got {cap!r} "
                f"(default {DEFAULT_MAX_METRICS_BYTES}: 2 MiB)"
            )
        if self.scrape_timeout_s is not None and self.scrape_timeout_s >= self.interval_s:
            raise ConfigError(
                f"publisher: 'scrape_timeout_s' ({self.scrape_timeout_s:g}) must be below 'interval_s' "
                f"({self.interval_s:g}); leave it unset for min({DEFAULT_SCRAPE_TIMEOUT_S:g} s, "
                f"{SCRAPE_TIMEOUT_SHARE:g} x interval)"
            )


@dataclass(slots=True)
class _Previous:
    """What one instance's earlier scrapes left behind: readiness history and cumulative counters."""

    ready_seen: bool = False
    readiness: int | None = None  # the last published state, to log changes
    ttft: tuple[float, float] | None = None
    tpot: tuple[float, float] | None = None
    prefix: tuple[float, float] | None = None
    prefill: PrefillRate = field(default_factory=PrefillRate)


@dataclass(slots=True)
class ScrapeResult:
    """One scrape of one instance. `outcome` is a metric label; `detail` becomes readiness_reason;
    `message`, when set, is what an operator must read (logged once while the problem lasts)."""

    health: int | None = None
    load: EngineLoad | None = None
    outcome: str = "ok"
    detail: str = ""
    message: str = ""


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
    dcgm_url, dcgm_gpus = _dcgm_settings(raw)
    gpu = raw.get("gpu", "")
    if not isinstance(gpu, str) or len(gpu) > MAX_GPU_NAME or not gpu.isprintable():
        raise ConfigError(f"publisher: 'gpu' must be a GPU name of at most {MAX_GPU_NAME} characters")
    return InstanceSpec(
        cluster=raw["cluster"],
        address=raw["address"],
        engine=engine,
        models=tuple(models),
        capacity_weight=weight,
        draining=bool(raw.get("draining", False)),
        metrics_path=str(raw.get("metrics_path") or ENGINE_METRICS[engine].metrics_path),
        health_path=str(raw.get("health_path", "/health")),
        dcgm_url=dcgm_url,
        dcgm_gpus=dcgm_gpus,
        gpu=gpu,
        kv_events=kv_events_spec(raw.get("kv_events"), f"publisher: instance {raw['address']}"),
    )


def _dcgm_settings(raw: dict[str, Any]) -> tuple[str, tuple[str, ...]]:
    """`dcgm_url` (http(s)://..., "{host}" allowed) and `dcgm_gpus` (GPU indices or UUIDs)."""
    where = f"publisher: instance {raw['address']}"
    url = raw.get("dcgm_url") or ""
    if not isinstance(url, str) or (url and not url.startswith(("http://", "https://"))):
        raise ConfigError(f"{where}: 'dcgm_url' must be an http:// or https:// URL")
    gpus = raw.get("dcgm_gpus", [])
    if not isinstance(gpus, list) or not all(
        isinstance(g, str | int) and not isinstance(g, bool) for g in gpus
    ):
        raise ConfigError(f"{where}: 'dcgm_gpus' must be a list of GPU indices or UUIDs")
    return url, tuple(str(g) for g in gpus)


# Bounds of the publisher's timing settings (readers reject snapshots whose TTL is out of range:
# fail here, not silently there).
_TIMINGS = (
    ("interval_s", 0.01, 3600.0),
    ("ttl_s", MIN_TTL_MS / 1000, MAX_TTL_MS / 1000),
    ("discovery_interval_s", 0.1, 86400.0),
    ("scrape_timeout_s", 0.005, 600.0),
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
    if raw.get("metrics_listen") is not None:
        raw["metrics_listen"] = listen_address(raw["metrics_listen"], "publisher: 'metrics_listen'")
    cfg = PublisherConfig(redis=redis, instances=instances, **raw)
    if not cfg.instances and not cfg.envoy_admin:
        raise ConfigError("publisher: give 'instances' or 'envoy_admin' (Envoy admin URL for discovery)")
    cfg.check()
    return cfg


class Publisher:
    """Runs one scrape-and-publish task per instance; `instances` may change while it runs (Envoy
    discovery replaces it, callers may append) and tasks follow within one interval."""

    def __init__(self, config: PublisherConfig, metrics: PublisherMetrics | None = None) -> None:
        config.check()
        self.config = config
        self.instances: list[InstanceSpec] = list(config.instances)
        self.sequence = int(time.time() * 1000)  # increasing across restarts of this publisher id
        self.metrics = metrics or PublisherMetrics()
        self.published = 0
        self.metrics_port: int | None = None  # where /metrics listens once run() started it
        self._prev: dict[str, _Previous] = {}
        self._specs: dict[str, InstanceSpec] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._retiring: set[asyncio.Task[None]] = set()
        self._stopping = False
        self._failing: set[str] = set()  # instances whose last cycle raised (log once, not per tick)
        self._problems: dict[str, str] = {}  # instance -> the scrape problem last logged (once each)
        self._parser: ThreadPoolExecutor | None = None  # parse threads, created on first use
        self._redis_ok = True
        self.kv_events: KvEventsRelay | None = None  # per-instance KV-event subscriptions, while running
        self._discovery_ok = True
        self._discovered = False

    def ready_instances(self) -> int:
        """Instances whose last published snapshot said READY (for launchers waiting on a fleet)."""
        return sum(prev.readiness == spb.READY for prev in self._prev.values())

    # -- supervision -------------------------------------------------------------------------------
    async def run(self, stop: asyncio.Event | None = None) -> None:
        stop = stop or asyncio.Event()
        self._stopping = False
        endpoint = (
            MetricsEndpoint(self.metrics, self.config.metrics_listen) if self.config.metrics_listen else None
        )
        self.metrics_port = endpoint.port if endpoint is not None else None
        client = redis_client(self.config.redis)
        self.kv_events = KvEventsRelay(self.config.redis, client, self.metrics)
        loop = asyncio.get_running_loop()
        next_discovery = 0.0
        self._announce(endpoint)
        # No session-wide timeout: each scrape has its own deadline (scrape_deadline_s).
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.config.scrape_deadline_s)
        try:
            async with aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0), timeout=timeout
            ) as session:
                while not stop.is_set():
                    if self.config.envoy_admin and loop.time() >= next_discovery:
                        await self._discover(session, self.config.envoy_admin)
                        next_discovery = loop.time() + self.config.discovery_interval_s
                    self._reconcile(session, client)
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stop.wait(), self.config.interval_s)
                await self._stop_tasks()
        finally:
            await self._stop_tasks()
            if self.kv_events is not None:
                await self.kv_events.stop()
            await client.aclose()
            if endpoint is not None:
                endpoint.close()
            if self._parser is not None:  # a parse still running stops itself at its deadline
                self._parser.shutdown(wait=False, cancel_futures=True)
                self._parser = None

    async def _discover(self, session: aiohttp.ClientSession, admin: str) -> None:
        """Replace `instances` from Envoy; on any failure keep the last known set."""
        try:
            async with asyncio.timeout(DISCOVERY_TIMEOUT_S):
                found = await discover_from_envoy(session, admin)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.warning(
                "envoy discovery from %s failed (keeping %d instances; retrying every %g s): %s",
                admin,
                len(self.instances),
                self.config.discovery_interval_s,
                str(exc) or type(exc).__name__,
                extra={"envoy_admin": admin},
            )
            self._discovery_ok = False
            return
        if not self._discovery_ok:
            log.info("envoy discovery from %s works again", admin)
        self._discovery_ok = True
        before = {s.upstream_id for s in self.instances}
        after = {s.upstream_id for s in found}
        self.instances = found
        if not found and (before or not self._discovered):
            log.warning(
                "envoy discovery: no cluster at %s carries `llm-extproc` filter metadata (engine, models): "
                "nothing to scrape; tag the GPU clusters in envoy.yaml",
                admin,
            )
        elif after != before:
            added = [s for s in found if s.upstream_id not in before]
            log.info(
                "envoy discovery: %d instances%s%s",
                len(found),
                f"; added {_describe(added)}" if added else "",
                f"; removed {', '.join(sorted(before - after))}" if before - after else "",
                extra={"instances": sorted(after)},
            )
        self._discovered = True

    def _announce(self, endpoint: MetricsEndpoint | None) -> None:
        """What this publisher will do, logged once at start (it is otherwise silent while all is well)."""
        cfg = self.config
        source = (
            f"instances from Envoy admin {cfg.envoy_admin} (every {cfg.discovery_interval_s:g} s)"
            if cfg.envoy_admin
            else f"{len(self.instances)} configured instances: {_describe(self.instances)}"
        )
        log.info(
            "publishing to %s (keys %s:snap:*) every %g s, scrape deadline %g s, ttl %g s, "
            "metrics pages up to %d bytes; %s; own metrics %s",
            cfg.redis.url.split("@")[-1],
            cfg.redis.prefix,
            cfg.interval_s,
            cfg.scrape_deadline_s,
            cfg.ttl_ms / 1000,
            cfg.max_metrics_bytes,
            source,
            f"on port {endpoint.port}" if endpoint is not None else "off",
            extra={"pool": cfg.redis.pool, "interval_s": cfg.interval_s},
        )

    def _reconcile(self, session: aiohttp.ClientSession, client: Any) -> None:
        """One task per listed instance: start the new, stop the gone, restart any that ended."""
        self._specs = {spec.upstream_id: spec for spec in self.instances}
        for uid, task in list(self._tasks.items()):
            if uid in self._specs and not task.done():
                continue
            del self._tasks[uid]
            self._retire(task)
            if uid not in self._specs:
                self._prev.pop(uid, None)
                self._failing.discard(uid)
                self._problems.pop(uid, None)
                self.metrics.forget(uid)
        for uid in self._specs:
            if uid not in self._tasks:
                self._tasks[uid] = asyncio.create_task(
                    self._instance_loop(uid, session, client), name=f"publish {uid}"
                )
        self.metrics.instances.set(len(self._tasks))
        if self.kv_events is not None:
            self.kv_events.reconcile((uid, s.address, s.kv_events) for uid, s in self._specs.items())

    def _retire(self, task: asyncio.Task[None]) -> None:
        task.cancel()
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)

    async def _stop_tasks(self) -> None:
        self._stopping = True  # instance loops also check this: a cancellation lost in a race
        for task in self._tasks.values():  # (a timeout firing at the same instant) cannot keep one
            self._retire(task)
        self._tasks.clear()
        while self._retiring:  # cancel again until every task has ended
            pending = set(self._retiring)
            for task in pending:
                task.cancel()
            await asyncio.wait(pending, timeout=0.5)

    async def _instance_loop(self, uid: str, session: aiohttp.ClientSession, client: Any) -> None:
        """Scrape and publish one instance every interval, on its own clock, for as long as it is listed."""
        loop = asyncio.get_running_loop()
        interval = self.config.interval_s
        # Spread the instances over the interval: N scrapes and writes do not all land at once.
        next_at = loop.time() + (zlib.crc32(uid.encode()) % 1000) / 1000 * interval
        while not self._stopping:
            delay = next_at - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            spec = self._specs.get(uid)
            if spec is None:
                return
            await self.cycle(session, client, spec, scheduled=next_at)
            next_at += interval
            behind = loop.time() - next_at
            if behind > 0:  # a slow Redis write: skip the missed ticks instead of bursting
                next_at += math.ceil(behind / interval) * interval

    async def tick(self, session: aiohttp.ClientSession, client: Any) -> list[spb.UpstreamSnapshot]:
        """One round over every instance, each published as soon as its own scrape ends (tests, tools)."""
        self._specs = {spec.upstream_id: spec for spec in self.instances}
        snaps = await asyncio.gather(*(self.cycle(session, client, spec) for spec in self.instances))
        return [s for s in snaps if s is not None]

    # -- one instance ------------------------------------------------------------------------------
    async def cycle(
        self,
        session: aiohttp.ClientSession,
        client: Any,
        spec: InstanceSpec,
        scheduled: float | None = None,
    ) -> spb.UpstreamSnapshot | None:
        """Scrape, build and write one instance's snapshot. Never raises (but for cancellation): an
        unexpected error is logged and counted, and the instance simply misses this tick."""
        loop = asyncio.get_running_loop()
        started = loop.time() if scheduled is None else scheduled
        uid = spec.upstream_id
        try:
            result = await self.scrape(session, spec)
            self._log_problem(spec, result)
            snap = self.snapshot(
                spec,
                result.health,
                result.load,
                self._prev.setdefault(uid, _Previous()),
                detail=result.detail,
            )
            self._log_change(spec, snap)
            outcome = result.outcome
            if outcome == "ok" and snap.readiness_reason == "no_load_signal":
                outcome = "no_load_signal"
            self.metrics.scrape(uid, outcome)
            self._failing.discard(uid)
        except asyncio.CancelledError:
            raise
        except Exception:
            self.metrics.scrape(uid, "error")
            if uid not in self._failing:
                log.exception("publisher: scraping %s failed; its task carries on", uid)
            self._failing.add(uid)
            return None
        await self.publish(client, snap, started)
        return snap

    def _log_problem(self, spec: InstanceSpec, result: ScrapeResult) -> None:
        """A scrape problem the operator must act on (a page over the cap, a redirect, a parse past
        the deadline), logged when it starts or changes, not every interval while it lasts."""
        uid = spec.upstream_id
        if not result.message:
            if self._problems.pop(uid, None) is not None and result.outcome == "ok":
                log.info("%s (%s at %s): /metrics scrapes work again", uid, spec.engine, spec.address)
            return
        if self._problems.get(uid) == result.detail:
            return
        self._problems[uid] = result.detail
        log.warning(
            "%s (%s at %s): %s",
            uid,
            spec.engine,
            spec.address,
            result.message,
            extra={"upstream": uid, "outcome": result.outcome, "reason": result.detail},
        )

    def _log_change(self, spec: InstanceSpec, snap: spb.UpstreamSnapshot) -> None:
        """One line per readiness change of an instance (first state included), with the reason."""
        prev = self._prev.setdefault(spec.upstream_id, _Previous())
        if prev.readiness == snap.readiness:
            return
        before = "NEW" if prev.readiness is None else spb.Readiness.Name(prev.readiness)
        state = spb.Readiness.Name(snap.readiness)
        prev.readiness = snap.readiness
        reason = f" ({snap.readiness_reason})" if snap.readiness_reason else ""
        log.log(
            logging.INFO if snap.readiness == spb.READY else logging.WARNING,
            "%s (%s at %s): %s -> %s%s",
            spec.upstream_id,
            spec.engine,
            spec.address,
            before,
            state,
            reason,
            extra={
                "upstream": spec.upstream_id,
                "state": state,
                "previous": before,
                "reason": reason.strip(" ()"),
            },
        )

    async def scrape(self, session: aiohttp.ClientSession, spec: InstanceSpec) -> ScrapeResult:
        """GET /health then /metrics and parse it (in a thread), all within one deadline. A DCGM
        exporter, when configured, is read at the same time, under the same deadline; whatever happens
        to it only leaves the GPU figures unknown."""
        gpu = asyncio.create_task(self.scrape_dcgm(session, spec)) if spec.dcgm_url else None
        try:
            result = await self._scrape_engine(session, spec)
            if gpu is not None and result.load is not None:
                _apply_gpu(result.load, await gpu)
        finally:
            if gpu is not None and not gpu.done():
                gpu.cancel()
        return result

    async def scrape_dcgm(self, session: aiohttp.ClientSession, spec: InstanceSpec) -> GpuReading:
        """This instance's GPUs from its DCGM exporter; never raises (but for cancellation)."""
        reason = "dcgm_error"
        deadline = time.monotonic() + self.config.scrape_deadline_s
        try:
            async with asyncio.timeout(self.config.scrape_deadline_s):
                async with session.get(spec.dcgm(), allow_redirects=False) as r:
                    body = await _read_capped(r, self.config.max_metrics_bytes) if r.status == 200 else None
                    if body is None:
                        raise ValueError(
                            f"status {r.status}, or more than {self.config.max_metrics_bytes} bytes"
                        )
            reason = "dcgm_bad_metrics"
            reading = await self._parse(deadline, _parse_dcgm, body, spec.dcgm_gpus)
        except asyncio.CancelledError:
            raise
        except TimeoutError:
            return GpuReading(rejected=[("gpu_utilization", "dcgm_timeout")])
        except Exception as exc:
            log.debug("dcgm scrape for %s failed: %s", spec.upstream_id, exc)
            return GpuReading(rejected=[("gpu_utilization", reason)])
        if reading.gpus == 0:
            reading.rejected.append(("gpu_utilization", "dcgm_no_gpu"))
        return reading

    async def _scrape_engine(self, session: aiohttp.ClientSession, spec: InstanceSpec) -> ScrapeResult:
        """Health, then at most `max_metrics_bytes` of /metrics (no redirects followed), parsed in a
        thread; the whole of it inside the scrape deadline, so one engine's page cannot hold the event
        loop that scrapes and writes every other instance."""
        result = ScrapeResult()
        cap = self.config.max_metrics_bytes
        budget = self.config.scrape_deadline_s
        deadline = time.monotonic() + budget
        body: bytes | None = None
        try:
            async with asyncio.timeout(budget):
                async with session.get(spec.url(spec.health_path), allow_redirects=False) as r:
                    result.health = r.status
                    if 300 <= r.status < 400:  # not followed: health_not_ok, and said why
                        result.message = _redirect_message(spec.health_path, r)
                    await r.content.read(MAX_HEALTH_BYTES)
                async with session.get(spec.url(spec.metrics_path), allow_redirects=False) as r:
                    if 300 <= r.status < 400:
                        result.outcome, result.detail = "redirect", f"metrics_redirect_{r.status}"
                        result.message = _redirect_message(spec.metrics_path, r)
                    elif r.status != 200:
                        result.outcome, result.detail = "metrics_error", f"metrics_status_{r.status}"
                    else:
                        body = await _read_capped(r, cap)
                        if body is None:
                            result.outcome = result.detail = "metrics_too_large"
                            result.message = (
                                f"{spec.metrics_path} is larger than max_metrics_bytes ({cap} bytes): read "
                                f"stopped there and the scrape counts as failed (metrics_too_large); "
                                f"raise max_metrics_bytes if the page is legitimate"
                            )
        except TimeoutError:
            result.outcome, result.detail = "timeout", "timeout"
        except (aiohttp.ClientError, OSError, ValueError) as exc:
            result.outcome = "unreachable" if result.health is None else "metrics_error"
            result.detail = result.outcome
            log.debug("scrape %s failed: %s", spec.upstream_id, exc)
        if result.health is not None and result.health != 200 and result.outcome == "ok":
            result.outcome = "health_not_ok"
        if body is not None and result.detail != "timeout":
            try:
                result.load = await self._parse(deadline, _parse_engine, spec.engine, body)
            except TimeoutError:
                result.outcome, result.detail = "parse_timeout", "metrics_parse_timeout"
                result.message = (
                    f"parsing {spec.metrics_path} ({len(body)} bytes) did not end within the scrape "
                    f"deadline ({budget:g} s); this round's figures are dropped (parse_timeout)"
                )
            except ValueError as exc:
                result.outcome, result.detail = "metrics_error", "bad_metrics"
                log.debug("scrape %s: %s", spec.upstream_id, exc)
        return result

    async def _parse(self, deadline: float, parse: Callable[..., _T], *args: Any) -> _T:
        """`parse(*args, deadline=deadline)` in a parse thread, awaited until `deadline`
        (time.monotonic()): the event loop goes on scraping and writing the other instances meanwhile.
        Raises TimeoutError at the deadline; the thread notices it too and stops parsing there."""
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise ParseTimeout("no time left to parse")
        if self._parser is None:
            self._parser = ThreadPoolExecutor(PARSE_WORKERS, thread_name_prefix="publisher-parse")
        job = functools.partial(parse, *args, deadline=deadline)
        future = asyncio.get_running_loop().run_in_executor(self._parser, job)
        async with asyncio.timeout(remaining):  # a parse still queued then is cancelled, never run
            return await future

    def snapshot(
        self,
        spec: InstanceSpec,
        health: int | None,
        load: EngineLoad | None,
        prev: _Previous,
        *,
        detail: str = "",
    ) -> spb.UpstreamSnapshot:
        """The snapshot for one scrape. Values out of range are left out (unknown) and counted; an
        instance with no load signal at all is not READY: unknown load must never look idle."""
        uid = spec.upstream_id
        self.sequence += 1
        snap = spb.UpstreamSnapshot(
            upstream_id=uid,
            cluster=spec.cluster,
            address=spec.address,
            engine=spec.engine,
            capacity_weight=spec.capacity_weight,
            publisher_id=self.config.publisher_id,
            sequence=self.sequence,
            published_at_ms=int(time.time() * 1000),  # stamped again when written
            ttl_ms=self.config.ttl_ms,
            load_presence=True,
        )
        rejected: list[tuple[str, str]] = []
        if load is not None:
            rejected = _fill_load(snap, load, prev)
            snap.lora_adapters.extend(_names(load.lora_adapters, "lora_adapters", rejected))
        gpu = spec.gpu or (load.gpu_model if load is not None else None)
        if gpu and len(gpu) <= MAX_GPU_NAME and gpu.isprintable():
            snap.gpu_model = gpu
        configured = list(spec.models) or (load.models if load is not None else [])
        snap.models.extend(_names(configured, "models", rejected))
        for name, reason in rejected:
            self.metrics.reject(uid, name, reason)
        signal = any(snap.HasField(f) for f in LOAD_FIELDS)
        if health is None:
            snap.readiness, snap.readiness_reason = spb.DOWN, detail or "unreachable"
        elif spec.draining:
            snap.readiness, snap.readiness_reason = spb.DRAINING, "draining"
        elif health == 200 and load is not None and signal:
            snap.readiness = spb.READY
        else:
            if health != 200:
                reason = f"health_status_{health}"
            elif load is None:
                reason = detail or "no_metrics"
            else:
                reason = "no_load_signal"
            snap.readiness = spb.DRAINING if prev.ready_seen and health != 200 else spb.WARMING_UP
            snap.readiness_reason = reason
        prev.ready_seen = prev.ready_seen or snap.readiness == spb.READY
        return snap

    async def publish(self, client: Any, snap: spb.UpstreamSnapshot, started: float | None = None) -> bool:
        """SET with the TTL and PUBLISH, stamped now; bounded so a hung Redis cannot hold the task."""
        loop = asyncio.get_running_loop()
        now = time.time()
        snap.published_at_ms = int(now * 1000)
        data = snap.SerializeToString()
        try:
            async with asyncio.timeout(PUBLISH_WRITE_TIMEOUT_S):
                key = self.config.redis.key(snap.upstream_id)
                await write_and_publish(client, [(self.config.redis.channel, data)], (key, data, snap.ttl_ms))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # Redis down or slow: keep scraping; the next tick retries
            if self._redis_ok:
                log.warning("publish failed (retrying every interval): %s", exc or type(exc).__name__)
            self._redis_ok = False
            self.metrics.published(snap.upstream_id, False, 0.0, now)
            return False
        if not self._redis_ok:
            log.info("publish: Redis writes succeed again")
        self._redis_ok = True
        self.published += 1
        lag = loop.time() - started if started is not None else 0.0
        self.metrics.published(snap.upstream_id, True, lag, now)
        return True


async def _read_capped(response: aiohttp.ClientResponse, cap: int) -> bytes | None:
    """The whole body, or None as soon as it is known to exceed `cap` bytes (read no further; closing
    the response then drops the connection). aiohttp's read(n) returns what is buffered, up to n
    bytes, hence the loop (a single read used to parse only the first ~128 KB of a larger page)."""
    declared = response.content_length
    if declared is not None and declared > cap and not response.headers.get("Content-Encoding"):
        return None
    chunks: list[bytes] = []
    size = 0
    while True:
        chunk = await response.content.read(cap + 1 - size)
        if not chunk:
            return b"".join(chunks)
        size += len(chunk)
        if size > cap:
            return None
        chunks.append(chunk)


def _redirect_message(path: str, response: aiohttp.ClientResponse) -> str:
    """Why a 3xx is a failed scrape: following it would send the publisher wherever the engine says."""
    location = response.headers.get("Location", "")[:200]
    return (
        f"{path} answered {response.status} (Location {location!r}); the publisher does not follow "
        f"redirects: point the instance's path at the page itself"
    )


def _parse_engine(engine: str, body: bytes, *, deadline: float) -> EngineLoad:
    """Decode and normalise one /metrics page (runs in a parse thread)."""
    return normalize(engine, body.decode("utf-8", errors="replace"), deadline=deadline)


def _parse_dcgm(body: bytes, gpus: tuple[str, ...], *, deadline: float) -> GpuReading:
    """Decode and read one DCGM exporter page (runs in a parse thread)."""
    return normalize_dcgm(body.decode("utf-8", errors="replace"), gpus, deadline=deadline)


def _describe(specs: list[InstanceSpec]) -> str:
    """`gpu-a/10.0.0.1:8000 (vllm: llama)`, comma separated, for log lines."""
    return (
        ", ".join(
            f"{s.upstream_id} ({s.engine}{': ' + ','.join(s.models) if s.models else ''})" for s in specs
        )
        or "none"
    )


def _checked(name: str, value: float | None, high: float, rejected: list[tuple[str, str]]) -> float | None:
    """`value` if it is a finite number in [0, high]; otherwise None, with the reason recorded."""
    if value is None:
        return None
    if math.isnan(value):
        reason = "nan"
    elif math.isinf(value):
        reason = "infinite"
    elif value < 0:
        reason = "negative"
    elif value > high:
        reason = "too_large"
    else:
        return value
    rejected.append((name, reason))
    return None


def _names(values: list[str], name: str, rejected: list[tuple[str, str]]) -> list[str]:
    """Model or adapter names readers accept: non-empty, at most MAX_ID_LEN long, at most MAX_MODELS
    of them (more: the whole list is left out, so a reader falls back to its configured models)."""
    out = []
    for v in values:
        if not v or len(v) > MAX_ID_LEN:
            rejected.append((name, "bad_name"))
        else:
            out.append(v)
    if len(out) > MAX_MODELS:
        rejected.append((name, "too_many"))
        return []
    return out


def _fill_load(snap: spb.UpstreamSnapshot, load: EngineLoad, prev: _Previous) -> list[tuple[str, str]]:
    """Copy `load` into `snap` within the bounds readers accept, leaving out (unknown) what is not;
    returns every (field, reason) left out, the engine-side rejections included. This is the last
    gate before protobuf, whose own range errors (a uint64 overflow) must never be reached."""
    rejected = list(load.rejected)
    running = _checked("num_running", load.num_running, MAX_QUEUE, rejected)
    if running is not None:
        snap.num_running = int(running)
    waiting = _checked("num_waiting", load.num_waiting, MAX_QUEUE, rejected)
    if waiting is not None:
        snap.num_waiting = int(waiting)
    usage = _checked("kv_cache_usage", load.kv_cache_usage, MAX_KV_USAGE, rejected)
    total = _checked("kv_blocks_total", load.kv_blocks_total, MAX_KV_BLOCKS, rejected)
    free = _checked("kv_blocks_free", load.kv_blocks_free, MAX_KV_BLOCKS, rejected)
    if free is not None and total is not None and free > total:
        rejected.append(("kv_blocks_free", "above_total"))
        free = None
    if usage is None and total and free is not None:
        usage = 1.0 - free / total
    if usage is not None:
        snap.kv_cache_usage = usage
    if total:
        if free is None and usage is not None:
            free = round(total * (1.0 - min(1.0, usage)))
        snap.kv_blocks_total = int(total)
        snap.kv_blocks_free = int(min(free or 0, total))
    block_size = _checked("block_size", load.block_size, MAX_BLOCK_SIZE, rejected)
    if block_size is not None:
        snap.block_size = int(block_size)
    max_len = _checked("max_model_len", load.max_model_len, MAX_MODEL_LEN, rejected)
    if max_len is not None:
        snap.max_model_len = int(max_len)
    gpu = _checked("gpu_utilization", load.gpu_utilization, MAX_KV_USAGE, rejected)
    if gpu is not None:
        snap.gpu_utilization = min(gpu, 1.0)  # readers take 0..1 (a sampled percent may read 100+)
    memory = _checked("gpu_memory_usage", load.gpu_memory_usage, MAX_KV_USAGE, rejected)
    if memory is not None:
        snap.gpu_memory_usage = min(memory, 1.0)
    slots = _checked("max_lora", load.max_lora, MAX_LORA_SLOTS, rejected)
    if slots is not None:
        snap.max_lora = int(slots)
    ttft, prev.ttft = _interval_mean(load.ttft_sum, load.ttft_count, prev.ttft)
    ttft = _checked("ttft", ttft, MAX_LATENCY_S, rejected)
    if ttft is not None:
        snap.ttft_seconds = ttft
    tpot, prev.tpot = _interval_mean(load.tpot_sum, load.tpot_count, prev.tpot)
    tpot = _checked("tpot", tpot, MAX_LATENCY_S, rejected)
    if tpot is not None:
        snap.tpot_seconds = tpot
    rate, prev.prefix = _interval_mean(load.prefix_cache_hits, load.prefix_cache_queries, prev.prefix)
    if rate is None:
        rate = load.prefix_cache_hit_rate
    if rate is not None and math.isfinite(rate):
        snap.prefix_cache_hit_rate = min(1.0, max(0.0, rate))
    # A prompt counter that includes cache hits is usable only with the hits to subtract.
    row = ENGINE_METRICS.get(snap.engine)
    if row is not None:
        cached = load.prefix_cache_hits if row.prompt_tokens_cached else 0.0
        if cached is not None:
            prev.prefill.update(load.prompt_tokens, cached, load.prefill_seconds)
    if prev.prefill.estimate is not None:  # the last figure stands while nothing new is measured
        snap.prefill_tokens_per_s = prev.prefill.estimate
    # The counters readers calibrate against (scheduling/calibration.py): every prompt token, cached
    # ones included (vLLM's prompt counter; SGLang's, which the table reads as prefix-cache queries),
    # and the TTFT histogram's count and sum, as cumulative values.
    prompt = load.prompt_tokens if row is not None and row.prompt_tokens_cached else None
    if prompt is None:
        prompt = load.prefix_cache_queries
    prompt = _checked("prompt_tokens_total", prompt, MAX_COUNTER, rejected)
    first = _checked("first_tokens_total", load.ttft_count, MAX_COUNTER, rejected)
    ttft_total = _checked("ttft_seconds_total", load.ttft_sum, MAX_COUNTER, rejected)
    if first is not None and ttft_total is not None:
        snap.first_tokens_total, snap.ttft_seconds_total = first, ttft_total
        if prompt is not None:
            snap.prompt_tokens_total = prompt
    return rejected


def _apply_gpu(load: EngineLoad, reading: GpuReading) -> None:
    """DCGM's figures replace the engine's own (Triton's nv_gpu_utilization): the operator chose them."""
    if reading.utilization is not None:
        load.gpu_utilization = reading.utilization
    if reading.memory_usage is not None:
        load.gpu_memory_usage = reading.memory_usage
    if reading.model is not None:
        load.gpu_model = reading.model
    load.rejected.extend(reading.rejected)


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
                                    "dcgm_url",
                                    "dcgm_gpus",
                                    "gpu",
                                    "kv_events",
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
