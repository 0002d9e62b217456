"""The publisher against faulty engines, all real processes or servers on loopback: a real
redis-server, two simulated engines, one engine that accepts connections and never answers (hung),
one that serves absurd values, and one whose /metrics is empty.

What must hold (the failures measured before per-instance scheduling):
- every healthy instance's snapshot in Redis stays fresh however long the hung one takes;
- the publisher stays alive through absurd values (a uint64 overflow killed it) and counts them;
- the hung instance is DOWN, the empty one is not READY (unknown load must not read as idle);
- with the hung instance DOWN and the others READY but slightly late, the service still has
  candidates (the stale-READY grace) instead of answering 503.
Assertions are about behaviour; time limits are loose so two busy shared cores do not flake them.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest
import redis.asyncio as aioredis
import yaml
from aiohttp import web

from extproc.fleet import ClusterSpec, FleetView, Pool, RoutingMode
from extproc.fleet import snapshot_pb2 as spb
from extproc.fleet.snapshots import decode
from extproc.publishers import InstanceSpec, Publisher, PublisherConfig
from extproc.settings import RedisSettings
from extproc_lab.engines import SimEngine
from extproc_lab.stack import RedisProcess, free_port

INTERVAL = 0.5
CLUSTER = "gpu"
MODEL = "m"

# Absurd but parseable: a block count beyond uint64, a negative queue, NaN usage, and a series of
# something else carrying a model label. The running gauge is sane, so the instance stays READY.
ABSURD_METRICS = f"""\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{engine="0",model_name="{MODEL}"}} 2.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{engine="0",model_name="{MODEL}"}} -1.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{{engine="0",model_name="{MODEL}"}} NaN
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{{block_size="16",engine="0",num_gpu_blocks="1e20"}} 1.0
# TYPE http_requests_total counter
http_requests_total{{handler="/v1/models",model_name="x"}} 3.0
"""


@dataclass(slots=True)
class Fleet:
    redis: RedisProcess
    settings: RedisSettings
    healthy: list[InstanceSpec]  # the two simulated engines
    absurd: InstanceSpec
    empty: InstanceSpec
    hung: InstanceSpec

    @property
    def all(self) -> list[InstanceSpec]:
        return [*self.healthy, self.absurd, self.empty, self.hung]

    def config(self) -> PublisherConfig:
        return PublisherConfig(redis=self.settings, instances=self.all, interval_s=INTERVAL)


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisProcess]:
    server = RedisProcess(tmp_path / "redis.log").start()
    yield server
    server.stop()


async def _tiny_engine(metrics: str) -> tuple[web.AppRunner, str]:
    """An engine that answers /health 200 and a fixed /metrics text."""

    async def health(_request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def exposition(_request: web.Request) -> web.Response:
        return web.Response(text=metrics, content_type="text/plain")

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", exposition)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    return runner, f"127.0.0.1:{port}"


@pytest.fixture
async def fleet(redis_server: RedisProcess) -> AsyncIterator[Fleet]:
    sims = [SimEngine(f"e{i}", MODEL) for i in range(2)]
    ports = [await e.start("127.0.0.1", 0) for e in sims]
    absurd, absurd_addr = await _tiny_engine(ABSURD_METRICS)
    empty, empty_addr = await _tiny_engine("")
    # Accepts TCP connections (the kernel completes the handshake) and never sends a byte back.
    hung = await asyncio.get_running_loop().create_server(asyncio.Protocol, "127.0.0.1", 0)
    hung_addr = f"127.0.0.1:{hung.sockets[0].getsockname()[1]}"
    try:
        yield Fleet(
            redis=redis_server,
            settings=RedisSettings(url=redis_server.url, pool="faults"),
            healthy=[InstanceSpec(CLUSTER, f"127.0.0.1:{p}", "sim") for p in ports],
            absurd=InstanceSpec(CLUSTER, absurd_addr, "vllm"),
            empty=InstanceSpec(CLUSTER, empty_addr, "vllm"),
            hung=InstanceSpec(CLUSTER, hung_addr, "sim"),
        )
    finally:
        hung.close()
        await absurd.cleanup()
        await empty.cleanup()
        for e in sims:
            await e.stop()


async def _read(
    client: aioredis.Redis, settings: RedisSettings, spec: InstanceSpec
) -> spb.UpstreamSnapshot | None:
    raw = await client.get(settings.key(spec.upstream_id))
    return spb.UpstreamSnapshot.FromString(raw) if raw is not None else None


async def _until(predicate: object, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await predicate():  # type: ignore[operator]
            return
        await asyncio.sleep(0.05)
    raise AssertionError("condition not met in time")


async def test_healthy_snapshots_stay_fresh_beside_hung_and_absurd_engines(fleet: Fleet) -> None:
    publisher = Publisher(fleet.config())
    assert publisher.config.scrape_deadline_s < INTERVAL
    ttl = publisher.config.ttl_ms / 1000
    stop = asyncio.Event()
    task = asyncio.create_task(publisher.run(stop))
    client = aioredis.from_url(fleet.redis.url)
    ready = [*fleet.healthy, fleet.absurd]
    try:

        async def first_round() -> bool:
            snaps = [await _read(client, fleet.settings, s) for s in fleet.all]
            return all(s is not None for s in snaps)

        await _until(first_round)
        # Sample every READY instance's key repeatedly for several intervals.
        ages: list[float] = []
        end = time.time() + 8 * INTERVAL
        while time.time() < end:
            for spec in ready:
                snap = await _read(client, fleet.settings, spec)
                assert snap is not None, f"{spec.upstream_id} missing from Redis"
                assert snap.readiness == spb.READY, (spec.upstream_id, snap.readiness_reason)
                ages.append(time.time() - snap.published_at_ms / 1000)
            await asyncio.sleep(0.1)
            assert not task.done(), "the publisher died"
        # Written every interval, stamped when written: never older than one interval plus the time
        # a write takes. The slack is generous (shared cores); the TTL is the line that matters.
        assert max(ages) < INTERVAL + 1.0 < ttl, max(ages)

        hung = await _read(client, fleet.settings, fleet.hung)
        assert hung is not None and hung.readiness == spb.DOWN and hung.readiness_reason == "timeout"
        empty = await _read(client, fleet.settings, fleet.empty)
        assert empty is not None and empty.readiness == spb.WARMING_UP
        assert empty.readiness_reason == "no_load_signal"

        absurd = await _read(client, fleet.settings, fleet.absurd)
        assert absurd is not None
        assert list(absurd.models) == [MODEL]  # not "x" from an unrelated series
        assert absurd.HasField("num_running") and absurd.num_running == 2
        assert not absurd.HasField("num_waiting") and not absurd.HasField("kv_cache_usage")  # unknown, not 0
        assert absurd.kv_blocks_total == 0
        uid = fleet.absurd.upstream_id
        rejected = publisher.metrics.value
        name = "llm_extproc_publisher_rejected_values_total"
        assert rejected(name, upstream=uid, field="kv_blocks_total", reason="too_large") >= 1
        assert rejected(name, upstream=uid, field="num_waiting", reason="negative") >= 1
        assert rejected(name, upstream=uid, field="kv_cache_usage", reason="nan") >= 1
        scrapes = "llm_extproc_publisher_scrapes_total"
        assert rejected(scrapes, upstream=fleet.hung.upstream_id, outcome="timeout") >= 1
        assert rejected(scrapes, upstream=fleet.empty.upstream_id, outcome="no_load_signal") >= 1
        assert not task.done()
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
        await client.aclose()


async def test_service_view_keeps_late_ready_instances_when_the_hung_one_is_down(fleet: Fleet) -> None:
    """Real snapshots from Redis into a FleetView whose clock is just past the READY ones' TTL while
    the hung instance's DOWN snapshot is still fresh: candidates must not be empty (no 503)."""
    publisher = Publisher(fleet.config())
    stop = asyncio.Event()
    task = asyncio.create_task(publisher.run(stop))
    client = aioredis.from_url(fleet.redis.url)
    addresses = tuple(s.address for s in fleet.all)
    pool = Pool(clusters=(ClusterSpec(CLUSTER, (MODEL,), endpoints=addresses),), mode=RoutingMode.ENDPOINT)
    try:

        async def first_round() -> bool:
            hung = await _read(client, fleet.settings, fleet.hung)
            ready = [await _read(client, fleet.settings, s) for s in (*fleet.healthy, fleet.absurd)]
            return (
                hung is not None
                and hung.readiness == spb.DOWN
                and all(s is not None and s.readiness == spb.READY for s in ready)
            )

        await _until(first_round)
        late = []
        for spec in (*fleet.healthy, fleet.absurd):
            snap = await _read(client, fleet.settings, spec)
            assert snap is not None and snap.readiness == spb.READY
            late.append(decode(snap.SerializeToString(), frozenset({CLUSTER})))
        clock = max(s.expires_at for s in late) + 0.05  # every READY snapshot just expired

        async def newer_down() -> bool:  # a DOWN snapshot written after those, so fresh at `clock`
            snap = await _read(client, fleet.settings, fleet.hung)
            return snap is not None and snap.published_at_ms / 1000 + snap.ttl_ms / 1000 > clock + 0.5

        await _until(newer_down)
        down_raw = await client.get(fleet.settings.key(fleet.hung.upstream_id))
        down = decode(down_raw, frozenset({CLUSTER}))
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
        await client.aclose()
    assert not down.ready and down.fresh(clock)

    view = FleetView(pool, clock=lambda: clock)
    for state in (*late, down):
        view.apply(state)
    view.rebuild()
    found = view.candidates(MODEL)
    assert found, "no candidates: the service would answer 503"
    assert {u.address for u in found} == {s.address for s in (*fleet.healthy, fleet.absurd)}
    assert view.counts["stale_ready"] == 3 and view.stale_ready_decisions == 1
    absurd_load = view.load(f"{CLUSTER}/{fleet.absurd.address}")
    assert absurd_load is not None and {"num_waiting", "kv_cache_usage"} <= absurd_load.unknown

    strict = FleetView(pool, clock=lambda: clock, stale_ready_grace_ttls=0.0)
    for state in (*late, down):
        strict.apply(state)
    strict.rebuild()
    assert strict.candidates(MODEL) == ()  # what the service did before the grace: 503


