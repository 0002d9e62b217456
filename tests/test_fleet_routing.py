"""End to end with live fleet state: simulated engines -> `publish` -> real Redis -> service -> real Envoy."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from gateway_stack import MODEL, Stack, service_config, wait_until

from extproc.publishers import InstanceSpec, Publisher, PublisherConfig
from extproc.settings import RedisSettings
from extproc_lab.engines import EngineGroup
from extproc_lab.stack import ENVOY_DIR, RedisProcess

pytestmark = pytest.mark.envoy

INTERVAL = 0.2
TTL = 1.0
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def fleet_engines() -> Iterator[EngineGroup]:
    group = EngineGroup([0.005, 0.005, 0.005], MODEL, max_batch=2)
    yield group
    group.close()


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisProcess]:
    server = RedisProcess(tmp_path / "redis.log").start()
    yield server
    server.stop()


class Fleet:
    def __init__(self, stack: Stack, publisher: Publisher, engines: EngineGroup) -> None:
        self.stack = stack
        self.publisher = publisher
        self.engines = engines

    async def served_by(self, n: int, **body: Any) -> Counter[str]:
        got: Counter[str] = Counter()
        async with aiohttp.ClientSession() as s:
            for _ in range(n):
                async with s.post(self.stack.url + "/v1/chat/completions", json={**CHAT, **body}) as r:
                    assert r.status == 200, await r.text()
                    await r.read()
                    got[r.headers["x-sim-engine"]] += 1
        return got

    def metric(self, key: str) -> float:
        return self.stack.metrics().get(key, 0.0)

    async def next_publish(self, ticks: int = 1) -> None:
        """Wait until the publisher has completed `ticks` more rounds, plus the view's rebuild tick."""
        target = self.publisher.published + ticks * len(self.publisher.instances)
        deadline = time.monotonic() + 10
        while self.publisher.published < target and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.4)  # Redis -> service -> rebuild (<= 0.25 s)


async def _fleet(
    fleet_engines: EngineGroup,
    redis_server: RedisProcess,
    tmp_path: Path,
    *,
    endpoint_mode: bool = False,
    published: list[int] | None = None,
) -> AsyncIterator[Fleet]:
    fleet_engines.reset()
    for e in fleet_engines.engines:
        e.ready = True
        e.token_delay_s = 0.005
    settings = {"url": redis_server.url, "resync_interval_s": 2.0}
    if endpoint_mode:
        cfg = yaml.safe_load((ENVOY_DIR / "llm-extproc-endpoint.yaml").read_text())
        cfg["pool"]["clusters"][0]["endpoints"] = [fleet_engines.address(i) for i in range(3)]
        cfg["fleet"] = settings
        stack = Stack(
            fleet_engines,
            tmp_path / "gw",
            envoy_file="endpoint-picker.yaml",
            service=cfg,
            clusters={"inference-pool": [0, 1, 2]},
        )
        specs = [InstanceSpec("inference-pool", fleet_engines.address(i), "sim") for i in range(3)]
    else:
        stack = Stack(fleet_engines, tmp_path / "gw", service=service_config(fleet=settings))
        specs = [InstanceSpec(c, fleet_engines.address(i), "sim") for i, c in enumerate(["gpu-a", "gpu-b"])]
    if published is not None:
        specs = [specs[i] for i in published]
    publisher = Publisher(
        PublisherConfig(
            redis=RedisSettings(url=redis_server.url), instances=specs, interval_s=INTERVAL, ttl_s=TTL
        )
    )
    stop = asyncio.Event()
    task = asyncio.create_task(publisher.run(stop))
    stack.start()
    fleet = Fleet(stack, publisher, fleet_engines)
    try:
        assert await asyncio.to_thread(
            wait_until, lambda: fleet.metric('llm_extproc_fleet_instances{state="fresh_ready"}') == len(specs)
        ), stack.logs()
        yield fleet
    finally:
        stop.set()
        await task
        stack.stop()


@pytest.fixture
async def fleet(
    fleet_engines: EngineGroup, redis_server: RedisProcess, tmp_path: Path
) -> AsyncIterator[Fleet]:
    async for f in _fleet(fleet_engines, redis_server, tmp_path):
        yield f


