"""The publisher against engines whose /metrics page is too big, too slow to parse, or a redirect
(security issue 32: one engine could make the whole fleet stale). Real HTTP servers on loopback, a
real redis-server where snapshots are published, the publisher's own code path throughout.

What must hold:
- a 16 MiB page (streamed, or gzip-compressed as prometheus_client serves it when asked) is read no
  further than `max_metrics_bytes` (default 2 MiB), is a failed scrape (`metrics_too_large`, logged
  once naming the engine and the cap) and costs the other engines nothing: their snapshots keep
  arriving every interval (before: the publisher parsed ~4 MB of the decompressed page on its event
  loop every tick, ~1.5 s each, and every snapshot fell behind);
- a page under the cap that cannot be parsed within the scrape deadline is dropped for that round
  (`parse_timeout`) while parsing runs in a thread: the loop keeps the others on schedule;
- a page larger than one network read (~128 KB) is read whole (before: only the first read was
  parsed, so an ordinary 300 KB vLLM page was `bad_metrics`);
- a 3xx from /health, /metrics or a DCGM exporter is not followed;
- `max_metrics_bytes` is validated like the other publisher keys.
Counts over several intervals, not tight wall-clock bounds: two busy shared cores must not flake them.
"""

from __future__ import annotations

import asyncio
import gzip
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import redis.asyncio as aioredis
import yaml
from aiohttp import web

from extproc.fleet import snapshot_pb2 as spb
from extproc.publishers import InstanceSpec, Publisher, PublisherConfig, load_publisher_config
from extproc.publishers.engines import normalize
from extproc.settings import ConfigError, RedisSettings
from extproc_lab.engines import SimEngine
from extproc_lab.stack import RedisProcess

INTERVAL = 0.5  # scrape deadline 0.4 s, TTL 2 s
CLUSTER = "gpu"
MODEL = "m"
MIB = 1024 * 1024
DEFAULT_CAP = 2 * MIB
SCRAPES = "llm_extproc_publisher_scrapes_total"

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

_BUCKETS = ("0.001", "0.01", "0.05", "0.1", "0.25", "0.5", "1.0", "2.5", "5.0", "10.0", "+Inf")
_LOAD = f"""\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{engine="0",model_name="{MODEL}"}} 7.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{engine="0",model_name="{MODEL}"}} 1.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{{engine="0",model_name="{MODEL}"}} 0.25
"""


def vllm_page(size: int) -> str:
    """A valid vLLM-like page of at least `size` bytes: histograms per adapter (what makes real
    pages big), then the load gauges, last, so a page read only in part has no load signal."""
    parts: list[str] = []
    n = i = 0
    while n < size:
        family = f"vllm:adapter_latency_{i}_seconds"
        lines = [f"# HELP {family} Latency per adapter.", f"# TYPE {family} histogram"]
        for a in range(4):
            labels = f'engine="0",model_name="{MODEL}",adapter="adapter-{i}-{a}"'
            lines += [f'{family}_bucket{{{labels},le="{b}"}} {i + a}.0' for b in _BUCKETS]
            lines += [f"{family}_count{{{labels}}} {i + a}.0", f"{family}_sum{{{labels}}} {i * 0.5}"]
        block = "\n".join(lines) + "\n"
        parts.append(block)
        n += len(block)
        i += 1
    return "".join(parts) + _LOAD


def repetitive_page(size: int) -> str:
    """A valid page of at most `size` bytes that compresses ~150:1: one block over and over. Served
    gzip-compressed it arrives in one piece (the old single read returned all of it)."""
    block = vllm_page(1)[: -len(_LOAD)]
    return block * ((size - len(_LOAD)) // len(block)) + _LOAD


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisProcess]:
    server = RedisProcess(tmp_path / "redis.log").start()
    yield server
    server.stop()


async def _health(_request: web.Request) -> web.Response:
    return web.Response(text="ok")


class Servers:
    """Tiny HTTP servers on 127.0.0.1, each `routes` path -> handler; stopped together."""

    def __init__(self) -> None:
        self.runners: list[web.AppRunner] = []

    async def start(self, routes: dict[str, Handler]) -> str:
        app = web.Application()
        for path, handler in routes.items():
            app.router.add_get(path, handler)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        self.runners.append(runner)
        return f"127.0.0.1:{runner.addresses[0][1]}"

    async def close(self) -> None:
        for runner in self.runners:
            await runner.cleanup()


