"""Decode speed live: real Envoy + llm-extproc + redis-server + publisher over two simulated engines.
The engines' inter-token latency reaches the service only through the publisher's scrape (vLLM's
`inter_token_latency_seconds`) and Redis.

- TPOT-aware admission (`admission.max_tpot_s`): while both engines decode slower than the setting,
  sheddable requests get 429 with Retry-After and critical ones are served; once decoding is fast
  again, sheddable requests are served.
- A request's own TPOT objective (`x-llm-tpot-slo-ms`; the default profile's `decode-speed` and
  `slo-tpot`): it goes to the engine that decodes fast enough, and gets 429 `slo_unattainable` when
  none does."""

from __future__ import annotations

import asyncio
import shutil
import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from extproc.publishers import InstanceSpec
from extproc_lab.bench.scenarios import MODEL, _n_cluster_gateway, start_publisher, wait_published
from extproc_lab.engines import EngineGroup
from extproc_lab.stack import LocalGateway, local_redis

pytestmark = [
    pytest.mark.envoy,
    pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server"),
]

ADMISSION = {
    "enabled": True,
    "max_tpot_s": 0.05,
    "tpot_window_s": 0.5,
    "retry_after_s": 1,
    "client_max_priority": "critical",  # these clients may ask for critical themselves
}


async def start_stack(
    tmp_path: Path, group: EngineGroup, stops: list[Any], service_extra: dict[str, Any] | None = None
) -> LocalGateway:
    """redis-server, Envoy + the service (one cluster per engine) and a publisher scraping the
    engines every 0.25 s; how to stop each is appended to `stops`. Returns once both are published."""
    redis, _ = local_redis(tmp_path / "redis.log")
    stops.append(redis.stop)
    clusters = {f"gpu-{i}": [p] for i, p in enumerate(group.ports)}
    gw = _n_cluster_gateway(tmp_path, clusters, redis.url, None, service_extra=service_extra)
    publisher = start_publisher(
        redis.url,
        [InstanceSpec(c, f"127.0.0.1:{p[0]}", "sim") for c, p in clusters.items()],
        stops,
        interval_s=0.25,
    )
    gw.start()
    stops.append(gw.stop)
    await wait_published(publisher, 2)
    return gw


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
        gw = await start_stack(tmp_path, group, stops, {"admission": ADMISSION})
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


# -- per-request TPOT objective (`slo-tpot`, in the default profile) --------------------------------
def routed(group: EngineGroup) -> list[int]:
    """Requests each engine got through Envoy (they carry the routing headers; direct ones do not)."""
    return [sum(1 for h in e.stats.routing_headers if h) for e in group.engines]


async def keep_decoding(session: aiohttp.ClientSession, port: int, tokens: int) -> None:
    """Background load sent straight to one engine, so that it always has a decode to report."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": tokens}
    while True:
        async with session.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body) as r:
            await r.read()


async def asking(session: aiohttp.ClientSession, url: str, tpot_ms: str) -> tuple[int, Any, bytes]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}
    headers = {"x-llm-tpot-slo-ms": tpot_ms}
    async with session.post(url + "/v1/chat/completions", json=body, headers=headers) as r:
        return r.status, r.headers.copy(), await r.read()


async def test_a_tpot_objective_routes_to_fast_engines_and_sheds_when_none_is(tmp_path: Path) -> None:
    """The shipped default profile, no admission: a request with `x-llm-tpot-slo-ms` goes to the
    engine whose reported decode speed meets it; when none does it gets 429 `slo_unattainable`,
    while requests without an objective are still served."""
    group = EngineGroup([0.1, 0.004], MODEL)  # gpu-0: 100 ms per output token; gpu-1: 4 ms
    stops: list[Any] = [group.close]
    background: list[asyncio.Task[None]] = []
    try:
        gw = await start_stack(tmp_path, group, stops)
        async with aiohttp.ClientSession() as session:
            # two background requests at a time per engine (gpu-1's short enough to end soon
            # after its slow spell below: 25 tokens, 2.5 s at 100 ms)
            for port, tokens in ((group.ports[0], 10), (group.ports[1], 25)):
                background += [asyncio.create_task(keep_decoding(session, port, tokens)) for _ in range(2)]

            async def only_fast(n: int, timeout_s: float) -> bool:
                """Until n requests in a row asking for 50 ms were all served by gpu-1 (a 429 while
                a slow spell is still in the smoothed figure breaks the streak)."""
                deadline = time.monotonic() + timeout_s
                streak = 0
                while time.monotonic() < deadline:
                    before = routed(group)
                    status, _, body = await asking(session, gw.url, "50")
                    assert status in (200, 429), body
                    after = routed(group)
                    streak = streak + 1 if status == 200 and after[1] > before[1] else 0
                    if streak >= n:
                        return True
                    await asyncio.sleep(0.05)
                return False

            assert await only_fast(20, timeout_s=20.0)
            # A generous objective both meet: either engine (predicted-ttft decides).
            assert (await asking(session, gw.url, "500"))[0] == 200

            group.engines[1].token_delay_s = 0.1  # now both decode at 100 ms
            deadline = time.monotonic() + 20.0
            while True:
                status, headers, body = await asking(session, gw.url, "50")
                if status == 429 or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.1)
            assert status == 429, body
            error = orjson.loads(body)["error"]
            assert (error["code"], error["type"]) == ("slo_unattainable", "rate_limit_error")
            assert "time per output token of 50 ms" in error["message"]
            assert headers["retry-after"] == "1"
            plain = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}
            async with session.post(gw.url + "/v1/chat/completions", json=plain) as r:
                assert r.status == 200  # no objective: served as ever

            group.engines[1].token_delay_s = 0.004  # fast again: served there again
            assert await only_fast(5, timeout_s=20.0)
    finally:
        for task in background:
            task.cancel()
        await asyncio.gather(*background, return_exceptions=True)
        for stop in reversed(stops):
            res = stop()
            if asyncio.iscoroutine(res):
                await res
