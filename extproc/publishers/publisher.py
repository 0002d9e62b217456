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
import time
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import aiohttp

from extproc.fleet import snapshot_pb2 as spb
from extproc.fleet.gpus import MAX_GPU_NAME
from extproc.fleet.redis_feed import redis_client, write_and_publish
from extproc.publishers.config import (
    InstanceSpec,
    PublisherConfig,
)
from extproc.publishers.engines import (
    EngineLoad,
    GpuReading,
    ParseTimeout,
)
from extproc.publishers.envoy_admin import (
    discover_from_envoy,
)
from extproc.publishers.kv_events import KvEventsRelay
from extproc.publishers.metrics import MetricsEndpoint, PublisherMetrics
from extproc.publishers.scrape import (
    _T,
    PARSE_WORKERS,
    ScrapeResult,
    _parse_dcgm,
    _parse_engine,
    _read_capped,
    _redirect_message,
)
from extproc.publishers.snapshot_fields import (
    LOAD_FIELDS,
    _apply_gpu,
    _fill_load,
    _names,
    _Previous,
)
from extproc.settings import (
    DISCOVERY_TIMEOUT_S,
    MAX_HEALTH_BYTES,
    PUBLISH_WRITE_TIMEOUT_S,
)

log = logging.getLogger("extproc.publisher")


def _state_name(readiness: int, blind: bool) -> str:
    return "READY, load unknown" if blind else spb.Readiness.Name(readiness)


def _carry_engine_facts(snap: spb.UpstreamSnapshot, last: spb.UpstreamSnapshot) -> None:
    """What the last reading said of the engine rather than its load: the models and adapters it
    serves (without them it would serve nothing) and its limits. The KV capacity stays unknown (its
    free blocks would be a load figure); readers keep the capacity they had."""
    if not snap.models:
        snap.models.extend(last.models)
    if not snap.lora_adapters:
        snap.lora_adapters.extend(last.lora_adapters)
    for name in ("max_lora", "max_num_seqs"):
        if not snap.HasField(name) and last.HasField(name):
            setattr(snap, name, getattr(last, name))
    snap.max_model_len = snap.max_model_len or last.max_model_len
    snap.gpu_model = snap.gpu_model or last.gpu_model


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
        """One line per readiness change of an instance (first state included), with the reason; READY
        with the load unknown (a failed /metrics) counts as a state of its own."""
        prev = self._prev.setdefault(spec.upstream_id, _Previous())
        blind = snap.readiness == spb.READY and bool(snap.readiness_reason)
        if prev.readiness == snap.readiness and prev.blind == blind:
            return
        before = "NEW" if prev.readiness is None else _state_name(prev.readiness, prev.blind)
        state = _state_name(snap.readiness, blind)
        prev.readiness, prev.blind = snap.readiness, blind
        reason = f" ({snap.readiness_reason})" if snap.readiness_reason else ""
        log.log(
            logging.INFO if snap.readiness == spb.READY and not blind else logging.WARNING,
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
        instance with no load signal is not READY (unknown load must never look idle), but for a
        failed /metrics within a TTL of a good reading: READY, every load field unknown."""
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
        if spec.max_num_seqs is not None:  # configured: wins over the engine's own figure
            snap.max_num_seqs = spec.max_num_seqs
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
            prev.loaded_at, prev.last_read = time.monotonic(), snap
        elif health == 200 and load is None and (last := self._recent_reading(prev)) is not None:
            # A busy engine's /metrics can miss one deadline while it serves fine: still READY, its
            # load unknown (readers estimate it), rather than out of rotation for a whole interval.
            snap.readiness, snap.readiness_reason = spb.READY, detail or "no_metrics"
            _carry_engine_facts(snap, last)
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

    def _recent_reading(self, prev: _Previous) -> spb.UpstreamSnapshot | None:
        """The last READY snapshot with a load reading, if no older than the snapshot TTL (as fresh as
        a snapshot readers still use)."""
        if prev.loaded_at is None or time.monotonic() - prev.loaded_at > self.config.ttl_ms / 1000:
            return None
        return prev.last_read

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


def _describe(specs: list[InstanceSpec]) -> str:
    """`gpu-a/10.0.0.1:8000 (vllm: llama)`, comma separated, for log lines."""
    return (
        ", ".join(
            f"{s.upstream_id} ({s.engine}{': ' + ','.join(s.models) if s.models else ''})" for s in specs
        )
        or "none"
    )