@pytest.fixture
async def servers() -> AsyncIterator[Servers]:
    group = Servers()
    yield group
    await group.close()


def _streamed(body: bytes) -> Handler:
    """/metrics sent in 64 KiB chunks without a Content-Length: the reader must stop by itself."""

    async def handler(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/plain; version=0.0.4"})
        await response.prepare(request)
        try:
            for i in range(0, len(body), 64 * 1024):
                await response.write(body[i : i + 64 * 1024])
        except (ConnectionError, RuntimeError):  # the publisher hung up: what it should do
            pass
        return response

    return handler


def _fixed(body: bytes, **headers: str) -> Handler:
    async def handler(_request: web.Request) -> web.Response:
        return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4", **headers})

    return handler


async def _read(
    client: aioredis.Redis, settings: RedisSettings, spec: InstanceSpec
) -> spb.UpstreamSnapshot | None:
    raw = await client.get(settings.key(spec.upstream_id))
    return spb.UpstreamSnapshot.FromString(raw) if raw is not None else None


async def _until(predicate: Callable[[], Awaitable[bool]], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await predicate():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("condition not met in time")


async def _keeps_schedule(
    publisher: Publisher, client: aioredis.Redis, settings: RedisSettings, spec: InstanceSpec
) -> None:
    """Over 8 intervals, `spec` is scraped and written about every interval and its snapshot in Redis
    is never older than an interval plus a generous second (the TTL is 4 intervals)."""
    uid = spec.upstream_id
    before = publisher.metrics.value(SCRAPES, upstream=uid, outcome="ok")
    ages: list[float] = []
    end = time.monotonic() + 8 * INTERVAL
    while time.monotonic() < end:
        snap = await _read(client, settings, spec)
        assert snap is not None, f"{uid}: its snapshot expired from Redis (the fleet went stale)"
        assert snap.readiness == spb.READY, snap
        ages.append(time.time() - snap.published_at_ms / 1000)
        await asyncio.sleep(0.05)
    published = publisher.metrics.value(SCRAPES, upstream=uid, outcome="ok") - before
    assert published >= 5, f"{uid}: {published:g} snapshots in 8 intervals (max age {max(ages):.2f} s)"
    assert max(ages) < INTERVAL + 1.0 < publisher.config.ttl_ms / 1000, max(ages)


async def test_a_16_mib_metrics_page_costs_only_its_own_engine(
    redis_server: RedisProcess, servers: Servers, caplog: pytest.LogCaptureFixture
) -> None:
    streamed = await servers.start({"/health": _health, "/metrics": _streamed(vllm_page(16 * MIB).encode())})
    compressed = gzip.compress(repetitive_page(16 * MIB).encode(), 6)  # ~130 KB on the wire
    zipped = await servers.start(
        {"/health": _health, "/metrics": _fixed(compressed, **{"Content-Encoding": "gzip"})}
    )
    sim = SimEngine("e0", MODEL)
    port = await sim.start("127.0.0.1", 0)
    settings = RedisSettings(url=redis_server.url, pool="limits")
    normal = InstanceSpec(CLUSTER, f"127.0.0.1:{port}", "sim")
    big = [InstanceSpec(CLUSTER, streamed, "vllm"), InstanceSpec(CLUSTER, zipped, "vllm")]
    publisher = Publisher(PublisherConfig(redis=settings, instances=[normal, *big], interval_s=INTERVAL))
    stop = asyncio.Event()
    client = aioredis.from_url(redis_server.url)
    caplog.set_level(logging.WARNING, logger="extproc.publisher")
    task = asyncio.create_task(publisher.run(stop))
    try:

        async def all_written() -> bool:
            return all([await _read(client, settings, s) is not None for s in (normal, *big)])

        await _until(all_written)
        await _keeps_schedule(publisher, client, settings, normal)
        for spec in big:
            snap = await _read(client, settings, spec)
            assert snap is not None and snap.readiness == spb.WARMING_UP, snap
            assert snap.readiness_reason == "metrics_too_large"
            failed = publisher.metrics.value(SCRAPES, upstream=spec.upstream_id, outcome="metrics_too_large")
            assert failed >= 5, failed  # every tick, and counted
            lines = [r.getMessage() for r in caplog.records if spec.upstream_id in r.getMessage()]
            too_large = [m for m in lines if "max_metrics_bytes" in m and str(DEFAULT_CAP) in m]
            assert len(too_large) == 1, lines  # said once, with the cap, not every interval
        assert not task.done()
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
        await client.aclose()
        await sim.stop()


async def test_the_read_stops_at_the_cap(servers: Servers) -> None:
    """The body is read no further than the cap (plus what aiohttp buffers ahead), not to its end."""
    from extproc.publishers.scrape import _read_capped

    address = await servers.start({"/metrics": _streamed(vllm_page(16 * MIB).encode())})
    async with aiohttp.ClientSession() as session, session.get(f"http://{address}/metrics") as r:
        assert await _read_capped(r, DEFAULT_CAP) is None
        assert r.content.total_bytes <= DEFAULT_CAP + 512 * 1024, r.content.total_bytes


async def test_a_page_that_cannot_be_parsed_in_time_is_dropped_and_the_others_keep_their_schedule(
    redis_server: RedisProcess, servers: Servers, caplog: pytest.LogCaptureFixture
) -> None:
    """Under the cap (raised to its 16 MiB maximum here) but ~3 s of parsing against a 0.4 s deadline:
    parsed in a thread that stops at the deadline, the round dropped, the other engine on schedule."""
    slow = await servers.start({"/health": _health, "/metrics": _fixed(vllm_page(8 * MIB).encode())})
    sim = SimEngine("e0", MODEL)
    port = await sim.start("127.0.0.1", 0)
    settings = RedisSettings(url=redis_server.url, pool="limits")
    normal = InstanceSpec(CLUSTER, f"127.0.0.1:{port}", "sim")
    heavy = InstanceSpec(CLUSTER, slow, "vllm")
    config = PublisherConfig(
        redis=settings, instances=[normal, heavy], interval_s=INTERVAL, max_metrics_bytes=16 * MIB
    )
    publisher = Publisher(config)
    stop = asyncio.Event()
    client = aioredis.from_url(redis_server.url)
    caplog.set_level(logging.WARNING, logger="extproc.publisher")
    task = asyncio.create_task(publisher.run(stop))
    try:

        async def both_written() -> bool:
            return all([await _read(client, settings, s) is not None for s in (normal, heavy)])

        await _until(both_written)
        await _keeps_schedule(publisher, client, settings, normal)
        snap = await _read(client, settings, heavy)
        assert snap is not None and snap.readiness == spb.WARMING_UP, snap
        assert snap.readiness_reason == "metrics_parse_timeout"
        assert publisher.metrics.value(SCRAPES, upstream=heavy.upstream_id, outcome="parse_timeout") >= 5
        logged = [r.getMessage() for r in caplog.records if heavy.upstream_id in r.getMessage()]
        assert sum("did not end within the scrape deadline" in m for m in logged) == 1, logged
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
        await client.aclose()
        await sim.stop()


def test_parsing_stops_at_its_deadline() -> None:
    """The parse thread cannot be killed, so the parser itself gives up at the deadline."""
    from extproc.publishers.engines import ParseTimeout

    page = vllm_page(8 * MIB)
    started = time.monotonic()
    with pytest.raises(ParseTimeout):
        normalize("vllm", page, deadline=started + 0.1)
    assert time.monotonic() - started < 1.0  # the whole page takes seconds
    assert normalize("vllm", vllm_page(64 * 1024), deadline=time.monotonic() + 60).num_running == 7


def test_a_line_the_parser_would_take_seconds_over_is_refused() -> None:
    """The text parser is quadratic in a line's labels (this 1.3 MB line: ~15 s) and the deadline is
    checked between lines: such a line is malformed, at once."""
    labels = ",".join(f'l{i}="v{i}"' for i in range(80_000))
    page = f"vllm:num_requests_running{{{labels}}} 1\n"
    started = time.monotonic()
    with pytest.raises(ValueError, match="longer than"):
        normalize("vllm", page, deadline=started + 60)
    assert time.monotonic() - started < 1.0


async def test_a_page_larger_than_one_read_is_read_whole(servers: Servers) -> None:
    """An ordinary 300 KB vLLM page, its load gauges last: all of it is parsed."""
    address = await servers.start({"/health": _health, "/metrics": _streamed(vllm_page(300 * 1024).encode())})
    spec = InstanceSpec(CLUSTER, address, "vllm")
    publisher = Publisher(PublisherConfig(redis=RedisSettings(), instances=[spec]))
    async with aiohttp.ClientSession() as session:
        result = await publisher.scrape(session, spec)
    assert (result.outcome, result.detail) == ("ok", "")
    assert result.load is not None and result.load.num_running == 7


async def test_redirects_are_not_followed(servers: Servers, caplog: pytest.LogCaptureFixture) -> None:
    """/metrics, /health and a DCGM exporter answering 3xx towards a server that would answer:
    nothing is fetched from there, each is a failed scrape with its reason."""
    hits: list[str] = []
    dcgm_page = 'DCGM_FI_DEV_GPU_UTIL{gpu="0",UUID="GPU-1",modelName="NVIDIA H100"} 40\n'

    def counted(body: str) -> Handler:
        async def handler(request: web.Request) -> web.Response:
            hits.append(request.path)
            return web.Response(text=body)

        return handler

    target = await servers.start(
        {"/health": counted("ok"), "/metrics": counted(_LOAD), "/dcgm": counted(dcgm_page)}
    )

    def moved(path: str, status: int) -> Handler:
        async def handler(_request: web.Request) -> web.Response:
            return web.Response(status=status, headers={"Location": f"http://{target}{path}"})

        return handler

    metrics_moved = await servers.start({"/health": _health, "/metrics": moved("/metrics", 302)})
    health_moved = await servers.start({"/health": moved("/health", 307), "/metrics": _fixed(_LOAD.encode())})
    dcgm_moved = await servers.start(
        {"/health": _health, "/metrics": _fixed(_LOAD.encode()), "/dcgm": moved("/dcgm", 301)}
    )
    specs = [
        InstanceSpec(CLUSTER, metrics_moved, "vllm"),
        InstanceSpec(CLUSTER, health_moved, "vllm"),
        InstanceSpec(
            CLUSTER, dcgm_moved, "vllm", dcgm_url="http://{host}:" + dcgm_moved.split(":")[1] + "/dcgm"
        ),
    ]
    caplog.set_level(logging.WARNING, logger="extproc.publisher")
    publisher = Publisher(PublisherConfig(redis=RedisSettings(), instances=specs))
    redis = _NoRedis()
    async with aiohttp.ClientSession() as session:
        snaps = {s.upstream_id: s for s in await publisher.tick(session, redis)}
    assert hits == []  # never followed

    metrics_snap = snaps[specs[0].upstream_id]
    assert metrics_snap.readiness == spb.WARMING_UP
    assert metrics_snap.readiness_reason == "metrics_redirect_302"
    assert publisher.metrics.value(SCRAPES, upstream=specs[0].upstream_id, outcome="redirect") == 1
    health_snap = snaps[specs[1].upstream_id]
    assert health_snap.readiness == spb.WARMING_UP and health_snap.readiness_reason == "health_status_307"
    dcgm_snap = snaps[specs[2].upstream_id]
    assert dcgm_snap.readiness == spb.READY and not dcgm_snap.HasField("gpu_utilization")
    assert not dcgm_snap.gpu_model  # nothing read from the exporter the redirect pointed at
    logged = " ".join(r.getMessage() for r in caplog.records)
    assert f"Location 'http://{target}/metrics'" in logged and "does not follow redirects" in logged


class _NoRedis:
    """Stands in for Redis where only the snapshots matter: every write fails (counted, swallowed)."""

    def pipeline(self, transaction: bool = True) -> Any:
        raise ConnectionError("no redis in this test")


def _write(tmp_path: Path, doc: dict[str, Any]) -> str:
    path = tmp_path / "publisher.yaml"
    path.write_text(yaml.safe_dump(doc))
    return str(path)


def test_max_metrics_bytes_default_and_configured(tmp_path: Path) -> None:
    assert load_publisher_config(None, envoy_admin="http://e").max_metrics_bytes == DEFAULT_CAP
    doc = {"envoy_admin": "http://e", "max_metrics_bytes": 512 * 1024}
    assert load_publisher_config(_write(tmp_path, doc)).max_metrics_bytes == 512 * 1024


@pytest.mark.parametrize("value", ["2MiB", "2097152", 0, -1, 100, 1.5e6, True, None, 64 * MIB])
def test_max_metrics_bytes_is_validated(tmp_path: Path, value: Any) -> None:
    doc = {"envoy_admin": "http://e", "max_metrics_bytes": value}
    with pytest.raises(
        ConfigError, match=r"'max_metrics_bytes' must be an integer number of bytes from 4096"
    ):
        load_publisher_config(_write(tmp_path, doc))
    with pytest.raises(ConfigError, match="max_metrics_bytes"):
        Publisher(PublisherConfig(redis=RedisSettings(), max_metrics_bytes=value))