async def test_growing_queue_stops_new_requests_within_one_interval(fleet: Fleet) -> None:
    busy, other = fleet.engines.engines[0], fleet.engines.engines[1]
    busy.token_delay_s = 0.3
    # Load the busy engine directly (as other gateways or clients would): 2 running, 6 waiting.
    async with aiohttp.ClientSession() as s:
        url = f"http://{fleet.engines.address(0)}/v1/chat/completions"
        direct = [asyncio.create_task(s.post(url, json={**CHAT, "max_tokens": 20})) for _ in range(8)]
        assert await asyncio.to_thread(wait_until, lambda: busy.stats.active == 8)
        await fleet.next_publish()  # one publish interval later...
        got = await fleet.served_by(12)
        for t in direct:
            t.cancel()
    assert got == Counter({other.name: 12}), got  # ...nothing new goes to the queueing engine


async def test_not_ready_instance_receives_nothing(fleet: Fleet) -> None:
    warming = fleet.engines.engines[1]
    warming.ready = False  # /health answers 503: the publisher reports WARMING_UP
    await fleet.next_publish()
    got = await fleet.served_by(12)
    assert got == Counter({fleet.engines.engines[0].name: 12}), got
    assert warming.stats.requests == 0
    warming.ready = True
    await fleet.next_publish()
    assert warming.name in await fleet.served_by(20)


async def test_slow_metrics_page_keeps_a_healthy_engine_in_rotation_for_one_ttl(fleet: Fleet) -> None:
    slow = fleet.engines.engines[0]
    slow.metrics_delay_s = 3 * fleet.publisher.config.scrape_deadline_s  # /health answers; /metrics is late
    uid = fleet.publisher.instances[0].upstream_id
    await fleet.next_publish()
    metrics = fleet.publisher.metrics
    assert metrics.value("llm_extproc_publisher_scrapes_total", upstream=uid, outcome="timeout") >= 1
    assert slow.name in await fleet.served_by(12)  # READY, its load unknown: not a 503, not skipped
    # A TTL without a reading: out of rotation, the other engine serves everything.
    await asyncio.sleep(TTL)
    await fleet.next_publish()
    assert await fleet.served_by(8) == Counter({fleet.engines.engines[1].name: 8})
    slow.metrics_delay_s = 0.0
    await fleet.next_publish(2)
    assert slow.name in await fleet.served_by(20)


async def test_new_instance_used_once_its_first_snapshot_arrives(
    fleet_engines: EngineGroup, redis_server: RedisProcess, tmp_path: Path
) -> None:
    async for fleet in _fleet(fleet_engines, redis_server, tmp_path, endpoint_mode=True, published=[0, 1]):
        newcomer = fleet_engines.engines[2]
        assert newcomer.name not in await fleet.served_by(20)  # Envoy knows it; no snapshot yet
        fleet.publisher.instances.append(InstanceSpec("inference-pool", fleet_engines.address(2), "sim"))
        await fleet.next_publish()
        assert newcomer.name in await fleet.served_by(20)


async def test_redis_outage_keeps_routing_then_falls_back_and_recovers(
    fleet: Fleet, redis_server: RedisProcess
) -> None:
    assert sum((await fleet.served_by(6)).values()) == 6
    redis_server.stop()
    # Requests keep flowing while Redis is gone (decided from memory)...
    assert sum((await fleet.served_by(6)).values()) == 6
    # ...and once every snapshot is older than its TTL, weighted round robin takes over.
    await asyncio.sleep(TTL + 0.5)
    before = fleet.metric('llm_extproc_fallbacks_total{reason="no_fresh_snapshot"}')
    got = await fleet.served_by(6)
    assert fleet.metric('llm_extproc_fallbacks_total{reason="no_fresh_snapshot"}') == before + 6
    assert got == Counter({e.name: 3 for e in fleet.engines.engines[:2]})  # round robin by weight
    redis_server.start()  # same port: publisher and service reconnect by themselves
    assert await asyncio.to_thread(
        wait_until, lambda: fleet.metric('llm_extproc_fleet_instances{state="fresh_ready"}') == 2, 20
    )
    after = fleet.metric('llm_extproc_fallbacks_total{reason="no_fresh_snapshot"}')
    await fleet.served_by(6)
    assert fleet.metric('llm_extproc_fallbacks_total{reason="no_fresh_snapshot"}') == after