async def test_cli_publisher_survives_absurd_values(fleet: Fleet, tmp_path: Path) -> None:
    """`llm-extproc publish` as a process: exit 2 on num_gpu_blocks="1e20" was the measured failure."""
    port = free_port()
    path = tmp_path / "publisher.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "redis": {"url": fleet.redis.url, "pool": "faults"},
                "interval_s": INTERVAL,
                "instances": [
                    {"cluster": CLUSTER, "address": s.address, "engine": s.engine}
                    for s in (fleet.healthy[0], fleet.absurd, fleet.hung)
                ],
            }
        )
    )
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "extproc.cli",
            "publish",
            "--config",
            str(path),
            "--metrics-listen",
            f"127.0.0.1:{port}",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    client = aioredis.from_url(fleet.redis.url)
    text = ""
    try:

        async def rejected_counted() -> bool:
            nonlocal text
            assert proc.poll() is None, proc.communicate()[0].decode()[-2000:]
            with contextlib.suppress(aiohttp.ClientError):
                async with (
                    aiohttp.ClientSession() as session,
                    session.get(f"http://127.0.0.1:{port}/metrics") as r,
                ):
                    text = await r.text()
            hung = f'outcome="timeout",upstream="{fleet.hung.upstream_id}"'
            return 'field="kv_blocks_total",reason="too_large"' in text and hung in text

        async def both_ready() -> bool:
            snaps = [await _read(client, fleet.settings, s) for s in (fleet.healthy[0], fleet.absurd)]
            return all(s is not None and s.readiness == spb.READY for s in snaps)

        await _until(rejected_counted, timeout=30.0)
        assert f'upstream="{fleet.absurd.upstream_id}"' in text
        await _until(both_ready)
        hung = await _read(client, fleet.settings, fleet.hung)
        assert hung is not None and hung.readiness == spb.DOWN
        assert proc.poll() is None
    finally:
        await client.aclose()
        proc.terminate()
        try:
            code = proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
    assert code == 0
