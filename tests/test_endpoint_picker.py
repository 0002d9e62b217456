"""envoy/endpoint-picker.yaml: the service picks ip:port; Envoy's override_host LB honours it."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Iterator

import aiohttp
import pytest
import yaml
from gateway_stack import MODEL, Stack, wait_until

from extproc.lab.engines import EngineGroup
from extproc.lab.stack import ENVOY_DIR

pytestmark = pytest.mark.envoy

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}


@pytest.fixture(scope="module")
def stack(engines: EngineGroup, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    cfg = yaml.safe_load((ENVOY_DIR / "llm-extproc-endpoint.yaml").read_text())
    cfg["pool"]["clusters"][0]["endpoints"] = [engines.address(0), engines.address(1)]
    cfg.pop("fleet")  # static pool + own in-flight counts here; tests/test_fleet_routing.py covers Redis
    s = Stack(
        engines,
        tmp_path_factory.mktemp("endpoint-picker"),
        envoy_file="endpoint-picker.yaml",
        service=cfg,
        clusters={"inference-pool": [0, 1]},
    ).start()
    yield s
    s.stop()


async def test_request_lands_on_picked_endpoint(stack: Stack, engines: EngineGroup) -> None:
    engines.reset()
    for e in engines.engines:
        e.token_delay_s = 0.02
    async with aiohttp.ClientSession() as s:

        async def one() -> str:
            async with s.post(stack.url + "/v1/chat/completions", json=CHAT) as r:
                assert r.status == 200
                await r.read()
                return r.headers["x-sim-engine"]

        served = Counter(await asyncio.gather(*(one() for _ in range(20))))
    assert set(served) == {e.name for e in engines.engines}
    for i, e in enumerate(engines.engines):
        # Each engine was reached because the service named exactly its address.
        assert e.stats.routing_headers, e.name
        for seen in e.stats.routing_headers:
            assert seen == {
                "x-llm-destination-cluster": "inference-pool",
                "x-gateway-destination-endpoint": engines.address(i),
            }
    assert wait_until(lambda: stack.inflight() == 0)


async def test_spoofed_endpoint_header_is_overwritten(stack: Stack, engines: EngineGroup) -> None:
    engines.reset()
    busy, idle = engines.engines
    for e in engines.engines:
        e.token_delay_s = 0.005
    busy.token_delay_s = 0.2
    async with aiohttp.ClientSession() as s:
        hold = asyncio.create_task(
            s.post(stack.url + "/v1/chat/completions", json={**CHAT, "max_tokens": 10})
        )
        assert await asyncio.to_thread(wait_until, lambda: busy.stats.active + idle.stats.active == 1)
        held = busy if busy.stats.active else idle
        other = idle if held is busy else busy
        spoof = {"x-gateway-destination-endpoint": engines.address(engines.engines.index(held))}
        async with s.post(stack.url + "/v1/chat/completions", json=CHAT, headers=spoof) as r:
            assert r.status == 200
            assert r.headers["x-sim-engine"] == other.name
        (await hold).close()
