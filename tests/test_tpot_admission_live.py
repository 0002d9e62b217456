"""TPOT-aware admission (`admission.max_tpot_s`) live: real Envoy + llm-extproc + redis-server +
publisher over two simulated engines. The engines' inter-token latency reaches the service only
through the publisher's scrape (vLLM's `inter_token_latency_seconds`) and Redis. While both engines
decode slower than the objective, sheddable requests get 429 with Retry-After and critical ones are
served; once decoding is fast again, sheddable requests are served."""

from __future__ import annotations

import asyncio
import shutil
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from extproc.lab.bench.scenarios import MODEL, _n_cluster_gateway, start_publisher, wait_published
from extproc.lab.engines import EngineGroup
from extproc.lab.stack import local_redis
from extproc.publishers.publisher import InstanceSpec

pytestmark = [
    pytest.mark.envoy,
    pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server"),
]

ADMISSION = {"enabled": True, "max_tpot_s": 0.05, "tpot_window_s": 0.5, "retry_after_s": 1}


async def post(session: aiohttp.ClientSession, url: str, priority: str, tokens: int) -> tuple[int, Any]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": tokens}
    headers = {"x-llm-priority": priority}
    async with session.post(url + "/v1/chat/completions", json=body, headers=headers) as r:
        await r.read()
        return r.status, r.headers.copy()


async def until(session: aiohttp.ClientSession, url: str, status: int, timeout_s: float) -> Any:
    """Probe with one-token sheddable requests (they add no inter-token gap) while critical requests
    of four tokens (admitted whatever the signal says) keep the engines decoding, until a probe gets
    `status`; its headers."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        fed = await asyncio.gather(*(post(session, url, "critical", 4) for _ in range(2)))
        assert all(s == 200 for s, _ in fed), fed
        got, headers = await post(session, url, "sheddable", 1)
        if got == status:
            return headers
        await asyncio.sleep(0.1)
    raise AssertionError(f"no sheddable request got {status} within {timeout_s} s")


async def test_slow_decoding_sheds_sheddable_until_it_is_fast_again(tmp_path: Path) -> None:
    group = EngineGroup([0.1, 0.1], MODEL)  # 0.1 s per output token: twice the objective
    stops: list[Any] = [group.close]
    try:
        redis, _ = local_redis(tmp_path / "redis.log")
        stops.append(redis.stop)
        clusters = {f"gpu-{i}": [p] for i, p in enumerate(group.ports)}
        gw = _n_cluster_gateway(tmp_path, clusters, redis.url, None, service_extra={"admission": ADMISSION})
        publisher = start_publisher(
            redis.url,
            [InstanceSpec(c, f"127.0.0.1:{p[0]}", "sim") for c, p in clusters.items()],
            stops,
            interval_s=0.25,
        )
        gw.start()
        stops.append(gw.stop)
        await wait_published(publisher, 2)
        async with aiohttp.ClientSession() as session:
            assert (await post(session, gw.url, "sheddable", 1))[0] == 200  # no TPOT reported yet
            headers = await until(session, gw.url, 429, timeout_s=20.0)
            assert headers["retry-after"] == "1"
            for engine in group.engines:
                engine.token_delay_s = 0.005
            # The critical requests bring the new speed into the snapshots.
            await until(session, gw.url, 200, timeout_s=20.0)
    finally:
        for stop in reversed(stops):
            res = stop()
            if asyncio.iscoroutine(res):
                await res
